//! Choosing targets (contract section 2.1, rules 1 and 2): the alias's targets minus those the
//! tenant may not reach or the state excludes; then the lowest priority group, split by weight.
//! What the shared state says about the targets (not-served, cooldowns, breakers, backend usage)
//! is read in one round trip per plan.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use onedoor_config::{Alias, BackendId, Tenant};
use onedoor_state::{
    now_ms, Ask, BackendQuery, Exclusion, MeterUsage, RoutingQuery, RoutingView, State,
    Unavailable, Verdict,
};
use smallvec::SmallVec;

use crate::provider;
use crate::request::Operation;
use crate::runtime::Runtime;

/// A target that may be asked in this request.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub backend: BackendId,
    /// The deployment or model name sent upstream; shared by the clones an attempt takes.
    pub deployment: Arc<str>,
    pub priority: u32,
    pub weight: u32,
    /// From a `"*"` target: the deployment is the requested name, learned by asking.
    pub discovery: bool,
    /// The target may continue a cut stream from a prefill (rule 5).
    pub accepts_prefill: bool,
}

impl Candidate {
    pub fn same_target(&self, other: &Candidate) -> bool {
        self.backend == other.backend && self.deployment == other.deployment
    }
}

/// Why a target was left out before any attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excluded {
    Region,
    NotServed,
    CoolingDown {
        until_ms: u64,
    },
    Unsupported,
    /// An operator drained its backend (`POST /admin/backends/{name}/drain`).
    Drained,
    /// Its backend failed its active health check twice in a row.
    Unhealthy,
    /// Its own circuit breaker or its backend's is open (or half-open with its one probe in
    /// flight).
    BreakerOpen {
        until_ms: u64,
    },
}

pub struct Plan {
    pub candidates: Vec<Candidate>,
    pub excluded: Vec<(Candidate, Excluded)>,
    /// The usage across instances of each metered backend the plan reads, when it was made.
    pub usage: Vec<(BackendId, MeterUsage)>,
}

/// The candidates of `alias` for this tenant; `requested` names the deployment on `"*"` targets.
/// `Err` only when the shared state cannot be read and `on_store_error` is `fail_closed`.
pub async fn plan(
    runtime: &Runtime,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
) -> Result<Plan, Unavailable> {
    plan_for(runtime, alias, requested, tenant, operation, Use::Call).await
}

/// [`plan`] for a batch: on an alias with batch deployments (`batch: true` targets), only
/// those; otherwise every target whose backend has a batch API.
pub async fn plan_batch(
    runtime: &Runtime,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
) -> Result<Plan, Unavailable> {
    plan_for(runtime, alias, requested, tenant, operation, Use::Batch).await
}

/// What the targets are asked for: a call now, or a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Call,
    Batch,
}

async fn plan_for(
    runtime: &Runtime,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
    purpose: Use,
) -> Result<Plan, Unavailable> {
    let opening = open(runtime, alias, requested, tenant, operation, purpose);
    if opening.open.is_empty() {
        return Ok(opening.plan);
    }
    // The reading borrows the open candidates: it ends before the opening is finished.
    let (ids, view) = {
        let reading = Reading::of(runtime, &opening.open);
        let view = runtime.state.routing(reading.query()).await?;
        (reading.ids, view)
    };
    Ok(opening.finish(runtime, &ids, view))
}

/// [`State::admit`] of `ask`, then [`plan`], in the one round trip to the state store that
/// [`State::admit_and_route`] makes of them.
pub async fn plan_admitting(
    runtime: &Runtime,
    ask: &Ask,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
) -> (Result<Verdict, Unavailable>, Result<Plan, Unavailable>) {
    let opening = open(runtime, alias, requested, tenant, operation, Use::Call);
    if opening.open.is_empty() {
        return (runtime.state.admit(ask).await, Ok(opening.plan));
    }
    let (ids, verdict, view) = {
        let reading = Reading::of(runtime, &opening.open);
        let (verdict, view) = runtime.state.admit_and_route(ask, reading.query()).await;
        (reading.ids, verdict, view)
    };
    (
        verdict,
        view.map(|view| opening.finish(runtime, &ids, view)),
    )
}

/// A plan before the shared state is read: what the config and this instance's flags decide.
struct Opening {
    plan: Plan,
    /// The candidates the state decides about.
    open: SmallVec<[Candidate; INLINE_TARGETS]>,
}

fn open(
    runtime: &Runtime,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
    purpose: Use,
) -> Opening {
    let snapshot = &runtime.snapshot;
    let batch_deployments = alias.targets.iter().any(|t| t.batch);
    let mut plan = Plan {
        candidates: Vec::with_capacity(alias.targets.len()),
        excluded: Vec::new(),
        usage: Vec::new(),
    };
    let mut open = SmallVec::new();
    for target in &alias.targets {
        let Some(backend) = snapshot.backends.get(target.backend) else {
            continue;
        };
        let candidate = Candidate {
            backend: target.backend,
            deployment: match &target.deployment {
                Some(deployment) => deployment.clone(),
                None => Arc::from(requested),
            },
            priority: target.priority,
            weight: target.weight.max(1),
            discovery: target.deployment.is_none(),
            accepts_prefill: target.accepts_prefill,
        };
        let exclusion = if !tenant.may_reach(&backend.region) {
            Some(Excluded::Region)
        } else if !provider::supports(backend, operation)
            || !serves(target, backend, purpose, batch_deployments)
        {
            Some(Excluded::Unsupported)
        } else {
            runtime.fleet.exclusion(target.backend)
        };
        match exclusion {
            Some(reason) => plan.excluded.push((candidate, reason)),
            None => open.push(candidate),
        }
    }
    Opening { plan, open }
}

