//! What operators and health probes say about each backend, apart from the config: whether it is
//! drained, and whether its active health check passes. Kept by backend name across reloads, so a
//! drained backend stays drained and a failing one stays out until its probe passes.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use onedoor_config::{BackendId, Snapshot};

use crate::router::Excluded;

/// Consecutive failed probes after which a backend leaves rotation.
pub const FAILED_PROBES_TO_LEAVE: u32 = 2;

/// The flags of every backend of one snapshot, indexed like `Snapshot::backends`.
pub struct Fleet {
    flags: Vec<Arc<Flags>>,
}

/// One backend's operator and probe flags. Shared (not copied) between the runtimes of successive
/// reloads, so a drain that races a reload is never lost.
#[derive(Debug)]
pub struct Flags {
    drained: AtomicBool,
    healthy: AtomicBool,
    failed_probes: AtomicU32,
    last_check: Mutex<Option<Check>>,
}

/// The result of the most recent health probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    pub at_ms: u64,
    pub passed: bool,
    /// The status code, or the transport failure (`connect_error`, `timeout`, ...).
    pub outcome: String,
}

impl Check {
    /// For `GET /admin/backends`.
    pub fn view(&self, now_ms: u64) -> serde_json::Value {
        serde_json::json!({
            "at_ms": self.at_ms,
            "ago_ms": now_ms.saturating_sub(self.at_ms),
            "passed": self.passed,
            "outcome": self.outcome,
        })
    }
}

impl Default for Flags {
    fn default() -> Self {
        Flags {
            drained: AtomicBool::new(false),
            healthy: AtomicBool::new(true),
            failed_probes: AtomicU32::new(0),
            last_check: Mutex::new(None),
        }
    }
}

impl Flags {
    pub fn drained(&self) -> bool {
        self.drained.load(Ordering::Relaxed)
    }

    pub fn set_drained(&self, drained: bool) {
        self.drained.store(drained, Ordering::Relaxed);
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub fn last_check(&self) -> Option<Check> {
        self.last_check
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Records a probe; returns the new health when this probe changed it.
    pub fn record(&self, check: Check) -> Option<bool> {
        let healthy = if check.passed {
            self.failed_probes.store(0, Ordering::Relaxed);
            true
        } else {
            let failed = self.failed_probes.fetch_add(1, Ordering::Relaxed) + 1;
            failed < FAILED_PROBES_TO_LEAVE && self.healthy()
        };
        *self
            .last_check
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(check);
        let was = self.healthy.swap(healthy, Ordering::Relaxed);
        (was != healthy).then_some(healthy)
    }

    /// A backend without a health check is healthy by definition.
    fn forget_health(&self) {
        self.failed_probes.store(0, Ordering::Relaxed);
        self.healthy.store(true, Ordering::Relaxed);
        *self
            .last_check
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl Fleet {
    /// Fresh flags: nothing drained, everything healthy until a probe says otherwise.
    pub fn new(snapshot: &Snapshot) -> Self {
        Fleet {
            flags: snapshot
                .backends
                .iter()
                .map(|_| Arc::new(Flags::default()))
                .collect(),
        }
    }

    /// The flags for a reloaded `snapshot`: a backend that still exists (by name) keeps its flags;
    /// one that lost its health check is healthy again.
    pub fn next(snapshot: &Snapshot, previous: &Fleet, previous_snapshot: &Snapshot) -> Self {
        let flags = snapshot
            .backends
            .iter()
            .map(|backend| {
                let kept = previous_snapshot
                    .backend_by_name
                    .get(&*backend.name)
                    .and_then(|&id| previous.flags.get(id))
                    .cloned();
                let flags = kept.unwrap_or_default();
                if backend.health_check.is_none() {
                    flags.forget_health();
                }
                flags
            })
            .collect();
        Fleet { flags }
    }

    pub fn get(&self, backend: BackendId) -> Option<&Arc<Flags>> {
        self.flags.get(backend)
    }

    /// Why routing leaves `backend` out, if the operator or its probe says so.
    pub fn exclusion(&self, backend: BackendId) -> Option<Excluded> {
        let flags = self.flags.get(backend)?;
        if flags.drained() {
            Some(Excluded::Drained)
        } else if !flags.healthy() {
            Some(Excluded::Unhealthy)
        } else {
            None
        }
    }
}

/// The `no_backend_available` message when every target was left out by a drain or a failing
/// health check (and nothing else); `None` when other reasons were involved.
pub fn out_of_rotation(alias: &str, reasons: &[Excluded]) -> Option<String> {
    let ours = |r: &Excluded| matches!(r, Excluded::Drained | Excluded::Unhealthy);
    if reasons.is_empty() || !reasons.iter().all(ours) {
        return None;
    }
    let message = if reasons.iter().all(|r| *r == Excluded::Drained) {
        format!("every backend of `{alias}` is drained (POST /admin/backends/{{name}}/undrain brings one back)")
    } else if reasons.iter().all(|r| *r == Excluded::Unhealthy) {
        format!("every backend of `{alias}` is failing its health check")
    } else {
        format!("every backend of `{alias}` is drained or failing its health check")
    };
    Some(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(passed: bool) -> Check {
        Check {
            at_ms: 0,
            passed,
            outcome: if passed { "200" } else { "500" }.into(),
        }
    }

    #[test]
    fn two_failed_probes_in_a_row_make_a_backend_unhealthy_and_one_pass_brings_it_back() {
        let flags = Flags::default();
        assert_eq!(flags.record(check(false)), None);
        assert!(flags.healthy());
        assert_eq!(flags.record(check(true)), None);
        assert_eq!(flags.record(check(false)), None);
        assert_eq!(flags.record(check(false)), Some(false));
        assert!(!flags.healthy());
        assert_eq!(flags.record(check(false)), None);
        assert_eq!(flags.record(check(true)), Some(true));
        assert_eq!(flags.last_check(), Some(check(true)));
    }

    #[test]
    fn the_message_names_drains_only_when_they_explain_everything() {
        assert!(
            out_of_rotation("chat", &[Excluded::Drained, Excluded::Drained])
                .is_some_and(|m| m.contains("drained"))
        );
        assert!(
            out_of_rotation("chat", &[Excluded::Drained, Excluded::Unhealthy])
                .is_some_and(|m| m.contains("drained or failing"))
        );
        assert_eq!(
            out_of_rotation("chat", &[Excluded::Drained, Excluded::Region]),
            None
        );
        assert_eq!(out_of_rotation("chat", &[]), None);
    }
}
