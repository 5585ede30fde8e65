//! The store the config chose (`state.store`): memory or Redis, behind one type that the gateway
//! holds, so the memory path stays a direct call with nothing boxed.

use std::sync::{Arc, Weak};

use tokio::sync::Notify;

use crate::ledger::FLUSH_AFTER;
use crate::meter::{Ask, MeterKey, MeterUsage, Reservation, Settlement, Verdict};
use crate::redis::{OnError, RedisConfig, RedisState};
use crate::{
    Backoff, BreakerRecord, Claim, Entry, MemoryState, RoutingQuery, RoutingView, State, TargetKey,
    Unavailable,
};

pub enum Store {
    Memory(MemoryState),
    Redis(RedisState),
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Store::Memory(_) => "Store::Memory",
            Store::Redis(_) => "Store::Redis",
        })
    }
}

/// A charge made without waiting: made already, or queued for Redis (its one meter, its
/// in-flight member and the tokens it counted).
#[derive(Debug)]
pub enum Detached {
    Made(Option<Reservation>),
    Queued {
        meter: MeterKey,
        member: u64,
        tokens: u64,
    },
}

/// How the store stands, for `/readyz` and operators.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// `memory` or `redis`.
    pub store: &'static str,
    pub reachable: bool,
    /// Ready to serve: reachable, or unreachable under `fail_open`.
    pub ready: bool,
    /// `shared`, `local` (one instance by design), `fail_open` (unreachable: this instance's own
    /// limits) or `fail_closed` (unreachable: refusing).
    pub mode: &'static str,
    /// Store calls that failed since start; the observability metric reads this.
    pub errors: u64,
    pub outages: u64,
    /// Why the store is unreachable, as Redis or the connection said it (never a password).
    pub problem: Option<String>,
}

impl Store {
    pub fn memory() -> Self {
        Store::Memory(MemoryState::new())
    }

    pub fn redis(config: &RedisConfig) -> Self {
        Store::Redis(RedisState::new(config))
    }

    /// Whether instances share this store (Redis) or each keeps its own (memory).
    pub fn is_shared(&self) -> bool {
        matches!(self, Store::Redis(_))
    }

    /// Checks the store now (Redis: a `PING`).
    pub async fn health(&self) -> Health {
        match self {
            Store::Memory(_) => Health {
                store: "memory",
                reachable: true,
                ready: true,
                mode: "local",
                errors: 0,
                outages: 0,
                problem: None,
            },
            Store::Redis(redis) => {
                let reachable = redis.ping().await;
                let fail_open = redis.on_error() == OnError::FailOpen;
                Health {
                    store: "redis",
                    reachable,
                    ready: reachable || fail_open,
                    mode: match (reachable, fail_open) {
                        (true, _) => "shared",
                        (false, true) => "fail_open",
                        (false, false) => "fail_closed",
                    },
                    errors: redis.errors(),
                    outages: redis.outages(),
                    problem: redis.problem().filter(|_| !reachable),
                }
            }
        }
    }

    /// [`State::settle`] without waiting for it: at once in memory; for Redis into the
    /// settlement queue, which the next admission of the same tenant takes along (so it decides
    /// on it) or which is paid within a few milliseconds.
    pub fn settle_detached(self: &Arc<Self>, reservation: &Reservation, settlement: Settlement) {
        match self.as_ref() {
            Store::Memory(memory) => memory.settle_now(reservation, settlement),
            Store::Redis(redis) if reservation.shared => {
                redis.ledger.settle(reservation, settlement);
                self.pay_queued_debts();
            }
            Store::Redis(redis) => redis.settle_locally(reservation, settlement),
        }
    }

