//! Realtime over WebSocket (contract section 3; wire reference section 5): the path that cannot
//! fail over once it has started. At the handshake the gateway authenticates (a header, or the
//! browser's key subprotocol), applies the tenant's policy (models, regions, `max_sessions`),
//! routes with the HTTP rules (`router::plan`, then the failover loop, which may move to another
//! backend only while no upstream has accepted the handshake), and opens the upstream socket
//! before it answers the client's 101, so a refusal is still a proper HTTP answer. From then on
//! the session is pinned: [`session`] pumps frames both ways until one side closes, and records
//! one usage record (and, when traced, one request span) for the whole session from its
//! `response.done` events.

mod ask;
mod close;
mod limit;
mod quota;
mod session;
mod upstream;

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use onedoor_config::{BackendId, Provider};
use onedoor_usage::{Source, Tokens, UsageRecord};
use tokio::time::Instant;

use crate::auth;
use crate::body::{full, Body, RequestBody};
use crate::errors::GatewayError;
use crate::failover::{Ending, Failover, Trail};
use crate::pipeline;
use crate::request::Operation;
use crate::router::{self, Excluded, Plan};
use crate::runtime::Runtime;
use crate::server::OnUpgrade;
use crate::surface::RealtimePath;
use crate::telemetry::{Attempts, RequestSpan};

use ask::Ask;
use quota::Quota;
use session::Session;
pub use session::Sessions;

/// What a handshake tells the request pipeline, for the answer's headers and its log line.
pub struct Handshake {
    pub response: Result<Response<Body>, GatewayError>,
    pub trail: Trail,
    pub backend: Option<BackendId>,
    pub alias: Option<Arc<str>>,
    /// (tenant, key id) of a handshake refused once the caller was known: the pipeline records
    /// it like any refused request. An accepted session records itself when it ends.
    pub refused: Option<(Arc<str>, Arc<str>)>,
}

/// What the handshake learned on its way, whatever its outcome.
#[derive(Default)]
struct Seen {
    trail: Trail,
    backend: Option<BackendId>,
    alias: Option<Arc<str>>,
    caller: Option<(Arc<str>, Arc<str>)>,
}

/// Answers a realtime handshake: 101 with the session running, or the refusal. A traced
/// handshake's `span` and its upstream `attempts` go with the session it opens, which ends the
/// span; a refusal leaves the span to the pipeline, with the attempts in its trail.
pub async fn open(
    runtime: &Arc<Runtime>,
    request: Request<RequestBody>,
    path: RealtimePath,
    request_id: &str,
    span: &mut Option<Box<RequestSpan>>,
    attempts: Option<Attempts>,
) -> Handshake {
    let mut seen = Seen::default();
    seen.trail.spans = attempts;
    let response = accept(runtime, request, path, request_id, &mut seen, span).await;
    let switched = matches!(&response, Ok(r) if r.status() == StatusCode::SWITCHING_PROTOCOLS);
    Handshake {
        response,
        trail: seen.trail,
        backend: seen.backend,
        alias: seen.alias,
        refused: seen.caller.filter(|_| !switched),
    }
}

