//! One client request, start to end: surface, auth, policy, router, attempts, answer. Each step
//! is a plain function call on the request; every answer leaves with the `x-onedoor-*` headers.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Request, Response, StatusCode};
use onedoor_config::{Alias, Key, Snapshot, Tenant};
use tokio::time::Instant;

use crate::access_log::{self, Line};
use crate::activity::Answered;
use crate::admission::{self, RateHeaders};
use crate::affinity;
use crate::attempt::{Answer, Continuation, Dispatch};
use crate::auth::{self, Caller};
use crate::body::{full, Body, RequestBody};
use crate::errors::GatewayError;
use crate::failover::{Ending, Failover, Trail};
use crate::messages;
use crate::provider;
use crate::realtime;
use crate::recording::{self, Ended, Estimate};
use crate::redaction::{self, Redaction};
use crate::reload::Live;
use crate::request::{ClientRequest, Operation};
use crate::router::{Candidate, Plan};
use crate::runtime::Runtime;
use crate::session_token;
use crate::stamp::Stamp;
use crate::surface::{self, AliasSource, Dialect, Route};
use crate::telemetry::{self, Attempts, RequestSpan};
use crate::trace::{self, Decision};
use crate::upstream::Failure;
use crate::usage::{self, Usage, UsageReport};

/// What the gateway learned about one request while serving it.
#[derive(Default)]
struct Exchange {
    trail: Trail,
    backend: Option<usize>,
    tenant: Option<Arc<str>>,
    key_id: Option<Arc<str>>,
    alias: Option<Arc<str>>,
    /// The deployment or model name sent to `backend`.
    deployment: Option<Arc<str>>,
    estimate: Estimate,
    /// A whole answer's usage block.
    tokens: Option<onedoor_usage::Tokens>,
    /// The caller's own limits, once admission looked at them.
    limits: Option<RateHeaders>,
    /// The answer's usage, once it is complete (a stream's when the stream ends).
    usage: Option<UsageReport>,
    /// The request in its tenant's in-flight gauge.
    entered: Option<crate::metrics::Entered>,
    /// The request's span, when it is traced over OTLP.
    span: Option<Box<RequestSpan>>,
}

/// Serves one client request with the runtime `live` holds when it begins. Taking `live`, not
/// its runtime, keeps the making of this future to two moves, which cannot fail: the server
/// makes it in its box ([`crate::boxing`]).
pub async fn handle(live: Arc<Live>, request: Request<RequestBody>) -> Response<Body> {
    let runtime = live.current();
    let started = Instant::now();
    let arrived_ms = onedoor_usage::now_ms();
    let id = request_id(arrived_ms);
    let method = request.method().clone();
    // A clone of the head's bytes, not a copy of the path.
    let uri = request.uri().clone();
    let mut exchange = Exchange::default();
    exchange.span = telemetry::begin(&runtime, &request, started, &mut exchange.trail);
    let response = match serve(&runtime, request, &id, &mut exchange).await {
        Ok(response) => response,
        Err(error) => error.into_response_in(surface::dialect_of(uri.path())),
    };
    // `x-onedoor-attempts`, and the usage record's trail.
    let attempts = exchange.trail.header();
    let mut response = decorate(response, &id, &attempts, &exchange, &runtime);
    let answer_by = started + runtime.snapshot.routing.timeouts.total;
    response
        .extensions_mut()
        .insert(crate::server::AnswerBy(answer_by));
    // Read once for the metrics, the access log and the usage record.
    let error = error_code(&response).map(str::to_owned);
    observe(
        &runtime,
        &id,
        &mut exchange,
        &mut response,
        error.as_deref(),
        started,
    )
    .await;
    let entered = exchange.entered.take();
    let (tenant, key_id) = (exchange.tenant.take(), exchange.key_id.take());
    // Requests with a caller get their access-log line with their usage record, which takes
    // the names the exchange gathered.
    let unrecorded = key_id.is_none();
    if let (Some(tenant), Some(key_id)) = (tenant, key_id) {
        let ended = Ended {
            request_id: id,
            arrived_ms,
            started,
            tenant,
            key_id,
            alias: exchange.alias.take().unwrap_or_else(|| Arc::from("-")),
            backend: exchange.backend,
            deployment: exchange.deployment.take(),
            attempts,
            error,
            estimate: exchange.estimate,
            tokens: exchange.tokens,
            usage: exchange.usage.clone(),
            entered,
            span: exchange
                .span
                .take()
                .map(|span| span.attempted(exchange.trail.spans.take())),
        };
        return recording::hand_off(&runtime, ended, response);
    }
    if unrecorded && (response.status().is_client_error() || response.status().is_server_error()) {
        let status = response.status().as_u16();
        let mut line = Line::refused(&id, arrived_ms, status, error.as_deref());
        line.alias = exchange.alias.as_deref();
        line.duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
        access_log::write(&line);
        let path = uri.path();
        tracing::debug!(%method, %path, status, "refused before a caller was known");
    }
    response
}

