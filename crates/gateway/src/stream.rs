//! Relaying an SSE stream (contract section 2.1, rule 4): events are framed, passed through the
//! provider's [`EventTranslator`] (OpenAI-shaped chunks go out as the upstream wrote them,
//! Anthropic events become OpenAI chunks), checked and forwarded. Until the first content event
//! the attempt can still fail over; after it, an upstream failure ends the caller's stream with an
//! explicit error event, never a silent close. The stream's usage is reported when it ends, and
//! told in a final SSE comment just before its terminal event.

use std::borrow::Cow;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;

use bytes::{Buf, Bytes, BytesMut};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use serde::Deserialize;
use tokio::time::{Duration, Instant, Sleep};

use crate::body::{Body, BoxError};
use crate::headroom::InFlight;
use crate::provider::EventTranslator;
use crate::redaction::{scrub, Redaction};
use crate::telemetry::StreamTrace;
use crate::upstream::{Failure, UpstreamBody};
use crate::usage::{Usage, UsageSink, UsageSource};

/// Splits a byte stream into SSE events (each ending in a blank line).
#[derive(Default)]
pub struct Framer {
    /// A frame pushed while no partial event waited: its events are sliced out of it without a
    /// copy (upstreams mostly send whole events, one or a few to a frame).
    whole: Bytes,
    /// A partial event and whatever came after it.
    buffer: BytesMut,
}

impl Framer {
    pub fn push(&mut self, bytes: &[u8]) {
        self.spill();
        self.buffer.extend_from_slice(bytes);
    }

    /// Takes a frame as it came; its whole events are relayed as slices of it.
    pub fn push_frame(&mut self, frame: Bytes) {
        self.spill();
        if frame.is_empty() {
            return;
        }
        if self.buffer.is_empty() {
            self.whole = frame;
        } else {
            self.buffer.extend_from_slice(&frame);
        }
    }

    /// Moves what is left of the whole frame into the buffer, ahead of anything pushed next.
    fn spill(&mut self) {
        if !self.whole.is_empty() {
            self.buffer
                .extend_from_slice(&std::mem::take(&mut self.whole));
        }
    }

    /// The next complete event, with its terminating blank line.
    pub fn next_event(&mut self) -> Option<Bytes> {
        if !self.whole.is_empty() {
            // The last event takes the frame itself: no empty slice keeps the upstream
            // connection's read buffer shared (it would reallocate rather than reuse it).
            return match find_event_end(&self.whole) {
                Some(end) if end == self.whole.len() => Some(std::mem::take(&mut self.whole)),
                Some(end) => Some(self.whole.split_to(end)),
                None => {
                    self.spill();
                    None
                }
            };
        }
        let end = find_event_end(&self.buffer)?;
        Some(self.buffer.split_to(end).freeze())
    }

    /// Whatever is left when the upstream closed (an event without its blank line).
    pub fn rest(&mut self) -> Option<Bytes> {
        self.spill();
        let rest = self.buffer.split().freeze();
        (!rest.iter().all(u8::is_ascii_whitespace)).then_some(rest)
    }
}

/// The end of the first event: after the line break that follows a line break (`\n\n`,
/// `\n\r\n`, `\r\n\r\n`).
fn find_event_end(buffer: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buffer).find_map(|i| match &buffer[i + 1..] {
        [b'\n', ..] => Some(i + 2),
        [b'\r', b'\n', ..] => Some(i + 3),
        _ => None,
    })
}

/// The `data:` payload of an event (multi-line data joined by `\n`), borrowed from the event
/// when it has a single data line.
pub fn event_data(event: &[u8]) -> Cow<'_, [u8]> {
    match single_data_line(event) {
        Some(data) => Cow::Borrowed(data),
        None => data_lines(event),
    }
}

