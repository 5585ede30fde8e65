//! The Anthropic Messages surface (`POST /v1/messages`), so Claude-speaking clients can use any
//! alias, Azure GPT deployments included: the request is translated into the gateway's OpenAI
//! shape at the door and routed like any chat call; the answer (whole, streamed, or an error)
//! is translated back on the way out.

mod answer;
mod request;
mod stream;

use bytes::Bytes;
use http::StatusCode;

pub use answer::error as error_body;
pub use stream::{encode_body, Encoder};

use crate::errors::GatewayError;
use crate::usage::Usage;

/// The Chat Completions body for a Messages request body.
pub fn to_chat(body: &[u8]) -> Result<Bytes, GatewayError> {
    request::to_chat(body).map(|chat| Bytes::from(chat.to_string()))
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
