//! Usage records and where they go: one [`UsageRecord`] per request, priced from its target's
//! price ([`cost_usd`]), handed to a [`Recorder`] that writes batches to SQLite or Postgres on a
//! thread of its own, keeps a copy in a memory-mapped ledger that survives `kill -9`, and spills
//! to a local journal while the store is away; and the chargeback queries of `onedoor usage
//! report` ([`report`]). Nothing here runs on the request path except [`Recorder::record`], a
//! push into the recording thread's buffer and a copy into its part of the ledger.

mod journal;
mod keys;
mod ledger;
mod postgres;
mod price;
mod record;
mod recorder;
mod report;
mod schema;
mod sqlite;
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use keys::{
    AuditEntry, Change, KeySet, KeyStore, KeyStoreError, KeyWrite, StoredKey, StoredSecret,
};
pub use price::{cost_of, cost_usd, price_of};
pub use record::{now_ms, utc_day, Source, Tokens, UsageRecord};
pub use recorder::{Recorder, RecorderStats};
pub use report::{parse_since, parse_until, report, GroupBy, Report, ReportQuery, ReportRow};
pub use store::{Destination, StoreUrl, UsageError};

/// A record as the unit tests use it: one measured request of 100 + 20 tokens.
#[cfg(test)]
pub(crate) fn testing_record(request_id: &str) -> UsageRecord {
    UsageRecord {
        request_id: request_id.to_owned(),
        at_ms: 1_796_083_200_000,
        tenant: "legal".into(),
        key_id: "legal-prod".into(),
        alias: "chat".into(),
        backend: Some("sub1-fr".into()),
        model: Some("gpt-4o".into()),
        region: Some("francecentral".into()),
        status: 200,
        tokens: Tokens {
            input: 100,
            output: 20,
            cached: 10,
            cache_write: 5,
            source: Source::Measured,
        },
        estimated_tokens: 150,
        cost_usd: 0.00045,
        duration_ms: 800,
        ttft_ms: Some(120),
        attempts: "sub1-fr=200".into(),
        stream: true,
        stream_cut: false,
        error: None,
        lines: None,
    }
}