fn error_code(response: &Response<Body>) -> Option<&str> {
    response
        .headers()
        .get(crate::errors::ERROR_HEADER)
        .and_then(|v| v.to_str().ok())
}

/// Counts the answered request in the metrics and keeps its decision trace, if it asked.
async fn observe(
    runtime: &Runtime,
    id: &str,
    exchange: &mut Exchange,
    response: &mut Response<Body>,
    code: Option<&str>,
    started: Instant,
) {
    let status = response.status().as_u16();
    let metrics = &runtime.metrics;
    metrics.answered(
        exchange.tenant.as_deref().unwrap_or("-"),
        exchange.alias.as_deref().unwrap_or("-"),
        status,
        code,
    );
    metrics.activity.answered(&Answered {
        status,
        code,
        tenant: exchange.tenant.as_deref(),
        alias: exchange.alias.as_deref(),
        backend: exchange
            .backend
            .and_then(|b| runtime.snapshot.backends.get(b))
            .map(|b| &*b.name),
        attempts: &exchange.trail.attempts,
    });
    metrics.attempted(&exchange.trail.attempts);
    metrics.overhead(started.elapsed(), exchange.trail.upstream);
    if let Some(decision) = exchange.trail.trace.take() {
        Box::pin(trace::keep(runtime, *decision, id, status)).await;
        if let Ok(value) = HeaderValue::from_str(id) {
            response.headers_mut().insert("x-onedoor-trace-id", value);
        }
    }
}

/// A unique id that sorts by time: 48 bits of Unix milliseconds (`arrived_ms`, the request's
/// arrival), then 80 random bits, as 32 hex digits. The usage store keys its records by it; ids
/// in arrival order keep those inserts cheap (random ones cost SQLite about four times as much).
fn request_id(arrived_ms: u64) -> String {
    let millis = u128::from(arrived_ms & ((1 << 48) - 1));
    let random = rand::random::<u128>() & ((1 << 80) - 1);
    let id = (millis << 80) | random;
    // Written digit by digit into place: `format!` costs ten times as much here.
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = [0u8; 32];
    for (i, digit) in text.iter_mut().enumerate() {
        *digit = DIGITS[((id >> (124 - 4 * i)) & 0xf) as usize];
    }
    String::from_utf8(text.to_vec()).unwrap_or_default()
}

