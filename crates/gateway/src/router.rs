//! Choosing targets (contract section 2.1, rules 1 and 2): the alias's targets minus those the
//! tenant may not reach or the state excludes; then the lowest priority group, split by weight.

use std::sync::atomic::{AtomicU64, Ordering};

use onedoor_config::{Alias, BackendId, Tenant};
use onedoor_state::{now_ms, Exclusion};

use crate::provider;
use crate::request::Operation;
use crate::runtime::Runtime;

/// A target that may be asked in this request.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub backend: BackendId,
    /// The deployment or model name sent upstream.
    pub deployment: String,
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
    /// Its backend's circuit breaker is open (or half-open with its one probe in flight).
    BreakerOpen {
        until_ms: u64,
    },
}

pub struct Plan {
    pub candidates: Vec<Candidate>,
    pub excluded: Vec<(Candidate, Excluded)>,
}

/// The candidates of `alias` for this tenant; `requested` names the deployment on `"*"` targets.
pub fn plan(
    runtime: &Runtime,
    alias: &Alias,
    requested: &str,
    tenant: &Tenant,
    operation: Operation,
) -> Plan {
    let snapshot = &runtime.snapshot;
    let now = now_ms();
    let mut plan = Plan {
        candidates: Vec::with_capacity(alias.targets.len()),
        excluded: Vec::new(),
    };
    for target in &alias.targets {
        let Some(backend) = snapshot.backends.get(target.backend) else {
            continue;
        };
        let candidate = Candidate {
            backend: target.backend,
            deployment: target.deployment.as_deref().unwrap_or(requested).to_owned(),
            priority: target.priority,
            weight: target.weight.max(1),
            discovery: target.deployment.is_none(),
            accepts_prefill: target.accepts_prefill,
        };
        let exclusion = if !tenant.may_reach(&backend.region) {
            Some(Excluded::Region)
        } else if !provider::supports(backend, operation) {
            Some(Excluded::Unsupported)
        } else if let Some(reason) = runtime.fleet.exclusion(target.backend) {
            Some(reason)
        } else {
            let breaker = runtime
                .breakers
                .blocked_until(target.backend, now)
                .map(|until_ms| Excluded::BreakerOpen { until_ms });
            match runtime
                .state
                .exclusion(&backend.name, &candidate.deployment, now)
            {
                Some(Exclusion::NotServed { .. }) => Some(Excluded::NotServed),
                // Whichever keeps the target out longer is the one that says when to come back.
                Some(Exclusion::CoolingDown { until_ms }) => match breaker {
                    Some(Excluded::BreakerOpen { until_ms: open }) if open > until_ms => breaker,
                    _ => Some(Excluded::CoolingDown { until_ms }),
                },
                None => breaker,
            }
        };
        match exclusion {
            Some(reason) => plan.excluded.push((candidate, reason)),
            None => plan.candidates.push(candidate),
        }
    }
    prefer_known_servers(runtime, &mut plan, now);
    plan
}

/// Discovery asks unknown backends only when no backend known to serve the name is left: inside
/// each priority group, the known ones come first (a priority of their own just before the rest).
fn prefer_known_servers(runtime: &Runtime, plan: &mut Plan, now: u64) {
    if !plan.candidates.iter().any(|c| c.discovery) {
        return;
    }
    let backends = &runtime.snapshot.backends;
    for candidate in &mut plan.candidates {
        let known = candidate.discovery
            && backends
                .get(candidate.backend)
                .is_some_and(|b| runtime.state.is_served(&b.name, &candidate.deployment, now));
        candidate.priority = candidate
            .priority
            .saturating_mul(2)
            .saturating_add(u32::from(!known));
    }
}

impl Plan {
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
        let scored: Vec<(usize, &Candidate, Fitness)> = self
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
        let group: Vec<&(usize, &Candidate, Fitness)> = pool()
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