async fn accept(
    runtime: &Arc<Runtime>,
    mut request: Request<RequestBody>,
    path: RealtimePath,
    request_id: &str,
    seen: &mut Seen,
    span: &mut Option<Box<RequestSpan>>,
) -> Result<Response<Body>, GatewayError> {
    let started = Instant::now();
    let arrived_ms = onedoor_usage::now_ms();
    let snapshot = &runtime.snapshot;
    let ask = Ask::read(path, request.uri().query().unwrap_or(""), request.headers())?;
    let caller = match (auth::presented_key(request.headers()), &ask.subprotocol_key) {
        (None, Some(key)) => auth::caller_of(runtime, key)?,
        _ => auth::identify(runtime, request.headers()).await?,
    };
    seen.caller = Some((caller.tenant.name.clone(), caller.key.id.clone()));
    // One copy of the name, for the handshake's record and the session's usage record.
    let alias_name: Arc<str> = Arc::from(ask.alias.as_str());
    seen.alias = Some(alias_name.clone());
    let (alias, alias_index) = pipeline::resolve(snapshot, &ask.alias, caller.tenant, &caller.key)?;
    let entered = runtime.sessions.enter().ok_or_else(|| {
        GatewayError::NoBackendAvailable(
            "onedoor is shutting down and opens no new realtime sessions; connect again shortly"
                .into(),
        )
    })?;
    let quota = Quota::check(&runtime.state, caller.tenant, &caller.key).await?;
    let slot = limit::admit(snapshot, &runtime.state, caller.tenant, &caller.key).await?;
    let mut plan = router::plan(
        runtime,
        alias,
        &ask.alias,
        caller.tenant,
        Operation::ChatCompletions,
    )
    .await
    .map_err(|_| GatewayError::StateUnavailable)?;
    keep_realtime_capable(runtime, &mut plan);
    let client = OnUpgrade::take(&mut request);
    let deadline = Instant::now() + snapshot.routing.timeouts.total;
    let mut failover = Failover::new(runtime, &ask.alias, alias_index, plan, deadline, 0);
    let asked = &ask;
    let traceparent = seen.trail.spans.as_ref().map(Attempts::traceparent);
    let traceparent = traceparent.as_deref();
    let outcome = failover
        .run(&mut seen.trail, |candidate| async move {
            upstream::connect(runtime, &candidate, asked, deadline, traceparent).await
        })
        .await;
    drop(failover);
    let (candidate, upstream) = match outcome {
        Ok(found) => found,
        Err(Ending::Error(error)) => return Err(error),
        Err(Ending::Upstream { backend, failure }) => {
            seen.backend = Some(backend);
            // An upstream's own refusal of the handshake (a 4xx that is the caller's to see), as it came.
            return Ok(crate::pipeline::passthrough(
                failure,
                crate::surface::Dialect::OpenAi,
                runtime.redaction(backend).map(|r| &**r),
            ));
        }
    };
    seen.backend = Some(candidate.backend);
    let backend = snapshot
        .backends
        .get(candidate.backend)
        .ok_or_else(|| GatewayError::UpstreamFailed(ask.alias.clone()))?;
    let record = UsageRecord {
        request_id: request_id.to_owned(),
        at_ms: arrived_ms,
        tenant: caller.tenant.name.clone(),
        key_id: caller.key.id.clone(),
        alias: alias_name,
        backend: Some(backend.name.clone()),
        model: Some(candidate.deployment.clone()),
        region: Some(backend.region.clone()),
        status: StatusCode::SWITCHING_PROTOCOLS.as_u16(),
        tokens: Tokens {
            input: 0,
            output: 0,
            cached: 0,
            cache_write: 0,
            source: Source::Estimated,
        },
        estimated_tokens: 0,
        cost_usd: 0.0,
        duration_ms: 0,
        ttft_ms: None,
        attempts: seen.trail.header(),
        stream: true,
        stream_cut: false,
        error: None,
        lines: None,
    };
    tracing::info!(
        request_id,
        tenant = %caller.tenant.name,
        alias = %ask.alias,
        backend = %backend.name,
        attempts = %record.attempts,
        "realtime session opened"
    );
    let price = onedoor_usage::price_of(alias, candidate.backend, &candidate.deployment).copied();
    let session = Session {
        runtime: runtime.clone(),
        upstream,
        client,
        entered,
        slot,
        quota: quota.priced(price),
        price,
        record,
        started,
        span: span
            .take()
            .map(|span| span.attempted(seen.trail.spans.take())),
    };
    // The session ends by itself: either side closing, its idle or maximum time, or the
    // gateway's shutdown (`Sessions::close_all`).
    tokio::spawn(session.run());
    Ok(switching(&ask))
}

/// Anthropic has no realtime API: its targets are left out as unsupported.
fn keep_realtime_capable(runtime: &Runtime, plan: &mut Plan) {
    let serves = |backend: BackendId| {
        runtime
            .snapshot
            .backends
            .get(backend)
            .is_some_and(|b| b.provider != Provider::Anthropic)
    };
    let (kept, left): (Vec<_>, Vec<_>) = plan.candidates.drain(..).partition(|c| serves(c.backend));
    plan.candidates = kept;
    plan.excluded
        .extend(left.into_iter().map(|c| (c, Excluded::Unsupported)));
}

/// The client's 101: the accept key, and `realtime` when the client offered it.
fn switching(ask: &Ask) -> Response<Body> {
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    headers.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    if let Ok(accept) = HeaderValue::from_str(&ask.accept_key()) {
        headers.insert(header::SEC_WEBSOCKET_ACCEPT, accept);
    }
    if ask.offers_realtime {
        headers.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static(ask::REALTIME),
        );
    }
    response
}
