//! Decision traces (contract section 3): for a key whose `trace_until` is in the future and a
//! request with `x-onedoor-trace: true`, the whole routing decision (alias, candidates kept and
//! excluded with reasons, fitness, attempts with timings, limits, tokens) as JSON, kept in a
//! capped ring with a TTL and, when the state store is shared, in the store so any instance can
//! answer `GET /admin/traces/{id}`. A request that does not ask pays one header lookup.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use http::HeaderMap;
use onedoor_config::Key;
use onedoor_state::{now_ms, State};
use serde_json::{json, Value};
use tokio::time::Instant;

use crate::router::{Excluded, Fitness, Plan};
use crate::runtime::Runtime;

/// Traces kept per instance; the oldest goes first.
const CAPACITY: usize = 1024;
/// How long a trace can be read back.
const TTL: Duration = Duration::from_secs(3600);
/// Store keys of traces, apart from the pins of stateful upstream objects.
const STORE_PREFIX: &str = "trace:";

/// Whether this request asks for a trace and its key may have one now.
pub fn asked(headers: &HeaderMap, key: &Key) -> bool {
    let Some(until) = key.trace_until else {
        return false;
    };
    let now = i64::try_from(now_ms() / 1000).unwrap_or(i64::MAX);
    until > now
        && headers
            .get("x-onedoor-trace")
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// One request's decision as it is being made.
#[derive(Debug)]
pub struct Decision {
    started: Instant,
    body: serde_json::Map<String, Value>,
    attempts: Vec<Value>,
}

impl Decision {
    pub fn new(started: Instant) -> Decision {
        Decision {
            started,
            body: serde_json::Map::new(),
            attempts: Vec::new(),
        }
    }

    fn at_ms(&self, at: Instant) -> f64 {
        at.duration_since(self.started).as_secs_f64() * 1000.0
    }

    pub fn set(&mut self, field: &str, value: Value) {
        self.body.insert(field.to_owned(), value);
    }

    /// The router's plan: every candidate kept, every one excluded with its reason.
    pub fn plan(&mut self, runtime: &Runtime, plan: &Plan) {
        let name = |b: usize| runtime.snapshot.backends.get(b).map(|b| &*b.name);
        let region = |b: usize| runtime.snapshot.backends.get(b).map(|b| &*b.region);
        let kept: Vec<Value> = plan
            .candidates
            .iter()
            .map(|c| {
                json!({"backend": name(c.backend), "region": region(c.backend), "deployment": &*c.deployment,
                       "priority": c.priority, "weight": c.weight, "kept": true})
            })
            .collect();
        let excluded = plan.excluded.iter().map(|(c, why)| {
            let (reason, until_ms) = reason(why);
            json!({"backend": name(c.backend), "region": region(c.backend), "deployment": &*c.deployment,
                   "priority": c.priority, "weight": c.weight, "kept": false, "reason": reason, "until_ms": until_ms})
        });
        self.set(
            "candidates",
            Value::Array(kept.into_iter().chain(excluded).collect()),
        );
    }

    /// A candidate the breaker refused at attempt time.
    pub fn skipped(&mut self, backend: &str, reason: &str) {
        let at = self.at_ms(Instant::now());
        self.attempts
            .push(json!({"backend": backend, "skipped": reason, "at_ms": at}));
    }

    /// One upstream attempt: when it started, how long it took, how it ended and why.
    pub fn attempt(
        &mut self,
        backend: &str,
        deployment: &str,
        fitness: Fitness,
        began: Instant,
        outcome: &str,
        detail: Option<String>,
    ) {
        let start_ms = self.at_ms(began);
        let duration_ms = began.elapsed().as_secs_f64() * 1000.0;
        self.attempts.push(json!({
            "backend": backend, "deployment": deployment,
            "fitness": {"headroom": fitness.headroom, "share": fitness.share, "fresh_region": fitness.fresh_region},
            "start_ms": start_ms, "duration_ms": duration_ms,
            "outcome": outcome, "detail": detail,
        }));
    }

    fn finish(mut self, id: &str, status: u16) -> String {
        self.set("id", json!(id));
        self.set("status", json!(status));
        let attempts = std::mem::take(&mut self.attempts);
        self.set("attempts", Value::Array(attempts));
        let duration_ms = self.at_ms(Instant::now());
        self.set("duration_ms", json!(duration_ms));
        Value::Object(self.body).to_string()
    }
}

fn reason(why: &Excluded) -> (&'static str, Option<u64>) {
    match why {
        Excluded::Region => ("region", None),
        Excluded::NotServed => ("not_served", None),
        Excluded::CoolingDown { until_ms } => ("cooling_down", Some(*until_ms)),
        Excluded::Unsupported => ("unsupported", None),
        Excluded::Drained => ("drained", None),
        Excluded::Unhealthy => ("unhealthy", None),
        Excluded::BreakerOpen { until_ms } => ("breaker_open", Some(*until_ms)),
    }
}

/// The traces of the last requests that asked for one, each with its expiry.
#[derive(Default)]
pub struct Traces {
    ring: Mutex<VecDeque<(String, u64, String)>>,
}

impl Traces {
    fn put(&self, id: &str, text: String, now: u64) {
        let mut ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        while ring.len() >= CAPACITY || ring.front().is_some_and(|(_, until, _)| *until <= now) {
            ring.pop_front();
        }
        let until = now + TTL.as_millis() as u64;
        ring.push_back((id.to_owned(), until, text));
    }

    fn get(&self, id: &str, now: u64) -> Option<String> {
        let ring = self.ring.lock().unwrap_or_else(|p| p.into_inner());
        ring.iter()
            .find(|(known, until, _)| known == id && *until > now)
            .map(|(_, _, text)| text.clone())
    }
}

/// Keeps a finished decision under the request id, here and in a shared store.
pub async fn keep(runtime: &Runtime, decision: Decision, id: &str, status: u16) {
    let text = decision.finish(id, status);
    if runtime.state.is_shared() {
        let key = format!("{STORE_PREFIX}{id}");
        runtime.state.pin(&key, &text, TTL.as_millis() as u64).await;
    }
    runtime.traces.put(id, text, now_ms());
}

/// A trace by id: this instance's, or the shared store's.
pub async fn find(runtime: &Runtime, id: &str) -> Option<String> {
    if let Some(text) = runtime.traces.get(id, now_ms()) {
        return Some(text);
    }
    if !runtime.state.is_shared() {
        return None;
    }
    let key = format!("{STORE_PREFIX}{id}");
    runtime.state.pinned(&key).await.ok().flatten()
}