/// Whether `target` takes this use: a batch deployment takes batches only, and where an alias
/// has batch deployments its batches go to them alone.
fn serves(
    target: &onedoor_config::Target,
    backend: &onedoor_config::Backend,
    purpose: Use,
    batch_deployments: bool,
) -> bool {
    match purpose {
        Use::Call => !target.batch,
        Use::Batch => crate::batch::takes_batches(backend) && (target.batch || !batch_deployments),
    }
}

impl Opening {
    /// The plan, once the state said what it knows about the open candidates' targets and
    /// their backends (`ids`, in the order of `view.backends`).
    fn finish(self, runtime: &Runtime, ids: &[BackendId], view: RoutingView) -> Plan {
        let Opening { mut plan, open } = self;
        let now = now_ms();
        for (&id, backend) in ids.iter().zip(&view.backends) {
            runtime.breakers.learn(id, backend.breaker, now);
            if let Some(usage) = backend.usage {
                plan.usage.push((id, usage));
            }
        }
        for (candidate, view) in open.into_iter().zip(view.targets) {
            let (backend, deployment) = (candidate.backend, &*candidate.deployment);
            let breakers = &runtime.breakers;
            breakers.learn_target(backend, deployment, view.breaker, now);
            let breaker = breakers
                .blocked_until(backend, deployment, now)
                .map(|until_ms| Excluded::BreakerOpen { until_ms });
            let exclusion = match view.exclusion {
                Some(Exclusion::NotServed { .. }) => Some(Excluded::NotServed),
                // Whichever keeps the target out longer is the one that says when to come back.
                Some(Exclusion::CoolingDown { remaining_ms }) => {
                    let until_ms = now + remaining_ms;
                    match breaker {
                        Some(Excluded::BreakerOpen { until_ms: open }) if open > until_ms => {
                            breaker
                        }
                        _ => Some(Excluded::CoolingDown { until_ms }),
                    }
                }
                None => breaker,
            };
            match exclusion {
                Some(reason) => plan.excluded.push((candidate, reason)),
                None => plan.candidates.push(prefer_known(candidate, view.served)),
            }
        }
        plan
    }
}

/// What one read of the shared state asks about `open`'s targets and their backends; inline
/// for an alias of up to [`INLINE_TARGETS`] targets.
struct Reading<'a> {
    targets: SmallVec<[(&'a str, &'a str); INLINE_TARGETS]>,
    /// Each target's breaker record, in the order of `targets`; empty when none has one.
    target_breakers: SmallVec<[Option<Arc<str>>; INLINE_TARGETS]>,
    /// The backends, each once, in the order the view answers for them.
    ids: SmallVec<[BackendId; INLINE_TARGETS]>,
    backends: SmallVec<[BackendQuery<'a>; INLINE_TARGETS]>,
}

/// The targets most aliases have at most: their plan's reading needs no allocation.
const INLINE_TARGETS: usize = 4;

impl<'a> Reading<'a> {
    fn of(runtime: &'a Runtime, open: &'a [Candidate]) -> Self {
        let backends = &runtime.snapshot.backends;
        let name = |id: BackendId| backends.get(id).map_or("?", |b| &*b.name);
        let targets = open
            .iter()
            .map(|c| (name(c.backend), &*c.deployment))
            .collect();
        let breakers = &runtime.breakers;
        let mut target_breakers: SmallVec<[Option<Arc<str>>; INLINE_TARGETS]> = open
            .iter()
            .map(|c| breakers.target_record_id(c.backend, &c.deployment))
            .collect();
        if target_breakers.iter().all(Option::is_none) {
            target_breakers.clear();
        }
        let mut ids: SmallVec<[BackendId; INLINE_TARGETS]> =
            open.iter().map(|c| c.backend).collect();
        ids.sort_unstable();
        ids.dedup();
        let backends = ids
            .iter()
            .map(|&id| BackendQuery {
                name: name(id),
                breaker: runtime.breakers.record_id(id),
                metered: runtime.load(id).is_some_and(|l| l.metered()),
            })
            .collect();
        Reading {
            targets,
            target_breakers,
            ids,
            backends,
        }
    }

    fn query(&self) -> RoutingQuery<'_> {
        RoutingQuery {
            targets: &self.targets,
            target_breakers: &self.target_breakers,
            backends: &self.backends,
        }
    }
}

