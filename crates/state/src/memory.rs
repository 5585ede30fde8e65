//! The in-memory store for one gateway instance: sharded maps, one small lock per meter, no global
//! lock. Also the Redis store's stand-in while Redis is unreachable and `on_store_error` is
//! `fail_open`. Its futures never wait: every method completes on its first poll.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use dashmap::DashMap;
use smallvec::SmallVec;

use crate::breaker::Record;
use crate::meter::{
    day_ends_in, day_of, month_ends_in, month_of, pick, Ask, Check, Limit, MeterKey, MeterLimits,
    MeterUsage, Refusal, Reservation, Settlement, Verdict, Window,
};
use crate::{
    now_ms, BackendView, Backoff, BreakerPhase, BreakerRecord, Claim, Entry, Exclusion,
    RoutingQuery, RoutingView, State, TargetKey, TargetView, Unavailable,
};

type Pair = (String, String);

/// The maps every request reads, hashed with foldhash (seeded per map) rather than SipHash.
type Map<K, V> = DashMap<K, V, foldhash::fast::RandomState>;

/// Expired entries are removed lazily, on lookup or listing, so the maps stay bounded by the
/// number of (backend, deployment) pairs that failed within their TTL.
#[derive(Default)]
pub struct MemoryState {
    clock: Clock,
    not_served: Expiring,
    served: Expiring,
    cooldowns: Expiring,
    meters: Map<MeterKey, Arc<Mutex<Meter>>>,
    breakers: Map<String, Record>,
    next_member: AtomicU64,
    /// key -> (backend, until)
    pins: DashMap<String, (String, u64)>,
    /// collection -> id -> value
    records: DashMap<String, BTreeMap<String, String>>,
}

/// Past this many pins, the expired ones are swept on the next pin.
const PIN_SWEEP_AT: usize = 100_000;

/// The system clock, or one a test moves by hand.
#[derive(Default)]
enum Clock {
    #[default]
    System,
    Manual(Arc<AtomicU64>),
}

impl Clock {
    fn now(&self) -> u64 {
        match self {
            Clock::System => now_ms(),
            Clock::Manual(ms) => ms.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug, Default)]
struct Meter {
    window: Window,
    in_flight: u64,
    /// (UTC day, tokens)
    day: (u64, u64),
    /// (UTC month, millionths of a dollar)
    month: (u64, u64),
}

impl Meter {
    fn roll(&mut self, day: u64, month: u64) {
        if self.day.0 != day {
            self.day = (day, 0);
        }
        if self.month.0 != month {
            self.month = (month, 0);
        }
    }

    fn usage(&self, second: u64) -> MeterUsage {
        let (requests, tokens) = self.window.used(second);
        let (requests_10s, tokens_10s) = self.window.recent(second);
        MeterUsage {
            requests,
            tokens,
            requests_10s,
            tokens_10s,
            in_flight: self.in_flight,
            day_tokens: self.day.1,
            month_micro_usd: self.month.1,
        }
    }

