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
}

/// Why a target was left out before any attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Excluded {
    Region,
    NotServed,
    CoolingDown { until_ms: u64 },
    Unsupported,
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
        };
        let exclusion = if !tenant.may_reach(&backend.region) {
            Some(Excluded::Region)
        } else if !provider::supports(backend, operation) {
            Some(Excluded::Unsupported)
        } else {
            match runtime
                .state
                .exclusion(&backend.name, &candidate.deployment, now)
            {
                Some(Exclusion::NotServed { .. }) => Some(Excluded::NotServed),
                Some(Exclusion::CoolingDown { until_ms }) => {
                    Some(Excluded::CoolingDown { until_ms })
                }
                None => None,
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

    /// The next candidate among those `open` says may still be asked: the lowest priority group,
    /// then a weighted turn inside it. The shared turn counter makes 3:1 weights an exact 3:1 split
    /// in steady state, with no lock.
    pub fn choose(&self, open: &[bool], turn: &AtomicU64) -> Option<usize> {
        let open_candidates = || self.candidates.iter().enumerate().filter(|(i, _)| open[*i]);
        let priority = open_candidates().map(|(_, c)| c.priority).min()?;
        let group = || open_candidates().filter(|(_, c)| c.priority == priority);
        let total: u64 = group().map(|(_, c)| u64::from(c.weight)).sum();
        let mut slot = turn.fetch_add(1, Ordering::Relaxed) % total.max(1);
        for (i, candidate) in group() {
            let weight = u64::from(candidate.weight);
            if slot < weight {
                return Some(i);
            }
            slot -= weight;
        }
        group().map(|(i, _)| i).next()
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
        }
    }

    #[test]
    fn the_lowest_priority_group_is_chosen_and_weights_split_it_exactly() {
        let plan = Plan {
            candidates: vec![candidate(2, 3), candidate(2, 1), candidate(1, 1)],
            excluded: vec![],
        };
        let turn = AtomicU64::new(0);
        assert_eq!(plan.choose(&[true, true, true], &turn), Some(2));
        let mut counts = [0usize; 2];
        for _ in 0..400 {
            counts[plan.choose(&[true, true, false], &turn).unwrap()] += 1;
        }
        assert_eq!(counts, [300, 100]);
        assert_eq!(plan.choose(&[false, false, false], &turn), None);
    }
}