/// Discovery asks unknown backends only when no backend known to serve the name is left: inside
/// each priority group, the known ones come first (a priority of their own just before the rest).
fn prefer_known(mut candidate: Candidate, served: bool) -> Candidate {
    if candidate.discovery {
        candidate.priority = candidate
            .priority
            .saturating_mul(2)
            .saturating_add(u32::from(!served));
    }
    candidate
}

impl Plan {
    /// The usage of the metered backend `backend` across instances when the plan was made.
    pub fn usage_of(&self, backend: BackendId) -> Option<MeterUsage> {
        let mut read = self.usage.iter();
        read.find(|(id, _)| *id == backend).map(|(_, usage)| *usage)
    }

    /// How many candidates share `priority`.
    pub fn group_size(&self, priority: u32) -> usize {
        self.candidates
            .iter()
            .filter(|c| c.priority == priority)
            .count()
    }

    /// The next candidate among those `open` says may still be asked: the lowest priority group
    /// among those with headroom (all open ones when none has any), then, after a failure, those in
    /// a region not yet tried, then a weighted turn. The shared turn counter makes 3:1 weights an
    /// exact 3:1 split in steady state, with no lock.
    pub fn choose(
        &self,
        open: &[bool],
        turn: &AtomicU64,
        fitness: impl Fn(&Candidate) -> Fitness,
    ) -> Option<usize> {
        // Few targets an alias: both lists stay on the stack.
        let scored: SmallVec<[(usize, &Candidate, Fitness); 4]> = self
            .candidates
            .iter()
            .enumerate()
            .filter(|(i, _)| open.get(*i).copied().unwrap_or(false))
            .map(|(i, c)| (i, c, fitness(c)))
            .collect();
        let roomy = scored.iter().any(|(_, _, f)| f.headroom);
        let pool = || scored.iter().filter(move |(_, _, f)| f.headroom || !roomy);
        let priority = pool().map(|(_, c, _)| c.priority).min()?;
        let fresh = pool().any(|(_, c, f)| c.priority == priority && f.fresh_region);
        let group: SmallVec<[&(usize, &Candidate, Fitness); 4]> = pool()
            .filter(|(_, c, f)| c.priority == priority && (f.fresh_region || !fresh))
            .collect();
        let share = |c: &Candidate, f: &Fitness| {
            ((f64::from(c.weight) * 1000.0 * f.share).round() as u64).max(1)
        };
        let total: u64 = group.iter().map(|(_, c, f)| share(c, f)).sum();
        let mut slot = turn.fetch_add(1, Ordering::Relaxed).wrapping_mul(1000) % total.max(1);
        for (i, candidate, fit) in &group {
            let weight = share(candidate, fit);
            if slot < weight {
                return Some(*i);
            }
            slot -= weight;
        }
        group.first().map(|(i, _, _)| *i)
    }
}

/// How a candidate stands for the next choice.
#[derive(Debug, Clone, Copy)]
pub struct Fitness {
    /// Its backend is under its rpm, tpm and in-flight limits (and the upstream's own report).
    pub headroom: bool,
    /// The fraction of its weight it gets now (below 1 while ramping up after failures).
    pub share: f64,
    /// Its region differs from every region already tried in this request.
    pub fresh_region: bool,
}

impl Default for Fitness {
    fn default() -> Self {
        Fitness {
            headroom: true,
            share: 1.0,
            fresh_region: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(priority: u32, weight: u32) -> Candidate {
        Candidate {
            backend: 0,
            deployment: "d".into(),
            priority,
            weight,
            discovery: false,
            accepts_prefill: false,
        }
    }

    #[test]
    fn the_lowest_priority_group_is_chosen_and_weights_split_it_exactly() {
        let plan = Plan {
            candidates: vec![candidate(2, 3), candidate(2, 1), candidate(1, 1)],
            excluded: vec![],
            usage: vec![],
        };
        let turn = AtomicU64::new(0);
        let fit = |_: &Candidate| Fitness::default();
        assert_eq!(plan.choose(&[true, true, true], &turn, fit), Some(2));
        let mut counts = [0usize; 2];
        for _ in 0..400 {
            counts[plan.choose(&[true, true, false], &turn, fit).unwrap()] += 1;
        }
        assert_eq!(counts, [300, 100]);
        assert_eq!(plan.choose(&[false, false, false], &turn, fit), None);
    }

    #[test]
    fn a_group_without_headroom_spills_to_the_next_priority() {
        let mut full = candidate(1, 1);
        full.backend = 7;
        let plan = Plan {
            candidates: vec![full, candidate(2, 1)],
            excluded: vec![],
            usage: vec![],
        };
        let turn = AtomicU64::new(0);
        let fit = |c: &Candidate| Fitness {
            headroom: c.backend != 7,
            ..Fitness::default()
        };
        assert_eq!(plan.choose(&[true, true], &turn, fit), Some(1));
        // When nobody has headroom, priority order holds again.
        let none = |_: &Candidate| Fitness {
            headroom: false,
            ..Fitness::default()
        };
        assert_eq!(plan.choose(&[true, true], &turn, none), Some(0));
    }
}