    /// Every limit the charge would break, with when it would fit.
    fn checks(&self, limits: &MeterLimits, usage: &MeterUsage, ask: &Ask, now: u64) -> Vec<Check> {
        let charge = ask.charge;
        let mut failing = Vec::new();
        let mut over =
            |limit: Limit, used: u64, asked: u64, cap: Option<u64>, frees: &dyn Fn(u64) -> u64| {
                if let Some(cap) = cap.filter(|cap| used + asked > *cap) {
                    failing.push(Check {
                        limit,
                        retry_after_ms: frees(cap),
                        used,
                        cap,
                        asked,
                    });
                }
            };
        over(
            Limit::TokensPerDay,
            usage.day_tokens,
            charge.tokens,
            limits.tokens_per_day,
            &|_| day_ends_in(now),
        );
        over(
            Limit::UsdPerMonth,
            usage.month_micro_usd,
            charge.micro_usd,
            limits.micro_usd_per_month,
            &|_| month_ends_in(now),
        );
        over(Limit::Rpm, usage.requests, 1, limits.rpm, &|cap| {
            self.window.frees_in(now, cap, 1, false)
        });
        over(
            Limit::Tpm,
            usage.tokens,
            charge.tokens,
            limits.tpm,
            &|cap| self.window.frees_in(now, cap, charge.tokens, true),
        );
        over(
            Limit::MaxInFlight,
            usage.in_flight,
            1,
            limits.max_in_flight,
            &|_| 1000,
        );
        failing
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn pair(backend: &str, deployment: &str) -> Pair {
    (backend.to_owned(), deployment.to_owned())
}

/// (backend, deployment) pairs until a time, with their number kept beside them: every request
/// asks each map about its targets, and an empty map (the usual case) answers from the count
/// without visiting its shards' locks or allocating a key.
#[derive(Default)]
struct Expiring {
    map: Map<Pair, u64>,
    entries: AtomicUsize,
}

impl Expiring {
    fn insert(&self, key: Pair, until: u64) {
        if self.map.insert(key, until).is_none() {
            self.entries.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Keeps the later of `until` and the time already there.
    fn extend(&self, key: Pair, until: u64) {
        match self.map.entry(key) {
            dashmap::mapref::entry::Entry::Occupied(mut held) => {
                if *held.get() < until {
                    *held.get_mut() = until;
                }
            }
            dashmap::mapref::entry::Entry::Vacant(free) => {
                free.insert(until);
                self.entries.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    fn remove(&self, key: &Pair) {
        if self.map.remove(key).is_some() {
            self.entries.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// Milliseconds left on the pair's time, if it has one still running; an expired one goes.
    fn live(&self, backend: &str, deployment: &str, now: u64) -> Option<u64> {
        if self.entries.load(Ordering::Acquire) == 0 {
            return None;
        }
        let key = pair(backend, deployment);
        let until = *self.map.get(&key)?;
        if until > now {
            return Some(until - now);
        }
        if self.map.remove_if(&key, |_, u| *u <= now).is_some() {
            self.entries.fetch_sub(1, Ordering::AcqRel);
        }
        None
    }

    /// The pairs whose time still runs, sorted; the expired ones go.
    fn listing(&self, now: u64) -> Vec<Entry> {
        let mut expired = 0;
        self.map.retain(|_, until| {
            let keep = *until > now;
            expired += usize::from(!keep);
            keep
        });
        self.entries.fetch_sub(expired, Ordering::AcqRel);
        let mut entries: Vec<Entry> = self
            .map
            .iter()
            .map(|e| Entry {
                key: TargetKey::new(&e.key().0, &e.key().1),
                remaining_ms: e.value().saturating_sub(now),
            })
            .collect();
        entries.sort_by(|a, b| {
            (&a.key.backend, &a.key.deployment).cmp(&(&b.key.backend, &b.key.deployment))
        });
        entries
    }
}

impl MemoryState {
    pub fn new() -> Self {
        Self::default()
    }

    /// A store on a clock the caller moves (milliseconds), for tests.
    pub fn with_clock(clock: Arc<AtomicU64>) -> Self {
        MemoryState {
            clock: Clock::Manual(clock),
            ..Self::default()
        }
    }

    fn now(&self) -> u64 {
        self.clock.now()
    }

    pub(crate) fn routing_now(&self, query: RoutingQuery<'_>) -> RoutingView {
        let now = self.now();
        let targets = query
            .targets
            .iter()
            .enumerate()
            .map(|(i, (backend, deployment))| {
                let exclusion = match self.not_served.live(backend, deployment, now) {
                    Some(remaining_ms) => Some(Exclusion::NotServed { remaining_ms }),
                    None => self
                        .cooldowns
                        .live(backend, deployment, now)
                        .map(|remaining_ms| Exclusion::CoolingDown { remaining_ms }),
                };
                TargetView {
                    exclusion,
                    served: self.served.live(backend, deployment, now).is_some(),
                    breaker: self.phase_of(query.target_breaker(i), now),
                }
            })
            .collect();
        let second = now / 1000;
        let backends = query
            .backends
            .iter()
            .map(|b| BackendView {
                breaker: self.phase_of(b.breaker, now),
                usage: b.metered.then(|| {
                    self.meters
                        .get(&MeterKey::backend(b.name))
                        .map(|m| lock(&m).usage(second))
                        .unwrap_or_default()
                }),
            })
            .collect();
        RoutingView { targets, backends }
    }

    pub(crate) fn mark_not_served_now(&self, key: &TargetKey, ttl_ms: u64) {
        let until = self.now() + ttl_ms;
        self.not_served
            .insert(pair(&key.backend, &key.deployment), until);
    }

    pub(crate) fn mark_served_now(&self, key: &TargetKey, ttl_ms: u64) {
        let pair = pair(&key.backend, &key.deployment);
        self.not_served.remove(&pair);
        self.served.insert(pair, self.now() + ttl_ms);
    }

    pub(crate) fn cool_down_now(&self, key: &TargetKey, wait_ms: u64) {
        let until = self.now() + wait_ms;
        self.cooldowns
            .extend(pair(&key.backend, &key.deployment), until);
    }

    pub(crate) fn pin_now(&self, key: &str, backend: &str, ttl_ms: u64) {
        let now = self.now();
        if self.pins.len() >= PIN_SWEEP_AT {
            self.pins.retain(|_, (_, until)| *until > now);
        }
        self.pins
            .insert(key.to_owned(), (backend.to_owned(), now + ttl_ms));
    }

    pub(crate) fn keep_now(&self, collection: &str, id: &str, value: &str) {
        self.records
            .entry(collection.to_owned())
            .or_default()
            .insert(id.to_owned(), value.to_owned());
    }

    pub(crate) fn recall_now(&self, collection: &str, id: &str) -> Option<String> {
        self.records.get(collection)?.get(id).cloned()
    }

    pub(crate) fn records_now(&self, collection: &str) -> Vec<(String, String)> {
        self.records
            .get(collection)
            .map_or_else(Vec::new, |records| {
                records
                    .iter()
                    .map(|(id, value)| (id.clone(), value.clone()))
                    .collect()
            })
    }

    pub(crate) fn forget_now(&self, collection: &str, id: &str) -> bool {
        self.records
            .get_mut(collection)
            .is_some_and(|mut records| records.remove(id).is_some())
    }

    pub(crate) fn pinned_now(&self, key: &str) -> Option<String> {
        let now = self.now();
        let backend = {
            let entry = self.pins.get(key)?;
            (entry.1 > now).then(|| entry.0.clone())
        };
        if backend.is_none() {
            self.pins.remove_if(key, |_, (_, until)| *until <= now);
        }
        backend
    }

    pub(crate) fn not_served_now(&self) -> Vec<Entry> {
        self.not_served.listing(self.now())
    }

    pub(crate) fn cooldowns_now(&self) -> Vec<Entry> {
        self.cooldowns.listing(self.now())
    }

    fn meter(&self, key: &MeterKey) -> Arc<Mutex<Meter>> {
        if let Some(meter) = self.meters.get(key) {
            return meter.clone();
        }
        self.meters.entry(key.clone()).or_default().clone()
    }

    pub(crate) fn admit_now(&self, ask: &Ask) -> Verdict {
        let now = self.now();
        let (second, day) = (now / 1000, day_of(now));
        let month = month_of(day);
        // A tenant's meter and its key's: both inline, no allocation.
        let meters: SmallVec<[Arc<Mutex<Meter>>; 2]> =
            ask.meters.iter().map(|(k, _)| self.meter(k)).collect();
        // Always locked in the ask's order (tenant before key), so two asks never deadlock.
        let mut guards: SmallVec<[MutexGuard<'_, Meter>; 2]> =
            meters.iter().map(|m| lock(m)).collect();
        for guard in guards.iter_mut() {
            guard.roll(day, month);
        }
        let usage: SmallVec<[MeterUsage; 2]> = guards.iter().map(|g| g.usage(second)).collect();
        if ask.enforce {
            let failing = guards
                .iter()
                .zip(&ask.meters)
                .zip(&usage)
                .enumerate()
                .flat_map(|(i, ((guard, (_, limits)), usage))| {
                    guard
                        .checks(limits, usage, ask, now)
                        .into_iter()
                        .map(move |check| (i, check))
                })
                .collect();
            if let Some((meter, check)) = pick(failing) {
                return Verdict::Refused(Refusal {
                    meter,
                    limit: check.limit,
                    retry_after_ms: check.retry_after_ms,
                    used: check.used,
                    cap: check.cap,
                    asked: check.asked,
                    usage: usage.to_vec(),
                });
            }
        }
        let charge = ask.charge;
        // The charge lands in the current second's bucket, which the window already counts (a
        // bucket reused from a minute ago was outside it), so the usage after is the usage
        // before plus the charge: no second pass over the window.
        let usage = guards
            .iter_mut()
            .zip(usage)
            .map(|(guard, before)| {
                guard.window.add(second, 1, charge.tokens);
                guard.in_flight += 1;
                guard.day.1 += charge.tokens;
                guard.month.1 += charge.micro_usd;
                MeterUsage {
                    requests: before.requests + 1,
                    tokens: before.tokens + charge.tokens,
                    requests_10s: before.requests_10s + 1,
                    tokens_10s: before.tokens_10s + charge.tokens,
                    in_flight: guard.in_flight,
                    day_tokens: guard.day.1,
                    month_micro_usd: guard.month.1,
                }
            })
            .collect();
        Verdict::Admitted(Reservation {
            meters: ask.meters.iter().map(|(k, _)| k.clone()).collect(),
            second,
            day,
            month,
            tokens: charge.tokens,
            micro_usd: charge.micro_usd,
            member: self.next_member.fetch_add(1, Ordering::Relaxed),
            usage,
            shared: false,
        })
    }

    pub(crate) fn settle_now(&self, reservation: &Reservation, settlement: Settlement) {
        let tokens = settlement.tokens as i64 - reservation.tokens as i64;
        let usd = settlement.micro_usd as i64 - reservation.micro_usd as i64;
        for key in &reservation.meters {
            let Some(meter) = self.meters.get(key).map(|m| m.clone()) else {
                continue;
            };
            let mut meter = lock(&meter);
            meter.window.adjust(reservation.second, tokens);
            if meter.day.0 == reservation.day {
                meter.day.1 = meter.day.1.saturating_add_signed(tokens);
            }
            if meter.month.0 == reservation.month {
                meter.month.1 = meter.month.1.saturating_add_signed(usd);
            }
            if settlement.release {
                meter.in_flight = meter.in_flight.saturating_sub(1);
            }
        }
    }

    pub(crate) fn charge_now(
        &self,
        meters: &[MeterKey],
        tokens: u64,
        micro_usd: u64,
    ) -> Vec<MeterUsage> {
        let now = self.now();
        let (second, day) = (now / 1000, day_of(now));
        let month = month_of(day);
        meters
            .iter()
            .map(|key| {
                let meter = self.meter(key);
                let mut meter = lock(&meter);
                meter.roll(day, month);
                meter.window.add(second, 0, tokens);
                meter.day.1 += tokens;
                meter.month.1 += micro_usd;
                meter.usage(second)
            })
            .collect()
    }

    pub(crate) fn usage_now(&self, meters: &[MeterKey]) -> Vec<MeterUsage> {
        let now = self.now();
        let day = day_of(now);
        let month = month_of(day);
        meters
            .iter()
            .map(|key| match self.meters.get(key).map(|m| m.clone()) {
                Some(meter) => {
                    let mut meter = lock(&meter);
                    meter.roll(day, month);
                    meter.usage(now / 1000)
                }
                None => MeterUsage::default(),
            })
            .collect()
    }

    fn phase_of(&self, breaker: Option<&str>, now: u64) -> BreakerPhase {
        breaker
            .and_then(|id| self.breakers.get(id).map(|r| r.phase(now)))
            .unwrap_or_default()
    }

    fn with_record<T>(&self, id: &str, change: impl FnOnce(&mut Record, u64) -> T) -> T {
        let now = self.now();
        let mut record = self.breakers.entry(id.to_owned()).or_default();
        change(&mut record, now)
    }

    pub(crate) fn trip_now(&self, id: &str, wait_ms: u64) -> BreakerRecord {
        self.with_record(id, |r, now| {
            r.trip(now, wait_ms);
            r.view(now)
        })
    }

    pub(crate) fn reopen_now(&self, id: &str, base_ms: u64, backoff: Backoff) -> BreakerRecord {
        self.with_record(id, |r, now| {
            r.reopen(now, base_ms, backoff);
            r.view(now)
        })
    }

    pub(crate) fn claim_now(&self, id: &str, lease_ms: u64) -> Claim {
        if !self.breakers.contains_key(id) {
            return Claim::Closed;
        }
        self.with_record(id, |r, now| r.claim(now, lease_ms))
    }

    pub(crate) fn close_now(&self, id: &str) {
        if let Some(mut r) = self.breakers.get_mut(id) {
            r.close(self.now());
        }
    }

    pub(crate) fn release_now(&self, id: &str) {
        if let Some(mut r) = self.breakers.get_mut(id) {
            r.release(self.now());
        }
    }

    pub(crate) fn breaker_now(&self, id: &str) -> BreakerRecord {
        let now = self.now();
        self.breakers
            .get(id)
            .map(|r| r.view(now))
            .unwrap_or_default()
    }
}

impl State for MemoryState {
    async fn routing(&self, query: RoutingQuery<'_>) -> Result<RoutingView, Unavailable> {
        Ok(self.routing_now(query))
    }

    async fn mark_not_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark_not_served_now(key, ttl_ms)
    }

    async fn mark_served(&self, key: &TargetKey, ttl_ms: u64) {
        self.mark_served_now(key, ttl_ms)
    }

    async fn cool_down(&self, key: &TargetKey, wait_ms: u64) {
        self.cool_down_now(key, wait_ms)
    }

    async fn pin(&self, key: &str, backend: &str, ttl_ms: u64) {
        self.pin_now(key, backend, ttl_ms)
    }

    async fn pinned(&self, key: &str) -> Result<Option<String>, Unavailable> {
        Ok(self.pinned_now(key))
    }

    async fn keep(&self, collection: &str, id: &str, value: &str) -> Result<(), Unavailable> {
        self.keep_now(collection, id, value);
        Ok(())
    }

    async fn recall(&self, collection: &str, id: &str) -> Result<Option<String>, Unavailable> {
        Ok(self.recall_now(collection, id))
    }

    async fn records(&self, collection: &str) -> Result<Vec<(String, String)>, Unavailable> {
        Ok(self.records_now(collection))
    }

    async fn forget(&self, collection: &str, id: &str) -> Result<bool, Unavailable> {
        Ok(self.forget_now(collection, id))
    }

    async fn not_served(&self) -> Result<Vec<Entry>, Unavailable> {
        Ok(self.not_served_now())
    }

    async fn cooldowns(&self) -> Result<Vec<Entry>, Unavailable> {
        Ok(self.cooldowns_now())
    }

    async fn admit(&self, ask: &Ask) -> Result<Verdict, Unavailable> {
        Ok(self.admit_now(ask))
    }

    async fn settle(&self, reservation: &Reservation, settlement: Settlement) {
        self.settle_now(reservation, settlement)
    }

    async fn charge(
        &self,
        meters: &[MeterKey],
        tokens: u64,
        micro_usd: u64,
    ) -> Result<Vec<MeterUsage>, Unavailable> {
        Ok(self.charge_now(meters, tokens, micro_usd))
    }

    async fn usage(&self, meters: &[MeterKey]) -> Result<Vec<MeterUsage>, Unavailable> {
        Ok(self.usage_now(meters))
    }

    async fn trip(&self, id: &str, wait_ms: u64) -> BreakerRecord {
        self.trip_now(id, wait_ms)
    }

    async fn reopen(&self, id: &str, base_ms: u64, backoff: Backoff) -> BreakerRecord {
        self.reopen_now(id, base_ms, backoff)
    }

    async fn claim_probe(&self, id: &str, lease_ms: u64) -> Claim {
        self.claim_now(id, lease_ms)
    }

    async fn close(&self, id: &str) {
        self.close_now(id)
    }

    async fn release_probe(&self, id: &str) {
        self.release_now(id)
    }

    async fn breaker(&self, id: &str) -> Result<BreakerRecord, Unavailable> {
        Ok(self.breaker_now(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meter::Charge;
    use crate::BackendQuery;

    fn clocked(at: u64) -> (MemoryState, Arc<AtomicU64>) {
        let clock = Arc::new(AtomicU64::new(at));
        (MemoryState::with_clock(clock.clone()), clock)
    }

    fn target(state: &MemoryState, backend: &str, deployment: &str) -> TargetView {
        state
            .routing_now(RoutingQuery {
                targets: &[(backend, deployment)],
                target_breakers: &[],
                backends: &[],
            })
            .targets[0]
    }

    #[test]
    fn a_not_served_entry_expires_at_its_deadline() {
        let (state, clock) = clocked(0);
        state.mark_not_served_now(&TargetKey::new("b", "d"), 1_000);
        clock.store(999, Ordering::Relaxed);
        assert_eq!(
            target(&state, "b", "d").exclusion,
            Some(Exclusion::NotServed { remaining_ms: 1 })
        );
        clock.store(1_000, Ordering::Relaxed);
        assert_eq!(target(&state, "b", "d").exclusion, None);
        assert!(state.not_served_now().is_empty());
    }

    /// The count that lets a lookup skip an empty map follows every way an entry comes and
    /// goes: marked twice, expired on lookup, swept by a listing, served after not served.
    #[test]
    fn exclusions_are_found_whatever_came_and_went_before() {
        let (state, clock) = clocked(0);
        let excluded = |b: &str| target(&state, b, "d").exclusion.is_some();
        state.mark_not_served_now(&TargetKey::new("a", "d"), 1_000);
        state.mark_not_served_now(&TargetKey::new("a", "d"), 1_000);
        state.mark_not_served_now(&TargetKey::new("b", "d"), 5_000);
        state.cool_down_now(&TargetKey::new("c", "d"), 1_000);
        state.cool_down_now(&TargetKey::new("c", "d"), 500);
        clock.store(2_000, Ordering::Relaxed);
        assert!(!excluded("a"), "expired on lookup");
        assert!(state.cooldowns_now().is_empty(), "swept by the listing");
        assert!(excluded("b"), "b is still not served after a and c went");
        state.mark_served_now(&TargetKey::new("b", "d"), 10_000);
        assert!(!excluded("b"));
        assert!(target(&state, "b", "d").served);
        state.mark_not_served_now(&TargetKey::new("e", "d"), 1_000);
        assert!(excluded("e"), "a new entry after the map emptied is seen");
        assert_eq!(state.not_served.entries.load(Ordering::Relaxed), 1);
        assert_eq!(state.cooldowns.entries.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_record_is_kept_until_it_is_forgotten_once() {
        let state = MemoryState::new();
        state.keep_now("batches:team", "b1", "one");
        state.keep_now("batches:team", "b1", "two");
        assert_eq!(
            state.recall_now("batches:team", "b1").as_deref(),
            Some("two")
        );
        assert_eq!(state.recall_now("batches:other", "b1"), None);
        assert_eq!(state.records_now("batches:team").len(), 1);
        assert!(state.forget_now("batches:team", "b1"));
        assert!(!state.forget_now("batches:team", "b1"));
        assert!(state.records_now("batches:team").is_empty());
    }

    #[test]
    fn a_pin_names_its_backend_until_it_expires() {
        let (state, clock) = clocked(0);
        assert_eq!(state.pinned_now("resp_1"), None);
        state.pin_now("resp_1", "sub1", 1_000);
        clock.store(999, Ordering::Relaxed);
        assert_eq!(state.pinned_now("resp_1").as_deref(), Some("sub1"));
        state.pin_now("resp_1", "sub2", 1_000);
        clock.store(1_500, Ordering::Relaxed);
        assert_eq!(state.pinned_now("resp_1").as_deref(), Some("sub2"));
        clock.store(1_999, Ordering::Relaxed);
        assert_eq!(state.pinned_now("resp_1"), None);
        assert!(state.pins.is_empty());
    }

    #[test]
    fn a_cooldown_only_ever_extends() {
        let (state, _) = clocked(0);
        state.cool_down_now(&TargetKey::new("b", "d"), 2_000);
        state.cool_down_now(&TargetKey::new("b", "d"), 1_500);
        assert_eq!(
            target(&state, "b", "d").exclusion,
            Some(Exclusion::CoolingDown {
                remaining_ms: 2_000
            })
        );
        assert_eq!(target(&state, "b", "other").exclusion, None);
    }

    fn ask(rpm: Option<u64>, tpm: Option<u64>, tokens: u64) -> Ask {
        Ask {
            meters: vec![
                (
                    MeterKey::tenant("t"),
                    MeterLimits {
                        rpm,
                        ..MeterLimits::default()
                    },
                ),
                (
                    MeterKey::key("t", "k"),
                    MeterLimits {
                        tpm,
                        ..MeterLimits::default()
                    },
                ),
            ],
            charge: Charge {
                tokens,
                micro_usd: 0,
                lease_ms: 60_000,
            },
            enforce: true,
        }
    }

    /// The usage an admission reports (the usage before plus its charge) is what reading the
    /// meters afterwards gives, also when the charge reuses the bucket of a minute ago.
    #[test]
    fn an_admission_reports_the_usage_it_leaves() {
        let (state, clock) = clocked(100_000);
        let keys = [MeterKey::tenant("t"), MeterKey::key("t", "k")];
        for (at, tokens) in [
            (100_000, 10),
            (100_500, 20),
            (130_000, 5),
            (160_000, 7),
            (160_100, 1),
        ] {
            clock.store(at, Ordering::Relaxed);
            let Verdict::Admitted(made) = state.admit_now(&ask(None, None, tokens)) else {
                panic!("no limits refuse");
            };
            assert_eq!(made.usage, state.usage_now(&keys), "at {at}");
        }
    }

    #[test]
    fn a_charge_held_for_later_leaves_the_minute_and_settles_in_its_day() {
        // 2026-12-02: the day and month of a real clock, never 1970's first.
        const NOW: u64 = 1_796_169_600_000;
        let (state, clock) = clocked(NOW);
        let keys = [MeterKey::tenant("t")];
        let Verdict::Admitted(held) = state.admit_now(&ask(None, None, 80)) else {
            panic!("no limits refuse");
        };
        let nothing = Settlement {
            tokens: 0,
            micro_usd: 0,
            release: true,
        };
        state.settle_now(&held.minute_part(), nothing);
        let usage = &state.usage_now(&keys)[0];
        assert_eq!(
            (usage.tokens, usage.day_tokens, usage.in_flight),
            (0, 80, 0)
        );
        clock.store(NOW + 30_000, Ordering::Relaxed);
        let Verdict::Admitted(_) = state.admit_now(&ask(None, None, 5)) else {
            panic!("no limits refuse");
        };
        let measured = Settlement {
            tokens: 50,
            micro_usd: 0,
            release: false,
        };
        state.settle_now(&held.period_part(), measured);
        let usage = &state.usage_now(&keys)[0];
        assert_eq!((usage.tokens, usage.day_tokens), (5, 55));
    }

    #[test]
    fn an_ask_is_charged_to_every_meter_only_when_all_have_room() {
        let (state, clock) = clocked(100_000);
        let Verdict::Admitted(first) = state.admit_now(&ask(Some(2), Some(100), 60)) else {
            panic!("the first ask fits");
        };
        assert_eq!(first.usage[0].requests, 1);
        assert_eq!(first.usage[1].tokens, 60);
        // The key's tpm refuses; the tenant's rpm is not charged for it.
        let Verdict::Refused(refusal) = state.admit_now(&ask(Some(2), Some(100), 50)) else {
            panic!("tpm is full");
        };
        assert_eq!((refusal.meter, refusal.limit), (1, Limit::Tpm));
        assert_eq!(refusal.retry_after_ms, 60_000);
        assert_eq!(state.usage_now(&[MeterKey::tenant("t")])[0].requests, 1);
        // Settling at the measured 30 tokens makes room for the 50.
        state.settle_now(
            &first,
            Settlement {
                tokens: 30,
                micro_usd: 0,
                release: true,
            },
        );
        clock.store(101_000, Ordering::Relaxed);
        assert!(matches!(
            state.admit_now(&ask(Some(2), Some(100), 50)),
            Verdict::Admitted(_)
        ));
        let Verdict::Refused(refusal) = state.admit_now(&ask(Some(2), None, 1)) else {
            panic!("rpm is full");
        };
        assert_eq!((refusal.meter, refusal.limit), (0, Limit::Rpm));
        // The first request's second leaves the window at 160 s.
        assert_eq!(refusal.retry_after_ms, 59_000);
    }

    #[test]
    fn a_period_quota_wins_over_a_rate_limit_and_waits_for_the_period_end() {
        let (state, _) = clocked(1_796_119_200_000);
        let limits = MeterLimits {
            rpm: Some(1),
            tokens_per_day: Some(10),
            ..MeterLimits::default()
        };
        let ask = |tokens| Ask {
            meters: vec![(MeterKey::tenant("t"), limits)],
            charge: Charge {
                tokens,
                micro_usd: 0,
                lease_ms: 1,
            },
            enforce: true,
        };
        assert!(matches!(state.admit_now(&ask(8)), Verdict::Admitted(_)));
        let Verdict::Refused(refusal) = state.admit_now(&ask(8)) else {
            panic!("both limits are over");
        };
        assert_eq!(refusal.limit, Limit::TokensPerDay);
        assert_eq!(refusal.retry_after_ms, 14 * 3_600_000);
        assert_eq!((refusal.used, refusal.cap, refusal.asked), (8, 10, 8));
    }

    #[test]
    fn the_routing_view_reads_breakers_and_backend_meters() {
        let (state, clock) = clocked(0);
        let backend = BackendQuery {
            name: "b",
            breaker: Some("b#p"),
            metered: true,
        };
        let view = |state: &MemoryState| {
            state
                .routing_now(RoutingQuery {
                    targets: &[],
                    target_breakers: &[],
                    backends: &[backend],
                })
                .backends[0]
        };
        assert_eq!(
            view(&state),
            BackendView {
                breaker: Default::default(),
                usage: Some(MeterUsage::default())
            }
        );
        state.trip_now("b#p", 500);
        state.admit_now(&Ask {
            meters: vec![(MeterKey::backend("b"), MeterLimits::default())],
            charge: Charge {
                tokens: 7,
                micro_usd: 0,
                lease_ms: 1,
            },
            enforce: false,
        });
        let seen = view(&state);
        assert_eq!(
            seen.breaker,
            crate::BreakerPhase::Open { remaining_ms: 500 }
        );
        assert_eq!(
            seen.usage.map(|u| (u.requests, u.tokens, u.in_flight)),
            Some((1, 7, 1))
        );
        clock.store(500, Ordering::Relaxed);
        assert_eq!(state.claim_now("b#p", 100), Claim::Probe);
        assert_eq!(state.claim_now("other", 100), Claim::Closed);
    }

    #[test]
    fn the_routing_view_reads_each_targets_own_breaker() {
        let (state, _clock) = clocked(0);
        state.trip_now("b#p@gpt-4o", 700);
        let ids: [Option<Arc<str>>; 2] = [Some("b#p@gpt-4o".into()), Some("b#p@mini".into())];
        let view = state.routing_now(RoutingQuery {
            targets: &[("b", "gpt-4o"), ("b", "mini"), ("c", "x")],
            target_breakers: &ids,
            backends: &[],
        });
        let phases: Vec<_> = view.targets.iter().map(|t| t.breaker).collect();
        assert_eq!(
            phases,
            [
                BreakerPhase::Open { remaining_ms: 700 },
                BreakerPhase::Closed,
                BreakerPhase::Closed
            ]
        );
    }
}
