//! Circuit breakers (contract section 2, `circuit_breakers`): one per backend that names a policy.
//! Failures a rule counts, within its window, trip the breaker open for the rule's `trip`; after
//! that it is half-open and lets one probe through at a time, which closes it or re-opens it with
//! backoff. Each instance counts the failures it sees; the breaker's phase is a record in the
//! state store (`onedoor_state`), so a breaker tripped on one instance is open on all of them and
//! one probe goes out for the whole fleet. The phase last seen is kept here, so a closed breaker
//! costs no store call.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use onedoor_config::{
    BackendId, BreakerPolicy, BreakerRule, FailureKind, FailureThreshold, Snapshot,
};
use onedoor_state::{BreakerPhase, Claim, State, Store};
use sha2::{Digest, Sha256};

use crate::outcome::retry_after;
use crate::upstream::Failure;

/// How long other requests leave a half-open backend alone while its probe is in flight (the
/// probe has no known end; this is when asking again makes sense).
const PROBE_PENDING_MS: u64 = 1000;
/// A probe's hold on a half-open breaker ends after this even if its instance never says how it
/// went (it died): then another may probe.
const PROBE_LEASE_MS: u64 = 60_000;
/// Percent rules remember at most this many recent outcomes (or `min_requests`, when larger).
const MAX_EVENTS: usize = 4096;

/// What one attempt told us about its backend, in the terms breaker rules are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    Success,
    Status {
        code: u16,
        retry_after: Option<Duration>,
    },
    /// A connection error, or a reset before a whole response.
    ConnectError,
    /// A connect, first-token or total timeout.
    Timeout,
}

impl Observed {
    pub fn of(failure: &Failure) -> Self {
        match failure {
            // An attempt without a token is not recorded at all (the failover loop skips it).
            Failure::ConnectError(_) | Failure::Reset(_) | Failure::AuthUnavailable(_) => {
                Observed::ConnectError
            }
            Failure::ConnectTimeout | Failure::FirstTokenTimeout | Failure::Timeout => {
                Observed::Timeout
            }
            Failure::Status {
                status, headers, ..
            } => Observed::Status {
                code: status.as_u16(),
                retry_after: retry_after(headers),
            },
        }
    }