    /// [`State::admit`] without waiting for it, for a backend's count (which refuses nothing, and
    /// has one meter): at once in memory; for Redis into the settlement queue, counted within a
    /// few milliseconds. [`Store::settle_after`] settles it.
    pub fn admit_detached(self: &Arc<Self>, ask: Ask) -> Detached {
        match (self.as_ref(), ask.meters.first()) {
            (Store::Redis(redis), Some((meter, _))) if redis.reachable() => {
                let member: u64 = rand::random();
                let tokens = ask.charge.tokens;
                redis
                    .ledger
                    .count(meter, tokens, member, ask.charge.lease_ms);
                self.pay_queued_debts();
                Detached::Queued {
                    meter: meter.clone(),
                    member,
                    tokens,
                }
            }
            (Store::Redis(redis), _) => Detached::Made(redis.admit_locally(&ask)),
            (Store::Memory(memory), _) => Detached::Made(match memory.admit_now(&ask) {
                Verdict::Admitted(reservation) => Some(reservation),
                Verdict::Refused(_) => None,
            }),
        }
    }

    /// Settles a [`Store::admit_detached`] charge without waiting.
    pub fn settle_after(self: &Arc<Self>, detached: Detached, settlement: Settlement) {
        match (self.as_ref(), detached) {
            (_, Detached::Made(Some(reservation))) => {
                self.settle_detached(&reservation, settlement)
            }
            (_, Detached::Made(None)) => {}
            (
                Store::Redis(redis),
                Detached::Queued {
                    meter,
                    member,
                    tokens,
                },
            ) => {
                redis
                    .ledger
                    .settle_count(&meter, tokens, member, settlement);
                self.pay_queued_debts();
            }
            (Store::Memory(_), Detached::Queued { .. }) => {}
        }
    }

    /// Pays what the Redis settlement queue holds now (at a graceful stop, once the requests
    /// are over).
    pub async fn settle_queued(&self) {
        if let Store::Redis(redis) = self {
            redis.pay_debts().await;
        }
    }

    /// Starts, once, the task that pays the Redis settlement queue a moment after it stops
    /// being empty. It holds the store only while it pays, and ends once the store is gone.
    fn pay_queued_debts(self: &Arc<Self>) {
        let Store::Redis(redis) = self.as_ref() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if redis.ledger.start_paying() {
            runtime.spawn(pay_after_each_debt(
                Arc::downgrade(self),
                redis.ledger.bell.clone(),
            ));
        }
    }

    /// [`State::mark_served`] without waiting for it: a success path should not wait on a
    /// write that only helps later requests.
    pub fn mark_served_detached(self: &Arc<Self>, key: TargetKey, ttl_ms: u64) {
        match self.as_ref() {
            Store::Memory(memory) => memory.mark_served_now(&key, ttl_ms),
            Store::Redis(_) => {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    let store = self.clone();
                    handle.spawn(async move { store.mark_served(&key, ttl_ms).await });
                }
            }
        }
    }

    /// [`State::release_probe`] without waiting for it.
    pub fn release_probe_detached(self: &Arc<Self>, id: String) {
        match self.as_ref() {
            Store::Memory(memory) => memory.release_now(&id),
            Store::Redis(_) => {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    let store = self.clone();
                    handle.spawn(async move { store.release_probe(&id).await });
                }
            }
        }
    }
}

async fn pay_after_each_debt(store: Weak<Store>, bell: Arc<Notify>) {
    loop {
        bell.notified().await;
        tokio::time::sleep(FLUSH_AFTER).await;
        let Some(store) = store.upgrade() else {
            return;
        };
        if let Store::Redis(redis) = store.as_ref() {
            redis.pay_debts().await;
        }
    }
}

/// Every method goes to the chosen store; the memory arm completes on its first poll. The
/// Redis arm's future (a round trip's state, a kilobyte or more) is boxed: held inline, it
/// would make the future of every caller that large, and every request's future copies its
/// callers' futures as it goes down, whichever store it has. A Redis call allocates once.
macro_rules! delegate {
    ($self:ident, $store:ident => $call:expr) => {
        match $self {
            Store::Memory($store) => $call.await,
            Store::Redis($store) => Box::pin($call).await,
        }
    };
}

