//! The one place a finished request becomes a [`UsageRecord`] and goes to the usage recorder:
//! a whole answer when the pipeline is done with it, a stream when its body ends or is dropped
//! (the caller went away) through [`Metered`], which carries the record-in-progress. The
//! recorder itself lives as long as the gateway; a reload keeps it unless `usage.store` changed.

use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{header, Response};
use http_body::{Frame, SizeHint};
use http_body_util::BodyExt;
use memchr::memmem::Finder;
use onedoor_config::{Alias, BackendId, Price, Snapshot};
use onedoor_usage::{Destination, Recorder, Source, Tokens, UsageRecord};
use serde::Deserialize;
use tokio::time::Instant;

use crate::access_log::{self, Line};
use crate::body::{Body, BoxError};
use crate::metrics::Metrics;
use crate::runtime::Runtime;
use crate::telemetry::RequestSpan;
use crate::usage::{Usage, UsageReport, UsageSource};

/// The recorder for a snapshot's `usage` settings; off (and logged) when it cannot start.
pub fn start(snapshot: &Snapshot) -> Recorder {
    let started = Destination::of(&snapshot.usage).and_then(Recorder::start);
    started.unwrap_or_else(|error| {
        tracing::error!(%error, "usage recording is off: the usage store cannot be used");
        Recorder::off()
    })
}

/// The recorder a reloaded `snapshot` runs with: the running one unless `usage.store` (or its
/// journal) changed. A replaced recorder goes on taking the records of requests that started on
/// it, and is closed with its successor at shutdown.
pub fn carry_over(running: &Recorder, snapshot: &Snapshot) -> Recorder {
    let Ok(destination) = Destination::of(&snapshot.usage) else {
        return running.clone();
    };
    if running.writes_to(&destination) {
        return running.clone();
    }
    let next = match Recorder::start(destination) {
        Ok(next) => next,
        Err(error) => {
            tracing::error!(%error, "the new usage store cannot be used; records keep going to the old one");
            return running.clone();
        }
    };
    next.replaces(running);
    next
}

/// What the gateway estimated before sending: the prompt alone, and prompt plus completion
/// budget (what routing and limits reserve).
#[derive(Debug, Clone, Copy, Default)]
pub struct Estimate {
    pub prompt: u64,
    pub total: u64,
}

/// What the pipeline knows about a request once its response head is ready. Its names move into
/// the usage record.
pub struct Ended {
    pub request_id: String,
    pub arrived_ms: u64,
    pub started: Instant,
    pub tenant: std::sync::Arc<str>,
    pub key_id: std::sync::Arc<str>,
    pub alias: std::sync::Arc<str>,
    pub backend: Option<BackendId>,
    pub deployment: Option<std::sync::Arc<str>>,
    /// `x-onedoor-attempts`.
    pub attempts: String,
    /// The answer's `x-onedoor-error`, when it is one of the gateway's errors.
    pub error: Option<String>,
    pub estimate: Estimate,
    /// A whole answer's usage, when the upstream reported it.
    pub tokens: Option<Tokens>,
    /// The answer's usage as the gateway measured (or, lacking the upstream's, counted) it; a
    /// stream's is there once the stream has ended.
    pub usage: Option<UsageReport>,
    /// The request in its tenant's in-flight gauge, until its record is written.
    pub entered: Option<crate::metrics::Entered>,
    /// The request's span, when it is traced: it ends with the record.
    pub span: Option<Box<RequestSpan>>,
}

/// The usage record's tokens for a gateway [`Usage`].
pub fn tokens_of(usage: &Usage) -> Tokens {
    Tokens {
        input: usage.prompt_tokens,
        output: usage.completion_tokens,
        cached: usage.cached_tokens,
        cache_write: usage.cache_write_tokens,
        source: match usage.source {
            UsageSource::Measured => Source::Measured,
            UsageSource::Estimated => Source::Estimated,
        },
    }
}