    fn is(&self, kind: &FailureKind) -> bool {
        match (self, kind) {
            (Observed::Status { code, .. }, FailureKind::Status { from, to }) => {
                (*from..=*to).contains(code)
            }
            (Observed::ConnectError, FailureKind::ConnectError)
            | (Observed::Timeout, FailureKind::Timeout) => true,
            _ => false,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Observed::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// Whether `rule` counts `outcome` as a failure.
fn counts(rule: &BreakerRule, outcome: &Observed) -> bool {
    rule.status.iter().any(|kind| outcome.is(kind))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How long `rule` keeps the breaker open after `outcome`: exactly the upstream's Retry-After
/// when the rule accepts it (`true`), else its `trip`, which the store doubles for each
/// consecutive re-open up to ten times.
fn open_for(rule: &BreakerRule, outcome: &Observed) -> (u64, bool) {
    match outcome.retry_after().filter(|_| rule.accept_retry_after) {
        Some(wait) => (millis(wait), true),
        None => (millis(rule.trip), false),
    }
}

/// One rule's recent outcomes, bounded by its `within` (and a count, so memory stays fixed).
#[derive(Debug, Default)]
struct Window {
    events: VecDeque<(u64, bool)>,
    failures: usize,
}

impl Window {
    /// Adds one outcome and says whether it brought the rule's threshold to be met.
    fn push(&mut self, rule: &BreakerRule, now: u64, failed: bool) -> bool {
        let cap = match rule.threshold {
            // Only failures count, and only the last `count` of them can matter.
            FailureThreshold::Count(count) if failed => count.max(1) as usize,
            FailureThreshold::Count(_) => return false,
            FailureThreshold::Percent { min_requests, .. } => MAX_EVENTS.max(min_requests as usize),
        };
        self.events.push_back((now, failed));
        self.failures += usize::from(failed);
        let since = now.saturating_sub(millis(rule.within));
        while self.events.len() > cap || self.events.front().is_some_and(|(at, _)| *at < since) {
            if let Some((_, old)) = self.events.pop_front() {
                self.failures -= usize::from(old);
            }
        }
        failed
            && match rule.threshold {
                FailureThreshold::Count(count) => self.failures >= count as usize,
                FailureThreshold::Percent {
                    percent,
                    min_requests,
                } => {
                    let requests = self.events.len();
                    requests >= min_requests as usize
                        && self.failures as f64 * 100.0 >= percent * requests as f64
                }
            }
    }

    fn clear(&mut self) {
        self.events.clear();
        self.failures = 0;
    }
}

/// The phase last seen (from a routing view, or this instance's own call), at `at_ms`.
#[derive(Debug, Clone, Copy, Default)]
struct Known {
    phase: BreakerPhase,
    at_ms: u64,
}

impl Known {
    fn blocked_until(&self, now: u64) -> Option<u64> {
        match self.phase {
            BreakerPhase::Open { remaining_ms } if now < self.at_ms + remaining_ms => {
                Some(self.at_ms + remaining_ms)
            }
            BreakerPhase::HalfOpen { probing: true } if now < self.at_ms + PROBE_PENDING_MS => {
                Some(self.at_ms + PROBE_PENDING_MS)
            }
            _ => None,
        }
    }
}

/// The breaker of one backend.
#[derive(Debug)]
pub struct Breaker {
    backend: String,
    /// Its record in the store: the backend and its policy, so a changed policy starts closed.
    id: String,
    policy: BreakerPolicy,
    /// One per rule of the policy, same order; this instance's own observations.
    windows: Mutex<Vec<Window>>,
    known: Mutex<Known>,
    /// The transitions this instance made, counted for metrics, in [`TRANSITIONS`] order.
    transitions: [AtomicU64; 4],
}

/// The transitions a breaker counts: tripped open, half-open for a probe, re-opened after a
/// failed probe, closed after a good one.
pub const TRANSITIONS: [&str; 4] = ["open", "half_open", "reopen", "close"];

impl Breaker {
    fn count(&self, transition: usize) {
        if let Some(counter) = self.transitions.get(transition) {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Breaker {
    fn new(backend: &str, policy: BreakerPolicy) -> Self {
        let digest = Sha256::digest(format!("{policy:?}").as_bytes());
        let windows = policy.rules.iter().map(|_| Window::default()).collect();
        Breaker {
            backend: backend.to_owned(),
            id: format!("{backend}#{}", hex::encode(&digest[..6])),
            policy,
            windows: Mutex::new(windows),
            known: Mutex::new(Known::default()),
            transitions: Default::default(),
        }
    }

    /// Takes in the phase the store reports; leaving closed forgets the failures counted so far.
    fn learn(&self, phase: BreakerPhase, now: u64) {
        let mut known = lock(&self.known);
        if known.phase == BreakerPhase::Closed && phase != BreakerPhase::Closed {
            lock(&self.windows).iter_mut().for_each(Window::clear);
        }
        *known = Known { phase, at_ms: now };
    }

    fn known(&self) -> Known {
        *lock(&self.known)
    }

    /// Counts `outcome` in this instance's windows; a rule whose threshold it meets trips the
    /// shared record.
    async fn record(&self, store: &Store, outcome: &Observed, now: u64) {
        // Open or half-open: a late answer to a request sent before the trip says nothing new.
        if self.known().phase != BreakerPhase::Closed {
            return;
        }
        let tripped = {
            let mut windows = lock(&self.windows);
            let tripped =
                self.policy
                    .rules
                    .iter()
                    .zip(windows.iter_mut())
                    .find_map(|(rule, window)| {
                        window
                            .push(rule, now, counts(rule, outcome))
                            .then_some(rule)
                    });
            if tripped.is_some() {
                windows.iter_mut().for_each(Window::clear);
            }
            tripped
        };
        let Some(rule) = tripped else {
            return;
        };
        let (wait, _) = open_for(rule, outcome);
        let record = store.trip(&self.id, wait).await;
        self.learn(record.phase, now);
        self.count(0);
        tracing::warn!(backend = %self.backend, rule = %rule.name, trip_ms = wait, "circuit breaker tripped");
    }

    /// The probe's outcome: a failure some rule counts re-opens with backoff, anything else closes.
    async fn settle(&self, store: &Store, outcome: &Observed, now: u64) {
        match self.policy.rules.iter().find(|rule| counts(rule, outcome)) {
            Some(rule) => {
                let (base, exact) = open_for(rule, outcome);
                let record = store.reopen(&self.id, base, exact).await;
                self.learn(record.phase, now);
                self.count(2);
                tracing::warn!(backend = %self.backend, rule = %rule.name, reopens = record.reopens, "circuit breaker probe failed: re-opened");
            }
            None => {
                store.close(&self.id).await;
                lock(&self.windows).iter_mut().for_each(Window::clear);
                self.learn(BreakerPhase::Closed, now);
                self.count(3);
                tracing::info!(backend = %self.backend, "circuit breaker probe succeeded: closed");
            }
        }
    }
}

/// Whether a request may send an attempt to a backend now.
#[derive(Debug)]
pub enum Admission {
    /// Closed (or no breaker): go ahead.
    Closed,
    /// Half-open, and this request holds the one probe.
    Probe(ProbePermit),
    /// Open, or half-open with a probe in flight: ask again at `until_ms`.
    Open { until_ms: u64 },
}

/// The right to send the one probe of a half-open breaker. [`ProbePermit::settle`] it with the
/// probe's outcome; dropped unsettled (the request never sent it), it lets the next request probe.
#[derive(Debug)]
pub struct ProbePermit {
    backend: BackendId,
    breaker: Arc<Breaker>,
    store: Arc<Store>,
    settled: bool,
}

impl ProbePermit {
    pub fn backend(&self) -> BackendId {
        self.backend
    }

    pub async fn settle(mut self, outcome: &Observed, now: u64) {
        self.settled = true;
        self.breaker.settle(&self.store, outcome, now).await;
    }
}

impl Drop for ProbePermit {
    fn drop(&mut self) {
        if !self.settled {
            self.store.release_probe_detached(self.breaker.id.clone());
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
        }
    }
}

/// A breaker as operators see it (`GET /admin/backends`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub policy: String,
    pub state: BreakerState,
    /// Until the trip ends (0 when half-open); `None` when closed.
    pub next_probe_in_ms: Option<u64>,
    /// How often it opened, re-opens after a failed probe included.
    pub trips: u64,
}

/// Every backend's breaker, by backend index. A backend without `circuit_breaker:` has none and
/// is always closed.
pub struct Breakers {
    by_backend: Vec<Option<Arc<Breaker>>>,
    store: Arc<Store>,
}

impl Breakers {
    /// The breakers of `snapshot`'s backends. On reload pass the running ones as `previous`: a
    /// backend whose name and policy are unchanged keeps its breaker and counted failures.
    pub fn new(snapshot: &Snapshot, previous: Option<&Breakers>, store: Arc<Store>) -> Self {
        let by_backend = snapshot
            .backends
            .iter()
            .map(|backend| {
                let policy = snapshot
                    .circuit_breakers
                    .get(backend.circuit_breaker.as_deref()?)?;
                let kept = previous
                    .and_then(|p| p.named(&backend.name))
                    .filter(|b| b.policy == *policy);
                Some(match kept {
                    Some(breaker) => breaker.clone(),
                    None => Arc::new(Breaker::new(&backend.name, policy.clone())),
                })
            })
            .collect();
        Breakers { by_backend, store }
    }

    fn named(&self, name: &str) -> Option<&Arc<Breaker>> {
        self.by_backend.iter().flatten().find(|b| b.backend == name)
    }

    fn get(&self, backend: BackendId) -> Option<&Arc<Breaker>> {
        self.by_backend.get(backend).and_then(Option::as_ref)
    }

    /// How often `backend`'s breaker made each of the [`TRANSITIONS`] here.
    pub fn transitions(&self, backend: BackendId) -> Option<[u64; 4]> {
        let breaker = self.get(backend)?;
        Some(
            breaker
                .transitions
                .each_ref()
                .map(|c| c.load(Ordering::Relaxed)),
        )
    }

    /// The store record of `backend`'s breaker, for the routing view to read.
    pub fn record_id(&self, backend: BackendId) -> Option<&str> {
        self.get(backend).map(|b| b.id.as_str())
    }

    /// Takes in the phase a routing view read for `backend`.
    pub fn learn(&self, backend: BackendId, phase: BreakerPhase, now: u64) {
        if let Some(breaker) = self.get(backend) {
            breaker.learn(phase, now);
        }
    }

    /// When `backend` may be asked again, if its breaker keeps requests out now. A half-open
    /// breaker whose probe is free does not: the request that gets to it first probes.
    pub fn blocked_until(&self, backend: BackendId, now: u64) -> Option<u64> {
        self.get(backend)?.known().blocked_until(now)
    }

    /// Asks right before an attempt; a half-open breaker hands its probe to the first asker in
    /// the fleet. A closed one costs no store call.
    pub async fn admit(&self, backend: BackendId, now: u64) -> Admission {
        let Some(breaker) = self.get(backend) else {
            return Admission::Closed;
        };
        let known = breaker.known();
        if known.phase == BreakerPhase::Closed {
            return Admission::Closed;
        }
        if let Some(until_ms) = known.blocked_until(now) {
            return Admission::Open { until_ms };
        }
        match self.store.claim_probe(&breaker.id, PROBE_LEASE_MS).await {
            Claim::Closed => {
                breaker.learn(BreakerPhase::Closed, now);
                Admission::Closed
            }
            Claim::Probe => {
                breaker.learn(BreakerPhase::HalfOpen { probing: true }, now);
                breaker.count(1);
                tracing::info!(backend = %breaker.backend, "circuit breaker half-open: one probe admitted");
                Admission::Probe(ProbePermit {
                    backend,
                    breaker: breaker.clone(),
                    store: self.store.clone(),
                    settled: false,
                })
            }
            Claim::Open { remaining_ms } => {
                breaker.learn(BreakerPhase::Open { remaining_ms }, now);
                Admission::Open {
                    until_ms: now + remaining_ms,
                }
            }
            Claim::Busy => {
                breaker.learn(BreakerPhase::HalfOpen { probing: true }, now);
                Admission::Open {
                    until_ms: now + PROBE_PENDING_MS,
                }
            }
        }
    }

    /// The outcome of an attempt that was not a probe (probes settle their permit instead).
    pub async fn record(&self, backend: BackendId, outcome: &Observed, now: u64) {
        if let Some(breaker) = self.get(backend) {
            breaker.record(&self.store, outcome, now).await;
        }
    }

    /// The breaker as the store has it now.
    pub async fn view(&self, backend: BackendId, now: u64) -> Option<View> {
        let breaker = self.get(backend)?;
        let record = self.store.breaker(&breaker.id).await.unwrap_or_default();
        breaker.learn(record.phase, now);
        let (state, next_probe_in_ms) = match record.phase {
            BreakerPhase::Closed => (BreakerState::Closed, None),
            BreakerPhase::Open { remaining_ms } => (BreakerState::Open, Some(remaining_ms)),
            BreakerPhase::HalfOpen { .. } => (BreakerState::HalfOpen, Some(0)),
        };
        Some(View {
            policy: breaker.policy.name.clone(),
            state,
            next_probe_in_ms,
            trips: record.trips,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use onedoor_state::MemoryState;

    use super::*;

    fn rule(threshold: FailureThreshold, status: Vec<FailureKind>, trip_ms: u64) -> BreakerRule {
        BreakerRule {
            name: "r".into(),
            threshold,
            within: Duration::from_secs(60),
            status,
            trip: Duration::from_millis(trip_ms),
            accept_retry_after: false,
        }
    }

    /// One backend's breaker (index 0) over a memory store whose clock the test moves.
    struct Rig {
        breakers: Breakers,
        clock: Arc<AtomicU64>,
    }

    impl Rig {
        fn new(rules: Vec<BreakerRule>) -> Self {
            let clock = Arc::new(AtomicU64::new(0));
            let store = Arc::new(Store::Memory(MemoryState::with_clock(clock.clone())));
            Rig::on(store, clock, rules)
        }

        fn on(store: Arc<Store>, clock: Arc<AtomicU64>, rules: Vec<BreakerRule>) -> Self {
            let policy = BreakerPolicy {
                name: "p".into(),
                rules,
            };
            Rig {
                breakers: Breakers {
                    by_backend: vec![Some(Arc::new(Breaker::new("b", policy)))],
                    store,
                },
                clock,
            }
        }

        fn at(&self, now: u64) -> u64 {
            self.clock.store(now, Ordering::Relaxed);
            now
        }

        async fn record(&self, now: u64, outcome: Observed) {
            let now = self.at(now);
            self.breakers.record(0, &outcome, now).await;
        }

        async fn admit(&self, now: u64) -> Admission {
            let now = self.at(now);
            self.breakers.admit(0, now).await
        }

        async fn state(&self, now: u64) -> (BreakerState, Option<u64>) {
            let now = self.at(now);
            let view = self.breakers.view(0, now).await.unwrap();
            (view.state, view.next_probe_in_ms)
        }
    }

    const SERVER_ERRORS: FailureKind = FailureKind::Status { from: 500, to: 599 };

    fn status(code: u16) -> Observed {
        Observed::Status {
            code,
            retry_after: None,
        }
    }

    #[tokio::test]
    async fn a_count_rule_trips_on_the_nth_counted_failure_within_its_window() {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(3),
            vec![SERVER_ERRORS, FailureKind::ConnectError],
            1000,
        )]);
        b.record(0, status(500)).await;
        b.record(1, Observed::Success).await;
        b.record(2, status(400)).await;
        b.record(3, status(404)).await;
        b.record(4, Observed::Timeout).await;
        b.record(30_000, Observed::ConnectError).await;
        assert_eq!(b.state(30_001).await, (BreakerState::Closed, None));
        // The first failure has left the 60 s window by now: two again.
        b.record(60_001, status(503)).await;
        assert_eq!(b.state(60_002).await, (BreakerState::Closed, None));
        b.record(60_010, status(502)).await;
        assert_eq!(b.state(60_010).await, (BreakerState::Open, Some(1000)));
        assert_eq!(b.breakers.view(0, b.at(60_010)).await.unwrap().trips, 1);
        assert!(matches!(
            b.admit(60_500).await,
            Admission::Open { until_ms: 61_010 }
        ));
    }

    #[tokio::test]
    async fn a_percent_rule_waits_for_min_requests_then_compares_the_share() {
        let percent = || {
            rule(
                FailureThreshold::Percent {
                    percent: 50.0,
                    min_requests: 4,
                },
                vec![SERVER_ERRORS],
                1000,
            )
        };
        let b = Rig::new(vec![percent()]);
        b.record(0, status(500)).await;
        b.record(1, status(500)).await;
        b.record(2, status(500)).await;
        assert_eq!(
            b.state(3).await.0,
            BreakerState::Closed,
            "under min_requests"
        );
        // 3 of 4 failed once the success counts in the denominator.
        b.record(3, Observed::Success).await;
        assert_eq!(
            b.state(4).await.0,
            BreakerState::Closed,
            "a success never trips"
        );
        b.record(5, status(500)).await;
        assert_eq!(b.state(6).await.0, BreakerState::Open);

        let b = Rig::new(vec![percent()]);
        for at in 0..6 {
            b.record(at, Observed::Success).await;
        }
        b.record(6, status(500)).await;
        b.record(7, status(500)).await;
        b.record(8, status(500)).await;
        assert_eq!(
            b.state(9).await.0,
            BreakerState::Closed,
            "3 of 9 is under 50%"
        );
    }

    #[tokio::test]
    async fn half_open_lets_one_probe_through_and_its_success_closes() {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            1000,
        )]);
        b.record(0, status(500)).await;
        assert!(matches!(b.admit(999).await, Admission::Open { .. }));
        assert_eq!(b.breakers.blocked_until(0, 999), Some(1000));
        assert_eq!(
            b.breakers.blocked_until(0, 1000),
            None,
            "a free probe does not keep requests out"
        );
        assert_eq!(b.state(1000).await, (BreakerState::HalfOpen, Some(0)));
        let Admission::Probe(probe) = b.admit(1000).await else {
            panic!("the first request after the trip probes")
        };
        assert_eq!(probe.backend(), 0);
        assert!(matches!(b.admit(1001).await, Admission::Open { .. }));
        assert_eq!(
            b.breakers.blocked_until(0, 1001),
            Some(1000 + PROBE_PENDING_MS)
        );
        // A non-probe answer arriving now changes nothing.
        b.record(1002, Observed::Success).await;
        assert_eq!(b.state(1002).await.0, BreakerState::HalfOpen);
        probe.settle(&Observed::Success, b.at(1003)).await;
        assert_eq!(b.state(1004).await, (BreakerState::Closed, None));
        assert!(matches!(b.admit(1004).await, Admission::Closed));
    }

    #[tokio::test]
    async fn a_probe_never_sent_frees_the_probe_for_the_next_request() {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            10,
        )]);
        b.record(0, status(500)).await;
        let first = b.admit(10).await;
        assert!(matches!(first, Admission::Probe(_)));
        drop(first);
        b.state(11).await;
        assert!(matches!(b.admit(11).await, Admission::Probe(_)));
    }