/// The payload of the usual event, one `data:` line and the blank line, found with one search.
fn single_data_line(event: &[u8]) -> Option<&[u8]> {
    let rest = event.strip_prefix(b"data:")?;
    let end = memchr::memchr(b'\n', rest)?;
    if !matches!(&rest[end + 1..], b"\n" | b"\r\n") {
        return None;
    }
    let line = &rest[..end];
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    Some(line.strip_prefix(b" ").unwrap_or(line))
}

/// [`event_data`] line by line.
fn data_lines(event: &[u8]) -> Cow<'_, [u8]> {
    let mut data = Cow::Borrowed(&[][..]);
    let mut lines = 0;
    let starts = std::iter::once(0).chain(memchr::memchr_iter(b'\n', event).map(|at| at + 1));
    for start in starts {
        let line = &event[start..];
        let line = &line[..memchr::memchr(b'\n', line).unwrap_or(line.len())];
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if let Some(value) = line.strip_prefix(b"data:") {
            let value = value.strip_prefix(b" ").unwrap_or(value);
            lines += 1;
            if lines == 1 {
                data = Cow::Borrowed(value);
            } else {
                let joined = data.to_mut();
                joined.push(b'\n');
                joined.extend_from_slice(value);
            }
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
    /// Keep the text sent so far, so a cut stream can be continued elsewhere (rule 5).
    pub track_transcript: bool,
}

/// A stream whose first content event has arrived: it may be committed to the caller.
pub struct Relay {
    body: UpstreamBody,
    framer: Framer,
    ready: VecDeque<Bytes>,
    rules: StreamRules,
    finished: bool,
    saw_finish: bool,
    pub malformed: u64,
    /// Keeps the backend's in-flight count until the stream ends.
    in_flight: Option<InFlight>,
    /// What reached the caller so far, when the alias continues cut streams.
    transcript: Option<Transcript>,
    /// On a continuation: the caller's stream identity its chunks are rewritten to.
    rewrite: Option<Identity>,
    /// The upstream's events in the shape the relay sends (identity for OpenAI-shaped chat).
    translator: Box<dyn EventTranslator>,
    /// The event that ends the stream (`[DONE]`, an error), held back until the usage is told.
    terminal: Option<Bytes>,
    /// The backend's credential, taken out of an error event that ends the stream: the one
    /// event that is the upstream's own words about a failure, which may quote it.
    redaction: Option<Arc<Redaction>>,
    /// The translator's output for one upstream event, kept to reuse its allocation.
    translated: Vec<(EventKind, Bytes)>,
    /// When the read under way gives up: one timer for the stream, moved on as events arrive
    /// (moving it later is a compare-and-swap; a timer per read was registered and removed for
    /// every event).
    timer: Pin<Box<Sleep>>,
}

/// The `id`, `created` and `model` of the caller's stream; a continuation's chunks carry them too,
/// so the caller sees one answer.
#[derive(Debug, Clone)]
pub struct Identity {
    id: serde_json::Value,
    created: serde_json::Value,
    model: serde_json::Value,
}

/// The text and identity of what a stream sent to the caller.
#[derive(Debug, Default)]
pub struct Transcript {
    text: String,
    tool_calls: bool,
    identity: Option<Identity>,
}

fn event_json(event: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(event_data(event).trim_ascii()).ok()
}

impl Transcript {
    fn record(&mut self, event: &[u8]) {
        let Some(value) = event_json(event) else {
            return;
        };
        if self.identity.is_none() && value["id"].as_str().is_some_and(|id| !id.is_empty()) {
            self.identity = Some(Identity {
                id: value["id"].clone(),
                created: value["created"].clone(),
                model: value["model"].clone(),
            });
        }
        for choice in value["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            if let Some(text) = delta["content"].as_str() {
                self.text.push_str(text);
            }
            self.tool_calls |= !delta["tool_calls"].is_null();
        }
    }
}

