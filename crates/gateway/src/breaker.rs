//! Circuit breakers (contract section 2, `circuit_breakers`): a backend that names a policy has
//! one breaker of its own and one per target on it (deployment or model). HTTP-status failures
//! and response timeouts count against the target that produced them, connection failures,
//! resets and connect timeouts against the whole backend (a rule's `scope` overrides that).
//! Failures a rule counts, within its window, trip that breaker open for the rule's `trip`; after
//! that it is half-open and lets one probe through at a time (for a target's breaker, a request
//! for that target), which closes it or re-opens it for the trip grown by the rule's `backoff`.
//! Each instance counts the failures it sees; the breakers' phases are records in the state store
//! (`onedoor_state`), so a breaker tripped on one instance is open on all of them and one probe
//! goes out for the whole fleet. The phase last seen is kept here, so a closed breaker costs no
//! store call.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use onedoor_config::{
    BackendId, BreakerPolicy, BreakerRule, BreakerScope, FailureKind, FailureThreshold, Snapshot,
};
use onedoor_state::{Backoff, BreakerPhase, Claim, State, Store};
use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use crate::outcome::retry_after;
use crate::upstream::Failure;

/// How long other requests leave a half-open breaker alone while its probe is in flight (the
/// probe has no known end; this is when asking again makes sense).
const PROBE_PENDING_MS: u64 = 1000;
/// A probe's hold on a half-open breaker ends after this even if its instance never says how it
/// went (it died): then another may probe.
const PROBE_LEASE_MS: u64 = 60_000;
/// Percent rules remember at most this many recent outcomes (or `min_requests`, when larger).
const MAX_EVENTS: usize = 4096;
/// Target breakers a backend keeps at most: those of its configured targets, then those of
/// deployments learned through `"*"` targets (named by callers) until this many.
const MAX_TARGETS: usize = 256;

/// What one attempt told us about its target, in the terms breaker rules are written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    Success,
    Status {
        code: u16,
        retry_after: Option<Duration>,
    },
    /// A connection error, or a reset before a whole response.
    ConnectError,
    /// No connection within the connect timeout.
    ConnectTimeout,
    /// A first-token or total timeout.
    Timeout,
}

impl Observed {
    pub fn of(failure: &Failure) -> Self {
        match failure {
            // An attempt without a token is not recorded at all (the failover loop skips it).
            Failure::ConnectError(_) | Failure::Reset(_) | Failure::AuthUnavailable(_) => {
                Observed::ConnectError
            }
            Failure::ConnectTimeout => Observed::ConnectTimeout,
            Failure::FirstTokenTimeout | Failure::Timeout => Observed::Timeout,
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
            | (Observed::ConnectTimeout | Observed::Timeout, FailureKind::Timeout) => true,
            _ => false,
        }
    }

