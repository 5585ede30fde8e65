//! The attempt loop (contract section 2.1, rule 3): after a failed attempt the next target at
//! once, a second try on the same target only under the same-target rule, bounded by
//! `routing.max_attempts` and the total timeout. Learns into the state as it goes: 404s into the
//! not-served cache, 429s into cooldowns, every outcome into its target's and its backend's circuit
//! breakers.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use onedoor_config::Snapshot;
use onedoor_state::{now_ms, State, TargetKey};
use smallvec::SmallVec;
use tokio::time::Instant;

use crate::breaker::{Admission, Observed, ProbePermit};
use crate::errors::GatewayError;
use crate::fleet;
use crate::outcome::{self, verdict, Verdict};
use crate::router::{Candidate, Excluded, Fitness, Plan};
use crate::runtime::Runtime;
use crate::telemetry::Attempts;
use crate::upstream::{Failure, Outcome};

/// Every attempt of one request, in order, for `x-onedoor-attempts`, logs and traces.
#[derive(Debug, Default)]
pub struct Trail {
    /// Each attempt's backend, its name shared with the configuration, and outcome.
    pub attempts: SmallVec<[(Arc<str>, Outcome); 2]>,
    /// Time spent waiting on upstreams (to a stream's first content), for the overhead metric.
    pub upstream: Duration,
    /// The decision trace, when the request asked for one and may have it.
    pub trace: Option<Box<crate::trace::Decision>>,
    /// Each attempt's timing and outcome, when the request is traced over OTLP.
    pub spans: Option<Attempts>,
}

impl Trail {
    fn push(&mut self, backend: Arc<str>, outcome: Outcome) {
        self.attempts.push((backend, outcome));
    }

    /// `backend=outcome,...` as the header carries it.
    pub fn header(&self) -> String {
        let length = self.attempts.iter().map(|(b, o)| b.len() + o.len() + 2);
        let mut out = String::with_capacity(length.sum());
        for (i, (backend, outcome)) in self.attempts.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(backend);
            out.push('=');
            out.push_str(outcome);
        }
        out
    }
}

/// How a request that got no success ends.
#[derive(Debug)]
pub enum Ending {
    /// A gateway error code.
    Error(GatewayError),
    /// The upstream's own answer (a 4xx such as a content filter), returned as it came.
    Upstream { backend: usize, failure: Failure },
}

pub struct Failover<'a> {
    runtime: &'a Runtime,
    alias: &'a str,
    alias_index: Option<usize>,
    plan: Plan,
    deadline: Instant,
    /// Whether each candidate may still be tried in this request.
    open: SmallVec<[bool; 4]>,
    retries: SmallVec<[u32; 4]>,
    verdicts: Vec<Verdict>,
    cooled_until_ms: Vec<u64>,
    context_fallback: Option<(usize, Failure)>,
    /// Attempts that could not connect at all.
    unreachable: usize,
    /// The request's token estimate, for headroom.
    tokens: u64,
    /// Regions of failed attempts: a retry prefers another one.
    tried_regions: Vec<Arc<str>>,
    /// Probes of half-open breakers this request got and has not sent yet; dropped with the
    /// request, they free the probe for the next one.
    probes: Vec<ProbePermit>,
}

impl<'a> Failover<'a> {
    pub fn new(
        runtime: &'a Runtime,
        alias: &'a str,
        alias_index: Option<usize>,
        plan: Plan,
        deadline: Instant,
        tokens: u64,
    ) -> Self {
        let n = plan.candidates.len();
        Failover {
            runtime,
            alias,
            alias_index,
            plan,
            deadline,
            open: smallvec::smallvec![true; n],
            retries: smallvec::smallvec![0; n],
            verdicts: Vec::new(),
            cooled_until_ms: Vec::new(),
            context_fallback: None,
            unreachable: 0,
            tokens,
            tried_regions: Vec::new(),
            probes: Vec::new(),
        }
    }

    /// Headroom, ramp-up share and region freshness of a candidate at `now` (ms), for the
    /// router's choice.
    fn fitness(&self, candidate: &Candidate, now: u64) -> Fitness {
        let backend = self.snapshot().backends.get(candidate.backend);
        let load = self.runtime.load(candidate.backend);
        let (Some(backend), Some(load)) = (backend, load) else {
            return Fitness::default();
        };
        let shared = self.plan.usage_of(candidate.backend);
        Fitness {
            headroom: load.fits(&backend.limits, shared, self.tokens, now),
            share: load.share(now),
            fresh_region: !self.tried_regions.contains(&backend.region),
        }
    }

