//! The Anthropic Messages surface (`POST /v1/messages`), so Claude-speaking clients can use any
//! alias, Azure GPT deployments included: the request is translated into the gateway's OpenAI
//! shape at the door and routed like any chat call; the answer (whole, streamed, or an error)
//! is translated back on the way out. The body as the client sent it rides along ([`Native`]):
//! an Anthropic backend is sent that, its `model` replaced, and its answer goes back as it came.

mod answer;
mod request;
mod stream;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};

pub use answer::error as error_body;
pub use stream::{encode_body, Encoder};

use crate::errors::GatewayError;
use crate::request::{ClientRequest, Operation};
use crate::usage::Usage;

pub use request::Refusal;

/// A Messages request as its client sent it, for the backends that speak its dialect.
pub struct Native {
    /// The client's body, read as deep as routing needs (its `model`, `stream`, `max_tokens`).
    pub body: ClientRequest,
    /// The client's `anthropic-beta` header: the features it asked of the API.
    pub beta: Option<HeaderValue>,
    /// Why the request has no chat form, when it has none: an OpenAI-shaped backend refuses it.
    pub untranslatable: Option<String>,
}

/// The Chat Completions body for a Messages request body.
pub fn to_chat(body: &[u8]) -> Result<Bytes, GatewayError> {
    match request::to_chat(body) {
        Ok(chat) => Ok(Bytes::from(chat.to_string())),
        Err(Refusal::Invalid(error)) => Err(error),
        Err(Refusal::Untranslatable(why)) => Err(GatewayError::InvalidRequest(why)),
    }
}

/// The request the gateway routes for a Messages body: its chat form, which OpenAI-shaped
/// backends are sent, with the body as it came ([`Native`]) for Anthropic backends. A body that
/// has no chat form is routed as it came, and only an Anthropic backend can take it.
pub fn request(body: Bytes, beta: Option<HeaderValue>) -> Result<ClientRequest, GatewayError> {
    let chat = match request::to_chat(&body) {
        Ok(chat) => Ok(Bytes::from(chat.to_string())),
        Err(Refusal::Invalid(error)) => return Err(error),
        Err(Refusal::Untranslatable(why)) => Err(why),
    };
    let native = ClientRequest::parse(body, Operation::ChatCompletions)?;
    let (mut routed, untranslatable) = match chat {
        Ok(chat) => (
            ClientRequest::parse(chat, Operation::ChatCompletions)?,
            None,
        ),
        Err(why) => (native.clone(), Some(why)),
    };
    routed.native = Some(std::sync::Arc::new(Native {
        body: native,
        beta,
        untranslatable,
    }));
    Ok(routed)
}

/// A whole `chat.completion` as an Anthropic `message`; a body that is not one is left as it came.
pub fn whole(body: &[u8], usage: &Usage) -> Bytes {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(completion) if completion["choices"].is_array() => {
            Bytes::from(answer::message(&completion, usage).to_string())
        }
        _ => Bytes::copy_from_slice(body),
    }
}

/// An upstream's error body in Anthropic's shape.
pub fn upstream_error(status: StatusCode, body: &[u8]) -> Bytes {
    Bytes::from(answer::upstream_error(status, body).to_string())
}
