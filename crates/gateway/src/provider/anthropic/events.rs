//! Anthropic stream events -> OpenAI chat completion chunks (reference section 4.4): one id,
//! created and model for the whole stream, the role in the first delta, text deltas, tool calls
//! under a running OpenAI tool index (never the Anthropic block index), argument fragments, the
//! finish chunk, the usage chunk when the client asked for it, `[DONE]`; an `error` event
//! becomes an OpenAI error event. Usage: input from `message_start`, output from the last
//! `message_delta`.

use std::collections::HashMap;

use bytes::Bytes;
use serde_json::{json, Value};

use super::answer::finish_reason;
use crate::provider::{EventTranslator, StreamAnswer};
use crate::stream::{error_event, event_data, EventKind};
use crate::usage::{estimate_tokens, Usage, UsageSource};

/// What an Anthropic content block is, by its index.
enum Block {
    Text,
    Tool { index: u64, arguments: bool },
    Other,
}

pub struct AnthropicEvents {
    id: Value,
    model: Value,
    created: u64,
    include_usage: bool,
    blocks: HashMap<u64, Block>,
    next_tool: u64,
    /// The usage of `message_start`, updated by each `message_delta`.
    usage: Option<Usage>,
    /// A `message_delta` (with the final output count) arrived.
    delta_seen: bool,
    finish_sent: bool,
    /// The finish reason sent, in OpenAI's words.
    finish_reason: Option<&'static str>,
    done: bool,
    prompt_estimate: u64,
    completion_chars: usize,
}

impl AnthropicEvents {
    pub fn new(include_usage: bool, prompt_estimate: u64, created: u64) -> Self {
        AnthropicEvents {
            id: json!(""),
            model: json!(""),
            created,
            include_usage,
            blocks: HashMap::new(),
            next_tool: 0,
            usage: None,
            delta_seen: false,
            finish_sent: false,
            finish_reason: None,
            done: false,
            prompt_estimate,
            completion_chars: 0,
        }
    }

    fn chunk(&self, choices: Value) -> Bytes {
        let mut chunk = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created,
            "model": self.model, "choices": choices,
        });
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        Bytes::from(format!("data: {chunk}\n\n"))
    }

    fn delta(&self, delta: Value, finish: Option<&str>) -> Bytes {
        self.chunk(json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]))
    }

    fn content(&mut self, text: &str, out: &mut Vec<(EventKind, Bytes)>) {
        if text.is_empty() {
            return;
        }
        self.completion_chars += text.chars().count();
        let event = self.delta(json!({"content": text}), None);
        out.push((EventKind::Content { finished: false }, event));
    }

    fn arguments(&mut self, index: u64, fragment: &str, out: &mut Vec<(EventKind, Bytes)>) {
        self.completion_chars += fragment.chars().count();
        let delta = json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]});
        out.push((
            EventKind::Content { finished: false },
            self.delta(delta, None),
        ));
    }

    /// The usage chunk (when asked) and `[DONE]`.
    fn end(&mut self, out: &mut Vec<(EventKind, Bytes)>) {
        if self.done {
            return;
        }
        self.done = true;
        if self.include_usage {
            let chunk = json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [], "usage": self.usage().to_openai(),
            });
            out.push((EventKind::Meta, Bytes::from(format!("data: {chunk}\n\n"))));
        }
        out.push((EventKind::Done, Bytes::from_static(b"data: [DONE]\n\n")));
    }

    fn block_start(&mut self, event: &Value, out: &mut Vec<(EventKind, Bytes)>) {
        let index = event["index"].as_u64().unwrap_or(0);
        let block = &event["content_block"];
        match block["type"].as_str() {
            Some("text") => {
                self.blocks.insert(index, Block::Text);
                let text = block["text"].as_str().unwrap_or_default().to_owned();
                self.content(&text, out);
            }
            Some("tool_use") => {
                let tool = self.next_tool;
                self.next_tool += 1;
                self.blocks.insert(
                    index,
                    Block::Tool {
                        index: tool,
                        arguments: false,
                    },
                );
                let delta = json!({"tool_calls": [{
                    "index": tool, "id": block["id"], "type": "function",
                    "function": {"name": block["name"], "arguments": ""},
                }]});
                out.push((
                    EventKind::Content { finished: false },
                    self.delta(delta, None),
                ));
            }
            _ => {
                self.blocks.insert(index, Block::Other);
            }
        }
    }

    fn block_delta(&mut self, event: &Value, out: &mut Vec<(EventKind, Bytes)>) {
        let index = event["index"].as_u64().unwrap_or(0);
        let delta = &event["delta"];
        match (delta["type"].as_str(), self.blocks.get_mut(&index)) {
            (Some("text_delta"), Some(Block::Text) | None) => {
                let text = delta["text"].as_str().unwrap_or_default().to_owned();
                self.content(&text, out);
            }
            (Some("input_json_delta"), Some(Block::Tool { index, arguments })) => {
                let fragment = delta["partial_json"].as_str().unwrap_or_default();
                if !fragment.is_empty() {
                    *arguments = true;
                    let (index, fragment) = (*index, fragment.to_owned());
                    self.arguments(index, &fragment, out);
                }
            }
            _ => {}
        }
    }

    fn block_stop(&mut self, event: &Value, out: &mut Vec<(EventKind, Bytes)>) {
        let index = event["index"].as_u64().unwrap_or(0);
        // A tool call without arguments still needs a JSON object for them.
        if let Some(Block::Tool {
            index,
            arguments: false,
        }) = self.blocks.remove(&index)
        {
            self.arguments(index, "{}", out);
        }
    }

    fn message_delta(&mut self, event: &Value, out: &mut Vec<(EventKind, Bytes)>) {
        let (merged, output_seen) =
            merge_delta_usage(self.usage, self.prompt_estimate, &event["usage"]);
        self.delta_seen |= output_seen;
        self.usage = Some(merged);
        let stop_reason = &event["delta"]["stop_reason"];
        if !stop_reason.is_null() && !self.finish_sent {
            self.finish_sent = true;
            let reason = finish_reason(stop_reason);
            self.finish_reason = Some(reason);
            let event = self.delta(json!({}), Some(reason));
            out.push((EventKind::Content { finished: true }, event));
        }
    }

    fn error(&mut self, event: &Value, out: &mut Vec<(EventKind, Bytes)>) {
        let error = &event["error"];
        let kind = error["type"].as_str().unwrap_or("api_error");
        let body = json!({"error": {
            "message": error["message"].as_str().unwrap_or("the Anthropic backend failed"),
            "type": if kind == "invalid_request_error" { "invalid_request_error" } else { "server_error" },
            "param": null,
            "code": kind,
        }});
        self.done = true;
        out.push((EventKind::Error, Bytes::from(format!("data: {body}\n\n"))));
    }
}

