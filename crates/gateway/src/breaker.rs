//! Circuit breakers (contract section 2, `circuit_breakers`): one per backend that names a policy.
//! Failures a rule counts, within its window, trip the breaker open for the rule's `trip`; after
//! that it is half-open and lets one probe through at a time, which closes it or re-opens it with
//! backoff. Kept in memory per instance; [`Breakers`] is the seam a shared store will sit behind.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use onedoor_config::{
    BackendId, BreakerPolicy, BreakerRule, FailureKind, FailureThreshold, Snapshot,
};

use crate::outcome::retry_after;
use crate::upstream::Failure;

/// How long other requests leave a half-open backend alone while its probe is in flight (the
/// probe has no known end; this is when asking again makes sense).
const PROBE_PENDING_MS: u64 = 1000;
/// A re-open never lasts longer than this many times the rule's `trip`.
const MAX_BACKOFF: u32 = 10;
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
            Failure::ConnectError(_) | Failure::Reset(_) => Observed::ConnectError,
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
/// when the rule accepts it, else its `trip`, doubled for each consecutive re-open up to
/// [`MAX_BACKOFF`] times.
fn open_for(rule: &BreakerRule, outcome: &Observed, reopens: u32) -> Duration {
    if let Some(wait) = outcome.retry_after().filter(|_| rule.accept_retry_after) {
        return wait;
    }
    let factor = 1u32
        .checked_shl(reopens)
        .unwrap_or(u32::MAX)
        .min(MAX_BACKOFF);
    rule.trip.saturating_mul(factor)
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Closed,
    Open {
        until_ms: u64,
    },
    /// The trip is over; `probing` while the one probe allowed is in flight.
    HalfOpen {
        probing: bool,
    },
}

#[derive(Debug)]
struct Inner {
    phase: Phase,
    /// One per rule of the policy, same order.
    windows: Vec<Window>,
    /// Failed probes since the breaker last closed: each re-open doubles the trip.
    reopens: u32,
}

/// The breaker of one backend.
#[derive(Debug)]
pub struct Breaker {
    backend: String,
    policy: BreakerPolicy,
    inner: Mutex<Inner>,
    trips: AtomicU64,
}

impl Breaker {
    fn new(backend: &str, policy: BreakerPolicy) -> Self {
        let windows = policy.rules.iter().map(|_| Window::default()).collect();
        Breaker {
            backend: backend.to_owned(),
            policy,
            inner: Mutex::new(Inner {
                phase: Phase::Closed,
                windows,
                reopens: 0,
            }),
            trips: AtomicU64::new(0),
        }
    }