/// Records the request now, or for a stream when its body ends; returns the response to send.
pub fn hand_off(runtime: &Runtime, mut ended: Ended, response: Response<Body>) -> Response<Body> {
    let recorder = &runtime.recorder;
    let stream = is_stream(&response);
    let mut pending = Pending::new(&runtime.snapshot, &mut ended, response.status().as_u16());
    pending.metrics = Some(runtime.metrics.clone());
    pending.entered = ended.entered.take();
    pending.span = ended.span.take();
    pending.error = ended.error.take();
    if !stream {
        let tokens = ended
            .tokens
            .unwrap_or_else(|| unmeasured(&ended, pending.status()));
        pending.deliver(recorder, tokens, None, false, None);
        return response;
    }
    pending.record.stream = true;
    let recorder = recorder.clone();
    let report = ended.usage;
    response.map(move |inner| {
        Metered {
            inner: Some(inner),
            pending: Some((pending, recorder)),
            seen: Seen::default(),
            report,
        }
        .boxed_unsync()
    })
}

fn is_stream(response: &Response<Body>) -> bool {
    response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The tokens of an answer without a usage block: the gateway's count of the prompt for an
/// answer, nothing for an error (no upstream produced tokens the caller received).
fn unmeasured(ended: &Ended, status: u16) -> Tokens {
    let answered = (200..300).contains(&status);
    Tokens {
        input: if answered { ended.estimate.prompt } else { 0 },
        output: 0,
        cached: 0,
        cache_write: 0,
        source: Source::Estimated,
    }
}

/// A record waiting for its tokens and timings, with the price of the target that answered.
struct Pending {
    record: UsageRecord,
    price: Option<Price>,
    started: Instant,
    estimate: Estimate,
    /// Where the finished record's tokens, cost and timings are counted.
    metrics: Option<std::sync::Arc<Metrics>>,
    /// The answer's `x-onedoor-error`, for the access log.
    error: Option<String>,
    /// Leaves the tenant's in-flight gauge when the record is delivered.
    entered: Option<crate::metrics::Entered>,
    /// Ends when the record is delivered.
    span: Option<Box<RequestSpan>>,
}

impl Pending {
    fn new(snapshot: &Snapshot, ended: &mut Ended, status: u16) -> Pending {
        let backend = ended.backend.and_then(|b| snapshot.backends.get(b));
        let price = match (ended.backend, ended.deployment.as_deref()) {
            (Some(backend), Some(deployment)) => alias_of(snapshot, &ended.alias)
                .and_then(|alias| onedoor_usage::price_of(alias, backend, deployment))
                .copied(),
            _ => None,
        };
        let record = UsageRecord {
            request_id: std::mem::take(&mut ended.request_id),
            at_ms: ended.arrived_ms,
            tenant: std::mem::take(&mut ended.tenant),
            key_id: std::mem::take(&mut ended.key_id),
            alias: std::mem::take(&mut ended.alias),
            backend: backend.map(|b| b.name.clone()),
            model: ended.deployment.take(),
            region: backend.map(|b| b.region.clone()),
            status,
            tokens: Tokens {
                input: 0,
                output: 0,
                cached: 0,
                cache_write: 0,
                source: Source::Estimated,
            },
            estimated_tokens: ended.estimate.total,
            cost_usd: 0.0,
            duration_ms: 0,
            ttft_ms: None,
            attempts: std::mem::take(&mut ended.attempts),
            stream: false,
            stream_cut: false,
            error: None,
            lines: None,
        };
        Pending {
            record,
            price,
            started: ended.started,
            estimate: ended.estimate,
            metrics: None,
            error: None,
            entered: None,
            span: None,
        }
    }

    fn status(&self) -> u16 {
        self.record.status
    }

    /// Finishes the record, counts it in the metrics and the access log, and records it.
    fn deliver(
        mut self,
        recorder: &Recorder,
        tokens: Tokens,
        ttft: Option<Instant>,
        cut: bool,
        why: Option<String>,
    ) {
        let metrics = self.metrics.clone();
        // A cut stream's answer said 200; what cut it is its error.
        let error = self.error.clone().or(why);
        let span = self.span.take();
        let mut record = self.finish(tokens, ttft, cut);
        record.error = error.clone();
        if let Some(metrics) = metrics {
            metrics.finished(&record);
        }
        if let Some(span) = span {
            span.end(&record, error.as_deref());
        }
        access_log::write(&Line::of(&record, error.as_deref()));
        recorder.record(record);
    }

    fn finish(mut self, tokens: Tokens, ttft: Option<Instant>, cut: bool) -> UsageRecord {
        let millis = |d: std::time::Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        self.record.tokens = tokens;
        self.record.cost_usd = onedoor_usage::cost_of(self.price.as_ref(), &tokens);
        self.record.duration_ms = millis(self.started.elapsed());
        self.record.ttft_ms = ttft.map(|at| millis(at.duration_since(self.started)));
        self.record.stream_cut = cut;
        self.record
    }
}

/// The alias a requested name resolved to (the `"*"` alias for names it discovered).
pub(crate) fn alias_of<'s>(snapshot: &'s Snapshot, name: &str) -> Option<&'s Alias> {
    match snapshot.alias_by_name.get(name) {
        Some(&index) => snapshot.aliases.get(index),
        None => snapshot.wildcard.as_ref(),
    }
}

