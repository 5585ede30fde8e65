//! OpenAI chat chunks -> Anthropic stream events, for Claude-speaking clients: the caller's
//! stream as `message_start`, one `content_block_start`/`delta`/`stop` run per text or tool call
//! (block indices counted across both), `message_delta` with the stop reason and the usage, and
//! `message_stop`; an error event becomes `event: error`. SSE comments (the gateway's usage
//! comment) pass through.

use bytes::{Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use serde_json::{json, Value};

use super::answer::{error_type, stop_reason};
use crate::body::Body;
use crate::stream::{event_data, Framer};
use crate::usage::Usage;

/// The content block being streamed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Open {
    Text { block: u64 },
    Tool { block: u64, call: u64 },
}

#[derive(Default)]
pub struct Encoder {
    framer: Framer,
    started: bool,
    next_block: u64,
    open: Option<Open>,
    stop_reason: Option<&'static str>,
    usage: Option<Usage>,
    ended: bool,
}

fn named(out: &mut BytesMut, name: &str, data: &Value) {
    out.extend_from_slice(format!("event: {name}\ndata: {data}\n\n").as_bytes());
}

impl Encoder {
    /// Encodes every complete event in `bytes`.
    pub fn push(&mut self, bytes: &[u8]) -> Bytes {
        self.framer.push(bytes);
        let mut out = BytesMut::new();
        while let Some(event) = self.framer.next_event() {
            self.encode(&event, &mut out);
        }
        out.freeze()
    }

    /// Whatever is left when the caller's stream ends.
    pub fn close(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        if let Some(rest) = self.framer.rest() {
            self.encode(&rest, &mut out);
        }
        out.freeze()
    }

    fn encode(&mut self, event: &[u8], out: &mut BytesMut) {
        if self.ended {
            return;
        }
        let data = event_data(event);
        let data = data.trim_ascii();
        if data.is_empty() {
            if event.starts_with(b":") && std::str::from_utf8(event).is_ok() {
                out.extend_from_slice(event);
            }
            return;
        }
        if data == b"[DONE]" {
            return self.finish(out);
        }
        let Ok(chunk) = serde_json::from_slice::<Value>(data) else {
            return;
        };
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            return self.error(error, out);
        }
        if let Some(usage) = chunk.get("usage").and_then(Usage::from_openai) {
            self.usage = Some(usage);
        }
        let choices = chunk["choices"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default();
        if choices.is_empty() {
            // Usage and Azure's filter-only chunks: nothing for the message itself.
            return;
        }
        self.start(&chunk, out);
        for choice in choices {
            self.choice(choice, out);
        }
    }

    fn start(&mut self, chunk: &Value, out: &mut BytesMut) {
        if self.started {
            return;
        }
        self.started = true;
        let id = match chunk["id"].as_str() {
            Some(id) if !id.is_empty() => json!(id),
            _ => json!(format!("msg_onedoor{:016x}", rand::random::<u64>())),
        };
        let message = json!({
            "id": id, "type": "message", "role": "assistant", "model": chunk["model"],
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        named(
            out,
            "message_start",
            &json!({"type": "message_start", "message": message}),
        );
    }

    fn choice(&mut self, choice: &Value, out: &mut BytesMut) {
        let delta = &choice["delta"];
        for key in ["content", "refusal"] {
            if let Some(text) = delta[key].as_str().filter(|t| !t.is_empty()) {
                self.text(text, out);
            }
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            self.tool_call(call, out);
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.close_block(out);
            self.stop_reason = Some(stop_reason(reason));
        }
    }

    fn text(&mut self, text: &str, out: &mut BytesMut) {
        let block = match self.open {
            Some(Open::Text { block }) => block,
            _ => {
                self.close_block(out);
                let block = self.open_block(Open::Text {
                    block: self.next_block,
                });
                let start = json!({"type": "content_block_start", "index": block, "content_block": {"type": "text", "text": ""}});
                named(out, "content_block_start", &start);
                block
            }
        };
        let delta = json!({"type": "content_block_delta", "index": block, "delta": {"type": "text_delta", "text": text}});
        named(out, "content_block_delta", &delta);
    }

    fn tool_call(&mut self, call: &Value, out: &mut BytesMut) {
        let index = call["index"].as_u64().unwrap_or(0);
        let block = match self.open {
            Some(Open::Tool { block, call: open }) if open == index && call["id"].is_null() => {
                block
            }
            _ => {
                self.close_block(out);
                let block = self.open_block(Open::Tool {
                    block: self.next_block,
                    call: index,
                });
                let start = json!({"type": "content_block_start", "index": block, "content_block": {
                    "type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {},
                }});
                named(out, "content_block_start", &start);
                block
            }
        };
        let fragment = match &call["function"]["arguments"] {
            Value::String(s) => s.clone(),
            Value::Null => String::new(),
            other => other.to_string(),
        };
        if !fragment.is_empty() {
            let delta = json!({"type": "content_block_delta", "index": block, "delta": {"type": "input_json_delta", "partial_json": fragment}});
            named(out, "content_block_delta", &delta);
        }
    }

    fn open_block(&mut self, open: Open) -> u64 {
        self.next_block += 1;
        self.open = Some(open);
        match open {
            Open::Text { block } | Open::Tool { block, .. } => block,
        }
    }

    fn close_block(&mut self, out: &mut BytesMut) {
        if let Some(Open::Text { block } | Open::Tool { block, .. }) = self.open.take() {
            named(
                out,
                "content_block_stop",
                &json!({"type": "content_block_stop", "index": block}),
            );
        }
    }

    fn finish(&mut self, out: &mut BytesMut) {
        self.start(&json!({}), out);
        self.close_block(out);
        self.ended = true;
        let usage = self.usage.unwrap_or(Usage::estimated(0, 0));
        let delta = json!({
            "type": "message_delta",
            "delta": {"stop_reason": self.stop_reason.unwrap_or("end_turn"), "stop_sequence": null},
            "usage": usage.to_anthropic(),
        });
        named(out, "message_delta", &delta);
        named(out, "message_stop", &json!({"type": "message_stop"}));
    }

    fn error(&mut self, error: &Value, out: &mut BytesMut) {
        self.ended = true;
        let message = error["message"].as_str().unwrap_or("the stream failed");
        let kind = match error["code"].as_str() {
            Some(
                code @ ("overloaded_error"
                | "rate_limit_error"
                | "api_error"
                | "invalid_request_error"),
            ) => code,
            _ => error_type(http::StatusCode::BAD_GATEWAY),
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        named(out, "error", &body);
    }
}

/// The caller's stream, re-encoded for an Anthropic client.
pub fn encode_body(body: Body) -> Body {
    let stream = futures_util::stream::unfold(
        (body, Encoder::default(), false),
        |(mut body, mut encoder, done)| async move {
            if done {
                return None;
            }
            loop {
                match body.frame().await {
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else {
                            continue;
                        };
                        let out = encoder.push(&data);
                        if !out.is_empty() {
                            return Some((Ok(Frame::data(out)), (body, encoder, false)));
                        }
                    }
                    Some(Err(error)) => return Some((Err(error), (body, encoder, true))),
                    None => {
                        let rest = encoder.close();
                        return (!rest.is_empty())
                            .then(|| (Ok(Frame::data(rest)), (body, encoder, true)));
                    }
                }
            }
        },
    );
    StreamBody::new(stream).boxed_unsync()
}