    /// The runtime's snapshot, for as long as the runtime is borrowed (not only `self`).
    fn snapshot(&self) -> &'a Snapshot {
        &self.runtime.snapshot
    }

    /// The candidate's backend name as the trail keeps it: the configuration's, shared.
    fn backend_label(&self, candidate: &Candidate) -> Arc<str> {
        self.snapshot()
            .backends
            .get(candidate.backend)
            .map_or_else(|| Arc::from("?"), |b| b.name.clone())
    }

    fn backend_name(&self, candidate: &Candidate) -> &'a str {
        self.snapshot()
            .backends
            .get(candidate.backend)
            .map(|b| &*b.name)
            .unwrap_or("?")
    }

    fn key(&self, i: usize) -> TargetKey {
        let candidate = &self.plan.candidates[i];
        TargetKey::new(self.backend_name(candidate), &candidate.deployment)
    }

    /// Runs attempts until one succeeds; `attempt` performs one and returns its success value.
    pub async fn run<T, F, Fut>(
        &mut self,
        trail: &mut Trail,
        mut attempt: F,
    ) -> Result<(Candidate, T), Ending>
    where
        F: FnMut(Candidate) -> Fut,
        Fut: Future<Output = Result<T, Failure>>,
    {
        let max_attempts = self.snapshot().routing.max_attempts.max(1) as usize;
        let mut again: Option<usize> = None;
        let mut out_of_time = false;
        // A "not served" answer is discovery, not a failed try: it spends its target, so the
        // number of targets still bounds it, but it does not use up `max_attempts`.
        let mut counted = 0usize;
        while counted < max_attempts {
            if Instant::now() >= self.deadline {
                out_of_time = true;
                break;
            }
            let turn = self.runtime.turn(self.alias_index);
            // One reading of the clock for the turn's choice, whatever the number of candidates.
            let now = now_ms();
            let Some(i) = again
                .take()
                .or_else(|| self.plan.choose(&self.open, turn, |c| self.fitness(c, now)))
            else {
                break;
            };
            if !self.admitted(i, now).await {
                if let Some(trace) = trail.trace.as_mut() {
                    trace.skipped(self.backend_name(&self.plan.candidates[i]), "breaker_open");
                }
                continue;
            }
            let backend = self.backend_label(&self.plan.candidates[i]);
            let fitness = trail
                .trace
                .as_ref()
                .map(|_| self.fitness(&self.plan.candidates[i], now));
            let began = Instant::now();
            let attempted = attempt(self.plan.candidates[i].clone()).await;
            trail.upstream += began.elapsed();
            let candidate = &self.plan.candidates[i];
            if let Some(spans) = trail.spans.as_mut() {
                spans.push(candidate, began, attempted.as_ref().err());
            }
            if let (Some(trace), Some(fitness)) = (trail.trace.as_mut(), fitness) {
                let (outcome, detail) = match &attempted {
                    Ok(_) => (Outcome::Borrowed("200"), None),
                    Err(failure) => (failure.label(), Some(failure.detail().to_string())),
                };
                trace.attempt(
                    &backend,
                    &candidate.deployment,
                    fitness,
                    began,
                    &outcome,
                    detail,
                );
            }
            match attempted {
                Ok(value) => {
                    self.observe(i, Observed::Success).await;
                    trail.push(backend, Outcome::Borrowed("200"));
                    if self.plan.candidates[i].discovery {
                        let ttl = self.snapshot().routing.not_served_ttl.as_millis() as u64;
                        self.runtime.state.mark_served_detached(self.key(i), ttl);
                    }
                    // The plan ends with this answer: its candidate is taken, not copied.
                    return Ok((self.plan.candidates.swap_remove(i), value));
                }
                Err(failure) => {
                    // Nothing was sent without a token: the backend's breaker learns nothing.
                    if !matches!(failure, Failure::AuthUnavailable(_)) {
                        self.observe(i, Observed::of(&failure)).await;
                    }
                    let outcome = failure.label();
                    tracing::debug!(%backend, %outcome, detail = failure.detail(), "attempt failed");
                    trail.push(backend, outcome);
                    let next = self.settle(i, failure).await;
                    if self.verdicts.last() != Some(&Verdict::NotServed) {
                        counted += 1;
                    }
                    match next {
                        Next::Again => again = Some(i),
                        Next::Move => {}
                        Next::OutOfTime => {
                            out_of_time = true;
                            break;
                        }
                        Next::Return(ending) => return Err(ending),
                    }
                }
            }
        }
        Err(self.ending(trail, out_of_time))
    }

    /// Whether the breakers of candidate `i` (its target's and its backend's) let an attempt go
    /// at `now` (ms). One may have opened since the plan was made, or another request may hold
    /// its probe: then the candidate is left out as if the plan had excluded it.
    async fn admitted(&mut self, i: usize, now: u64) -> bool {
        let candidate = &self.plan.candidates[i];
        let (backend, deployment) = (candidate.backend, &candidate.deployment);
        if self.probes.iter().any(|p| p.is_for(backend, deployment)) {
            return true;
        }
        match self.runtime.breakers.admit(backend, deployment, now).await {
            Admission::Closed => true,
            Admission::Probe(permit) => {
                self.probes.push(permit);
                true
            }
            Admission::Open { until_ms } => {
                self.open[i] = false;
                let candidate = self.plan.candidates[i].clone();
                self.plan
                    .excluded
                    .push((candidate, Excluded::BreakerOpen { until_ms }));
                false
            }
        }
    }

    /// Tells the breakers of candidate `i` how its attempt went; a probe settles its permit.
    async fn observe(&mut self, i: usize, outcome: Observed) {
        let candidate = &self.plan.candidates[i];
        let (backend, deployment) = (candidate.backend, &candidate.deployment);
        let now = now_ms();
        match self
            .probes
            .iter()
            .position(|p| p.is_for(backend, deployment))
        {
            Some(k) => self.probes.swap_remove(k).settle(&outcome, now).await,
            None => {
                let breakers = &self.runtime.breakers;
                breakers.record(backend, deployment, &outcome, now).await
            }
        }
    }

    /// Applies rule 3 to one failed attempt and says what comes next.
    async fn settle(&mut self, i: usize, failure: Failure) -> Next {
        let verdict = verdict(&failure);
        self.verdicts.push(verdict);
        if matches!(failure, Failure::ConnectError(_) | Failure::ConnectTimeout) {
            self.unreachable += 1;
        }
        self.note_failure(i, verdict);
        let routing = &self.runtime.snapshot.routing;
        let alone = self.plan.group_size(self.plan.candidates[i].priority) == 1;
        let may_retry = alone && self.retries[i] < routing.same_target_retries;
        match verdict {
            Verdict::Transient if may_retry => {
                self.retries[i] += 1;
                return Next::Again;
            }
            Verdict::Throttled(retry_after) => {
                let wait = retry_after.unwrap_or(outcome::DEFAULT_COOLDOWN);
                let wait_ms = wait.as_millis() as u64;
                self.runtime.state.cool_down(&self.key(i), wait_ms).await;
                self.cooled_until_ms.push(now_ms() + wait_ms);
                let fits = retry_after.is_some_and(|w| {
                    w <= routing.max_retry_wait && Instant::now() + w < self.deadline
                });
                if may_retry && fits {
                    self.retries[i] += 1;
                    tokio::time::sleep(wait).await;
                    return Next::Again;
                }
            }
            Verdict::NotServed => {
                let ttl = routing.not_served_ttl.as_millis() as u64;
                self.runtime.state.mark_not_served(&self.key(i), ttl).await;
            }
            Verdict::ContextTooLong => {
                let deployment = self.plan.candidates[i].deployment.clone();
                for (j, candidate) in self.plan.candidates.iter().enumerate() {
                    if candidate.deployment == deployment {
                        self.open[j] = false;
                    }
                }
                self.context_fallback = Some((self.plan.candidates[i].backend, failure));
                return Next::Move;
            }
            Verdict::CredentialRejected => {
                tracing::warn!(backend = %self.backend_name(&self.plan.candidates[i]), "the backend rejected its own credential (401/403); check its api_key or identity");
            }
            Verdict::OutOfTime => return Next::OutOfTime,
            Verdict::ClientError => {
                return Next::Return(Ending::Upstream {
                    backend: self.plan.candidates[i].backend,
                    failure,
                })
            }
            Verdict::Transient | Verdict::TimedOut | Verdict::AuthUnavailable => {}
        }
        self.open[i] = false;
        Next::Move
    }

    /// A failure that says the backend is struggling counts toward its ramp-up and sends the next
    /// attempt to another region when there is one.
    fn note_failure(&mut self, i: usize, verdict: Verdict) {
        let struggling = matches!(
            verdict,
            Verdict::Transient
                | Verdict::Throttled(_)
                | Verdict::TimedOut
                | Verdict::CredentialRejected
        );
        if !struggling {
            return;
        }
        let backend = self.plan.candidates[i].backend;
        if let Some(load) = self.runtime.load(backend) {
            load.failed();
        }
        if let Some(region) = self
            .snapshot()
            .backends
            .get(backend)
            .map(|b| b.region.clone())
        {
            if !self.tried_regions.contains(&region) {
                self.tried_regions.push(region);
            }
        }
    }

    /// The answer when no attempt succeeded.
    fn ending(&mut self, trail: &Trail, out_of_time: bool) -> Ending {
        if let Some((backend, failure)) = self.context_fallback.take() {
            return Ending::Upstream { backend, failure };
        }
        let alias = self.alias.to_owned();
        if self.served_nowhere() {
            return Ending::Error(GatewayError::ServedNowhere(alias));
        }
        if trail.attempts.is_empty() {
            return Ending::Error(self.nothing_to_try());
        }
        if out_of_time {
            return Ending::Error(GatewayError::UpstreamTimeout(alias));
        }
        let telling: Vec<Verdict> = self
            .verdicts
            .iter()
            .copied()
            .filter(|v| *v != Verdict::NotServed)
            .collect();
        let error = if telling.is_empty() {
            self.nothing_to_try()
        } else if telling.iter().all(|v| matches!(v, Verdict::Throttled(_))) {
            GatewayError::UpstreamRateLimited {
                alias,
                retry_after: self.soonest_free(),
            }
        } else if telling.iter().all(|v| *v == Verdict::AuthUnavailable) {
            GatewayError::UpstreamAuthUnavailable(alias)
        } else if telling
            .iter()
            .all(|v| matches!(v, Verdict::TimedOut | Verdict::OutOfTime))
        {
            GatewayError::UpstreamTimeout(alias)
        } else {
            match self
                .plan
                .excluded
                .iter()
                .filter(|(_, r)| *r == Excluded::Region)
                .count()
            {
                0 => GatewayError::UpstreamFailed(alias),
                outside => GatewayError::UpstreamFailedInRegions { alias, outside },
            }
        };
        Ending::Error(error)
    }

    /// On the `"*"` alias: every backend that could be reached (or was, recently) said it lacks
    /// the name, so to the caller the model does not exist; the others are down or out of rotation.
    fn served_nowhere(&self) -> bool {
        let discovery = self
            .plan
            .candidates
            .iter()
            .chain(self.plan.excluded.iter().map(|(c, _)| c))
            .all(|c| c.discovery);
        let learned = self.verdicts.contains(&Verdict::NotServed)
            || self
                .plan
                .excluded
                .iter()
                .any(|(_, r)| *r == Excluded::NotServed);
        let telling = self
            .verdicts
            .iter()
            .filter(|v| **v != Verdict::NotServed)
            .count();
        let out_of_rotation = self
            .plan
            .excluded
            .iter()
            .all(|(_, r)| !matches!(r, Excluded::CoolingDown { .. } | Excluded::Region));
        discovery && learned && telling == self.unreachable && out_of_rotation
    }

    /// The wait until the soonest cooling target frees up or open breaker half-opens.
    fn soonest_free(&self) -> Duration {
        let excluded = self
            .plan
            .excluded
            .iter()
            .filter_map(|(_, reason)| match reason {
                Excluded::CoolingDown { until_ms } | Excluded::BreakerOpen { until_ms } => {
                    Some(*until_ms)
                }
                _ => None,
            });
        let soonest = excluded.chain(self.cooled_until_ms.iter().copied()).min();
        let now = now_ms();
        Duration::from_millis(
            soonest
                .map(|u| u.saturating_sub(now))
                .unwrap_or(1000)
                .max(1),
        )
    }

    /// Why nothing (more) could be asked: every target was excluded or taught us it lacks the model.
    fn nothing_to_try(&self) -> GatewayError {
        let alias = self.alias.to_owned();
        let reasons: Vec<Excluded> = self.plan.excluded.iter().map(|(_, r)| *r).collect();
        if reasons
            .iter()
            .any(|r| matches!(r, Excluded::CoolingDown { .. }))
        {
            return GatewayError::UpstreamRateLimited {
                alias,
                retry_after: self.soonest_free(),
            };
        }
        // Of the remaining reasons only an open breaker passes soon.
        if reasons
            .iter()
            .any(|r| matches!(r, Excluded::BreakerOpen { .. }))
        {
            return GatewayError::CircuitOpen {
                alias,
                retry_after: self.soonest_free(),
            };
        }
        let message = if !reasons.is_empty() && reasons.iter().all(|r| *r == Excluded::Region) {
            format!("no backend in the regions this key may use serves `{alias}`")
        } else if !reasons.is_empty() && reasons.iter().all(|r| *r == Excluded::Unsupported) {
            format!("the backends of `{alias}` use a provider that cannot serve this operation yet")
        } else if let Some(message) = fleet::out_of_rotation(&alias, &reasons) {
            message
        } else {
            format!("`{alias}` is not served by any of its backends (each answered that it lacks the deployment, is drained or failing its health check, or is outside the regions this key may use)")
        };
        GatewayError::NoBackendAvailable(message)
    }
}

enum Next {
    Again,
    Move,
    OutOfTime,
    Return(Ending),
}