    /// Whether the attempt got an answer from its target (or its time ran out waiting for one).
    fn reached(&self) -> bool {
        !matches!(self, Observed::ConnectError | Observed::ConnectTimeout)
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Observed::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// What `outcome` is held against under `rule`: its `scope`, else the target when the target
/// answered and the backend when no connection was had.
fn blame(rule: &BreakerRule, outcome: &Observed) -> BreakerScope {
    match rule.scope {
        Some(scope) => scope,
        None if outcome.reached() => BreakerScope::Target,
        None => BreakerScope::Backend,
    }
}

/// Whether `rule` counts `outcome` as a failure of the breaker of `scope`.
fn counts(rule: &BreakerRule, outcome: &Observed, scope: BreakerScope) -> bool {
    rule.status.iter().any(|kind| outcome.is(kind)) && blame(rule, outcome) == scope
}

/// Whether any failure `rule` counts can be held against a target.
fn may_blame_targets(rule: &BreakerRule) -> bool {
    match rule.scope {
        Some(scope) => scope == BreakerScope::Target,
        None => rule
            .status
            .iter()
            .any(|kind| !matches!(kind, FailureKind::ConnectError)),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// How long `rule` keeps the breaker open after `outcome`, and how a failed probe grows that:
/// exactly the upstream's Retry-After when the rule accepts it, else its `trip` grown by its
/// `backoff`.
fn open_for(rule: &BreakerRule, outcome: &Observed) -> (u64, Backoff) {
    match outcome.retry_after().filter(|_| rule.accept_retry_after) {
        Some(wait) => (millis(wait), Backoff::NONE),
        None => (
            millis(rule.trip),
            Backoff {
                factor: rule.backoff.factor,
                max_ms: millis(rule.backoff.max),
            },
        ),
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

/// The transitions a breaker counts: tripped open, half-open for a probe, re-opened after a
/// failed probe, closed after a good one.
pub const TRANSITIONS: [&str; 4] = ["open", "half_open", "reopen", "close"];

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One breaker: of a backend (`deployment` none) or of one target on it.
#[derive(Debug)]
struct Circuit {
    scope: BreakerScope,
    /// The target's deployment or model; `None` for the backend's own breaker.
    deployment: Option<Arc<str>>,
    /// Its record in the store.
    id: Arc<str>,
    /// One per rule of the policy, same order; this instance's own observations.
    windows: Mutex<Vec<Window>>,
    known: Mutex<Known>,
    /// The transitions this instance made, counted for metrics, in [`TRANSITIONS`] order.
    transitions: [AtomicU64; 4],
}

/// What a circuit says to one attempt.
enum Gate {
    Closed,
    /// This request holds its one probe.
    Probe,
    Open {
        until_ms: u64,
    },
}

impl Circuit {
    fn new(policy: &BreakerPolicy, id: String, deployment: Option<Arc<str>>) -> Self {
        Circuit {
            scope: match deployment {
                Some(_) => BreakerScope::Target,
                None => BreakerScope::Backend,
            },
            deployment,
            id: id.into(),
            windows: Mutex::new(policy.rules.iter().map(|_| Window::default()).collect()),
            known: Mutex::new(Known::default()),
            transitions: Default::default(),
        }
    }

    fn count(&self, transition: usize) {
        if let Some(counter) = self.transitions.get(transition) {
            counter.fetch_add(1, Ordering::Relaxed);
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

    fn target(&self) -> &str {
        self.deployment.as_deref().unwrap_or("")
    }

    /// Counts `outcome` in this instance's windows; a rule whose threshold it meets trips the
    /// shared record.
    async fn record(&self, breaker: &Breaker, store: &Store, outcome: &Observed, now: u64) {
        // Open or half-open: a late answer to a request sent before the trip says nothing new.
        if self.known().phase != BreakerPhase::Closed {
            return;
        }
        let tripped = {
            let mut windows = lock(&self.windows);
            let tripped = breaker
                .policy
                .rules
                .iter()
                .zip(windows.iter_mut())
                .find_map(|(rule, window)| {
                    window
                        .push(rule, now, counts(rule, outcome, self.scope))
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
        tracing::warn!(backend = %breaker.backend, target = self.target(), rule = %rule.name, trip_ms = wait, "circuit breaker tripped");
    }

    /// The probe's outcome: a failure some rule holds against this breaker re-opens it with
    /// backoff; a target's probe that reached no target says nothing of it; anything else closes.
    async fn settle(&self, breaker: &Breaker, store: &Store, outcome: &Observed, now: u64) {
        let rules = &breaker.policy.rules;
        match rules.iter().find(|rule| counts(rule, outcome, self.scope)) {
            Some(rule) => {
                let (base, backoff) = open_for(rule, outcome);
                let record = store.reopen(&self.id, base, backoff).await;
                self.learn(record.phase, now);
                self.count(2);
                tracing::warn!(backend = %breaker.backend, target = self.target(), rule = %rule.name, reopens = record.reopens, "circuit breaker probe failed: re-opened");
            }
            None if self.scope == BreakerScope::Target && !outcome.reached() => {
                store.release_probe(&self.id).await;
                self.learn(BreakerPhase::HalfOpen { probing: false }, now);
            }
            None => {
                store.close(&self.id).await;
                lock(&self.windows).iter_mut().for_each(Window::clear);
                self.learn(BreakerPhase::Closed, now);
                self.count(3);
                tracing::info!(backend = %breaker.backend, target = self.target(), "circuit breaker probe succeeded: closed");
            }
        }
    }

    /// Asks right before an attempt; a half-open breaker hands its probe to the first asker in
    /// the fleet. A closed one costs no store call.
    async fn admit(&self, backend: &str, store: &Store, now: u64) -> Gate {
        let known = self.known();
        if known.phase == BreakerPhase::Closed {
            return Gate::Closed;
        }
        if let Some(until_ms) = known.blocked_until(now) {
            return Gate::Open { until_ms };
        }
        match store.claim_probe(&self.id, PROBE_LEASE_MS).await {
            Claim::Closed => {
                self.learn(BreakerPhase::Closed, now);
                Gate::Closed
            }
            Claim::Probe => {
                self.learn(BreakerPhase::HalfOpen { probing: true }, now);
                self.count(1);
                tracing::info!(%backend, target = self.target(), "circuit breaker half-open: one probe admitted");
                Gate::Probe
            }
            Claim::Open { remaining_ms } => {
                self.learn(BreakerPhase::Open { remaining_ms }, now);
                Gate::Open {
                    until_ms: now + remaining_ms,
                }
            }
            Claim::Busy => {
                self.learn(BreakerPhase::HalfOpen { probing: true }, now);
                Gate::Open {
                    until_ms: now + PROBE_PENDING_MS,
                }
            }
        }
    }

    async fn view(&self, store: &Store, now: u64) -> CircuitView {
        let record = store.breaker(&self.id).await.unwrap_or_default();
        self.learn(record.phase, now);
        let (state, next_probe_in_ms) = match record.phase {
            BreakerPhase::Closed => (BreakerState::Closed, None),
            BreakerPhase::Open { remaining_ms } => (BreakerState::Open, Some(remaining_ms)),
            BreakerPhase::HalfOpen { .. } => (BreakerState::HalfOpen, Some(0)),
        };
        CircuitView {
            deployment: self.deployment.clone(),
            state,
            next_probe_in_ms,
            trips: record.trips,
            reopens: record.reopens,
        }
    }
}

/// The breakers of one backend: its own, and one per target when the policy holds failures
/// against targets.
#[derive(Debug)]
pub struct Breaker {
    backend: String,
    /// The backend and its policy, so a changed policy starts closed; its targets' records add
    /// `@deployment`.
    id: String,
    policy: BreakerPolicy,
    own: Arc<Circuit>,
    /// `None` when no rule holds a failure against a target.
    targets: Option<Mutex<HashMap<Arc<str>, Arc<Circuit>>>>,
}

impl Breaker {
    fn new(backend: &str, policy: BreakerPolicy) -> Self {
        let digest = Sha256::digest(format!("{policy:?}").as_bytes());
        let id = format!("{backend}#{}", hex::encode(&digest[..6]));
        let targets = policy
            .rules
            .iter()
            .any(may_blame_targets)
            .then(|| Mutex::new(HashMap::new()));
        Breaker {
            backend: backend.to_owned(),
            own: Arc::new(Circuit::new(&policy, id.clone(), None)),
            id,
            policy,
            targets,
        }
    }

    /// The breaker of target `deployment`, made on first use while there is room for it.
    fn target(&self, deployment: &str) -> Option<Arc<Circuit>> {
        let mut targets = lock(self.targets.as_ref()?);
        if let Some(circuit) = targets.get(deployment) {
            return Some(circuit.clone());
        }
        if targets.len() >= MAX_TARGETS {
            return None;
        }
        let name: Arc<str> = Arc::from(deployment);
        let id = format!("{}@{deployment}", self.id);
        let circuit = Arc::new(Circuit::new(&self.policy, id, Some(name.clone())));
        targets.insert(name, circuit.clone());
        Some(circuit)
    }

    /// Its own breaker first, then its targets' by name.
    fn circuits(&self) -> Vec<Arc<Circuit>> {
        let mut targets: Vec<Arc<Circuit>> = match &self.targets {
            Some(map) => lock(map).values().cloned().collect(),
            None => Vec::new(),
        };
        targets.sort_by(|a, b| a.deployment.cmp(&b.deployment));
        targets.insert(0, self.own.clone());
        targets
    }

    /// Counts `outcome` against the backend's breaker and the target's.
    async fn record(&self, store: &Store, deployment: &str, outcome: &Observed, now: u64) {
        self.own.record(self, store, outcome, now).await;
        if let Some(target) = self.target(deployment) {
            target.record(self, store, outcome, now).await;
        }
    }
}

/// Whether a request may send an attempt to a target now.
#[derive(Debug)]
pub enum Admission {
    /// Closed (or no breaker): go ahead.
    Closed,
    /// Half-open, and this request holds the one probe (of the backend's breaker, the target's,
    /// or both).
    Probe(ProbePermit),
    /// Open, or half-open with a probe in flight: ask again at `until_ms`.
    Open { until_ms: u64 },
}

/// The right to send the one probe of a half-open breaker. [`ProbePermit::settle`] it with the
/// probe's outcome; dropped unsettled (the request never sent it), it lets the next request probe.
#[derive(Debug)]
pub struct ProbePermit {
    backend: BackendId,
    deployment: Arc<str>,
    breaker: Arc<Breaker>,
    /// The breakers whose probe this is: the backend's, the target's, or both.
    claimed: SmallVec<[Arc<Circuit>; 2]>,
    store: Arc<Store>,
    settled: bool,
}

impl ProbePermit {
    /// Whether this is the probe of an attempt at (`backend`, `deployment`).
    pub fn is_for(&self, backend: BackendId, deployment: &str) -> bool {
        self.backend == backend && *self.deployment == *deployment
    }

    /// The probe's outcome settles the breakers it probed and counts in the other one.
    pub async fn settle(mut self, outcome: &Observed, now: u64) {
        self.settled = true;
        let breaker = &self.breaker;
        let target = breaker.target(&self.deployment);
        for circuit in std::iter::once(breaker.own.clone()).chain(target) {
            if self.claimed.iter().any(|c| Arc::ptr_eq(c, &circuit)) {
                circuit.settle(breaker, &self.store, outcome, now).await;
            } else {
                circuit.record(breaker, &self.store, outcome, now).await;
            }
        }
    }
}

impl Drop for ProbePermit {
    fn drop(&mut self) {
        if !self.settled {
            for circuit in &self.claimed {
                self.store.release_probe_detached(circuit.id.to_string());
            }
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

/// One breaker as operators see it (`GET /admin/backends`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CircuitView {
    /// The target's deployment or model; `None` for the backend's own breaker.
    pub deployment: Option<Arc<str>>,
    pub state: BreakerState,
    /// Until the trip ends (0 when half-open); `None` when closed.
    pub next_probe_in_ms: Option<u64>,
    /// How often it opened, re-opens after a failed probe included.
    pub trips: u64,
    /// Failed probes in a row since it last closed (each grew the wait by the backoff).
    pub reopens: u32,
}

/// A backend's breakers as operators see them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub policy: String,
    /// The backend's own breaker (connection failures).
    pub own: CircuitView,
    /// Its targets' breakers, by deployment or model.
    pub targets: Vec<CircuitView>,
}

/// Every backend's breakers, by backend index. A backend without `circuit_breaker:` has none and
/// is always closed.
pub struct Breakers {
    by_backend: Vec<Option<Arc<Breaker>>>,
    store: Arc<Store>,
}

impl Breakers {
    /// The breakers of `snapshot`'s backends, with one for each target its aliases name. On
    /// reload pass the running ones as `previous`: a backend whose name and policy are unchanged
    /// keeps its breakers and counted failures.
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
        let breakers = Breakers { by_backend, store };
        let aliases = snapshot.aliases.iter().chain(&snapshot.wildcard);
        for target in aliases.flat_map(|alias| &alias.targets) {
            if let (Some(breaker), Some(deployment)) =
                (breakers.get(target.backend), &target.deployment)
            {
                breaker.target(deployment);
            }
        }
        breakers
    }

    fn named(&self, name: &str) -> Option<&Arc<Breaker>> {
        self.by_backend.iter().flatten().find(|b| b.backend == name)
    }

    fn get(&self, backend: BackendId) -> Option<&Arc<Breaker>> {
        self.by_backend.get(backend).and_then(Option::as_ref)
    }

    /// How often each of `backend`'s breakers made each of the [`TRANSITIONS`] here: its own
    /// (deployment `None`) first, then its targets'.
    pub fn transitions(&self, backend: BackendId) -> Vec<(Option<Arc<str>>, [u64; 4])> {
        let Some(breaker) = self.get(backend) else {
            return Vec::new();
        };
        breaker
            .circuits()
            .iter()
            .map(|c| {
                let counts = c.transitions.each_ref().map(|n| n.load(Ordering::Relaxed));
                (c.deployment.clone(), counts)
            })
            .collect()
    }

    /// The store record of `backend`'s own breaker, for the routing view to read.
    pub fn record_id(&self, backend: BackendId) -> Option<&str> {
        self.get(backend).map(|b| b.id.as_str())
    }

    /// The store record of the breaker of target (`backend`, `deployment`), when it has one.
    pub fn target_record_id(&self, backend: BackendId, deployment: &str) -> Option<Arc<str>> {
        let circuit = self.get(backend)?.target(deployment)?;
        Some(circuit.id.clone())
    }

    /// Takes in the phase a routing view read for `backend`'s own breaker.
    pub fn learn(&self, backend: BackendId, phase: BreakerPhase, now: u64) {
        if let Some(breaker) = self.get(backend) {
            breaker.own.learn(phase, now);
        }
    }

    /// Takes in the phase a routing view read for the breaker of (`backend`, `deployment`).
    pub fn learn_target(
        &self,
        backend: BackendId,
        deployment: &str,
        phase: BreakerPhase,
        now: u64,
    ) {
        if let Some(target) = self.get(backend).and_then(|b| b.target(deployment)) {
            target.learn(phase, now);
        }
    }

    /// When target (`backend`, `deployment`) may be asked again, if its breaker or its backend's
    /// keeps requests out now (the later of the two). A half-open breaker whose probe is free
    /// does not: the request that gets to it first probes.
    pub fn blocked_until(&self, backend: BackendId, deployment: &str, now: u64) -> Option<u64> {
        let breaker = self.get(backend)?;
        let own = breaker.own.known().blocked_until(now);
        let target = breaker
            .target(deployment)
            .and_then(|t| t.known().blocked_until(now));
        own.max(target)
    }

    /// Asks right before an attempt at (`backend`, `deployment`): the backend's breaker, then
    /// the target's; a half-open one hands its probe to the first asker in the fleet. Closed ones
    /// cost no store call.
    pub async fn admit(&self, backend: BackendId, deployment: &Arc<str>, now: u64) -> Admission {
        let Some(breaker) = self.get(backend) else {
            return Admission::Closed;
        };
        let mut claimed: SmallVec<[Arc<Circuit>; 2]> = SmallVec::new();
        let target = breaker.target(deployment);
        for circuit in std::iter::once(breaker.own.clone()).chain(target) {
            match circuit.admit(&breaker.backend, &self.store, now).await {
                Gate::Closed => {}
                Gate::Probe => claimed.push(circuit),
                Gate::Open { until_ms } => {
                    for probe in claimed {
                        probe.learn(BreakerPhase::HalfOpen { probing: false }, now);
                        self.store.release_probe_detached(probe.id.to_string());
                    }
                    return Admission::Open { until_ms };
                }
            }
        }
        if claimed.is_empty() {
            return Admission::Closed;
        }
        Admission::Probe(ProbePermit {
            backend,
            deployment: deployment.clone(),
            breaker: breaker.clone(),
            claimed,
            store: self.store.clone(),
            settled: false,
        })
    }

    /// The outcome of an attempt at (`backend`, `deployment`) that was not a probe (probes
    /// settle their permit instead).
    pub async fn record(&self, backend: BackendId, deployment: &str, outcome: &Observed, now: u64) {
        if let Some(breaker) = self.get(backend) {
            breaker.record(&self.store, deployment, outcome, now).await;
        }
    }

    /// `backend`'s breakers as the store has them now.
    pub async fn view(&self, backend: BackendId, now: u64) -> Option<View> {
        let breaker = self.get(backend)?;
        let mut circuits = breaker.circuits().into_iter();
        let own = circuits.next()?.view(&self.store, now).await;
        let mut targets = Vec::new();
        for circuit in circuits {
            targets.push(circuit.view(&self.store, now).await);
        }
        Some(View {
            policy: breaker.policy.name.clone(),
            own,
            targets,
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
            scope: None,
            backoff: onedoor_config::BreakerBackoff {
                factor: 2.0,
                max: Duration::from_millis(1000),
            },
        }
    }

    /// One backend's breakers (index 0), asked about its target "d", over a memory store whose
    /// clock the test moves.
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
            self.record_at("d", now, outcome).await;
        }

        async fn record_at(&self, deployment: &str, now: u64, outcome: Observed) {
            let now = self.at(now);
            self.breakers.record(0, deployment, &outcome, now).await;
        }

        async fn admit(&self, now: u64) -> Admission {
            self.admit_at("d", now).await
        }

        async fn admit_at(&self, deployment: &str, now: u64) -> Admission {
            let now = self.at(now);
            self.breakers.admit(0, &Arc::from(deployment), now).await
        }

        async fn view(&self, now: u64) -> View {
            let now = self.at(now);
            self.breakers.view(0, now).await.unwrap()
        }

        /// Target "d"'s breaker.
        async fn state(&self, now: u64) -> (BreakerState, Option<u64>) {
            let view = self.view(now).await;
            let d = view
                .targets
                .iter()
                .find(|t| t.deployment.as_deref() == Some("d"));
            d.map_or((BreakerState::Closed, None), |t| {
                (t.state, t.next_probe_in_ms)
            })
        }

        /// The backend's own breaker.
        async fn own_state(&self, now: u64) -> (BreakerState, Option<u64>) {
            let view = self.view(now).await;
            (view.own.state, view.own.next_probe_in_ms)
        }

        async fn trips(&self, now: u64) -> u64 {
            let view = self.view(now).await;
            view.targets.iter().map(|t| t.trips).sum::<u64>() + view.own.trips
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
        b.record(30_000, status(504)).await;
        assert_eq!(b.state(30_001).await, (BreakerState::Closed, None));
        // The first failure has left the 60 s window by now: two again.
        b.record(60_001, status(503)).await;
        assert_eq!(b.state(60_002).await, (BreakerState::Closed, None));
        b.record(60_010, status(502)).await;
        assert_eq!(b.state(60_010).await, (BreakerState::Open, Some(1000)));
        assert_eq!(b.trips(60_010).await, 1);
        assert!(matches!(
            b.admit(60_500).await,
            Admission::Open { until_ms: 61_010 }
        ));
    }

    #[tokio::test]
    async fn statuses_open_only_their_targets_breaker_and_connection_failures_the_backends() {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(2),
            vec![
                SERVER_ERRORS,
                FailureKind::ConnectError,
                FailureKind::Timeout,
            ],
            1000,
        )]);
        b.record_at("d", 0, status(503)).await;
        b.record_at("e", 1, status(503)).await;
        b.record_at("d", 2, Observed::ConnectError).await;
        assert_eq!(b.state(3).await.0, BreakerState::Closed, "one 503 each");
        b.record_at("d", 4, status(500)).await;
        assert_eq!(b.state(5).await.0, BreakerState::Open);
        assert_eq!(b.own_state(5).await.0, BreakerState::Closed);
        assert!(matches!(b.admit_at("d", 6).await, Admission::Open { .. }));
        assert!(matches!(b.admit_at("e", 6).await, Admission::Closed));
        // The second connection failure, on another target, opens the whole backend.
        b.record_at("e", 7, Observed::ConnectTimeout).await;
        assert_eq!(b.own_state(8).await, (BreakerState::Open, Some(999)));
        assert!(matches!(b.admit_at("e", 8).await, Admission::Open { .. }));
        assert_eq!(b.breakers.blocked_until(0, "e", 8), Some(1007));
    }

    #[tokio::test]
    async fn a_rules_scope_overrides_what_a_failure_is_held_against() {
        let mut whole = rule(FailureThreshold::Count(1), vec![SERVER_ERRORS], 1000);
        whole.scope = Some(BreakerScope::Backend);
        let b = Rig::new(vec![whole]);
        b.record_at("e", 0, status(500)).await;
        assert_eq!(b.own_state(1).await.0, BreakerState::Open);
        assert!(b.view(1).await.targets.is_empty(), "no rule holds targets");
        assert!(matches!(b.admit_at("d", 1).await, Admission::Open { .. }));

        let mut per_target = rule(
            FailureThreshold::Count(1),
            vec![FailureKind::ConnectError],
            1000,
        );
        per_target.scope = Some(BreakerScope::Target);
        let b = Rig::new(vec![per_target]);
        b.record_at("d", 0, Observed::ConnectError).await;
        assert_eq!(b.state(1).await.0, BreakerState::Open);
        assert_eq!(b.own_state(1).await.0, BreakerState::Closed);
        assert!(matches!(b.admit_at("e", 1).await, Admission::Closed));
    }

    #[tokio::test]
    async fn a_targets_probe_that_reaches_no_target_leaves_it_half_open_and_counts_for_the_backend()
    {
        let b = Rig::new(vec![rule(
            FailureThreshold::Count(1),
            vec![SERVER_ERRORS, FailureKind::ConnectError],
            100,
        )]);
        b.record(0, status(502)).await;
        let Admission::Probe(probe) = b.admit(100).await else {
            panic!("probe")
        };
        probe.settle(&Observed::ConnectError, b.at(101)).await;
        assert_eq!(b.state(102).await, (BreakerState::HalfOpen, Some(0)));
        assert_eq!(b.own_state(102).await.0, BreakerState::Open);
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
        assert_eq!(b.breakers.blocked_until(0, "d", 999), Some(1000));
        assert_eq!(
            b.breakers.blocked_until(0, "d", 1000),
            None,
            "a free probe does not keep requests out"
        );
        assert_eq!(b.state(1000).await, (BreakerState::HalfOpen, Some(0)));
        let Admission::Probe(probe) = b.admit(1000).await else {
            panic!("the first request after the trip probes")
        };
        assert!(probe.is_for(0, "d"));
        assert!(matches!(b.admit(1001).await, Admission::Open { .. }));
        assert_eq!(
            b.breakers.blocked_until(0, "d", 1001),
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
    async fn a_failed_probe_re_opens_with_the_rules_backoff_up_to_its_max() {
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
        assert_eq!(b.trips(now).await, 6);
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
        assert_eq!(
            Observed::of(&Failure::ConnectTimeout),
            Observed::ConnectTimeout
        );
        assert_eq!(Observed::of(&Failure::Timeout), Observed::Timeout);
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
        before.record(0, "x", &status(500), 0).await;
        let state = |view: Option<View>| {
            view.map(|v| (v.targets[0].deployment.clone(), v.targets[0].state))
        };
        let kept = Breakers::new(&parse(yaml("30s")), Some(&before), store.clone());
        assert_eq!(
            state(kept.view(0, 0).await),
            Some((Some("x".into()), BreakerState::Open))
        );
        let changed = Breakers::new(&parse(yaml("10s")), Some(&before), store);
        assert_eq!(
            state(changed.view(0, 0).await),
            Some((Some("x".into()), BreakerState::Closed))
        );
    }
}
