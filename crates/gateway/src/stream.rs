//! Relaying an OpenAI-shaped SSE stream (contract section 2.1, rule 4): events are framed, checked
//! and forwarded as the upstream wrote them. Until the first content event the attempt can still
//! fail over; after it, an upstream failure ends the caller's stream with an explicit error event,
//! never a silent close.

use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use serde::Deserialize;
use tokio::time::{Duration, Instant};

use crate::body::{Body, BoxError};
use crate::upstream::Failure;

/// Splits a byte stream into SSE events (each ending in a blank line).
#[derive(Default)]
pub struct Framer {
    buffer: BytesMut,
}

impl Framer {
    pub fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next complete event, with its terminating blank line.
    pub fn next_event(&mut self) -> Option<Bytes> {
        let end = find_event_end(&self.buffer)?;
        Some(self.buffer.split_to(end).freeze())
    }

    /// Whatever is left when the upstream closed (an event without its blank line).
    pub fn rest(&mut self) -> Option<Bytes> {
        let rest = self.buffer.split().freeze();
        (!rest.iter().all(u8::is_ascii_whitespace)).then_some(rest)
    }
}

fn find_event_end(buffer: &[u8]) -> Option<usize> {
    let mut i = 0;
    while i + 1 < buffer.len() {
        match &buffer[i..] {
            [b'\n', b'\n', ..] => return Some(i + 2),
            [b'\r', b'\n', b'\r', b'\n', ..] => return Some(i + 4),
            [b'\n', b'\r', b'\n', ..] => return Some(i + 3),
            _ => i += 1,
        }
    }
    None
}

/// The `data:` payload of an event (multi-line data joined by `\n`).
fn event_data(event: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            if !data.is_empty() {
                data.push(b'\n');
            }
            data.extend_from_slice(value.strip_prefix(b" ").unwrap_or(value));
        }
    }
    data
}

/// What one upstream event is, for relaying decisions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    Done,
    /// Not JSON: dropped and counted, never forwarded.
    Malformed,
    /// No data line (comments, keep-alives).
    Empty,
    /// Azure's `choices: []` chunk carrying only content-filter results.
    FilterOnly,
    /// A chunk before any content (the role chunk) or after it (the usage chunk).
    Meta,
    /// Text, tool calls, or a finish reason.
    Content {
        finished: bool,
    },
    /// An upstream `error` object inside the stream.
    Error,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    prompt_filter_results: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    usage: Option<serde::de::IgnoredAny>,
}

#[derive(Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    refusal: Option<String>,
}

pub fn classify(event: &[u8]) -> EventKind {
    let data = event_data(event);
    let data = data.trim_ascii();
    if data.is_empty() {
        return EventKind::Empty;
    }
    if data == b"[DONE]" {
        return EventKind::Done;
    }
    let Ok(chunk) = serde_json::from_slice::<Chunk>(data) else {
        return EventKind::Malformed;
    };
    if chunk.error.is_some() {
        return EventKind::Error;
    }
    if chunk.choices.is_empty() {
        let filter_only = chunk.prompt_filter_results.is_some() && chunk.usage.is_none();
        return if filter_only {
            EventKind::FilterOnly
        } else {
            EventKind::Meta
        };
    }
    let finished = chunk.choices.iter().any(|c| c.finish_reason.is_some());
    let has_content = chunk.choices.iter().any(|c| {
        c.delta.as_ref().is_some_and(|d| {
            d.content.as_deref().is_some_and(|t| !t.is_empty())
                || d.tool_calls.is_some()
                || d.refusal.as_deref().is_some_and(|t| !t.is_empty())
        })
    });
    if finished || has_content {
        EventKind::Content { finished }
    } else {
        EventKind::Meta
    }
}

/// The OpenAI-shaped error event that ends a stream the gateway could not complete.
pub fn error_event(message: &str) -> Bytes {
    let body = serde_json::json!({
        "error": {"message": message, "type": "server_error", "param": null, "code": "upstream_failed"}
    });
    Bytes::from(format!("data: {body}\n\n"))
}

/// Stream timing and dialect rules for one relay.
#[derive(Debug, Clone, Copy)]
pub struct StreamRules {
    pub idle: Duration,
    pub deadline: Instant,
    /// Drop Azure's filter-only chunks (plain OpenAI paths).
    pub drop_filter_chunks: bool,
}

/// A stream whose first content event has arrived: it may be committed to the caller.
pub struct Relay {
    body: Incoming,
    framer: Framer,
    ready: VecDeque<Bytes>,
    rules: StreamRules,
    finished: bool,
    saw_finish: bool,
    pub malformed: u64,
}

enum Read {
    Data(Bytes),
    End,
    Failed(String),
    Idle,
    OutOfTime,
}

