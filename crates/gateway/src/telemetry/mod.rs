//! OpenTelemetry traces over OTLP/HTTP (`telemetry.otlp`): one SERVER span per model call and one
//! CLIENT span per upstream attempt, with the GenAI semantic-convention attributes. Spans are
//! built once, when the request's usage record is final (a stream's when the stream ends), from
//! what the pipeline records anyway, and handed to the [`Telemetry`] exporter. Without
//! `telemetry.otlp` nothing here runs and no request carries a span. Prompts, completions and
//! keys are never attributes. A realtime session's span ends with the session, and a stream's
//! continuation after a cut ([`StreamTrace`]) has attempt spans of its own.

mod export;
mod stream;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use http::{HeaderMap, HeaderValue, Request, Uri};
use onedoor_config::{Backend, Provider, Snapshot};
use onedoor_usage::UsageRecord;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanLinks};
use serde::Deserialize;
use tokio::time::Instant;

use crate::failover::Trail;
use crate::outcome::{verdict, Verdict};
use crate::request::{ClientRequest, Operation};
use crate::router::Candidate;
use crate::runtime::Runtime;
use crate::surface::{self, Route};
use crate::upstream::Failure;

pub use export::{carry_over, start, SpanStats, Telemetry};
pub use stream::{Continued, StreamTrace};

use stream::Part;

/// The caller's trace, from a W3C `traceparent` header.
struct Parent {
    trace: TraceId,
    span: SpanId,
    sampled: bool,
}

impl Parent {
    /// `VERSION-TRACE-SPAN-FLAGS`; anything malformed (or all-zero ids) starts a new trace.
    fn of(headers: &HeaderMap) -> Option<Parent> {
        let value = headers.get("traceparent")?.to_str().ok()?.trim();
        let mut parts = value.split('-');
        let version = parts.next()?;
        let (trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?);
        let sizes = (version.len(), trace.len(), span.len(), flags.len()) == (2, 32, 16, 2);
        if !sizes || version == "ff" || (version == "00" && parts.next().is_some()) {
            return None;
        }
        let trace = TraceId::from_hex(trace).ok()?;
        let span = SpanId::from_hex(span).ok()?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        (trace != TraceId::INVALID && span != SpanId::INVALID).then_some(Parent {
            trace,
            span,
            sampled: flags & 1 == 1,
        })
    }
}

/// A sampled request's span in the making: its ids, and what the pipeline told it.
pub struct RequestSpan {
    telemetry: Arc<Telemetry>,
    snapshot: Arc<Snapshot>,
    trace: TraceId,
    id: SpanId,
    /// The caller's span, when the request came with a `traceparent`.
    parent: Option<SpanId>,
    started: Instant,
    /// `gen_ai.operation.name`, from the surface the request came to.
    operation: &'static str,
    method: http::Method,
    path: String,
    call: Option<CallFacts>,
    reply: Reply,
    attempts: Vec<Attempt>,
    /// A streamed answer's own account, once the stream is relayed.
    stream: Option<Arc<StreamTrace>>,
    /// How a realtime session ended.
    session: Option<SessionEnd>,
}

/// How a realtime session ended, for its span.
struct SessionEnd {
    /// The close code the client saw (1006: its connection ended without one).
    close_code: u16,
    /// `client`, `upstream`, `idle`, `max_session` or `shutdown`.
    ended_by: &'static str,
    /// `response.done` events.
    responses: u64,
}

/// What the client asked for, as far as spans tell it.
struct CallFacts {
    max_tokens: Option<u64>,
    temperature: Option<f64>,
}

/// What a whole answer says about itself.
#[derive(Default, Deserialize)]
struct Reply {
    id: Option<String>,
    model: Option<String>,
    #[serde(default)]
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    finish_reason: Option<String>,
}

