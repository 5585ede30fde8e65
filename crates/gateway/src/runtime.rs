//! What one config snapshot runs on: the snapshot itself, one upstream client and header stamp per
//! backend, and the per-alias turn counters that split load by weight. Swapped whole on reload.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use http::HeaderValue;
use onedoor_config::Snapshot;
use onedoor_state::Store;
use onedoor_usage::Recorder;

use crate::breaker::Breakers;
use crate::fleet::Fleet;
use crate::headroom::Load;
use crate::metrics::Metrics;
use crate::provider;
use crate::realtime::Sessions;
use crate::redaction::Redaction;
use crate::upstream::{client_fits, LaneClients};

pub struct Runtime {
    pub snapshot: Arc<Snapshot>,
    pub clients: Vec<LaneClients>,
    /// The headers every request to a backend carries (same index as `snapshot.backends`).
    pub stamps: Vec<Vec<provider::Header>>,
    /// The Entra ID token cache of each backend that has an identity (same index).
    pub credentials: crate::identity::Credentials,
    /// What to take out of each backend's answers: its own credential (same index).
    redactions: Vec<Option<Arc<Redaction>>>,
    /// Each backend's `x-onedoor-backend` and `x-onedoor-region` values, made once.
    pub answered_by: Vec<[Option<HeaderValue>; 2]>,
    /// The upstream URL of every configured target, made once.
    pub uris: provider::Uris,
    /// One counter per alias (same index as `snapshot.aliases`), the last one for `"*"`.
    turns: Vec<AtomicU64>,
    /// The shared state: not-served cache, cooldowns, breaker records, meters.
    pub state: Arc<Store>,
    /// One per backend (same index as `snapshot.backends`).
    pub loads: Vec<Arc<Load>>,
    /// Drained and health flags per backend (same index as `snapshot.backends`).
    pub fleet: Fleet,
    /// The circuit breaker of each backend that has one.
    pub breakers: Breakers,
    /// Where finished requests go as usage records; shared by every runtime of the gateway.
    pub recorder: Recorder,
    /// Open realtime sessions; shared by every runtime of the gateway, so shutdown reaches
    /// sessions that started on an older config.
    pub sessions: Arc<Sessions>,
    /// The gateway's metrics; shared by every runtime of the gateway.
    pub metrics: Arc<Metrics>,
    /// Recent decision traces; shared by every runtime of the gateway.
    pub traces: Arc<crate::trace::Traces>,
    /// The span exporter, when `telemetry.otlp` is configured; shared while it is unchanged.
    pub telemetry: Option<Arc<crate::telemetry::Telemetry>>,
    /// Where the listeners are in a stop; shared by every runtime of the gateway.
    pub stopping: Arc<crate::stopping::Stopping>,
    /// The JWT issuers' signing keys; shared by every runtime of the gateway.
    pub key_sets: Arc<crate::jwt::KeySets>,
    /// Client keys made through the admin API; shared by every runtime of the gateway.
    pub client_keys: Arc<crate::client_keys::ClientKeys>,
}

impl Runtime {
    pub fn new(snapshot: Arc<Snapshot>, state: Arc<Store>) -> Self {
        let clients = snapshot.backends.iter().map(LaneClients::new).collect();
        let stamps = snapshot.backends.iter().map(provider::stamp).collect();
        let credentials = crate::identity::Credentials::new(&snapshot, None);
        let redactions = snapshot
            .backends
            .iter()
            .map(|b| Redaction::of(b).map(Arc::new))
            .collect();
        let answered_by = snapshot
            .backends
            .iter()
            .map(|b| [&b.name, &b.region].map(|v| HeaderValue::from_str(v).ok()))
            .collect();
        let uris = provider::Uris::new(&snapshot);
        let turns = (0..=snapshot.aliases.len())
            .map(|_| AtomicU64::new(0))
            .collect();
        let loads = snapshot
            .backends
            .iter()
            .map(|backend| {
                let load = Arc::new(Load::default());
                load.meter_in(&state, backend);
                load
            })
            .collect();
        let fleet = Fleet::new(&snapshot);
        let breakers = Breakers::new(&snapshot, None, state.clone());
        Runtime {
            snapshot,
            clients,
            stamps,
            credentials,
            redactions,
            answered_by,
            uris,
            turns,
            state,
            loads,
            fleet,
            breakers,
            recorder: Recorder::off(),
            sessions: Arc::default(),
            metrics: Arc::default(),
            traces: Arc::default(),
            telemetry: None,
            stopping: Arc::default(),
            key_sets: Arc::default(),
            client_keys: Arc::new(crate::client_keys::ClientKeys::none()),
        }
    }

    /// The runtime for a reloaded `snapshot`: the one place that decides what survives a reload.
    /// The learned state is shared; a backend that keeps its name keeps its load, its drained and
    /// health flags, its breaker (when its policy is unchanged), and (when its client settings are
    /// unchanged) its upstream client and pool.
    pub fn next(&self, snapshot: Arc<Snapshot>) -> Runtime {
        let mut next = Runtime::new(snapshot, self.state.clone());
        next.credentials =
            crate::identity::Credentials::new(&next.snapshot, Some(&self.credentials));
        next.fleet = Fleet::next(&next.snapshot, &self.fleet, &self.snapshot);
        next.breakers = Breakers::new(&next.snapshot, Some(&self.breakers), self.state.clone());
        next.recorder = crate::recording::carry_over(&self.recorder, &next.snapshot);
        next.sessions = self.sessions.clone();
        next.metrics = self.metrics.clone();
        next.traces = self.traces.clone();
        next.telemetry = crate::telemetry::carry_over(&self.telemetry, &next.snapshot);
        next.stopping = self.stopping.clone();
        next.key_sets = self.key_sets.clone();
        next.client_keys = self.client_keys.clone();
        for (id, backend) in next.snapshot.backends.iter().enumerate() {
            let Some(&old) = self.snapshot.backend_by_name.get(&*backend.name) else {
                continue;
            };
            if let (Some(load), Some(slot)) = (self.loads.get(old), next.loads.get_mut(id)) {
                load.meter_in(&self.state, backend);
                *slot = load.clone();
            }
            let same_client = self
                .snapshot
                .backends
                .get(old)
                .is_some_and(|before| client_fits(before, backend));
            if let (true, Some(client), Some(slot)) =
                (same_client, self.clients.get(old), next.clients.get_mut(id))
            {
                *slot = client.clone();
            }
        }
        next
    }

    /// The load of backend `backend`.
    pub fn load(&self, backend: usize) -> Option<&Arc<Load>> {
        self.loads.get(backend)
    }

    /// What to take out of backend `backend`'s answers before they reach a client.
    pub fn redaction(&self, backend: usize) -> Option<&Arc<Redaction>> {
        self.redactions.get(backend)?.as_ref()
    }

    /// The turn counter of an alias (`None` for `"*"`).
    pub fn turn(&self, alias: Option<usize>) -> &AtomicU64 {
        let index = alias.unwrap_or(self.snapshot.aliases.len());
        &self.turns[index.min(self.turns.len() - 1)]
    }
}
