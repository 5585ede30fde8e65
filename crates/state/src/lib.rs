//! Routing state shared by every request: which (backend, deployment) pairs are served or not,
//! which targets cool down after a 429. One in-memory implementation today; the trait is the seam for a
//! shared store.

mod memory;

pub use memory::MemoryState;

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch: the one clock every state record is kept in, so records
/// mean the same thing on every instance.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A (backend, deployment) pair: the unit a not-served entry or a cooldown is kept for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TargetKey {
    pub backend: String,
    pub deployment: String,
}

impl TargetKey {
    pub fn new(backend: &str, deployment: &str) -> Self {
        TargetKey {
            backend: backend.to_owned(),
            deployment: deployment.to_owned(),
        }
    }
}

/// Why a target is skipped without being asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exclusion {
    /// It answered "deployment not found"; skipped until `until_ms`.
    NotServed { until_ms: u64 },
    /// It answered 429; skipped until `until_ms`.
    CoolingDown { until_ms: u64 },
}

/// One entry of a listing for operators (`/admin/backends`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub key: TargetKey,
    pub until_ms: u64,
}

pub trait State: Send + Sync + 'static {
    /// What currently excludes `(backend, deployment)`, if anything. Not-served wins over cooldown.
    fn exclusion(&self, backend: &str, deployment: &str, now_ms: u64) -> Option<Exclusion>;
    fn mark_not_served(&self, key: TargetKey, until_ms: u64);
    /// Remembers that `(backend, deployment)` answered, so discovery prefers it next time.
    fn mark_served(&self, key: TargetKey, until_ms: u64);
    fn is_served(&self, backend: &str, deployment: &str, now_ms: u64) -> bool;
    fn cool_down(&self, key: TargetKey, until_ms: u64);
    fn not_served(&self, now_ms: u64) -> Vec<Entry>;
    fn cooldowns(&self, now_ms: u64) -> Vec<Entry>;
}