impl State for Store {
    async fn routing(&self, query: RoutingQuery<'_>) -> Result<RoutingView, Unavailable> {
        delegate!(self, s => s.routing(query))
    }

    async fn mark_not_served(&self, key: &TargetKey, ttl_ms: u64) {
        delegate!(self, s => s.mark_not_served(key, ttl_ms))
    }

    async fn mark_served(&self, key: &TargetKey, ttl_ms: u64) {
        delegate!(self, s => s.mark_served(key, ttl_ms))
    }

    async fn cool_down(&self, key: &TargetKey, wait_ms: u64) {
        delegate!(self, s => s.cool_down(key, wait_ms))
    }

    async fn not_served(&self) -> Result<Vec<Entry>, Unavailable> {
        delegate!(self, s => s.not_served())
    }

    async fn cooldowns(&self) -> Result<Vec<Entry>, Unavailable> {
        delegate!(self, s => s.cooldowns())
    }

    async fn admit(&self, ask: &Ask) -> Result<Verdict, Unavailable> {
        delegate!(self, s => s.admit(ask))
    }

    async fn admit_and_route(
        &self,
        ask: &Ask,
        query: RoutingQuery<'_>,
    ) -> (
        Result<Verdict, Unavailable>,
        Result<RoutingView, Unavailable>,
    ) {
        delegate!(self, s => s.admit_and_route(ask, query))
    }

    async fn settle(&self, reservation: &Reservation, settlement: Settlement) {
        delegate!(self, s => s.settle(reservation, settlement))
    }

    async fn charge(
        &self,
        meters: &[MeterKey],
        tokens: u64,
        micro_usd: u64,
    ) -> Result<Vec<MeterUsage>, Unavailable> {
        delegate!(self, s => s.charge(meters, tokens, micro_usd))
    }

    async fn usage(&self, meters: &[MeterKey]) -> Result<Vec<MeterUsage>, Unavailable> {
        delegate!(self, s => s.usage(meters))
    }

    async fn trip(&self, id: &str, wait_ms: u64) -> BreakerRecord {
        delegate!(self, s => s.trip(id, wait_ms))
    }

    async fn reopen(&self, id: &str, base_ms: u64, backoff: Backoff) -> BreakerRecord {
        delegate!(self, s => s.reopen(id, base_ms, backoff))
    }

    async fn claim_probe(&self, id: &str, lease_ms: u64) -> Claim {
        delegate!(self, s => s.claim_probe(id, lease_ms))
    }

    async fn close(&self, id: &str) {
        delegate!(self, s => s.close(id))
    }

    async fn release_probe(&self, id: &str) {
        delegate!(self, s => s.release_probe(id))
    }

    async fn breaker(&self, id: &str) -> Result<BreakerRecord, Unavailable> {
        delegate!(self, s => s.breaker(id))
    }

    async fn pin(&self, key: &str, backend: &str, ttl_ms: u64) {
        delegate!(self, s => s.pin(key, backend, ttl_ms))
    }

    async fn pinned(&self, key: &str) -> Result<Option<String>, Unavailable> {
        delegate!(self, s => s.pinned(key))
    }

    async fn keep(&self, collection: &str, id: &str, value: &str) -> Result<(), Unavailable> {
        delegate!(self, s => s.keep(collection, id, value))
    }

    async fn recall(&self, collection: &str, id: &str) -> Result<Option<String>, Unavailable> {
        delegate!(self, s => s.recall(collection, id))
    }

    async fn records(&self, collection: &str) -> Result<Vec<(String, String)>, Unavailable> {
        delegate!(self, s => s.records(collection))
    }

    async fn forget(&self, collection: &str, id: &str) -> Result<bool, Unavailable> {
        delegate!(self, s => s.forget(collection, id))
    }
}