/// The usage block of a whole answer: OpenAI Chat Completions and embeddings, the Responses
/// API, or Anthropic Messages. Only `usage` is decoded; the rest of the body is skipped.
pub fn measured(body: &[u8]) -> Option<Tokens> {
    serde_json::from_slice::<Probe>(body).ok()?.usage?.tokens()
}

#[derive(Deserialize)]
struct Probe {
    #[serde(default)]
    usage: Option<UsageBlock>,
}

/// The fields of every dialect's usage object that count tokens.
#[derive(Deserialize)]
struct UsageBlock {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    prompt_tokens_details: Option<Details>,
    input_tokens: Option<u64>,
    output_tokens: Option<u64>,
    input_tokens_details: Option<Details>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

impl UsageBlock {
    fn tokens(&self) -> Option<Tokens> {
        let cached = |details: &Option<Details>| details.as_ref().and_then(|d| d.cached_tokens);
        if let Some(prompt) = self.prompt_tokens {
            return Some(Tokens {
                input: prompt,
                output: self.completion_tokens.unwrap_or(0),
                cached: cached(&self.prompt_tokens_details).unwrap_or(0),
                cache_write: self.cache_creation_input_tokens.unwrap_or(0),
                source: Source::Measured,
            });
        }
        // Anthropic counts cache reads and writes apart from `input_tokens`; Responses does not.
        let input = self.input_tokens?;
        let read = self.cache_read_input_tokens;
        let write = self.cache_creation_input_tokens.unwrap_or(0);
        Some(Tokens {
            input: input + read.unwrap_or(0) + write,
            output: self.output_tokens.unwrap_or(0),
            cached: read
                .or_else(|| cached(&self.input_tokens_details))
                .unwrap_or(0),
            cache_write: write,
            source: Source::Measured,
        })
    }
}

/// What the caller's stream showed so far.
#[derive(Default)]
struct Seen {
    first_at: Option<Instant>,
    /// Events with content (a rough count of output tokens when no usage comes).
    events: u64,
    usage: Option<Tokens>,
    cut: bool,
    /// Why the stream was cut, as an error code: the one its error event carried, or the
    /// gateway's own word when it ended without one.
    why: Option<String>,
}

impl Seen {
    /// Takes in a frame of the caller's stream; its usage chunk is read only when
    /// `read_usage` (the relay tells its own otherwise).
    fn frame(&mut self, data: &[u8], read_usage: bool) {
        self.first_at.get_or_insert_with(Instant::now);
        let mut start = 0;
        loop {
            let end = memchr::memchr(b'\n', &data[start..]).map_or(data.len(), |at| start + at);
            self.line(&data[start..end], read_usage);
            if end == data.len() {
                return;
            }
            start = end + 1;
        }
    }