async fn serve(
    runtime: &Arc<Runtime>,
    request: Request<RequestBody>,
    id: &str,
    exchange: &mut Exchange,
) -> Result<Response<Body>, GatewayError> {
    let snapshot = &runtime.snapshot;
    match surface::route(request.method(), request.uri().path())? {
        Route::Healthz => Ok(json(StatusCode::OK, r#"{"status":"ok"}"#)),
        // The rare routes' futures are boxed, so every request's future stays small.
        Route::Readyz => Ok(Box::pin(crate::readiness::answer(runtime)).await),
        Route::Models => {
            let caller = auth::identify(runtime, request.headers()).await?;
            Ok(models(snapshot, caller.tenant, &caller.key))
        }
        Route::Batch(resource, dialect) => {
            let mut served = crate::batch::Served::default();
            let answer = crate::batch::serve(runtime, request, resource, dialect, &mut served);
            let answer = Box::pin(answer).await;
            exchange.trail.attempts = served.trail.attempts;
            exchange.backend = served.backend;
            answer
        }
        Route::Realtime(path) => {
            let attempts = exchange.trail.spans.take();
            let opening = realtime::open(runtime, request, path, id, &mut exchange.span, attempts);
            let handshake = Box::pin(opening).await;
            exchange.trail = handshake.trail;
            exchange.backend = handshake.backend;
            exchange.alias = handshake.alias;
            if let Some((tenant, key_id)) = handshake.refused {
                exchange.tenant = Some(tenant);
                exchange.key_id = Some(key_id);
            }
            handshake.response
        }
        Route::Call {
            operation,
            dialect,
            alias,
        } => {
            let caller = auth::identify(runtime, request.headers()).await?;
            exchange.tenant = Some(caller.tenant.name.clone());
            exchange.key_id = Some(caller.key.id.clone());
            exchange.entered = Some(runtime.metrics.enter(&caller.tenant.name));
            if trace::asked(request.headers(), &caller.key) {
                exchange.trail.trace = Some(Box::new(Decision::new(Instant::now())));
            }
            let session = session_token::presented(request.headers());
            let beta = match dialect {
                Dialect::Anthropic => request.headers().get(provider::ANTHROPIC_BETA).cloned(),
                Dialect::OpenAi | Dialect::Azure => None,
            };
            let body = read_body(request, snapshot.max_request_body)?;
            let mut call = Call::new(runtime, caller, operation, dialect, alias, body, beta)?;
            call.session = session;
            call.run(runtime, exchange).await
        }
    }
}

fn json(status: StatusCode, body: &'static str) -> Response<Body> {
    let mut response = Response::new(full(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// `GET /v1/models`: the aliases this key may use.
fn models(snapshot: &Snapshot, tenant: &Tenant, key: &Key) -> Response<Body> {
    let data: Vec<serde_json::Value> = snapshot
        .aliases
        .iter()
        .filter(|alias| tenant.may_use(&alias.name) && key.may_use(&alias.name))
        .map(|alias| serde_json::json!({"id": alias.name, "object": "model", "created": 0, "owned_by": "onedoor"}))
        .collect();
    let body = serde_json::json!({"object": "list", "data": data});
    let mut response = Response::new(full(body.to_string()));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

/// The body the server read, within `limit`.
fn read_body(request: Request<RequestBody>, limit: u64) -> Result<Bytes, GatewayError> {
    match request.into_body() {
        RequestBody::Whole(bytes) if bytes.len() as u64 <= limit => Ok(bytes),
        RequestBody::Whole(_) | RequestBody::TooLarge => {
            Err(GatewayError::RequestTooLarge { limit })
        }
    }
}

/// One model call on its way through the router.
struct Call<'a> {
    dispatch: Dispatch,
    caller: Caller<'a>,
    name: Arc<str>,
    request: ClientRequest,
    /// The session token the request carries (`session_affinity` aliases).
    session: Option<String>,
}

impl<'a> Call<'a> {
    fn new(
        runtime: &Arc<Runtime>,
        caller: Caller<'a>,
        operation: Operation,
        dialect: Dialect,
        alias: AliasSource,
        body: Bytes,
        beta: Option<HeaderValue>,
    ) -> Result<Self, GatewayError> {
        let request = match dialect {
            Dialect::Anthropic => messages::request(body, beta)?,
            Dialect::OpenAi | Dialect::Azure => ClientRequest::parse(body, operation)?,
        };
        let name = match alias {
            AliasSource::Path(name) => Arc::from(name),
            AliasSource::Body => request.model.clone().ok_or_else(|| {
                GatewayError::InvalidRequest("missing required field `model`".into())
            })?,
        };
        let dispatch = Dispatch {
            runtime: runtime.clone(),
            operation,
            dialect,
            continues_cut_streams: false,
            traceparent: None,
        };
        Ok(Call {
            dispatch,
            caller,
            name,
            request,
            session: None,
        })
    }

    /// Runs the call on `runtime`, its dispatch's own, borrowed rather than cloned: a clone is
    /// two atomic operations on a count both lanes share.
    async fn run(
        &mut self,
        runtime: &Runtime,
        exchange: &mut Exchange,
    ) -> Result<Response<Body>, GatewayError> {
        let snapshot = &runtime.snapshot;
        exchange.alias = Some(self.name.clone());
        let resolved = resolve(snapshot, &self.name, self.caller.tenant, &self.caller.key);
        if let Some(trace) = exchange.trail.trace.as_mut() {
            trace.set("alias", match &resolved {
                Ok((alias, index)) => serde_json::json!({"requested": self.name, "resolved": alias.name, "wildcard": index.is_none()}),
                Err(error) => serde_json::json!({"requested": self.name, "refused": error.to_string()}),
            });
        }
        let (alias, alias_index) = resolved?;
        let operation = self.dispatch.operation;
        if let Some(span) = exchange.span.as_mut() {
            span.call(&self.request);
            self.dispatch.traceparent = exchange.trail.spans.as_ref().map(Attempts::traceparent);
        }
        let request = admission::Request {
            snapshot,
            store: &runtime.state,
            tenant: self.caller.tenant,
            key: &self.caller.key,
            alias,
            requested: &self.name,
            body: &self.request,
            operation,
        };
        let (admitted, plan) = admission::admit_and_plan(request, runtime).await;
        if let Some(trace) = exchange.trail.trace.as_mut() {
            let (limits, refused) = match &admitted {
                Ok(admission) => (&admission.headers, None),
                Err((error, limits)) => (limits, Some(error.code())),
            };
            trace.set("limits", serde_json::json!({
                "tenant": self.caller.tenant.name,
                "requests_per_minute": limits.requests.map(|(limit, remaining)| serde_json::json!({"limit": limit, "remaining": remaining})),
                "tokens_per_minute": limits.tokens.map(|(limit, remaining)| serde_json::json!({"limit": limit, "remaining": remaining})),
                "refused": refused,
            }));
        }
        let mut admission = admitted.map_err(|(error, limits)| {
            exchange.limits = Some(limits);
            error
        })?;
        exchange.limits = Some(admission.headers);
        let mut plan = plan.map_err(|_| GatewayError::StateUnavailable)?;
        keep_native_targets(snapshot, &mut plan, &self.request);
        if let Some(previous) = self.request.previous_response_id.as_deref() {
            follow(runtime, &mut plan, previous).await?;
        }
        let session = session_token::follow(
            runtime,
            alias,
            self.caller.tenant,
            self.session.as_deref(),
            &mut plan,
        )
        .await?;
        self.dispatch.continues_cut_streams = alias.continue_cut_streams
            && self.request.stream
            && operation == Operation::ChatCompletions;
        let fallbacks: Vec<Candidate> = match self.dispatch.continues_cut_streams {
            true => plan.candidates.clone(),
            false => Vec::new(),
        };
        let deadline = Instant::now() + snapshot.routing.timeouts.total;
        // The gateway's own prompt count is read only where no usage may come with the answer
        // (a stream) or a trace shows it: a whole answer carries its usage, measured or counted.
        let wants_prompt = self.request.stream || exchange.trail.trace.is_some();
        let (prompt, tokens) = match admission.estimate {
            Some(counted) => (counted.prompt, counted.prompt + counted.completion),
            None => (
                match wants_prompt {
                    true => self.request.prompt_estimate(),
                    false => 0,
                },
                self.request.estimated_tokens(operation),
            ),
        };
        exchange.estimate = Estimate {
            prompt,
            total: tokens,
        };
        if let Some(trace) = exchange.trail.trace.as_mut() {
            trace.plan(runtime, &plan);
            trace.set(
                "tokens_estimated",
                serde_json::json!({"prompt": prompt, "total": tokens}),
            );
        }
        // Borrowed by its run, not moved into it: the run's future does not carry it twice.
        let mut failover = Failover::new(runtime, &self.name, alias_index, plan, deadline, tokens);
        let (dispatch, request) = (&self.dispatch, &self.request);
        // Each attempt's future is boxed, where it is made: the request's futures above it stay
        // kilobytes smaller, and each of them is copied as the request goes down.
        let outcome = failover
            .run(&mut exchange.trail, |candidate| {
                let attempt = |candidate| dispatch.attempt(request, candidate, deadline, None);
                crate::boxing::in_place(attempt, candidate)
            })
            .await;
        // Its breaker probes, if it took any, are let go as soon as the attempts end.
        drop(failover);
        let dialect = self.dispatch.dialect;
        let answered = match outcome {
            Ok((candidate, Answer::Stream(relay))) => {
                let native = relay.passes_through();
                exchange.backend = Some(candidate.backend);
                exchange.deployment = Some(candidate.deployment.clone());
                let trace = exchange.span.as_mut().map(|span| span.streaming());
                let answering = match self.dispatch.continues_cut_streams {
                    true => relay.continued_by(Box::new(Continuation {
                        dispatch: self.dispatch.clone(),
                        request: self.request.clone(),
                        fallbacks: fallbacks
                            .into_iter()
                            .filter(|c| !c.same_target(&candidate))
                            .collect(),
                        deadline,
                        trace: trace.clone(),
                    })),
                    false => relay.answering(),
                };
                let (sink, report) = usage::channel();
                exchange.usage = Some(report.clone());
                let measured = snapshot
                    .backends
                    .get(candidate.backend)
                    .is_some_and(provider::reports_stream_usage);
                let price = admission::price_of(alias, &candidate).cloned();
                let body = answering.reporting(sink).tracing(trace).into_body();
                let body = admission.hold_until_reported(body, report, price);
                Ok(stream_response(body, dialect, measured, native))
            }
            Ok((
                candidate,
                Answer::Whole {
                    status,
                    content_type,
                    body,
                    usage,
                    native,
                },
            )) => {
                exchange.backend = Some(candidate.backend);
                exchange.deployment = Some(candidate.deployment.clone());
                exchange.usage = Some(usage::reported(usage));
                exchange.tokens = Some(recording::tokens_of(&usage));
                if let Some(span) = exchange.span.as_mut() {
                    span.answered(&body);
                }
                if let Some(trace) = exchange.trail.trace.as_mut() {
                    trace.set(
                        "tokens_measured",
                        serde_json::json!({
                            "input": usage.prompt_tokens, "output": usage.completion_tokens,
                            "cached": usage.cached_tokens, "source": usage.source.as_str(),
                        }),
                    );
                }
                match usage.source {
                    usage::UsageSource::Measured => admission.reconcile(
                        usage.prompt_tokens,
                        usage.completion_tokens,
                        admission::price_of(alias, &candidate),
                    ),
                    usage::UsageSource::Estimated => admission.keep_estimate(),
                }
                let response = respond(status, content_type, body, &usage, dialect, native);
                Ok(response.map(|body| admission.hold(body)))
            }
            Err(Ending::Error(error)) => Err(error),
            Err(Ending::Upstream { backend, failure }) => {
                exchange.backend = Some(backend);
                let redaction = runtime.redaction(backend).map(|r| &**r);
                Ok(passthrough(failure, dialect, redaction))
            }
        };
        session.stamp(runtime, exchange.backend, answered).await
    }
}

/// A request that only its own dialect can say (an Anthropic body with blocks chat requests
/// have no form for) goes to the targets that speak that dialect, when the alias has any;
/// otherwise the first target refuses it, saying what it cannot take.
fn keep_native_targets(snapshot: &Snapshot, plan: &mut Plan, request: &ClientRequest) {
    let untranslatable = request.native.as_ref().map(|n| n.untranslatable.is_some());
    if untranslatable != Some(true) {
        return;
    }
    let speaks = |candidate: &Candidate| {
        let backend = snapshot.backends.get(candidate.backend);
        backend.is_some_and(|b| provider::passes_through(b, request))
    };
    if plan.candidates.iter().any(speaks) {
        plan.candidates.retain(speaks);
    }
}

/// A follow-up of a stored response (`previous_response_id`) goes to the backend that holds
/// it, and only there.
async fn follow(runtime: &Runtime, plan: &mut Plan, previous: &str) -> Result<(), GatewayError> {
    let holder = affinity::holder(&runtime.state, previous)
        .await
        .map_err(|_| GatewayError::StateUnavailable)?;
    let Some(holder) = holder else {
        return Ok(());
    };
    let Some(&backend) = runtime.snapshot.backend_by_name.get(&holder) else {
        return Ok(());
    };
    match affinity::restrict(plan, backend) {
        true => Ok(()),
        false => Err(GatewayError::NoBackendAvailable(format!(
            "the response `{previous}` is held by the backend `{holder}`, which cannot take this request now"
        ))),
    }
}

/// The alias a name means for this tenant: a configured alias, or the `"*"` discovery alias.
pub(crate) fn resolve<'s>(
    snapshot: &'s Snapshot,
    name: &str,
    tenant: &Tenant,
    key: &Key,
) -> Result<(&'s Alias, Option<usize>), GatewayError> {
    let may_use = |name: &str| tenant.may_use(name) && key.may_use(name);
    if let Some(&index) = snapshot.alias_by_name.get(name) {
        if !may_use(name) {
            return Err(GatewayError::ModelNotAllowed(name.to_owned()));
        }
        let alias = snapshot
            .aliases
            .get(index)
            .ok_or_else(|| GatewayError::ModelNotFound(name.to_owned()))?;
        return Ok((alias, Some(index)));
    }
    match &snapshot.wildcard {
        Some(wildcard) if may_use("*") => Ok((wildcard, None)),
        _ => Err(GatewayError::ModelNotFound(name.to_owned())),
    }
}

/// A whole answer in the caller's dialect (`native`: it is in it already), with how its usage
/// is known.
fn respond(
    status: StatusCode,
    content_type: Option<HeaderValue>,
    body: Bytes,
    usage: &Usage,
    dialect: Dialect,
    native: bool,
) -> Response<Body> {
    let (body, content_type) = match dialect {
        Dialect::Anthropic if !native => (
            messages::whole(&body, usage),
            Some(HeaderValue::from_static("application/json")),
        ),
        Dialect::Anthropic | Dialect::OpenAi | Dialect::Azure => (body, content_type),
    };
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    if let Some(content_type) = content_type {
        headers.insert(header::CONTENT_TYPE, content_type);
    }
    headers.insert(USAGE, HeaderValue::from_static(usage.source.as_str()));
    response
}

/// `x-onedoor-usage`: whether the answer's usage was measured or estimated.
const USAGE: HeaderName = HeaderName::from_static("x-onedoor-usage");
/// `x-accel-buffering: no` asks a proxy in front of the gateway not to hold a stream's events.
const ACCEL_BUFFERING: HeaderName = HeaderName::from_static("x-accel-buffering");

/// The response head of an SSE stream to the caller. Its usage is known only when it ends (a
/// final SSE comment tells it): `x-onedoor-usage: measured` is sent up front only when the
/// upstream's provider reports usage in every complete stream. A stream in the caller's dialect
/// already (`native`) goes out as it came; an Anthropic caller's other streams are re-encoded.
fn stream_response(body: Body, dialect: Dialect, measured: bool, native: bool) -> Response<Body> {
    let body = match dialect {
        Dialect::Anthropic if !native => messages::encode_body(body),
        Dialect::Anthropic | Dialect::OpenAi | Dialect::Azure => body,
    };
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    if measured {
        headers.insert(USAGE, HeaderValue::from_static("measured"));
    }
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert(ACCEL_BUFFERING, HeaderValue::from_static("no"));
    response
}

/// An upstream's own client error, as it came (status, content type and body); for an
/// Anthropic caller in Anthropic's error shape, its message kept. Its body and content type are
/// scrubbed of the backend's credential (`redaction`) as they leave: some providers quote the
/// key they were sent in the error message.
pub(crate) fn passthrough(
    failure: Failure,
    dialect: Dialect,
    redaction: Option<&Redaction>,
) -> Response<Body> {
    let Failure::Status {
        status,
        mut headers,
        body,
    } = failure
    else {
        return GatewayError::UpstreamFailed("the request".into()).into_response_in(dialect);
    };
    let body = match dialect {
        Dialect::Anthropic => {
            headers.remove(header::CONTENT_TYPE);
            messages::upstream_error(status, &body)
        }
        Dialect::OpenAi | Dialect::Azure => body,
    };
    let mut response = Response::new(full(redaction::scrub(redaction, body)));
    *response.status_mut() = status;
    let content_type = match headers.remove(header::CONTENT_TYPE) {
        Some(value) => redaction::scrub_header(redaction, value),
        None => HeaderValue::from_static("application/json"),
    };
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, content_type);
    response
}

fn decorate(
    mut response: Response<Body>,
    id: &str,
    attempts: &str,
    exchange: &Exchange,
    runtime: &Runtime,
) -> Response<Body> {
    const REQUEST_ID: HeaderName = HeaderName::from_static("x-onedoor-request-id");
    const ATTEMPTS: HeaderName = HeaderName::from_static("x-onedoor-attempts");
    const BACKEND: HeaderName = HeaderName::from_static("x-onedoor-backend");
    const REGION: HeaderName = HeaderName::from_static("x-onedoor-region");
    let mut stamp = Stamp::with_capacity(STAMP_BYTES + attempts.len());
    stamp.add(&REQUEST_ID, id.as_bytes());
    stamp.add(&ATTEMPTS, attempts.as_bytes());
    let answered_by = exchange.backend.and_then(|b| runtime.answered_by.get(b));
    for (name, value) in [BACKEND, REGION]
        .into_iter()
        .zip(answered_by.into_iter().flatten())
    {
        if let Some(value) = value {
            stamp.add_value(&name, value);
        }
    }
    if let Some(limits) = &exchange.limits {
        limits.stamp(&mut stamp);
    }
    stamp.put(&mut response);
    response
}

/// Room in a stamp for the values of everything but the attempts: the request id, a backend's
/// name and region, and four rate-limit numbers.
const STAMP_BYTES: usize = 160;

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::request_id;

    #[test]
    fn a_request_id_is_32_hex_digits_that_start_with_the_time() {
        let now = onedoor_usage::now_ms();
        let id = request_id(now);
        assert_eq!(id.len(), 32);
        assert!(id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
        let millis = u64::from_str_radix(&id[..12], 16).unwrap();
        assert_eq!(millis, now & ((1 << 48) - 1), "{id}");
        assert_ne!(request_id(now)[12..], id[12..]);
    }
}
