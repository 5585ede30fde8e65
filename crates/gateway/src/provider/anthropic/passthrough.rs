//! An Anthropic client's answers from an Anthropic backend, passed through: the message and the
//! stream's events go to the caller as the upstream wrote them (thinking blocks and their
//! signatures, citations, fields the gateway does not know), read only for what the gateway
//! must know: the usage (the cache buckets with it), whether content began, whether the answer
//! finished, its id and stop reason.

use std::borrow::Cow;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::Value;

use super::answer::finish_reason;
use super::events::merge_delta_usage;
use crate::provider::{EventTranslator, StreamAnswer};
use crate::stream::{event_data, EventKind};
use crate::usage::{estimate_tokens, Usage, UsageSource};

/// The parts of a message, or of a stream event, the gateway reads; the rest is skipped unread.
#[derive(Deserialize, Default)]
struct Read<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Cow<'a, str>>,
    #[serde(default)]
    usage: Option<Value>,
    #[serde(default)]
    content: Option<Vec<Block<'a>>>,
    #[serde(default)]
    message: Option<Head>,
    #[serde(borrow, default)]
    delta: Option<Block<'a>>,
}

/// A content block or a block's delta: the text it carries, and a delta's stop reason.
#[derive(Deserialize, Default)]
struct Block<'a> {
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    partial_json: Option<Cow<'a, str>>,
    #[serde(default)]
    stop_reason: Option<String>,
}

impl Block<'_> {
    fn chars(&self) -> usize {
        [&self.text, &self.thinking, &self.partial_json]
            .into_iter()
            .flatten()
            .map(|t| t.chars().count())
            .sum()
    }
}

/// `message_start`'s message: its id and first usage.
#[derive(Deserialize, Default)]
struct Head {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    usage: Option<Value>,
}

/// A whole Messages answer's usage (`None` when it reported none, or is no message), and the
/// characters of its content, for counting when it reported none.
pub fn read_answer(body: &[u8]) -> (Option<Usage>, usize) {
    let Ok(message) = serde_json::from_slice::<Read>(body) else {
        return (None, 0);
    };
    if message.kind.as_deref() != Some("message") {
        return (None, 0);
    }
    let chars = message.content.iter().flatten().map(Block::chars).sum();
    let usage = message.usage.as_ref().and_then(Usage::from_anthropic);
    (usage, chars)
}

/// An Anthropic stream relayed as it came, its events classified and its usage read.
pub struct PassedEvents {
    prompt_estimate: u64,
    id: Option<String>,
    /// The usage of `message_start`, updated by each `message_delta`.
    usage: Option<Usage>,
    /// A `message_delta` (with the final output count) arrived.
    delta_seen: bool,
    finish_reason: Option<&'static str>,
    completion_chars: usize,
    done: bool,
}

impl PassedEvents {
    pub fn new(prompt_estimate: u64) -> Self {
        PassedEvents {
            prompt_estimate,
            id: None,
            usage: None,
            delta_seen: false,
            finish_reason: None,
            completion_chars: 0,
            done: false,
        }
    }

    fn kind(&mut self, event: Read) -> EventKind {
        match event.kind.as_deref().unwrap_or_default() {
            "message_start" => {
                let head = event.message.unwrap_or_default();
                self.id = head.id;
                self.usage = head.usage.as_ref().and_then(Usage::from_anthropic);
                EventKind::Meta
            }
            "content_block_delta" => {
                let delta = event.delta.unwrap_or_default();
                self.completion_chars += delta.chars();
                EventKind::Content { finished: false }
            }
            "message_delta" => {
                if let Some(usage) = &event.usage {
                    let merged = merge_delta_usage(self.usage, self.prompt_estimate, usage);
                    self.delta_seen |= merged.1;
                    self.usage = Some(merged.0);
                }
                let stop = event.delta.and_then(|d| d.stop_reason);
                match stop {
                    Some(reason) => {
                        self.finish_reason = Some(finish_reason(&Value::String(reason)));
                        EventKind::Content { finished: true }
                    }
                    None => EventKind::Meta,
                }
            }
            "message_stop" => {
                self.done = true;
                EventKind::Done
            }
            "error" => {
                self.done = true;
                EventKind::Error
            }
            // Block starts and stops, pings, and events of kinds not known yet.
            _ => EventKind::Meta,
        }
    }
}

/// Anthropic's named SSE event.
fn named(name: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
}