/// Begins the span of a model call (not of health checks or the model list) when telemetry is on
/// and the trace is sampled (the caller's `traceparent` decides when it has one); the attempts of
/// such a request are then timed in `trail`. Costs one field read when telemetry is off.
pub fn begin<B>(
    runtime: &Runtime,
    request: &Request<B>,
    started: Instant,
    trail: &mut Trail,
) -> Option<Box<RequestSpan>> {
    let telemetry = runtime.telemetry.as_ref()?;
    let parent = Parent::of(request.headers());
    let trace = parent.as_ref().map_or_else(new_trace_id, |p| p.trace);
    let sampled = match &parent {
        Some(parent) => parent.sampled,
        None => telemetry.samples(trace),
    };
    if !sampled {
        return None;
    }
    let operation = match surface::route(request.method(), request.uri().path()) {
        Ok(Route::Call { operation, .. }) => operation_name(operation),
        Ok(Route::Realtime(_)) => "realtime",
        _ => return None,
    };
    trail.spans = Some(Attempts {
        list: Vec::new(),
        upstream: Arc::new(Traceparent {
            trace,
            sent: AtomicU64::new(0),
        }),
    });
    Some(Box::new(RequestSpan {
        telemetry: telemetry.clone(),
        snapshot: runtime.snapshot.clone(),
        trace,
        id: new_span_id(),
        parent: parent.map(|p| p.span),
        started,
        operation,
        method: request.method().clone(),
        path: request.uri().path().to_owned(),
        call: None,
        reply: Reply::default(),
        attempts: Vec::new(),
        stream: None,
        session: None,
    }))
}

/// `gen_ai.operation.name`: the Responses API is a chat too.
fn operation_name(operation: Operation) -> &'static str {
    match operation {
        Operation::Embeddings => "embeddings",
        Operation::ChatCompletions | Operation::Responses => "chat",
    }
}

fn new_trace_id() -> TraceId {
    TraceId::from(rand::random::<u128>().max(1))
}

fn new_span_id() -> SpanId {
    SpanId::from(rand::random::<u64>().max(1))
}