    #[tokio::test]
    async fn a_failed_probe_re_opens_with_doubling_backoff_capped_at_ten_trips() {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            100,
        )]);
        b.record(0, status(500)).await;
        let mut now = 100;
        for expected in [200, 400, 800, 1000, 1000] {
            let Admission::Probe(probe) = b.admit(now).await else {
                panic!("probe at {now}")
            };
            probe.settle(&status(503), now).await;
            assert_eq!(b.state(now).await, (BreakerState::Open, Some(expected)));
            now += expected;
        }
        assert_eq!(b.breakers.view(0, b.at(now)).await.unwrap().trips, 6);
        let Admission::Probe(probe) = b.admit(now).await else {
            panic!("probe at {now}")
        };
        probe.settle(&Observed::Success, now).await;
        // Closed again: the next trip starts from the plain `trip`.
        b.record(now, status(500)).await;
        assert_eq!(b.state(now).await, (BreakerState::Open, Some(100)));
    }

    #[tokio::test]
    async fn accept_retry_after_trips_for_exactly_the_upstreams_retry_after() {
        let mut throttled = rule(
            FailureThreshold::Count(1),
            vec![FailureKind::Status { from: 429, to: 429 }],
            10_000,
        );
        throttled.accept_retry_after = true;
        let b = Rig::new(vec![throttled.clone()]);
        let slow_down = Observed::Status {
            code: 429,
            retry_after: Some(Duration::from_millis(1500)),
        };
        b.record(0, slow_down).await;
        assert_eq!(b.state(0).await, (BreakerState::Open, Some(1500)));
        // A re-open honours the Retry-After too, without backoff.
        let Admission::Probe(probe) = b.admit(1500).await else {
            panic!("probe")
        };
        probe.settle(&slow_down, 1500).await;
        assert_eq!(b.state(1500).await, (BreakerState::Open, Some(1500)));
        // Without a Retry-After the rule's own trip applies.
        let b = Rig::new(vec![throttled]);
        b.record(0, status(429)).await;
        assert_eq!(b.state(0).await, (BreakerState::Open, Some(10_000)));
    }

    #[tokio::test]
    async fn a_breaker_tripped_by_one_instance_is_open_for_another_on_the_same_store() {
        let clock = Arc::new(AtomicU64::new(0));
        let store = Arc::new(Store::Memory(MemoryState::with_clock(clock.clone())));
        let rules = || vec![rule(FailureThreshold::Count(1), vec![SERVER_ERRORS], 1000)];
        let a = Rig::on(store.clone(), clock.clone(), rules());
        let b = Rig::on(store, clock, rules());
        a.record(0, status(500)).await;
        assert!(
            matches!(b.admit(1).await, Admission::Closed),
            "b has not looked yet"
        );
        assert_eq!(b.state(1).await.0, BreakerState::Open);
        assert!(matches!(
            b.admit(2).await,
            Admission::Open { until_ms: 1000 }
        ));
        // Only one of them gets the probe.
        let (first, second) = (a.admit(1000).await, b.admit(1000).await);
        assert!(matches!(first, Admission::Probe(_)));
        assert!(matches!(second, Admission::Open { .. }));
    }

    #[test]
    fn each_failure_maps_to_the_kind_rules_name() {
        assert_eq!(
            Observed::of(&Failure::Reset("x".into())),
            Observed::ConnectError
        );
        assert_eq!(Observed::of(&Failure::FirstTokenTimeout), Observed::Timeout);
        assert_eq!(Observed::of(&Failure::ConnectTimeout), Observed::Timeout);
    }

    #[tokio::test]
    async fn reload_keeps_the_breaker_of_an_unchanged_backend_and_policy() {
        let yaml = |trip: &str| {
            format!(
                "circuit_breakers: {{ p: {{ rules: [{{ name: r, failures: {{ count: 1, within: 1m, status: [500] }}, trip: {trip} }}] }} }}
backends:
  - {{ name: a, provider: openai, url: http://127.0.0.1:1, region: r, circuit_breaker: p }}
  - {{ name: b, provider: openai, url: http://127.0.0.1:2, region: r }}
models:
  - {{ name: m, targets: [{{ backend: a, model: x }}, {{ backend: b, model: x }}] }}
"
            )
        };
        let parse = |text: String| {
            onedoor_config::parse(&text, std::path::Path::new("t.yaml"), &|_| None).unwrap()
        };
        let store = Arc::new(Store::memory());
        let before = Breakers::new(&parse(yaml("30s")), None, store.clone());
        assert!(
            before.view(1, 0).await.is_none(),
            "a backend without a policy has no breaker"
        );
        before.record(0, &status(500), 0).await;
        let kept = Breakers::new(&parse(yaml("30s")), Some(&before), store.clone());
        assert_eq!(
            kept.view(0, 0).await.map(|v| v.state),
            Some(BreakerState::Open)
        );
        let changed = Breakers::new(&parse(yaml("10s")), Some(&before), store);
        assert_eq!(
            changed.view(0, 0).await.map(|v| v.state),
            Some(BreakerState::Closed)
        );
    }
}