impl EventTranslator for PassedEvents {
    fn translate(&mut self, event: Bytes, out: &mut Vec<(EventKind, Bytes)>) {
        // The event goes out as it came: the caller must get text (the parser does not check
        // the strings it skips).
        if std::str::from_utf8(&event).is_err() {
            out.push((EventKind::Malformed, Bytes::new()));
            return;
        }
        let data = event_data(&event);
        let data = data.trim_ascii();
        if data.is_empty() {
            out.push((EventKind::Empty, event));
            return;
        }
        let Ok(read) = serde_json::from_slice::<Read>(data) else {
            out.push((EventKind::Malformed, Bytes::new()));
            return;
        };
        if self.done {
            return;
        }
        let kind = self.kind(read);
        out.push((kind, event));
    }

    fn finish(&mut self, out: &mut Vec<(EventKind, Bytes)>) {
        if !self.done {
            self.done = true;
            let stop = named("message_stop", &serde_json::json!({"type": "message_stop"}));
            out.push((EventKind::Done, stop));
        }
    }

    fn failure_event(&self, message: &str) -> Bytes {
        let error = serde_json::json!({"type": "error", "error": {"type": "api_error", "message": message}});
        named("error", &error)
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
            id: self.id.as_deref(),
            finish_reason: self.finish_reason,
        }
    }

    fn passes_through(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn run(input: &str) -> (Vec<(EventKind, Bytes)>, Usage) {
        let mut framer = crate::stream::Framer::default();
        framer.push(input.as_bytes());
        let mut events = PassedEvents::new(7);
        let mut out = Vec::new();
        while let Some(event) = framer.next_event() {
            events.translate(event, &mut out);
        }
        let usage = events.usage();
        (out, usage)
    }

    #[test]
    fn events_pass_as_they_came_and_their_usage_is_read_with_the_cache_buckets() {
        let input = concat!(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":5,\"cache_creation_input_tokens\":100,\"cache_read_input_tokens\":40,\"output_tokens\":1}}}\n\n",
            "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"thinking_delta\",\"thinking\":\"Hmm\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"signature_delta\",\"signature\":\"c2ln\"}}\n\n",
            "event: ping\ndata: {\"type\":\"ping\"}\n\n",
            "event: future_kind\ndata: {\"type\":\"future_kind\",\"x\":1}\n\n",
            "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":9}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let (out, usage) = run(input);
        let joined: Vec<u8> = out.iter().flat_map(|(_, e)| e.to_vec()).collect();
        assert_eq!(std::str::from_utf8(&joined).unwrap(), input);
        let kinds: Vec<EventKind> = out.iter().map(|(k, _)| *k).collect();
        use EventKind::*;
        assert_eq!(
            kinds,
            [
                Meta,
                Meta,
                Content { finished: false },
                Content { finished: false },
                Meta,
                Meta,
                Content { finished: true },
                Done
            ]
        );
        assert_eq!(usage.prompt_tokens, 145);
        assert_eq!(usage.cached_tokens, 40);
        assert_eq!(usage.cache_write_tokens, 100);
        assert_eq!(usage.completion_tokens, 9);
        assert_eq!(usage.source, UsageSource::Measured);
    }

    #[test]
    fn an_event_that_is_not_text_is_never_passed_on() {
        let mut events = PassedEvents::new(0);
        let mut out = Vec::new();
        let event = b"event: ping\ndata: {\"type\":\"ping\",\"x\":\"\xff\"}\n\n";
        events.translate(Bytes::from_static(event), &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, EventKind::Malformed);
    }

    #[test]
    fn an_error_event_ends_the_stream_and_nothing_after_it_is_taken() {
        let input = concat!(
            "event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n",
            "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
        );
        let (out, usage) = run(input);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, EventKind::Error);
        assert_eq!(usage.source, UsageSource::Estimated);
    }

    #[test]
    fn a_whole_message_is_read_for_its_usage_and_its_text() {
        let body = br#"{"type":"message","content":[{"type":"thinking","thinking":"ab","signature":"s"},{"type":"text","text":"hello","citations":[]}],"usage":{"input_tokens":3,"cache_read_input_tokens":2,"output_tokens":4}}"#;
        let (usage, chars) = read_answer(body);
        let usage = usage.unwrap();
        assert_eq!((usage.prompt_tokens, usage.cached_tokens), (5, 2));
        assert_eq!(chars, 7);
        assert_eq!(read_answer(b"{\"type\":\"error\"}"), (None, 0));
        assert_eq!(read_answer(b"not json"), (None, 0));
    }
}
