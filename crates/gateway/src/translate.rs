//! The dialect translations as plain functions over bytes, exactly as the request path runs
//! them: for the snapshot and property tests, the fuzz targets, and anyone who wants to see
//! what the gateway would send. Streams are framed and filtered as the relay frames and filters
//! them; no function here panics on any input.

use bytes::Bytes;

use crate::provider::anthropic::{AnthropicEvents, PassedEvents};
use crate::provider::openai_shaped::ChatEvents;
use crate::provider::responses::ResponsesEvents;
use crate::provider::{self, EventTranslator};
use crate::stream::{EventKind, Framer};
use crate::usage::Usage;

/// `created` used by translated answers here, so outputs are reproducible.
pub const CREATED: u64 = 1_700_000_000;

/// What a translated stream came to: the events the relay would send, and the usage it counted.
pub struct Translated {
    pub output: Vec<u8>,
    pub usage: Usage,
}

fn run(mut translator: Box<dyn EventTranslator>, input: &[u8]) -> Translated {
    let mut framer = Framer::default();
    framer.push(input);
    let mut events = Vec::new();
    while let Some(event) = framer.next_event() {
        translator.translate(event, &mut events);
    }
    if let Some(rest) = framer.rest() {
        translator.translate(rest, &mut events);
    }
    // As the relay does: malformed and empty events are never forwarded.
    let mut output = Vec::new();
    for (kind, event) in events {
        if !matches!(kind, EventKind::Malformed | EventKind::Empty) {
            output.extend_from_slice(&event);
        }
    }
    Translated {
        output,
        usage: translator.usage(),
    }
}

/// An Anthropic Messages event stream as OpenAI chat chunks.
pub fn anthropic_stream(input: &[u8], include_usage: bool) -> Translated {
    run(
        Box::new(AnthropicEvents::new(include_usage, 0, CREATED)),
        input,
    )
}

/// An Anthropic Messages event stream as an Anthropic client gets it from an Anthropic backend:
/// passed through, its usage read.
pub fn anthropic_passed_stream(input: &[u8]) -> Translated {
    run(Box::new(PassedEvents::new(0)), input)
}

/// An OpenAI-shaped chat stream as the relay sends it: quirks repaired, the usage chunk kept
/// only when the client asked for it.
pub fn chat_stream(input: &[u8], include_usage: bool) -> Translated {
    run(Box::new(ChatEvents::new(include_usage, 0)), input)
}

/// A Responses API event stream (relayed as it came; usage read).
pub fn responses_stream(input: &[u8]) -> Translated {
    run(Box::new(ResponsesEvents::new(0, None)), input)
}

/// OpenAI chat chunks as the Anthropic event stream a Claude-speaking client receives.
pub fn messages_stream(input: &[u8]) -> Vec<u8> {
    let mut encoder = crate::messages::Encoder::default();
    let mut out = encoder.push(input).to_vec();
    out.extend_from_slice(&encoder.close());
    out
}

/// An OpenAI chat request as the Anthropic Messages request sent for `model`.
pub fn chat_request_to_anthropic(body: &[u8], model: &str) -> Result<Vec<u8>, String> {
    let chat: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    provider::anthropic::translate_request(&chat, model)
        .map(|v| v.to_string().into_bytes())
        .map_err(|e| e.to_string())
}

/// An Anthropic Messages answer as the `chat.completion` an OpenAI client receives.
pub fn anthropic_answer(body: &[u8]) -> (Vec<u8>, Option<Usage>) {
    let (body, usage) = provider::anthropic::answer(Bytes::copy_from_slice(body), CREATED);
    (body.to_vec(), usage)
}

/// An Anthropic error body in the OpenAI envelope.
pub fn anthropic_error(body: &[u8]) -> Option<Vec<u8>> {
    provider::anthropic::error_body(body).map(|b| b.to_vec())
}

/// An OpenAI-shaped `chat.completion` with its quirks repaired, and its usage.
pub fn chat_answer(body: &[u8]) -> (Vec<u8>, Option<Usage>) {
    let (body, usage, _) = provider::openai_shaped::completion(Bytes::copy_from_slice(body));
    (body.to_vec(), usage)
}

/// A Messages request from a Claude-speaking client as the chat request the gateway routes.
pub fn messages_request(body: &[u8]) -> Result<Vec<u8>, String> {
    crate::messages::to_chat(body)
        .map(|b| b.to_vec())
        .map_err(|e| e.to_string())
}

/// A `chat.completion` as the Anthropic `message` a Claude-speaking client receives.
pub fn messages_answer(body: &[u8]) -> Vec<u8> {
    let usage = Usage::of_body(body).unwrap_or(Usage::estimated(0, 0));
    crate::messages::whole(body, &usage).to_vec()
}

/// An upstream (OpenAI or Azure) error body as the Anthropic error a Claude-speaking client
/// receives.
pub fn messages_error(status: u16, body: &[u8]) -> Vec<u8> {
    let status = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::BAD_GATEWAY);
    crate::messages::upstream_error(status, body).to_vec()
}