impl RequestSpan {
    /// The model call the request turned out to be.
    pub fn call(&mut self, request: &ClientRequest) {
        let temperature = request
            .field("temperature")
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<f64>().ok());
        self.call = Some(CallFacts {
            max_tokens: request.max_tokens,
            temperature,
        });
    }

    /// A whole answer (in the OpenAI shape): its id, model and finish reasons.
    pub fn answered(&mut self, body: &[u8]) {
        if let Ok(reply) = serde_json::from_slice::<Reply>(body) {
            self.reply = reply;
        }
    }

    /// The attempts the attempt loop timed.
    pub fn attempted(mut self: Box<Self>, attempts: Option<Attempts>) -> Box<Self> {
        self.attempts = attempts.map(|a| a.list).unwrap_or_default();
        self
    }

    /// The account the streamed answer's relay keeps for this span.
    pub fn streaming(&mut self) -> Arc<StreamTrace> {
        self.stream.get_or_insert_with(Default::default).clone()
    }

    /// A realtime session ended: the close code its client saw, what ended it, and how many
    /// responses it had.
    pub fn session_closed(&mut self, close_code: u16, ended_by: &'static str, responses: u64) {
        self.session = Some(SessionEnd {
            close_code,
            ended_by,
            responses,
        });
    }

    /// Ends the request span now, with its finished usage record, and queues it and its
    /// attempts' spans for export.
    pub fn end(mut self: Box<Self>, record: &UsageRecord, error: Option<&str>) {
        if let Some(stream) = self.stream.take() {
            self.take_stream(&stream);
        }
        let clock = Clock::now();
        let ending = Ending::of(&self, record, error);
        self.telemetry.push(self.request_span(&ending, &clock));
        // The answer is the last attempt's that did not fail: the attempt loop's winner, or
        // the continuation that took over a cut stream.
        let winner = self
            .attempts
            .iter()
            .rposition(|a| a.failure.is_none())
            .filter(|_| ending.answered);
        for (i, attempt) in self.attempts.iter().enumerate() {
            let winning = Some(i) == winner;
            self.telemetry
                .push(self.attempt_span(attempt, &ending, winning, &clock));
        }
    }

    /// What the stream told: the answer's id and finish reason, the continuations' attempts
    /// after the attempt loop's, and each part of the stream on the attempt that sent it.
    fn take_stream(&mut self, stream: &StreamTrace) {
        let told = stream.take();
        if told.id.is_some() {
            self.reply.id = told.id;
        }
        if let Some(reason) = told.finish_reason {
            self.reply.choices = vec![Choice {
                finish_reason: Some(reason),
            }];
        }
        self.attempts.extend(told.continuations);
        let mut parts = told.parts.into_iter();
        for attempt in self.attempts.iter_mut().filter(|a| a.failure.is_none()) {
            attempt.part = parts.next();
        }
    }

    fn request_span(&self, ending: &Ending<'_>, clock: &Clock) -> SpanData {
        let record = ending.record;
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", ending.operation),
            KeyValue::new("gen_ai.request.model", record.alias.clone()),
            KeyValue::new("http.request.method", self.method.as_str().to_owned()),
            KeyValue::new("url.path", self.path.clone()),
            KeyValue::new("http.response.status_code", i64::from(record.status)),
            KeyValue::new("onedoor.request_id", record.request_id.clone()),
            KeyValue::new("onedoor.tenant", record.tenant.clone()),
            KeyValue::new("onedoor.key_id", record.key_id.clone()),
            KeyValue::new("onedoor.alias", record.alias.clone()),
            KeyValue::new("onedoor.attempts", record.attempts.clone()),
            KeyValue::new("onedoor.stream", record.stream),
            KeyValue::new("onedoor.usage.source", record.tokens.source.as_str()),
            KeyValue::new("onedoor.cost_usd", record.cost_usd),
        ];
        attributes.extend(usage_of(record));
        if let Some(backend) = ending.backend {
            attributes.extend(backend_of(backend));
        }
        if ending.answered {
            attributes.extend(ending.reply.iter().cloned());
        }
        if let Some(call) = &self.call {
            if let Some(max_tokens) = call.max_tokens {
                let max_tokens = count(max_tokens);
                attributes.push(KeyValue::new("gen_ai.request.max_tokens", max_tokens));
            }
            if let Some(temperature) = call.temperature {
                attributes.push(KeyValue::new("gen_ai.request.temperature", temperature));
            }
        }
        if let Some(ttft) = record.ttft_ms {
            attributes.push(KeyValue::new("onedoor.ttft_ms", count(ttft)));
        }
        if record.stream_cut {
            attributes.push(KeyValue::new("onedoor.stream_cut", true));
        }
        if let Some(session) = &self.session {
            let code = i64::from(session.close_code);
            attributes.push(KeyValue::new("onedoor.realtime.close_code", code));
            attributes.push(KeyValue::new("onedoor.realtime.ended_by", session.ended_by));
            let responses = count(session.responses);
            attributes.push(KeyValue::new("onedoor.realtime.responses", responses));
        }
        // As for HTTP servers: a 4xx is the caller's error, not the gateway's.
        let status = match (&ending.error_type, record.status >= 500, record.stream_cut) {
            (_, _, true) => Status::error("the stream was cut"),
            (Some(kind), true, _) => Status::error(kind.clone()),
            _ => Status::Unset,
        };
        if let Some(kind) = &ending.error_type {
            attributes.push(KeyValue::new("error.type", kind.clone()));
        }
        let name = format!("{} {}", ending.operation, record.alias);
        let parent = self.parent.unwrap_or(SpanId::INVALID);
        let mut span = self.span(self.id, parent, SpanKind::Server, name, attributes);
        span.parent_span_is_remote = self.parent.is_some();
        span.start_time = clock.at(self.started);
        span.end_time = clock.wall;
        span.status = status;
        span
    }

    fn attempt_span(
        &self,
        attempt: &Attempt,
        ending: &Ending<'_>,
        winning: bool,
        clock: &Clock,
    ) -> SpanData {
        let record = ending.record;
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", ending.operation),
            KeyValue::new("gen_ai.request.model", attempt.deployment.clone()),
            KeyValue::new("onedoor.request_id", record.request_id.clone()),
        ];
        if let Some(backend) = self.snapshot.backends.get(attempt.backend) {
            attributes.extend(backend_of(backend));
            attributes.extend(server_of(backend));
        }
        let mut status = match &attempt.failure {
            Some(failed) => {
                if let Some(code) = failed.status {
                    attributes.push(KeyValue::new("http.response.status_code", i64::from(code)));
                }
                attributes.push(KeyValue::new("error.type", failed.label.clone()));
                Status::error(failed.reason.clone())
            }
            None => Status::Unset,
        };
        // Its answer reached the caller: the whole answer, or a part of the stream.
        let sent = winning || attempt.part.is_some();
        if sent {
            let code = i64::from(record.status);
            attributes.push(KeyValue::new("http.response.status_code", code));
            match &attempt.part {
                Some(part) => attributes.extend(tokens(
                    part.usage.prompt_tokens,
                    part.usage.completion_tokens,
                )),
                None => attributes.extend(usage_of(record)),
            }
        }
        if winning {
            attributes.extend(ending.reply.iter().cloned());
        }
        let cut = attempt.part.as_ref().and_then(|part| part.cut.as_ref());
        if let Some(cut) = cut {
            attributes.push(KeyValue::new("error.type", "stream_cut"));
            status = Status::error(cut.reason.clone());
        }
        let name = format!("{} {}", ending.operation, attempt.deployment);
        let mut span = self.span(attempt.id, self.id, SpanKind::Client, name, attributes);
        span.start_time = clock.at(attempt.began);
        // A streamed answer's attempt lasts as long as its part of the stream.
        span.end_time = match (cut, sent && record.stream) {
            (Some(cut), _) => clock.at(cut.at),
            (None, true) => clock.wall,
            (None, false) => clock.at(attempt.ended),
        };
        span.status = status;
        span
    }

    fn span(
        &self,
        id: SpanId,
        parent: SpanId,
        kind: SpanKind,
        name: String,
        attributes: Vec<KeyValue>,
    ) -> SpanData {
        let context = SpanContext::new(
            self.trace,
            id,
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        );
        SpanData {
            span_context: context,
            parent_span_id: parent,
            parent_span_is_remote: false,
            span_kind: kind,
            name: name.into(),
            start_time: SystemTime::UNIX_EPOCH,
            end_time: SystemTime::UNIX_EPOCH,
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: Status::Unset,
            instrumentation_scope: self.telemetry.scope.clone(),
        }
    }
}

