//! The in-memory store for one gateway instance: sharded maps, no global lock.

use dashmap::DashMap;

use crate::{Entry, Exclusion, State, TargetKey};

/// Expired entries are removed lazily, on lookup or listing, so the maps stay bounded by the
/// number of (backend, deployment) pairs that failed within their TTL.
#[derive(Default)]
pub struct MemoryState {
    not_served: DashMap<(String, String), u64>,
    served: DashMap<(String, String), u64>,
    cooldowns: DashMap<(String, String), u64>,
}

impl MemoryState {
    pub fn new() -> Self {
        Self::default()
    }
}

fn live(
    map: &DashMap<(String, String), u64>,
    backend: &str,
    deployment: &str,
    now_ms: u64,
) -> Option<u64> {
    let key = (backend.to_owned(), deployment.to_owned());
    let until = *map.get(&key)?;
    if until > now_ms {
        Some(until)
    } else {
        map.remove_if(&key, |_, u| *u <= now_ms);
        None
    }
}

fn listing(map: &DashMap<(String, String), u64>, now_ms: u64) -> Vec<Entry> {
    map.retain(|_, until| *until > now_ms);
    let mut entries: Vec<Entry> = map
        .iter()
        .map(|e| Entry {
            key: TargetKey::new(&e.key().0, &e.key().1),
            until_ms: *e.value(),
        })
        .collect();
    entries.sort_by(|a, b| {
        (&a.key.backend, &a.key.deployment).cmp(&(&b.key.backend, &b.key.deployment))
    });
    entries
}

impl State for MemoryState {
    fn exclusion(&self, backend: &str, deployment: &str, now_ms: u64) -> Option<Exclusion> {
        if self.not_served.is_empty() && self.cooldowns.is_empty() {
            return None;
        }
        if let Some(until_ms) = live(&self.not_served, backend, deployment, now_ms) {
            return Some(Exclusion::NotServed { until_ms });
        }
        live(&self.cooldowns, backend, deployment, now_ms)
            .map(|until_ms| Exclusion::CoolingDown { until_ms })
    }

    fn mark_not_served(&self, key: TargetKey, until_ms: u64) {
        self.not_served
            .insert((key.backend, key.deployment), until_ms);
    }

    fn mark_served(&self, key: TargetKey, until_ms: u64) {
        self.not_served
            .remove(&(key.backend.clone(), key.deployment.clone()));
        self.served.insert((key.backend, key.deployment), until_ms);
    }

    fn is_served(&self, backend: &str, deployment: &str, now_ms: u64) -> bool {
        !self.served.is_empty() && live(&self.served, backend, deployment, now_ms).is_some()
    }

    fn cool_down(&self, key: TargetKey, until_ms: u64) {
        let entry = self
            .cooldowns
            .entry((key.backend, key.deployment))
            .or_insert(0);
        let mut current = entry;
        if *current < until_ms {
            *current = until_ms;
        }
    }

    fn not_served(&self, now_ms: u64) -> Vec<Entry> {
        listing(&self.not_served, now_ms)
    }

    fn cooldowns(&self, now_ms: u64) -> Vec<Entry> {
        listing(&self.cooldowns, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_not_served_entry_expires_at_its_deadline() {
        let state = MemoryState::new();
        state.mark_not_served(TargetKey::new("b", "d"), 1_000);
        assert_eq!(
            state.exclusion("b", "d", 999),
            Some(Exclusion::NotServed { until_ms: 1_000 })
        );
        assert_eq!(state.exclusion("b", "d", 1_000), None);
        assert!(state.not_served(1_000).is_empty());
    }

    #[test]
    fn a_cooldown_only_ever_extends() {
        let state = MemoryState::new();
        state.cool_down(TargetKey::new("b", "d"), 2_000);
        state.cool_down(TargetKey::new("b", "d"), 1_500);
        assert_eq!(
            state.exclusion("b", "d", 0),
            Some(Exclusion::CoolingDown { until_ms: 2_000 })
        );
        assert_eq!(state.exclusion("b", "other", 0), None);
    }
}