/// The stream's usage so far (`current`, from `message_start`) with a `message_delta`'s `usage`
/// in it, and whether that gave the output count.
pub(super) fn merge_delta_usage(
    current: Option<Usage>,
    prompt_estimate: u64,
    usage: &Value,
) -> (Usage, bool) {
    let mut merged = current.unwrap_or(Usage::estimated(prompt_estimate, 0));
    let output = usage["output_tokens"].as_u64();
    if let Some(output) = output {
        merged.completion_tokens = output;
    }
    // Newer API versions repeat the input counts here; older ones leave them to message_start.
    if usage["input_tokens"].is_u64() {
        if let Some(input) = Usage::from_anthropic(usage) {
            merged.prompt_tokens = input.prompt_tokens;
            merged.cached_tokens = input.cached_tokens;
            merged.cache_write_tokens = input.cache_write_tokens;
            merged.source = UsageSource::Measured;
        }
    }
    (merged, output.is_some())
}

impl EventTranslator for AnthropicEvents {
    fn translate(&mut self, event: Bytes, out: &mut Vec<(EventKind, Bytes)>) {
        let data = event_data(&event);
        let data = data.trim_ascii();
        if data.is_empty() {
            return;
        }
        let Ok(event) = serde_json::from_slice::<Value>(data) else {
            out.push((EventKind::Malformed, Bytes::new()));
            return;
        };
        if self.done {
            return;
        }
        match event["type"].as_str().unwrap_or_default() {
            "message_start" => {
                let message = &event["message"];
                self.id = message["id"].clone();
                self.model = message["model"].clone();
                self.usage = Usage::from_anthropic(&message["usage"]);
                let role = self.delta(json!({"role": "assistant", "content": ""}), None);
                out.push((EventKind::Meta, role));
            }
            "content_block_start" => self.block_start(&event, out),
            "content_block_delta" => self.block_delta(&event, out),
            "content_block_stop" => self.block_stop(&event, out),
            "message_delta" => self.message_delta(&event, out),
            "message_stop" => self.end(out),
            "error" => self.error(&event, out),
            _ => {}
        }
    }

    fn finish(&mut self, out: &mut Vec<(EventKind, Bytes)>) {
        self.end(out);
    }

    fn failure_event(&self, message: &str) -> Bytes {
        error_event(message)
    }

    fn usage(&self) -> Usage {
        let counted = estimate_tokens(self.completion_chars);
        match self.usage {
            Some(usage) if self.delta_seen => usage,
            Some(usage) => Usage {
                completion_tokens: counted,
                source: UsageSource::Estimated,
                ..usage
            },
            None => Usage::estimated(self.prompt_estimate, counted),
        }
    }

    fn answer_so_far(&self) -> StreamAnswer<'_> {
        StreamAnswer {
            id: self.id.as_str().filter(|id| !id.is_empty()),
            finish_reason: self.finish_reason,
        }
    }
}
