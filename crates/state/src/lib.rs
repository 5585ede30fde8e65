//! The state every gateway instance must agree on: the not-served cache, cooldowns after 429s,
//! circuit-breaker records, and meters (rolling-minute windows, requests in flight, daily tokens,
//! monthly spend) for tenants, keys and backends. [`State`] is the contract; [`MemoryState`] keeps
//! it for one instance, [`RedisState`] shares it between many (atomic Lua scripts, Redis time,
//! hash-tagged keys), and [`Store`] is whichever the config chose.
//!
//! Every method speaks in durations ("for 30 s", "frees in 1.2 s"), never in instant clocks:
//! the Redis store keeps time by Redis `TIME`, so instances whose clocks drift still agree.

mod admissions;
mod breaker;
mod ledger;
mod memory;
mod meter;
mod notices;
mod redis;
mod redis_link;
mod store;
mod views;

use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

pub use breaker::{Backoff, BreakerPhase, BreakerRecord, Claim};
pub use memory::MemoryState;
pub use meter::{
    day_ends_in, month_ends_in, Ask, Charge, Limit, MeterKey, MeterLimits, MeterUsage, Refusal,
    Reservation, Settlement, Verdict, SHORT_WINDOW_SECONDS,
};
pub use notices::Notices;
pub use redis::{OnError, RedisConfig, RedisState};
pub use store::{Detached, Health, Store};
pub use views::VIEW_FRESH_FOR;

/// Milliseconds since the Unix epoch on this instance's clock.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A (backend, deployment) pair: the unit a not-served entry or a cooldown is kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TargetKey {
    pub backend: String,
    pub deployment: String,
}

impl TargetKey {
    pub fn new(backend: &str, deployment: &str) -> Self {
        TargetKey {
            backend: backend.to_owned(),
            deployment: deployment.to_owned(),
        }
    }
}

/// Why a target is skipped without being asked, and for how much longer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclusion {
    /// It answered "deployment not found".
    NotServed { remaining_ms: u64 },
    /// It answered 429.
    CoolingDown { remaining_ms: u64 },
}

/// One entry of a listing for operators (`/admin/backends`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: TargetKey,
    pub remaining_ms: u64,
}

/// The store could not be reached and `on_store_error` is `fail_closed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the shared state store is unreachable")]
pub struct Unavailable;

/// What one routing decision needs to know, read in one go: for each target, whether it is
/// excluded or known to serve, and its breaker; for each backend, its breaker and (when it is
/// metered) its usage.
#[derive(Debug, Clone, Copy)]
pub struct RoutingQuery<'a> {
    pub targets: &'a [(&'a str, &'a str)],
    /// The breaker record of each target, in the order of `targets` (missing at the end: none).
    pub target_breakers: &'a [Option<Arc<str>>],
    pub backends: &'a [BackendQuery<'a>],
}