    fn line(&mut self, line: &[u8], read_usage: bool) {
        if line.starts_with(b"event: error") {
            self.cut = true;
        }
        if self.cut && self.why.is_none() {
            self.why = line
                .strip_prefix(b"data:")
                .and_then(|p| error_code(p.trim_ascii()));
        }
        let Some(rest) = line.strip_prefix(b"data:") else {
            return;
        };
        let payload = rest.trim_ascii();
        if payload.starts_with(b"{\"error\"") {
            self.cut = true;
            self.why = self.why.take().or_else(|| error_code(payload));
        } else if payload != b"[DONE]" {
            self.events += 1;
            if read_usage && self.usage.is_none() {
                self.usage = streamed_usage(payload);
            }
        }
    }
}

/// The usage an OpenAI usage chunk carries; only events with a `usage` object are parsed (with
/// `include_usage` every chunk names it, as `"usage":null`, until the last).
fn streamed_usage(payload: &[u8]) -> Option<Tokens> {
    if !has_usage_object(payload) {
        return None;
    }
    measured(payload)
}

/// Built once: building a searcher costs more than searching a short event with it.
static USAGE_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));

/// Whether `"usage"` is followed by `:` and an object somewhere in `payload`.
fn has_usage_object(payload: &[u8]) -> bool {
    USAGE_KEY.find_iter(payload).any(|at| {
        let mut after = payload[at + 7..]
            .iter()
            .filter(|b| !b.is_ascii_whitespace());
        after.next() == Some(&b':') && after.next() == Some(&b'{')
    })
}

/// A streamed answer's body that records its request when it ends: at its last frame, at an
/// error, or when dropped before either (the caller hung up).
struct Metered {
    inner: Option<Body>,
    pending: Option<(Pending, Recorder)>,
    seen: Seen,
    /// The relay's own account of the stream, read first when it is there.
    report: Option<UsageReport>,
}

impl Metered {
    fn finish(&mut self) {
        let Some((pending, recorder)) = self.pending.take() else {
            return;
        };
        let reported = self.report.as_ref().and_then(UsageReport::get);
        let tokens = reported
            .map(|u| tokens_of(&u))
            .or(self.seen.usage)
            .unwrap_or(Tokens {
                input: pending.estimate.prompt,
                output: self.seen.events,
                cached: 0,
                cache_write: 0,
                source: Source::Estimated,
            });
        let why = self.seen.why.take();
        pending.deliver(&recorder, tokens, self.seen.first_at, self.seen.cut, why);
    }
}

/// The code an error event's payload carries: OpenAI's `error.code` (else `error.type`),
/// Anthropic's `error.type`.
fn error_code(payload: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Event<'a> {
        #[serde(borrow)]
        error: Option<Error<'a>>,
    }
    #[derive(serde::Deserialize)]
    struct Error<'a> {
        #[serde(borrow)]
        code: Option<std::borrow::Cow<'a, str>>,
        #[serde(borrow, rename = "type")]
        kind: Option<std::borrow::Cow<'a, str>>,
    }
    let error = serde_json::from_slice::<Event>(payload).ok()?.error?;
    error.code.or(error.kind).map(|code| code.into_owned())
}

