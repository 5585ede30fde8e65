//! What one config snapshot runs on: the snapshot itself, one upstream client and credential per
//! backend, and the per-alias turn counters that split load by weight. Swapped whole on reload.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use http::HeaderValue;
use onedoor_config::Snapshot;
use onedoor_state::State;

use crate::provider;
use crate::upstream::{client_for, UpstreamClient};

pub struct Runtime {
    pub snapshot: Arc<Snapshot>,
    pub clients: Vec<UpstreamClient>,
    pub credentials: Vec<Option<(&'static str, HeaderValue)>>,
    /// One counter per alias (same index as `snapshot.aliases`), the last one for `"*"`.
    turns: Vec<AtomicU64>,
    pub state: Arc<dyn State>,
}

impl Runtime {
    pub fn new(snapshot: Arc<Snapshot>, state: Arc<dyn State>) -> Self {
        let clients = snapshot.backends.iter().map(client_for).collect();
        let credentials = snapshot.backends.iter().map(provider::credential).collect();
        let turns = (0..=snapshot.aliases.len())
            .map(|_| AtomicU64::new(0))
            .collect();
        Runtime {
            snapshot,
            clients,
            credentials,
            turns,
            state,
        }
    }

    /// The turn counter of an alias (`None` for `"*"`).
    pub fn turn(&self, alias: Option<usize>) -> &AtomicU64 {
        let index = alias.unwrap_or(self.snapshot.aliases.len());
        &self.turns[index.min(self.turns.len() - 1)]
    }
}