impl RoutingQuery<'_> {
    /// The breaker record of the `i`-th target, when it has one.
    pub fn target_breaker(&self, i: usize) -> Option<&str> {
        self.target_breakers.get(i).and_then(Option::as_deref)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct BackendQuery<'a> {
    pub name: &'a str,
    /// The breaker record to read ([`BreakerRecord`] id), when the backend has a breaker.
    pub breaker: Option<&'a str>,
    /// Read its meter: it has limits that headroom routing compares against.
    pub metered: bool,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutingView {
    /// Same order as [`RoutingQuery::targets`].
    pub targets: Vec<TargetView>,
    /// Same order as [`RoutingQuery::backends`].
    pub backends: Vec<BackendView>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TargetView {
    /// Not-served wins over a cooldown.
    pub exclusion: Option<Exclusion>,
    /// It answered this deployment recently (discovery asks it first).
    pub served: bool,
    /// Its own breaker (closed when it has none).
    pub breaker: BreakerPhase,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BackendView {
    pub breaker: BreakerPhase,
    /// `None` when not metered.
    pub usage: Option<MeterUsage>,
}

/// The shared state contract. Every method is one round trip at most; writes that only teach
/// (not-served, cooldowns) may be answered before they land.
pub trait State: Send + Sync + 'static {
    /// Everything a routing decision reads, in one round trip.
    fn routing(
        &self,
        query: RoutingQuery<'_>,
    ) -> impl Future<Output = Result<RoutingView, Unavailable>> + Send;

    fn mark_not_served(&self, key: &TargetKey, ttl_ms: u64) -> impl Future<Output = ()> + Send;
    /// Remembers that `key` answered, so discovery prefers it next time; clears a not-served entry.
    fn mark_served(&self, key: &TargetKey, ttl_ms: u64) -> impl Future<Output = ()> + Send;
    /// A cooldown only ever extends.
    fn cool_down(&self, key: &TargetKey, wait_ms: u64) -> impl Future<Output = ()> + Send;
    fn not_served(&self) -> impl Future<Output = Result<Vec<Entry>, Unavailable>> + Send;
    fn cooldowns(&self) -> impl Future<Output = Result<Vec<Entry>, Unavailable>> + Send;

    /// Checks every meter of `ask` against its limits and, only when all have room, charges all
    /// of them at once. With `ask.enforce` false it only counts.
    fn admit(&self, ask: &Ask) -> impl Future<Output = Result<Verdict, Unavailable>> + Send;
    /// [`State::admit`], then [`State::routing`], exactly as the two calls one after the other
    /// would do them, but in one round trip where the store can send both at once (a request's
    /// admission and its routing view). The routing view is read whatever the verdict.
    fn admit_and_route(
        &self,
        ask: &Ask,
        query: RoutingQuery<'_>,
    ) -> impl Future<
        Output = (
            Result<Verdict, Unavailable>,
            Result<RoutingView, Unavailable>,
        ),
    > + Send {
        async move { (self.admit(ask).await, self.routing(query).await) }
    }
    /// Replaces a reservation's charge with the final numbers and, when asked, ends its time in
    /// flight.
    fn settle(
        &self,
        reservation: &Reservation,
        settlement: Settlement,
    ) -> impl Future<Output = ()> + Send;
    /// Counts tokens and spend that were used without a reservation (a realtime session's
    /// responses, admitted at its handshake) where they fall now, on every meter: in the rolling
    /// minute, the UTC day and the UTC month. No request is counted and nothing is in flight.
    /// Returns each meter's usage after the charge.
    fn charge(
        &self,
        meters: &[MeterKey],
        tokens: u64,
        micro_usd: u64,
    ) -> impl Future<Output = Result<Vec<MeterUsage>, Unavailable>> + Send;
    /// Current usage of each meter (for `/admin/tenants`).
    fn usage(
        &self,
        meters: &[MeterKey],
    ) -> impl Future<Output = Result<Vec<MeterUsage>, Unavailable>> + Send;

    /// Opens a closed breaker for `wait_ms`; an open or half-open one is left as it is.
    fn trip(&self, id: &str, wait_ms: u64) -> impl Future<Output = BreakerRecord> + Send;
    /// A failed probe: re-opens a half-open breaker for `base_ms` grown by `backoff` for each
    /// consecutive re-open ([`Backoff::wait`]).
    fn reopen(
        &self,
        id: &str,
        base_ms: u64,
        backoff: Backoff,
    ) -> impl Future<Output = BreakerRecord> + Send;
    /// The one probe of a half-open breaker, held for at most `lease_ms`.
    fn claim_probe(&self, id: &str, lease_ms: u64) -> impl Future<Output = Claim> + Send;
    /// A successful probe closes a half-open breaker.
    fn close(&self, id: &str) -> impl Future<Output = ()> + Send;
    /// A probe that was never sent: the next request may probe.
    fn release_probe(&self, id: &str) -> impl Future<Output = ()> + Send;
    fn breaker(&self, id: &str) -> impl Future<Output = Result<BreakerRecord, Unavailable>> + Send;

    /// Pins `key` (a stateful upstream object, such as a Responses answer) to the backend that
    /// holds it, for `ttl_ms`, so follow-ups that name it go there; a later pin replaces it.
    fn pin(&self, key: &str, backend: &str, ttl_ms: u64) -> impl Future<Output = ()> + Send;
    /// The backend `key` is pinned to, while its pin lasts.
    fn pinned(&self, key: &str)
        -> impl Future<Output = Result<Option<String>, Unavailable>> + Send;

    /// Keeps `value` as the record `id` of `collection` (a tenant's files or batches), replacing
    /// any record of that id. Records never expire: they go when [`State::forget`] removes them.
    fn keep(
        &self,
        collection: &str,
        id: &str,
        value: &str,
    ) -> impl Future<Output = Result<(), Unavailable>> + Send;
    /// The record `id` of `collection`, if there is one.
    fn recall(
        &self,
        collection: &str,
        id: &str,
    ) -> impl Future<Output = Result<Option<String>, Unavailable>> + Send;
    /// Every record of `collection` as (id, value), in no particular order.
    fn records(
        &self,
        collection: &str,
    ) -> impl Future<Output = Result<Vec<(String, String)>, Unavailable>> + Send;
    /// Removes the record `id` of `collection`; `true` only for the one caller that removed it,
    /// however many instances ask at once.
    fn forget(
        &self,
        collection: &str,
        id: &str,
    ) -> impl Future<Output = Result<bool, Unavailable>> + Send;
}
