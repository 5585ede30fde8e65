//! `limits` blocks: a backend's quota (`rpm`, `tpm`, `max_in_flight`), and a tenant's or key's,
//! which may also cap sessions, daily tokens and monthly spend.

use crate::model::Limits;
use crate::problems::Problems;
use crate::read::{self, Fields};
use crate::tree::Node;

pub(crate) const BACKEND: &[&str] = &["rpm", "tpm", "max_in_flight"];
pub(crate) const TENANT: &[&str] = &[
    "rpm",
    "tpm",
    "max_in_flight",
    "max_sessions",
    "tokens_per_day",
    "usd_per_month",
];

/// Read a limits block whose keys must be among `known` (one of [`BACKEND`], [`TENANT`]).
pub(crate) fn limits(node: Option<&Node>, known: &[&str], p: &mut Problems) -> Limits {
    let f = Fields::open(node, known, p);
    Limits {
        rpm: f.int("rpm", 1, p),
        tpm: f.int("tpm", 1, p),
        max_in_flight: f.int("max_in_flight", 1, p),
        max_sessions: f.int("max_sessions", 1, p),
        tokens_per_day: f.int("tokens_per_day", 1, p),
        usd_per_month: f
            .get("usd_per_month")
            .and_then(|n| read::non_negative(n, p)),
    }
}
