//! The store the config chose (`state.store`): memory or Redis, behind one type that the gateway
//! holds, so the memory path stays a direct call with nothing boxed.

use std::sync::Arc;

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

/// A charge made without waiting: made already, or still on its way to Redis.
#[derive(Debug)]
pub enum Detached {
    Made(Option<Reservation>),
    Pending(tokio::task::JoinHandle<Option<Reservation>>),
}

/// How the store stands, for `/readyz` and operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
                }
            }
        }
    }

    /// [`State::settle`] without waiting for it: at once in memory, as a task for Redis (the
    /// answer has gone out already, nothing waits on it).
    pub fn settle_detached(self: &Arc<Self>, reservation: &Reservation, settlement: Settlement) {
        match self.as_ref() {
            Store::Memory(memory) => memory.settle_now(reservation, settlement),
            Store::Redis(_) => {
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    let (store, reservation) = (self.clone(), reservation.clone());
                    handle.spawn(async move { store.settle(&reservation, settlement).await });
                }
            }
        }
    }

    /// [`State::admit`] without waiting for it (a backend's count, which refuses nothing): at
    /// once in memory, as a task for Redis. [`Store::settle_after`] settles it once it is made.
    pub fn admit_detached(self: &Arc<Self>, ask: Ask) -> Detached {
        match self.as_ref() {
            Store::Memory(memory) => Detached::Made(match memory.admit_now(&ask) {
                Verdict::Admitted(reservation) => Some(reservation),
                Verdict::Refused(_) => None,
            }),
            Store::Redis(_) => match tokio::runtime::Handle::try_current() {
                Ok(handle) => {
                    let store = self.clone();
                    Detached::Pending(handle.spawn(async move {
                        match store.admit(&ask).await {
                            Ok(Verdict::Admitted(reservation)) => Some(reservation),
                            _ => None,
                        }
                    }))
                }
                Err(_) => Detached::Made(None),
            },
        }
    }

    /// Settles a [`Store::admit_detached`] charge once it has been made, without waiting.
    pub fn settle_after(self: &Arc<Self>, detached: Detached, settlement: Settlement) {
        match detached {
            Detached::Made(Some(reservation)) => self.settle_detached(&reservation, settlement),
            Detached::Made(None) => {}
            Detached::Pending(made) => {
                let store = self.clone();
                if let Ok(handle) = tokio::runtime::Handle::try_current() {
                    handle.spawn(async move {
                        if let Ok(Some(reservation)) = made.await {
                            store.settle(&reservation, settlement).await;
                        }
                    });
                }
            }
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
}