impl http_body::Body for Metered {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.seen.frame(data, this.report.is_none());
                }
                // The server may send this frame as the last without polling again: the record
                // goes first, so that an answer the caller received whole is always recorded.
                if this
                    .inner
                    .as_ref()
                    .is_some_and(http_body::Body::is_end_stream)
                {
                    this.finish();
                }
            }
            Poll::Ready(Some(Err(_))) => {
                this.seen.cut = true;
                this.seen
                    .why
                    .get_or_insert_with(|| "upstream_failed".to_owned());
                this.finish();
            }
            Poll::Ready(None) => this.finish(),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), http_body::Body::size_hint)
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        // The relay inside goes first: whatever it reports at its end is in by now.
        let unfinished = self
            .inner
            .take()
            .is_some_and(|b| !http_body::Body::is_end_stream(&b));
        if unfinished && self.pending.is_some() {
            // Dropped before its end: the caller went away, or its connection was cut.
            self.seen.cut = true;
            self.seen
                .why
                .get_or_insert_with(|| "client_closed".to_owned());
        }
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_chunks_with_a_usage_object_are_parsed() {
        assert!(!has_usage_object(br#"{"choices":[],"usage":null}"#));
        assert!(!has_usage_object(br#"{"content":"usage","usage" : null}"#));
        assert!(has_usage_object(
            br#"{"x":"usage","usage" : {"prompt_tokens":1}}"#
        ));
        let chunk = br#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#;
        assert_eq!(streamed_usage(chunk).map(|t| t.input), Some(3));
    }

    #[test]
    fn usage_blocks_of_every_dialect_are_read() {
        let openai = br#"{"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":4}}}"#;
        let tokens = measured(openai).unwrap();
        assert_eq!((tokens.input, tokens.output, tokens.cached), (12, 5, 4));
        assert_eq!(tokens.source, Source::Measured);
        let anthropic = br#"{"usage":{"input_tokens":10,"cache_read_input_tokens":100,"cache_creation_input_tokens":5,"output_tokens":7}}"#;
        let tokens = measured(anthropic).unwrap();
        assert_eq!((tokens.input, tokens.output, tokens.cached), (115, 7, 100));
        let responses = br#"{"usage":{"input_tokens":5,"input_tokens_details":{"cached_tokens":2},"output_tokens":3}}"#;
        let tokens = measured(responses).unwrap();
        assert_eq!((tokens.input, tokens.output, tokens.cached), (5, 3, 2));
        assert_eq!(measured(br#"{"choices":[]}"#), None);
    }

    #[test]
    fn a_cut_stream_is_told_by_the_code_its_error_event_carries() {
        let mut seen = Seen::default();
        seen.frame(b"data: {\"choices\":[]}\n\n", true);
        assert_eq!(seen.why, None);
        seen.frame(
            b"data: {\"error\":{\"message\":\"the request ran out of time\",\"code\":\"upstream_timeout\"}}\n\n",
            true,
        );
        assert!(seen.cut);
        assert_eq!(seen.why.as_deref(), Some("upstream_timeout"));
        let mut anthropic = Seen::default();
        anthropic.frame(
            b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"x\"}}\n\n",
            true,
        );
        assert_eq!(anthropic.why.as_deref(), Some("overloaded_error"));
    }

    #[test]
    fn a_stream_shows_its_usage_chunk_and_its_cut() {
        let mut seen = Seen::default();
        seen.frame(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n",
            true,
        );
        assert_eq!(seen.usage, None);
        seen.frame(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n", true);
        assert_eq!(seen.usage.map(|u| u.total()), Some(11));
        assert!(!seen.cut);
        seen.frame(b"data: {\"error\":{\"message\":\"cut\"}}\n\n", true);
        assert!(seen.cut);
        for frame in [
            &b"event: error\ndata: {\"type\":\"error\"}\n\n"[..],
            b"event: ping\ndata: {}\n\nevent: error\ndata: {}\n\n",
        ] {
            let mut seen = Seen::default();
            seen.frame(frame, true);
            assert!(seen.cut, "{}", String::from_utf8_lossy(frame));
        }
        let mut seen = Seen::default();
        seen.frame(b"event: ping\ndata: {\"text\":\"event: error\"}\n\n", true);
        assert!(!seen.cut);
        // With the relay telling the usage, the chunks are counted but not read for it.
        let mut seen = Seen::default();
        seen.frame(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9}}\n\ndata: {}",
            false,
        );
        assert_eq!((seen.usage, seen.events), (None, 2));
    }
}