impl Relay {
    async fn read(&mut self, until: Instant) -> Read {
        loop {
            match tokio::time::timeout_at(until, self.body.frame()).await {
                Err(_) if until >= self.rules.deadline => return Read::OutOfTime,
                Err(_) => return Read::Idle,
                Ok(None) => return Read::End,
                Ok(Some(Err(error))) => return Read::Failed(error.to_string()),
                Ok(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        return Read::Data(data);
                    }
                }
            }
        }
    }

    /// Takes complete events out of the framer; returns whether the upstream is finished.
    fn absorb(&mut self, data: &[u8]) -> Option<EventKind> {
        self.framer.push(data);
        let mut notable = None;
        while let Some(event) = self.framer.next_event() {
            let kind = classify(&event);
            match kind {
                EventKind::Malformed => {
                    self.malformed += 1;
                    tracing::debug!("dropped a malformed upstream stream event");
                    continue;
                }
                EventKind::Empty => continue,
                EventKind::FilterOnly if self.rules.drop_filter_chunks => continue,
                EventKind::Content { finished } => {
                    self.saw_finish |= finished;
                    notable.get_or_insert(kind);
                }
                EventKind::Done | EventKind::Error => {
                    self.finished = true;
                    notable = Some(kind);
                    self.ready.push_back(event);
                    break;
                }
                EventKind::FilterOnly | EventKind::Meta => {}
            }
            self.ready.push_back(event);
        }
        notable
    }

    /// Reads until the first content event; failures before it are the attempt's failures.
    pub async fn open(
        body: Incoming,
        rules: StreamRules,
        first_token_by: Instant,
    ) -> Result<Relay, Failure> {
        let mut relay = Relay {
            body,
            framer: Framer::default(),
            ready: VecDeque::new(),
            rules,
            finished: false,
            saw_finish: false,
            malformed: 0,
        };
        let until = first_token_by.min(rules.deadline);
        loop {
            match relay.read(until).await {
                Read::Data(data) => match relay.absorb(&data) {
                    Some(EventKind::Error) => {
                        return Err(Failure::Reset("the upstream sent an error event".into()))
                    }
                    Some(_) => return Ok(relay),
                    None => {}
                },
                Read::End => {
                    return Err(Failure::Reset("the stream ended before any content".into()))
                }
                Read::Failed(e) => return Err(Failure::Reset(e)),
                Read::Idle if until < rules.deadline => return Err(Failure::FirstTokenTimeout),
                Read::Idle | Read::OutOfTime => return Err(Failure::Timeout),
            }
        }
    }

    /// The next bytes for the caller, `None` once the stream is over.
    async fn next_chunk(&mut self) -> Option<Bytes> {
        loop {
            if let Some(first) = self.ready.pop_front() {
                return Some(self.join(first));
            }
            if self.finished {
                return None;
            }
            let until = (Instant::now() + self.rules.idle).min(self.rules.deadline);
            let cut = match self.read(until).await {
                Read::Data(data) => {
                    self.absorb(&data);
                    continue;
                }
                Read::End => return Some(self.end_cleanly()),
                Read::Failed(e) => format!("the upstream stream failed midway: {e}"),
                Read::Idle => "the upstream stream stalled (idle timeout)".to_owned(),
                Read::OutOfTime => "the request ran out of time (total timeout)".to_owned(),
            };
            return Some(self.cut(&cut));
        }
    }

    fn join(&mut self, first: Bytes) -> Bytes {
        if self.ready.is_empty() {
            return first;
        }
        let mut out = BytesMut::from(first.chunk());
        while let Some(event) = self.ready.pop_front() {
            out.extend_from_slice(&event);
        }
        out.freeze()
    }

    /// The upstream closed without `[DONE]`: finished at once when the answer was complete,
    /// otherwise an explicit error.
    fn end_cleanly(&mut self) -> Bytes {
        self.finished = true;
        if let Some(rest) = self.framer.rest() {
            if matches!(classify(&rest), EventKind::Content { finished: true }) {
                self.saw_finish = true;
            }
        }
        if self.saw_finish {
            Bytes::from_static(b"data: [DONE]\n\n")
        } else {
            self.cut("the upstream stream ended before the answer was complete")
        }
    }

    fn cut(&mut self, reason: &str) -> Bytes {
        self.finished = true;
        tracing::warn!(reason, "stream cut after content reached the caller");
        error_event(reason)
    }

    pub fn into_body(self) -> Body {
        let stream = futures_util::stream::unfold(self, |mut relay| async move {
            let chunk = relay.next_chunk().await?;
            Some((Ok::<_, BoxError>(Frame::data(chunk)), relay))
        });
        StreamBody::new(stream).boxed_unsync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_framer_splits_events_across_reads() {
        let mut framer = Framer::default();
        framer.push(b"data: {\"a\":1}\n\ndata: {\"b\"");
        assert_eq!(
            framer.next_event().as_deref(),
            Some(&b"data: {\"a\":1}\n\n"[..])
        );
        assert_eq!(framer.next_event(), None);
        framer.push(b":2}\r\n\r\n");
        assert_eq!(
            framer.next_event().as_deref(),
            Some(&b"data: {\"b\":2}\r\n\r\n"[..])
        );
    }

    #[test]
    fn events_are_told_apart() {
        assert_eq!(classify(b"data: [DONE]\n\n"), EventKind::Done);
        assert_eq!(classify(b"data: {nope\n\n"), EventKind::Malformed);
        assert_eq!(classify(b": keep-alive\n\n"), EventKind::Empty);
        assert_eq!(
            classify(br#"data: {"choices":[],"prompt_filter_results":[{"prompt_index":0}]}"#),
            EventKind::FilterOnly
        );
        assert_eq!(
            classify(
                br#"data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#
            ),
            EventKind::Meta
        );
        assert_eq!(
            classify(
                br#"data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}"#
            ),
            EventKind::Content { finished: false }
        );
        assert_eq!(
            classify(br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#),
            EventKind::Content { finished: true }
        );
        assert_eq!(
            classify(br#"data: {"error":{"message":"x"}}"#),
            EventKind::Error
        );
    }
}