/// A continuation's event in the caller's stream identity, without its role announcement;
/// `None` for events the caller already had (the role chunk) or that are not JSON.
fn rewritten(event: &[u8], identity: &Identity) -> Option<Bytes> {
    let mut value = event_json(event)?;
    value["id"] = identity.id.clone();
    value["created"] = identity.created.clone();
    value["model"] = identity.model.clone();
    for choice in value["choices"].as_array_mut().into_iter().flatten() {
        if let Some(delta) = choice.get_mut("delta").and_then(|d| d.as_object_mut()) {
            delta.remove("role");
        }
    }
    Some(Bytes::from(format!("data: {value}\n\n")))
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
        if self.timer.deadline() != until {
            self.timer.as_mut().reset(until);
        }
        loop {
            // The body first: a frame that is there is taken even when the time is up.
            let frame = std::future::poll_fn(|cx| {
                match http_body::Body::poll_frame(Pin::new(&mut self.body), cx) {
                    Poll::Ready(frame) => Poll::Ready(Some(frame)),
                    Poll::Pending => self.timer.as_mut().poll(cx).map(|()| None),
                }
            });
            match frame.await {
                None if until >= self.rules.deadline => return Read::OutOfTime,
                None => return Read::Idle,
                Some(None) => return Read::End,
                Some(Some(Err(error))) => return Read::Failed(error.to_string()),
                Some(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data() {
                        return Read::Data(data);
                    }
                }
            }
        }
    }

    /// Takes complete events out of the framer; returns the most telling kind among them.
    fn absorb(&mut self, data: Bytes) -> Option<EventKind> {
        self.framer.push_frame(data);
        let mut notable = None;
        let mut translated = std::mem::take(&mut self.translated);
        'events: while let Some(event) = self.framer.next_event() {
            self.translator.translate(event, &mut translated);
            for (kind, event) in translated.drain(..) {
                self.take(kind, event, &mut notable);
                if self.finished {
                    break 'events;
                }
            }
        }
        translated.clear();
        self.translated = translated;
        notable
    }

    /// Queues one translated event for the caller (or drops it, by the rules).
    fn take(&mut self, kind: EventKind, event: Bytes, notable: &mut Option<EventKind>) {
        match kind {
            EventKind::Malformed => {
                self.malformed += 1;
                if let Some(in_flight) = &self.in_flight {
                    in_flight.dropped_event();
                }
                tracing::debug!("dropped a malformed upstream stream event");
                return;
            }
            EventKind::Empty => return,
            EventKind::FilterOnly if self.rules.drop_filter_chunks => return,
            EventKind::Content { finished } => {
                self.saw_finish |= finished;
                notable.get_or_insert(kind);
            }
            EventKind::Done | EventKind::Error => {
                self.finished = true;
                *notable = Some(kind);
                self.terminal = Some(event);
                return;
            }
            EventKind::FilterOnly | EventKind::Meta => {}
        }
        let event = match (&self.rewrite, kind) {
            (None, _) => event,
            (Some(_), EventKind::FilterOnly) => return,
            (Some(_), EventKind::Meta)
                if event_json(&event)
                    .is_some_and(|v| v["choices"].as_array().is_some_and(|c| !c.is_empty())) =>
            {
                return
            }
            (Some(identity), _) => match rewritten(&event, identity) {
                Some(event) => event,
                None => return,
            },
        };
        if let (Some(transcript), EventKind::Content { .. }) = (self.transcript.as_mut(), kind) {
            transcript.record(&event);
        }
        self.ready.push_back(event);
    }

    /// The stream's usage so far, as its translator counted it.
    pub fn usage(&self) -> Usage {
        self.translator.usage()
    }

    /// Whether its events are the upstream's own, in the caller's dialect.
    pub fn passes_through(&self) -> bool {
        self.translator.passes_through()
    }

    /// Reads until the first content event; failures before it are the attempt's failures.
    pub async fn open(
        body: UpstreamBody,
        rules: StreamRules,
        first_token_by: Instant,
        translator: Box<dyn EventTranslator>,
    ) -> Result<Relay, Failure> {
        Self::open_with(body, rules, first_token_by, None, translator).await
    }

    /// Opens a continuation of the caller's stream `identity` (rule 5).
    pub async fn open_continuing(
        body: UpstreamBody,
        rules: StreamRules,
        first_token_by: Instant,
        identity: Identity,
        translator: Box<dyn EventTranslator>,
    ) -> Result<Relay, Failure> {
        Self::open_with(body, rules, first_token_by, Some(identity), translator).await
    }

    async fn open_with(
        body: UpstreamBody,
        rules: StreamRules,
        first_token_by: Instant,
        rewrite: Option<Identity>,
        translator: Box<dyn EventTranslator>,
    ) -> Result<Relay, Failure> {
        let until = first_token_by.min(rules.deadline);
        let mut relay = Relay {
            body,
            framer: Framer::default(),
            ready: VecDeque::new(),
            rules,
            finished: false,
            saw_finish: false,
            malformed: 0,
            in_flight: None,
            transcript: rules.track_transcript.then(Transcript::default),
            rewrite,
            translator,
            terminal: None,
            redaction: None,
            translated: Vec::new(),
            timer: Box::pin(tokio::time::sleep_until(until)),
        };
        loop {
            match relay.read(until).await {
                Read::Data(data) => match relay.absorb(data) {
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

    /// The next step of the stream: bytes for the caller, a cut not yet told, or the end.
    async fn step(&mut self) -> Step {
        loop {
            if let Some(first) = self.ready.pop_front() {
                return Step::Data(self.join(first));
            }
            if self.finished {
                return Step::End;
            }
            let now = Instant::now();
            // An upstream that never pauses is held to the deadline too, not only one that waits.
            let read = match now >= self.rules.deadline {
                true => Read::OutOfTime,
                false => {
                    self.read((now + self.rules.idle).min(self.rules.deadline))
                        .await
                }
            };
            let cut = match read {
                Read::Data(data) => {
                    self.absorb(data);
                    continue;
                }
                Read::End => return self.end_cleanly(),
                Read::Failed(e) => format!("the upstream stream failed midway: {e}"),
                Read::Idle => "the upstream stream stalled (idle timeout)".to_owned(),
                Read::OutOfTime => "the request ran out of time (total timeout)".to_owned(),
            };
            self.finished = true;
            return Step::Cut(cut);
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

    /// The upstream closed without its terminal event: finished at once when the answer was
    /// complete (the last event, if it lacked its blank line, still goes out), otherwise a cut.
    fn end_cleanly(&mut self) -> Step {
        let mut rest = Vec::new();
        if let Some(event) = self.framer.rest() {
            self.translator.translate(event, &mut rest);
        }
        let completes = self.saw_finish
            || rest
                .iter()
                .any(|(k, _)| matches!(k, EventKind::Content { finished: true } | EventKind::Done));
        if !completes {
            self.finished = true;
            return Step::Cut(
                "the upstream stream ended before the answer was complete".to_owned(),
            );
        }
        let mut notable = None;
        for (kind, event) in rest {
            if !self.finished {
                self.take(kind, event, &mut notable);
            }
        }
        if !self.finished {
            let mut tail = Vec::new();
            self.translator.finish(&mut tail);
            for (kind, event) in tail {
                self.take(kind, event, &mut notable);
            }
        }
        self.finished = true;
        match self.ready.pop_front() {
            Some(first) => Step::Data(self.join(first)),
            None => Step::End,
        }
    }

    /// Counts the stream in flight on its backend until it ends.
    pub fn holding(mut self, in_flight: InFlight) -> Self {
        self.in_flight = Some(in_flight);
        self
    }

    /// Scrubs the stream's terminal event of `redaction`'s credential.
    pub fn scrubbing(mut self, redaction: Option<Arc<Redaction>>) -> Self {
        self.redaction = redaction;
        self
    }

    /// The caller's stream from this relay alone.
    pub fn answering(self) -> Answering {
        Answering::new(self, None)
    }

    /// The caller's stream, continued by `continuer` if it is cut (rule 5).
    pub fn continued_by(self, continuer: Box<dyn Continuer>) -> Answering {
        Answering::new(self, Some(continuer))
    }
}

enum Step {
    Data(Bytes),
    Cut(String),
    End,
}

/// Asks another target to continue a cut stream from the text the caller already has.
pub trait Continuer: Send {
    /// A relay for the continuation of `sent`, already past its first content event, or `None`
    /// when no candidate could continue.
    fn continue_after<'a>(
        &'a mut self,
        sent: &'a str,
        identity: Identity,
    ) -> Pin<Box<dyn Future<Output = Option<Relay>> + Send + 'a>>;
}

/// The caller's stream: one relay, or a relay and its continuations.
pub struct Answering {
    relay: Relay,
    continuer: Option<Box<dyn Continuer>>,
    /// Where the usage goes when the stream ends.
    sink: Option<UsageSink>,
    /// The usage of relays a continuation replaced.
    spent: Option<Usage>,
    ended: bool,
    /// The request's span's account of the stream, when it is traced.
    trace: Option<Arc<StreamTrace>>,
}

impl Answering {
    fn new(relay: Relay, continuer: Option<Box<dyn Continuer>>) -> Self {
        Answering {
            relay,
            continuer,
            sink: None,
            spent: None,
            ended: false,
            trace: None,
        }
    }

    /// Tells `trace` (a traced request's) the answer's id and finish reason and the stream's
    /// cuts as they happen.
    pub fn tracing(mut self, trace: Option<Arc<StreamTrace>>) -> Self {
        self.trace = trace;
        self
    }

    /// Reports the stream's usage to `sink` when it ends.
    pub fn reporting(mut self, sink: UsageSink) -> Self {
        self.sink = Some(sink);
        self
    }

    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.ended {
            return None;
        }
        loop {
            match self.relay.step().await {
                Step::Data(bytes) => return Some(bytes),
                Step::End => {
                    let redaction = self.relay.redaction.as_deref();
                    let terminal = self.relay.terminal.take().map(|t| scrub(redaction, t));
                    return Some(self.end(terminal, None));
                }
                Step::Cut(reason) => {
                    let cut_at = Instant::now();
                    if let Some(next) = self.continuation().await {
                        tracing::info!(reason, "a cut stream is continued by another target");
                        let cut = std::mem::replace(&mut self.relay, next);
                        if let Some(trace) = &self.trace {
                            let answer = cut.translator.answer_so_far();
                            trace.ended(answer, cut.usage(), Some((cut_at, &reason)));
                        }
                        self.spent = Some(self.spent.map_or(cut.usage(), |s| s.plus(cut.usage())));
                        continue;
                    }
                    tracing::warn!(reason, "stream cut after content reached the caller");
                    let failure = self.relay.translator.failure_event(&reason);
                    return Some(self.end(Some(failure), Some((cut_at, &reason))));
                }
            }
        }
    }

    /// The usage comment and the terminal event; the usage is reported and settled (and told
    /// the trace, with the `cut` that ended the stream, if one did).
    fn end(&mut self, terminal: Option<Bytes>, cut: Option<(Instant, &str)>) -> Bytes {
        let (own, usage) = self.tell_end(cut);
        if let (Some(in_flight), UsageSource::Measured) =
            (self.relay.in_flight.as_mut(), own.source)
        {
            in_flight.settle(own.total_tokens(), onedoor_state::now_ms());
        }
        let mut out = BytesMut::from(usage.sse_comment().as_bytes());
        if let Some(terminal) = terminal {
            out.extend_from_slice(&terminal);
        }
        out.freeze()
    }

    /// Ends the stream's account: the trace hears what it said (and the `cut` that ended it, if
    /// one did) and the sink its usage, continuations' included. Returns the last relay's own
    /// usage and the stream's.
    fn tell_end(&mut self, cut: Option<(Instant, &str)>) -> (Usage, Usage) {
        self.ended = true;
        let own = self.relay.usage();
        if let Some(trace) = &self.trace {
            trace.ended(self.relay.translator.answer_so_far(), own, cut);
        }
        let usage = self.spent.map_or(own, |s| s.plus(own));
        if let Some(sink) = self.sink.take() {
            sink.report(usage);
        }
        (own, usage)
    }

    async fn continuation(&mut self) -> Option<Relay> {
        let continuer = self.continuer.as_mut()?;
        let transcript = self.relay.transcript.take()?;
        if transcript.tool_calls || transcript.text.is_empty() {
            return None;
        }
        let identity = transcript.identity.clone()?;
        let mut next = continuer.continue_after(&transcript.text, identity).await?;
        next.transcript = Some(transcript);
        Some(next)
    }

    pub fn into_body(self) -> Body {
        // Boxed: each step moves the state into its future and out again, a pointer and not
        // the whole relay.
        let stream = futures_util::stream::unfold(Box::new(self), |mut answering| async move {
            let chunk = answering.next_chunk().await?;
            Some((Ok::<_, BoxError>(Frame::data(chunk)), answering))
        });
        StreamBody::new(stream).boxed_unsync()
    }
}

impl Drop for Answering {
    /// A stream the caller left before its end still tells its trace what it said, and its
    /// usage so far (measured once the usage chunk went by, else counted from the text).
    fn drop(&mut self) {
        if !self.ended {
            self.tell_end(None);
        }
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
        framer.push_frame(Bytes::from_static(b":2}\r\n\r\ndata: 3\n\ndata: 4"));
        assert_eq!(
            framer.next_event().as_deref(),
            Some(&b"data: {\"b\":2}\r\n\r\n"[..])
        );
        assert_eq!(framer.next_event().as_deref(), Some(&b"data: 3\n\n"[..]));
        assert_eq!(framer.next_event(), None);
        framer.push_frame(Bytes::from_static(b"\n\n"));
        assert_eq!(framer.next_event().as_deref(), Some(&b"data: 4\n\n"[..]));
        assert_eq!(framer.rest(), None);
    }

    #[test]
    fn whole_frames_are_split_without_a_copy() {
        let frame = Bytes::from_static(b"data: 1\n\ndata: 2\n\n");
        let mut framer = Framer::default();
        framer.push_frame(frame.clone());
        let first = framer.next_event().unwrap();
        assert_eq!(first.as_ptr(), frame.as_ptr());
        assert_eq!(framer.next_event().as_deref(), Some(&b"data: 2\n\n"[..]));
        assert_eq!(framer.next_event(), None);
        assert!(matches!(event_data(b"data: a\n\n"), Cow::Borrowed(b"a")));
        assert_eq!(&*event_data(b"data: a\ndata: b\n\n"), b"a\nb");
        let events: [&[u8]; 10] = [
            b"data: a\n\n",
            b"data:a\r\n\r\n",
            b"data:  a \r\n\n",
            b"data: a\n",
            b"data: a\n\n\n",
            b"data: a\ndata: b\n\n",
            b"event: x\ndata: a\n\n",
            b"data:\n\n",
            b"data: a\r\r\n\n",
            b": comment\n\n",
        ];
        for event in events {
            let lines = data_lines(event);
            assert_eq!(
                event_data(event),
                lines,
                "{}",
                String::from_utf8_lossy(event)
            );
            if let Some(single) = single_data_line(event) {
                assert_eq!(single, &*lines, "{}", String::from_utf8_lossy(event));
            }
        }
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
