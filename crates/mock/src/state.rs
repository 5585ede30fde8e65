//! The live state of one endpoint: its spec, current behaviours, counters and quota windows.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::quota::Window;
use crate::realtime::RealtimeCounters;
use crate::{Behavior, DeploymentSpec, EndpointSpec};

/// A poisoned lock only means another request panicked mid-update; the counters are still usable.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub struct Deployment {
    pub spec: DeploymentSpec,
    pub window: Mutex<Window>,
}

/// Request counts, shared with in-flight answers so they can report cancellation.
#[derive(Default)]
pub struct Counters {
    pub total: AtomicU64,
    pub cancelled: AtomicU64,
    /// Connections accepted.
    pub connections: AtomicU64,
    pub per_deployment: Mutex<BTreeMap<String, u64>>,
}

pub struct Shared {
    pub spec: EndpointSpec,
    pub deployments: Vec<Deployment>,
    pub counters: Arc<Counters>,
    pub realtime: RealtimeCounters,
    behavior: Mutex<Behavior>,
    overrides: Mutex<HashMap<String, Behavior>>,
    /// Requests seen under a nonzero error_rate, so failures are spread evenly rather than random.
    error_ticks: AtomicU64,
    /// Bearer tokens issued before this (Unix ms) are refused: `POST /_mock/revoke-tokens`.
    pub tokens_not_before_ms: AtomicU64,
    /// Ids of the Responses API answers this endpoint stored.
    responses: Mutex<HashSet<String>>,
    /// The last model request: its headers and its body as it arrived, for tests to read.
    last_request: Mutex<Option<(hyper::HeaderMap, bytes::Bytes)>>,
    /// The keys of the prompt prefixes in the (Anthropic) prompt cache.
    prompt_cache: Mutex<HashSet<u64>>,
    /// The files and batches this endpoint holds.
    pub batches: Mutex<crate::batch::Holdings>,
}

impl Shared {
    pub fn new(spec: EndpointSpec) -> Self {
        let deployments = spec
            .deployments
            .iter()
            .map(|d| Deployment {
                spec: d.clone(),
                window: Mutex::default(),
            })
            .collect();
        Self {
            behavior: Mutex::new(spec.behavior.clone()),
            spec,
            deployments,
            counters: Arc::default(),
            realtime: RealtimeCounters::default(),
            overrides: Mutex::default(),
            error_ticks: AtomicU64::new(0),
            tokens_not_before_ms: AtomicU64::new(0),
            responses: Mutex::default(),
            last_request: Mutex::default(),
            prompt_cache: Mutex::default(),
            batches: Mutex::default(),
        }
    }

    pub fn deployment(&self, name: &str) -> Option<&Deployment> {
        self.deployments.iter().find(|d| d.spec.name == name)
    }

    pub fn store_response(&self, id: &str) {
        lock(&self.responses).insert(id.to_owned());
    }

    pub fn has_response(&self, id: &str) -> bool {
        lock(&self.responses).contains(id)
    }

    /// Keeps a model request's headers and body, for [`Shared::last_request`].
    pub fn remember_request(&self, headers: &hyper::HeaderMap, body: &bytes::Bytes) {
        *lock(&self.last_request) = Some((headers.clone(), body.clone()));
    }

    /// The last model request: its headers, and its body as text (byte for byte when UTF-8).
    pub fn last_request(&self) -> serde_json::Value {
        let Some((headers, body)) = lock(&self.last_request).clone() else {
            return serde_json::Value::Null;
        };
        let headers: serde_json::Map<String, serde_json::Value> = headers
            .iter()
            .map(|(name, value)| {
                let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
                (name.as_str().to_owned(), serde_json::Value::String(value))
            })
            .collect();
        let body = String::from_utf8_lossy(&body).into_owned();
        serde_json::json!({"headers": headers, "body": body})
    }

    /// Puts a prompt prefix in the cache; whether it was there already.
    pub fn cache_prefix(&self, key: u64) -> bool {
        !lock(&self.prompt_cache).insert(key)
    }

    pub fn set_behavior(&self, b: Behavior) {
        *lock(&self.behavior) = b;
    }

    pub fn set_deployment_behavior(&self, deployment: &str, b: Behavior) {
        lock(&self.overrides).insert(deployment.to_owned(), b);
    }

    /// The deployment's override when it has one, else the endpoint's behaviour.
    pub fn behavior_for(&self, deployment: Option<&str>) -> Behavior {
        let overrides = lock(&self.overrides);
        match deployment.and_then(|d| overrides.get(d)) {
            Some(b) => b.clone(),
            None => lock(&self.behavior).clone(),
        }
    }

    /// Whether this request is one of the `rate` fraction that fail: request k fails when
    /// floor((k+1)·rate) > floor(k·rate), which is exact over any run of requests.
    pub fn roll_error(&self, rate: f64) -> bool {
        if rate <= 0.0 {
            return false;
        }
        let k = self.error_ticks.fetch_add(1, Ordering::Relaxed) as f64;
        ((k + 1.0) * rate).floor() > (k * rate).floor()
    }

    pub fn count(&self, deployment: Option<&str>) {
        self.counters.total.fetch_add(1, Ordering::Relaxed);
        if let Some(d) = deployment {
            *lock(&self.counters.per_deployment)
                .entry(d.to_owned())
                .or_default() += 1;
        }
    }

    pub fn requests(&self, deployment: &str) -> u64 {
        lock(&self.counters.per_deployment)
            .get(deployment)
            .copied()
            .unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.counters.total.load(Ordering::Relaxed)
    }

    pub fn cancelled(&self) -> u64 {
        self.counters.cancelled.load(Ordering::Relaxed)
    }

    /// Per-deployment counts, listing every configured deployment even when it saw nothing.
    pub fn per_deployment(&self) -> BTreeMap<String, u64> {
        let mut counts = lock(&self.counters.per_deployment).clone();
        for d in &self.deployments {
            counts.entry(d.spec.name.clone()).or_default();
        }
        counts
    }

    pub fn reset_counters(&self) {
        self.counters.total.store(0, Ordering::Relaxed);
        self.counters.cancelled.store(0, Ordering::Relaxed);
        self.counters.connections.store(0, Ordering::Relaxed);
        lock(&self.counters.per_deployment).clear();
        self.realtime.sessions.store(0, Ordering::Relaxed);
        self.error_ticks.store(0, Ordering::Relaxed);
    }

    /// Back to the state the endpoint started in: counters, behaviours and quota windows.
    pub fn reset_all(&self) {
        self.reset_counters();
        self.set_behavior(self.spec.behavior.clone());
        lock(&self.overrides).clear();
        lock(&self.prompt_cache).clear();
        *lock(&self.last_request) = None;
        *lock(&self.batches) = crate::batch::Holdings::default();
        for d in &self.deployments {
            *lock(&d.window) = Window::default();
        }
    }
}
