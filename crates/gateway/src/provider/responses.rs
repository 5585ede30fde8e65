//! Responses API streams (`POST /v1/responses` with `stream: true`), relayed as they came: only
//! told apart for the relay (content deltas, the terminal `response.completed`, failures), with
//! the usage read from `response.completed` and the response id remembered so follow-ups find
//! the backend that holds it.

use bytes::Bytes;
use serde_json::{json, Value};

use crate::affinity::ResponsePin;
use crate::provider::{EventTranslator, StreamAnswer};
use crate::stream::{event_data, EventKind};
use crate::usage::{estimate_tokens, Usage};

pub struct ResponsesEvents {
    prompt_estimate: u64,
    usage: Option<Usage>,
    completion_chars: usize,
    pin: Option<ResponsePin>,
    sequence: u64,
    /// The response's id, from the first event that names it.
    id: Option<String>,
}

impl ResponsesEvents {
    pub fn new(prompt_estimate: u64, pin: Option<ResponsePin>) -> Self {
        ResponsesEvents {
            prompt_estimate,
            usage: None,
            completion_chars: 0,
            pin,
            sequence: 0,
            id: None,
        }
    }

    fn kind(&mut self, event: &Value) -> EventKind {
        if let Some(n) = event["sequence_number"].as_u64() {
            self.sequence = n;
        }
        let content = |this: &mut Self, text: &Value| {
            this.completion_chars += text.as_str().map_or(0, |t| t.chars().count());
            EventKind::Content { finished: false }
        };
        match event["type"].as_str().unwrap_or_default() {
            "response.created" | "response.in_progress" => {
                if let (Some(pin), Some(id)) = (self.pin.take(), event["response"]["id"].as_str()) {
                    pin.remember_later(id);
                }
                EventKind::Meta
            }
            "response.output_text.delta"
            | "response.refusal.delta"
            | "response.function_call_arguments.delta" => content(self, &event["delta"]),
            "response.output_item.added" if event["item"]["type"] == "function_call" => {
                EventKind::Content { finished: false }
            }
            "response.completed" | "response.incomplete" => {
                self.usage = Usage::from_openai(&event["response"]["usage"]);
                EventKind::Done
            }
            "response.failed" | "error" => EventKind::Error,
            _ => EventKind::Meta,
        }
    }
}

impl EventTranslator for ResponsesEvents {
    fn translate(&mut self, event: Bytes, out: &mut Vec<(EventKind, Bytes)>) {
        let data = event_data(&event);
        let data = data.trim_ascii();
        if data.is_empty() {
            return;
        }
        match serde_json::from_slice::<Value>(data) {
            Ok(mut value) => {
                let kind = self.kind(&value);
                if self.id.is_none() {
                    self.id = take_response_id(&mut value);
                }
                out.push((kind, event));
            }
            Err(_) => out.push((EventKind::Malformed, event)),
        }
    }

    /// A Responses stream has no terminal marker of its own beyond `response.completed`.
    fn finish(&mut self, _out: &mut Vec<(EventKind, Bytes)>) {}

    fn failure_event(&self, message: &str) -> Bytes {
        let body = json!({
            "type": "error", "code": "upstream_failed", "message": message, "param": null,
            "sequence_number": self.sequence + 1,
        });
        Bytes::from(format!("event: error\ndata: {body}\n\n"))
    }

    fn usage(&self) -> Usage {
        self.usage.unwrap_or_else(|| {
            Usage::estimated(self.prompt_estimate, estimate_tokens(self.completion_chars))
        })
    }

    fn answer_so_far(&self) -> StreamAnswer<'_> {
        StreamAnswer {
            id: self.id.as_deref(),
            finish_reason: None,
        }
    }
}

/// The `response.id` of an event that carries its response, moved out of the event (which has
/// been classified and is not read again).
fn take_response_id(event: &mut Value) -> Option<String> {
    match event.get_mut("response")?.get_mut("id")?.take() {
        Value::String(id) if !id.is_empty() => Some(id),
        _ => None,
    }
}

/// The characters of a whole Responses answer's output (for an estimate without usage).
pub fn output_chars(body: &Value) -> usize {
    let mut chars = 0;
    for item in body["output"].as_array().into_iter().flatten() {
        chars += item["arguments"].as_str().map_or(0, |t| t.chars().count());
        for part in item["content"].as_array().into_iter().flatten() {
            chars += part["text"].as_str().map_or(0, |t| t.chars().count());
        }
    }
    chars
}
