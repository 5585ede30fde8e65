//! Stateful upstream objects: a Responses answer is stored by the backend that produced it, so a
//! follow-up naming it (`previous_response_id`) must go to that backend and no other. The pin
//! lives in the shared state, so every gateway instance sends the follow-up to the same place.

use std::sync::Arc;
use std::time::Duration;

use onedoor_state::{State, Store, Unavailable};

use crate::router::Plan;

/// How long a response stays pinned: as long as OpenAI keeps a stored response by default.
pub const RESPONSE_PIN_TTL: Duration = Duration::from_secs(30 * 24 * 3600);

fn key(response_id: &str) -> String {
    format!("responses/{response_id}")
}

/// Remembers, for one attempt, which backend the response it produces lives on.
#[derive(Clone)]
pub struct ResponsePin {
    state: Arc<Store>,
    backend: String,
}

impl ResponsePin {
    pub fn new(state: Arc<Store>, backend: &str) -> Self {
        ResponsePin {
            state,
            backend: backend.to_owned(),
        }
    }

    pub async fn remember(&self, response_id: &str) {
        let ttl = RESPONSE_PIN_TTL.as_millis() as u64;
        self.state.pin(&key(response_id), &self.backend, ttl).await;
    }

    /// For a stream, which learns the id in the middle of being relayed: the pin is written
    /// beside it (the memory store at once; Redis within a round trip), long before the
    /// response is complete and can be followed up.
    pub fn remember_later(self, response_id: &str) {
        let id = response_id.to_owned();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move { self.remember(&id).await });
        }
    }

    /// Pins the response of a whole Responses answer body.
    pub async fn remember_body(&self, body: &[u8]) {
        let id = serde_json::from_slice::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v["id"].as_str().map(str::to_owned));
        if let Some(id) = id {
            self.remember(&id).await;
        }
    }
}

/// The backend that holds `response_id`, when it is pinned.
pub async fn holder(state: &Store, response_id: &str) -> Result<Option<String>, Unavailable> {
    state.pinned(&key(response_id)).await
}

/// Keeps only the candidates on `backend`; whether any is left.
pub fn restrict(plan: &mut Plan, backend: usize) -> bool {
    plan.candidates.retain(|c| c.backend == backend);
    !plan.candidates.is_empty()
}