    /// The critical sections are a few comparisons and never panic; a poisoned lock still holds
    /// consistent state.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn blocked_until(&self, now: u64) -> Option<u64> {
        match self.lock().phase {
            Phase::Open { until_ms } if now < until_ms => Some(until_ms),
            Phase::HalfOpen { probing: true } => Some(now + PROBE_PENDING_MS),
            Phase::Closed | Phase::Open { .. } | Phase::HalfOpen { probing: false } => None,
        }
    }

    fn admit(self: &Arc<Self>, backend: BackendId, now: u64) -> Admission {
        let mut inner = self.lock();
        match inner.phase {
            Phase::Closed => Admission::Closed,
            Phase::Open { until_ms } if now < until_ms => Admission::Open { until_ms },
            Phase::HalfOpen { probing: true } => Admission::Open {
                until_ms: now + PROBE_PENDING_MS,
            },
            Phase::Open { .. } | Phase::HalfOpen { probing: false } => {
                inner.phase = Phase::HalfOpen { probing: true };
                drop(inner);
                tracing::info!(backend = %self.backend, "circuit breaker half-open: one probe admitted");
                Admission::Probe(ProbePermit {
                    backend,
                    breaker: self.clone(),
                    settled: false,
                })
            }
        }
    }

    fn record(&self, outcome: &Observed, now: u64) {
        let mut inner = self.lock();
        // Open or half-open: a late answer to a request sent before the trip says nothing new.
        if inner.phase != Phase::Closed {
            return;
        }
        let tripped = self
            .policy
            .rules
            .iter()
            .zip(inner.windows.iter_mut())
            .find_map(|(rule, window)| {
                window
                    .push(rule, now, counts(rule, outcome))
                    .then_some(rule)
            });
        if let Some(rule) = tripped {
            let wait = open_for(rule, outcome, 0);
            self.open(&mut inner, now, wait);
            drop(inner);
            tracing::warn!(backend = %self.backend, rule = %rule.name, trip_ms = millis(wait), "circuit breaker tripped");
        }
    }

    /// The probe's outcome: a failure some rule counts re-opens with backoff, anything else closes.
    fn settle(&self, outcome: &Observed, now: u64) {
        let mut inner = self.lock();
        if inner.phase != (Phase::HalfOpen { probing: true }) {
            return;
        }
        match self.policy.rules.iter().find(|rule| counts(rule, outcome)) {
            Some(rule) => {
                inner.reopens = inner.reopens.saturating_add(1);
                let wait = open_for(rule, outcome, inner.reopens);
                self.open(&mut inner, now, wait);
                drop(inner);
                tracing::warn!(backend = %self.backend, rule = %rule.name, trip_ms = millis(wait), "circuit breaker probe failed: re-opened");
            }
            None => {
                inner.phase = Phase::Closed;
                inner.reopens = 0;
                inner.windows.iter_mut().for_each(Window::clear);
                drop(inner);
                tracing::info!(backend = %self.backend, "circuit breaker probe succeeded: closed");
            }
        }
    }

    fn open(&self, inner: &mut Inner, now: u64, wait: Duration) {
        inner.phase = Phase::Open {
            until_ms: now.saturating_add(millis(wait)),
        };
        inner.windows.iter_mut().for_each(Window::clear);
        self.trips.fetch_add(1, Ordering::Relaxed);
    }

    /// A probe that was never sent: the next request may probe.
    fn release(&self) {
        let mut inner = self.lock();
        if inner.phase == (Phase::HalfOpen { probing: true }) {
            inner.phase = Phase::HalfOpen { probing: false };
        }
    }

    fn view(&self, now: u64) -> View {
        let (state, next_probe_in_ms) = match self.lock().phase {
            Phase::Closed => (BreakerState::Closed, None),
            Phase::Open { until_ms } if now < until_ms => {
                (BreakerState::Open, Some(until_ms - now))
            }
            Phase::Open { .. } | Phase::HalfOpen { .. } => (BreakerState::HalfOpen, Some(0)),
        };
        View {
            policy: self.policy.name.clone(),
            state,
            next_probe_in_ms,
            trips: self.trips.load(Ordering::Relaxed),
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
    settled: bool,
}

impl ProbePermit {
    pub fn backend(&self) -> BackendId {
        self.backend
    }

    pub fn settle(mut self, outcome: &Observed, now: u64) {
        self.settled = true;
        self.breaker.settle(outcome, now);
    }
}

impl Drop for ProbePermit {
    fn drop(&mut self) {
        if !self.settled {
            self.breaker.release();
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
#[derive(Debug, Default)]
pub struct Breakers {
    by_backend: Vec<Option<Arc<Breaker>>>,
}

impl Breakers {
    /// The breakers of `snapshot`'s backends. On reload pass the running ones as `previous`: a
    /// backend whose name and policy are unchanged keeps its breaker, state and counters.
    pub fn new(snapshot: &Snapshot, previous: Option<&Breakers>) -> Self {
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
        Breakers { by_backend }
    }

    fn named(&self, name: &str) -> Option<&Arc<Breaker>> {
        self.by_backend.iter().flatten().find(|b| b.backend == name)
    }

    fn get(&self, backend: BackendId) -> Option<&Arc<Breaker>> {
        self.by_backend.get(backend).and_then(Option::as_ref)
    }

    /// When `backend` may be asked again, if its breaker keeps requests out now. A half-open
    /// breaker whose probe is free does not: the request that gets to it first probes.
    pub fn blocked_until(&self, backend: BackendId, now: u64) -> Option<u64> {
        self.get(backend)?.blocked_until(now)
    }

    /// Asks right before an attempt; a half-open breaker hands its probe to the first asker.
    pub fn admit(&self, backend: BackendId, now: u64) -> Admission {
        match self.get(backend) {
            Some(breaker) => breaker.admit(backend, now),
            None => Admission::Closed,
        }
    }

    /// The outcome of an attempt that was not a probe (probes settle their permit instead).
    pub fn record(&self, backend: BackendId, outcome: &Observed, now: u64) {
        if let Some(breaker) = self.get(backend) {
            breaker.record(outcome, now);
        }
    }

    pub fn view(&self, backend: BackendId, now: u64) -> Option<View> {
        self.get(backend).map(|b| b.view(now))
    }
}

#[cfg(test)]
mod tests {
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

    fn breaker(rules: Vec<BreakerRule>) -> Arc<Breaker> {
        Arc::new(Breaker::new(
            "b",
            BreakerPolicy {
                name: "p".into(),
                rules,
            },
        ))
    }

    const SERVER_ERRORS: FailureKind = FailureKind::Status { from: 500, to: 599 };

    fn status(code: u16) -> Observed {
        Observed::Status {
            code,
            retry_after: None,
        }
    }

    fn state(b: &Breaker, now: u64) -> (BreakerState, Option<u64>) {
        let view = b.view(now);
        (view.state, view.next_probe_in_ms)
    }

    #[test]
    fn a_count_rule_trips_on_the_nth_counted_failure_within_its_window() {
        let b = breaker(vec![rule(
            FailureThreshold::Count(3),
            vec![SERVER_ERRORS, FailureKind::ConnectError],
            1000,
        )]);
        b.record(&status(500), 0);
        b.record(&Observed::Success, 1);
        b.record(&status(400), 2);
        b.record(&status(404), 3);
        b.record(&Observed::Timeout, 4);
        b.record(&Observed::ConnectError, 30_000);
        assert_eq!(state(&b, 30_001), (BreakerState::Closed, None));
        // The first failure has left the 60 s window by now: two again.
        b.record(&status(503), 60_001);
        assert_eq!(state(&b, 60_002), (BreakerState::Closed, None));
        b.record(&status(502), 60_010);
        assert_eq!(state(&b, 60_010), (BreakerState::Open, Some(1000)));
        assert_eq!(b.view(0).trips, 1);
        assert!(matches!(
            b.admit(0, 60_500),
            Admission::Open { until_ms: 61_010 }
        ));
    }

    #[test]
    fn a_percent_rule_waits_for_min_requests_then_compares_the_share() {
        let b = breaker(vec![rule(
            FailureThreshold::Percent {
                percent: 50.0,
                min_requests: 4,
            },
            vec![SERVER_ERRORS],
            1000,
        )]);
        b.record(&status(500), 0);
        b.record(&status(500), 1);
        b.record(&status(500), 2);
        assert_eq!(state(&b, 3).0, BreakerState::Closed, "under min_requests");
        // 3 of 4 failed once the success counts in the denominator.
        b.record(&Observed::Success, 3);
        assert_eq!(
            state(&b, 4).0,
            BreakerState::Closed,
            "a success never trips"
        );
        b.record(&status(500), 5);
        assert_eq!(state(&b, 6).0, BreakerState::Open);

        let b = breaker(vec![rule(
            FailureThreshold::Percent {
                percent: 50.0,
                min_requests: 4,
            },
            vec![SERVER_ERRORS],
            1000,
        )]);
        for at in 0..6 {
            b.record(&Observed::Success, at);
        }
        b.record(&status(500), 6);
        b.record(&status(500), 7);
        b.record(&status(500), 8);
        assert_eq!(state(&b, 9).0, BreakerState::Closed, "3 of 9 is under 50%");
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_success_closes() {
        let b = breaker(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            1000,
        )]);
        b.record(&status(500), 0);
        assert!(matches!(b.admit(0, 999), Admission::Open { .. }));
        assert_eq!(b.blocked_until(999), Some(1000));
        assert_eq!(
            b.blocked_until(1000),
            None,
            "a free probe does not keep requests out"
        );
        assert_eq!(state(&b, 1000), (BreakerState::HalfOpen, Some(0)));
        let Admission::Probe(probe) = b.admit(7, 1000) else {
            panic!("the first request after the trip probes")
        };
        assert_eq!(probe.backend(), 7);
        assert!(matches!(b.admit(0, 1001), Admission::Open { .. }));
        assert_eq!(b.blocked_until(1001), Some(1001 + PROBE_PENDING_MS));
        // A non-probe answer arriving now changes nothing.
        b.record(&Observed::Success, 1002);
        assert_eq!(state(&b, 1002).0, BreakerState::HalfOpen);
        probe.settle(&Observed::Success, 1003);
        assert_eq!(state(&b, 1004), (BreakerState::Closed, None));
        assert!(matches!(b.admit(0, 1004), Admission::Closed));
    }

    #[test]
    fn a_probe_never_sent_frees_the_probe_for_the_next_request() {
        let b = breaker(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            10,
        )]);
        b.record(&status(500), 0);
        let first = b.admit(0, 10);
        assert!(matches!(first, Admission::Probe(_)));
        drop(first);
        assert!(matches!(b.admit(0, 11), Admission::Probe(_)));
    }

    #[test]
    fn a_failed_probe_re_opens_with_doubling_backoff_capped_at_ten_trips() {
        let b = breaker(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS],
            100,
        )]);
        b.record(&status(500), 0);
        let mut now = 100;
        for expected in [200, 400, 800, 1000, 1000] {
            let Admission::Probe(probe) = b.admit(0, now) else {
                panic!("probe at {now}")
            };
            probe.settle(&status(503), now);
            assert_eq!(state(&b, now), (BreakerState::Open, Some(expected)));
            now += expected;
        }
        assert_eq!(b.view(now).trips, 6);
        let Admission::Probe(probe) = b.admit(0, now) else {
            panic!("probe at {now}")
        };
        probe.settle(&Observed::Success, now);
        // Closed again: the next trip starts from the plain `trip`.
        b.record(&status(500), now);
        assert_eq!(state(&b, now), (BreakerState::Open, Some(100)));
    }

    #[test]
    fn accept_retry_after_trips_for_exactly_the_upstreams_retry_after() {
        let mut throttled = rule(
            FailureThreshold::Count(1),
            vec![FailureKind::Status { from: 429, to: 429 }],
            10_000,
        );
        throttled.accept_retry_after = true;
        let b = breaker(vec![throttled.clone()]);
        let slow_down = Observed::Status {
            code: 429,
            retry_after: Some(Duration::from_millis(1500)),
        };
        b.record(&slow_down, 0);
        assert_eq!(state(&b, 0), (BreakerState::Open, Some(1500)));
        // A re-open honours the Retry-After too, without backoff.
        let Admission::Probe(probe) = b.admit(0, 1500) else {
            panic!("probe")
        };
        probe.settle(&slow_down, 1500);
        assert_eq!(state(&b, 1500), (BreakerState::Open, Some(1500)));
        // Without a Retry-After the rule's own trip applies.
        let b = breaker(vec![throttled]);
        b.record(&status(429), 0);
        assert_eq!(state(&b, 0), (BreakerState::Open, Some(10_000)));
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

    #[test]
    fn reload_keeps_the_breaker_of_an_unchanged_backend_and_policy() {
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
        let before = Breakers::new(&parse(yaml("30s")), None);
        assert!(
            before.view(1, 0).is_none(),
            "a backend without a policy has no breaker"
        );
        before.record(0, &status(500), 0);
        let kept = Breakers::new(&parse(yaml("30s")), Some(&before));
        assert_eq!(kept.view(0, 0).map(|v| v.state), Some(BreakerState::Open));
        let changed = Breakers::new(&parse(yaml("10s")), Some(&before));
        assert_eq!(
            changed.view(0, 0).map(|v| v.state),
            Some(BreakerState::Closed)
        );
    }
}