/// A finished request, as its spans tell it.
struct Ending<'a> {
    record: &'a UsageRecord,
    operation: &'static str,
    /// The backend that answered.
    backend: Option<&'a Backend>,
    /// A successful answer from `backend`.
    answered: bool,
    /// `gen_ai.response.*` of the answer.
    reply: Vec<KeyValue>,
    /// The `x-onedoor-error` code, else the status, of an answer of 400 and up.
    error_type: Option<String>,
}

impl<'a> Ending<'a> {
    fn of(span: &'a RequestSpan, record: &'a UsageRecord, error: Option<&str>) -> Ending<'a> {
        let snapshot = &span.snapshot;
        let backend = record
            .backend
            .as_deref()
            .and_then(|name| snapshot.backend_by_name.get(name))
            .and_then(|&b| snapshot.backends.get(b));
        let error_type = error
            .map(str::to_owned)
            .or_else(|| (record.status >= 400).then(|| record.status.to_string()));
        Ending {
            record,
            operation: span.operation,
            backend,
            // A realtime session's answer is its 101.
            answered: backend.is_some()
                && ((200..300).contains(&record.status) || record.status == 101),
            reply: span.reply.attributes(record.model.as_deref()),
            error_type,
        }
    }
}

impl Reply {
    /// `gen_ai.response.*`; the model is the deployment's when the answer did not name one.
    fn attributes(&self, deployment: Option<&str>) -> Vec<KeyValue> {
        let mut attributes = Vec::new();
        if let Some(model) = self.model.as_deref().or(deployment) {
            attributes.push(KeyValue::new("gen_ai.response.model", model.to_owned()));
        }
        if let Some(id) = &self.id {
            attributes.push(KeyValue::new("gen_ai.response.id", id.clone()));
        }
        let reasons: Vec<StringValue> = self
            .choices
            .iter()
            .filter_map(|c| c.finish_reason.clone())
            .map(StringValue::from)
            .collect();
        if !reasons.is_empty() {
            let reasons = Value::Array(Array::String(reasons));
            attributes.push(KeyValue::new("gen_ai.response.finish_reasons", reasons));
        }
        attributes
    }
}

