//! Anthropic Messages backends: `{url}/v1/messages` with `x-api-key` and the backend's
//! `anthropic-version`. The client's OpenAI request is translated on the way out; answers,
//! error bodies and streams are translated back into the OpenAI shape the rest of the gateway
//! (and the caller's dialect) works from. An Anthropic client's request and answers pass
//! through instead (`passthrough.rs`).

mod answer;
mod events;
mod passthrough;
mod request;

use bytes::Bytes;
use onedoor_config::Backend;
use serde_json::Value;

pub use events::AnthropicEvents;
pub use passthrough::{read_answer, PassedEvents};

use super::Unsendable;
use crate::request::ClientRequest;
use crate::usage::Usage;

/// The Messages URL of `backend`.
pub fn url(backend: &Backend) -> String {
    format!("{}/v1/messages", backend.url)
}

/// The Messages request body for an OpenAI chat `request`, asking for `model`.
pub fn body(model: &str, request: &ClientRequest) -> Result<Bytes, Unsendable> {
    let chat: Value = serde_json::from_slice(request.raw())
        .map_err(|e| Unsendable::Invalid(format!("the request body is not valid JSON: {e}")))?;
    let body = translate_request(&chat, model)?;
    Ok(Bytes::from(body.to_string()))
}

/// The Messages request for an OpenAI chat request (also what the snapshot tests read).
pub fn translate_request(chat: &Value, model: &str) -> Result<Value, Unsendable> {
    request::translate(chat, model).map_err(|e| Unsendable::Invalid(e.0))
}

/// A Messages answer as a `chat.completion`, and its usage; a body that is not a message is
/// left as it came.
pub fn answer(body: Bytes, created: u64) -> (Bytes, Option<Usage>) {
    match serde_json::from_slice::<Value>(&body) {
        Ok(message) if message["type"] == "message" => {
            let (completion, usage) = answer::completion(&message, created);
            (Bytes::from(completion.to_string()), usage)
        }
        _ => (body, None),
    }
}

/// An Anthropic error body in the OpenAI envelope; `None` when it is not one.
pub fn error_body(body: &[u8]) -> Option<Bytes> {
    let value: Value = serde_json::from_slice(body).ok()?;
    (value["type"] == "error").then(|| Bytes::from(answer::error(&value).to_string()))
}