fn usage_of(record: &UsageRecord) -> [KeyValue; 2] {
    tokens(record.tokens.input, record.tokens.output)
}

fn tokens(input: u64, output: u64) -> [KeyValue; 2] {
    [
        KeyValue::new("gen_ai.usage.input_tokens", count(input)),
        KeyValue::new("gen_ai.usage.output_tokens", count(output)),
    ]
}

fn backend_of(backend: &Backend) -> [KeyValue; 3] {
    [
        KeyValue::new("gen_ai.provider.name", provider_name(backend.provider)),
        KeyValue::new("onedoor.backend", backend.name.clone()),
        KeyValue::new("onedoor.region", backend.region.clone()),
    ]
}

/// `gen_ai.provider.name` of a backend's provider.
fn provider_name(provider: Provider) -> &'static str {
    match provider {
        Provider::Azure => "azure.ai.openai",
        Provider::OpenAi => "openai",
        Provider::Anthropic => "anthropic",
    }
}

/// `server.address` and `server.port` of a backend.
fn server_of(backend: &Backend) -> Vec<KeyValue> {
    let Ok(uri) = backend.url.parse::<Uri>() else {
        return Vec::new();
    };
    let Some(host) = uri.host() else {
        return Vec::new();
    };
    let port = uri.port_u16().unwrap_or(match uri.scheme_str() {
        Some("http") => 80,
        _ => 443,
    });
    vec![
        KeyValue::new("server.address", host.to_owned()),
        KeyValue::new("server.port", i64::from(port)),
    ]
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// The wall clock and the monotonic clock read together, to place monotonic instants in time.
struct Clock {
    wall: SystemTime,
    now: Instant,
}

impl Clock {
    fn now() -> Clock {
        Clock {
            wall: SystemTime::now(),
            now: Instant::now(),
        }
    }

    fn at(&self, instant: Instant) -> SystemTime {
        let ago = self.now.saturating_duration_since(instant);
        self.wall.checked_sub(ago).unwrap_or(self.wall)
    }
}

/// The attempts of a traced request, as the attempt loop saw them, and the `traceparent` they
/// carry upstream.
#[derive(Debug)]
pub struct Attempts {
    list: Vec<Attempt>,
    upstream: Arc<Traceparent>,
}

impl Attempts {
    /// An attempt on `candidate` that began at `began` and has just ended.
    pub fn push(&mut self, candidate: &Candidate, began: Instant, failure: Option<&Failure>) {
        self.list.push(Attempt {
            id: self.upstream.take().unwrap_or_else(new_span_id),
            backend: candidate.backend,
            deployment: candidate.deployment.to_string(),
            began,
            ended: Instant::now(),
            failure: failure.map(Failed::of),
            part: None,
        });
    }

    /// What each attempt's upstream request is stamped with.
    pub fn traceparent(&self) -> Arc<Traceparent> {
        self.upstream.clone()
    }
}

/// The `traceparent` of a traced request's upstream requests: each attempt gets a span id of
/// its own, which its attempt span then takes, so a traced upstream joins the trace under it.
#[derive(Debug)]
pub struct Traceparent {
    trace: TraceId,
    /// The span id the last attempt sent (0: none since it was taken).
    sent: AtomicU64,
}

impl Traceparent {
    pub fn stamp(&self, headers: &mut HeaderMap) {
        let span = new_span_id();
        let value = format!("00-{}-{span}-01", self.trace);
        if let Ok(value) = HeaderValue::from_str(&value) {
            self.sent
                .store(u64::from_be_bytes(span.to_bytes()), Ordering::Relaxed);
            headers.insert("traceparent", value);
        }
    }

    fn take(&self) -> Option<SpanId> {
        let sent = self.sent.swap(0, Ordering::Relaxed);
        (sent != 0).then(|| SpanId::from(sent))
    }
}

/// One upstream attempt of a traced request.
#[derive(Debug)]
struct Attempt {
    /// Its span's id, the one its upstream request carried.
    id: SpanId,
    backend: usize,
    deployment: String,
    began: Instant,
    ended: Instant,
    failure: Option<Failed>,
    /// The part of the caller's stream it sent, when it streamed.
    part: Option<Part>,
}

#[derive(Debug)]
struct Failed {
    /// The outcome word of `x-onedoor-attempts` (`429`, `timeout`, `connect_error` ...).
    label: String,
    status: Option<u16>,
    /// Why, in a few words: `429 rate_limited`, `404 deployment_not_found`, `connect_error: ...`.
    reason: String,
}

impl Failed {
    fn of(failure: &Failure) -> Failed {
        let reason = match failure {
            Failure::Status { status, .. } => {
                let why = match verdict(failure) {
                    Verdict::Throttled(_) => "rate_limited",
                    Verdict::NotServed => "deployment_not_found",
                    Verdict::ContextTooLong => "context_length_exceeded",
                    Verdict::CredentialRejected => "credential_rejected",
                    Verdict::ClientError => "client_error",
                    Verdict::Transient
                    | Verdict::TimedOut
                    | Verdict::OutOfTime
                    | Verdict::AuthUnavailable => "upstream_error",
                };
                format!("{} {why}", status.as_u16())
            }
            Failure::ConnectError(detail) => format!("connect_error: {detail}"),
            Failure::Reset(detail) => format!("reset: {detail}"),
            Failure::ConnectTimeout => "connect_timeout".to_owned(),
            Failure::FirstTokenTimeout => "first_token_timeout".to_owned(),
            Failure::Timeout => "timeout".to_owned(),
            Failure::AuthUnavailable(_) => "auth_unavailable".to_owned(),
        };
        let status = match failure {
            Failure::Status { status, .. } => Some(status.as_u16()),
            _ => None,
        };
        Failed {
            label: failure.label().into_owned(),
            status,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(traceparent: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", traceparent.parse().unwrap());
        headers
    }

    #[test]
    fn a_traceparent_gives_the_callers_trace_span_and_sampling() {
        let parent = Parent::of(&headers(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ))
        .unwrap();
        assert_eq!(
            parent.trace,
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(parent.span, SpanId::from_hex("00f067aa0ba902b7").unwrap());
        assert!(parent.sampled);
        let unsampled = Parent::of(&headers(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
        ))
        .unwrap();
        assert!(!unsampled.sampled);
    }

    #[test]
    fn a_malformed_traceparent_starts_a_new_trace() {
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "not a traceparent",
        ] {
            assert!(Parent::of(&headers(bad)).is_none(), "{bad}");
        }
    }

    #[test]
    fn failures_say_why_in_a_few_words() {
        let throttled = Failure::Status {
            status: http::StatusCode::TOO_MANY_REQUESTS,
            headers: HeaderMap::new(),
            body: bytes::Bytes::new(),
        };
        let failed = Failed::of(&throttled);
        assert_eq!(
            (failed.label.as_str(), failed.status, failed.reason.as_str()),
            ("429", Some(429), "429 rate_limited")
        );
        let failed = Failed::of(&Failure::ConnectError("connection refused".into()));
        assert_eq!(failed.label, "connect_error");
        assert_eq!(failed.reason, "connect_error: connection refused");
        assert_eq!(failed.status, None);
    }
}
