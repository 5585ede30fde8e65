//! One client request, start to end: surface, auth, policy, router, attempts, answer. Each step
//! is a plain function call on the request; every answer leaves with the `x-onedoor-*` headers.

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use hyper::body::Incoming;
use onedoor_config::{Alias, Snapshot, Tenant};
use tokio::time::Instant;

use crate::attempt::{measured_tokens, Answer, Continuation, Dispatch};
use crate::auth::{self, Caller};
use crate::body::{full, Body};
use crate::errors::GatewayError;
use crate::failover::{Ending, Failover, Trail};
use crate::request::{ClientRequest, Operation};
use crate::router::{self, Candidate};
use crate::runtime::Runtime;
use crate::surface::{self, AliasSource, Dialect, Route};
use crate::upstream::Failure;

/// What the gateway learned about one request while serving it.
#[derive(Default)]
struct Exchange {
    trail: Trail,
    backend: Option<usize>,
    tenant: Option<String>,
    key_id: Option<String>,
    alias: Option<String>,
}

pub async fn handle(runtime: Arc<Runtime>, request: Request<Incoming>) -> Response<Body> {
    let started = Instant::now();
    let id = request_id();
    let method = request.method().clone();
    let path = request.uri().path().to_owned();
    let mut exchange = Exchange::default();
    let response = match serve(&runtime, request, &mut exchange).await {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    let response = decorate(response, &id, &exchange, &runtime.snapshot);
    if exchange.alias.is_some()
        || response.status().is_client_error()
        || response.status().is_server_error()
    {
        tracing::info!(
            request_id = %id,
            %method,
            path = %path,
            tenant = exchange.tenant.as_deref().unwrap_or("-"),
            key_id = exchange.key_id.as_deref().unwrap_or("-"),
            alias = exchange.alias.as_deref().unwrap_or("-"),
            status = response.status().as_u16(),
            attempts = %exchange.trail.header(),
            duration_ms = started.elapsed().as_secs_f64() * 1000.0,
            "request"
        );
    }
    response
}

fn request_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

async fn serve(
    runtime: &Arc<Runtime>,
    request: Request<Incoming>,
    exchange: &mut Exchange,
) -> Result<Response<Body>, GatewayError> {
    let snapshot = &runtime.snapshot;
    match surface::route(request.method(), request.uri().path())? {
        Route::Healthz => Ok(json(StatusCode::OK, r#"{"status":"ok"}"#)),
        Route::Readyz => Ok(json(StatusCode::OK, r#"{"status":"ready"}"#)),
        Route::Models => {
            let caller = auth::authenticate(snapshot, request.headers())?;
            Ok(models(snapshot, caller.tenant))
        }
        Route::Call {
            operation,
            dialect,
            alias,
        } => {
            let caller = auth::authenticate(snapshot, request.headers())?;
            exchange.tenant = Some(caller.tenant.name.clone());
            exchange.key_id = Some(caller.key.id.clone());
            let body = read_body(request, snapshot.max_request_body).await?;
            let call = Call::new(runtime, caller, operation, dialect, alias, body)?;
            call.run(exchange).await
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
fn models(snapshot: &Snapshot, tenant: &Tenant) -> Response<Body> {
    let data: Vec<serde_json::Value> = snapshot
        .aliases
        .iter()
        .filter(|alias| tenant.may_use(&alias.name))
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

/// Reads the body, refusing it from its Content-Length when that is already over the limit.
async fn read_body(request: Request<Incoming>, limit: u64) -> Result<Bytes, GatewayError> {
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit) {
        return Err(GatewayError::RequestTooLarge { limit });
    }
    let limited = Limited::new(
        request.into_body(),
        usize::try_from(limit).unwrap_or(usize::MAX),
    );
    match limited.collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            Err(GatewayError::RequestTooLarge { limit })
        }
        Err(error) => Err(GatewayError::InvalidRequest(format!(
            "the request body could not be read: {error}"
        ))),
    }
}

/// One model call on its way through the router.
struct Call<'a> {
    dispatch: Dispatch,
    caller: Caller<'a>,
    name: String,
    request: ClientRequest,
}

impl<'a> Call<'a> {
    fn new(
        runtime: &Arc<Runtime>,
        caller: Caller<'a>,
        operation: Operation,
        dialect: Dialect,
        alias: AliasSource,
        body: Bytes,
    ) -> Result<Self, GatewayError> {
        let request = ClientRequest::parse(body, operation)?;
        let name = match alias {
            AliasSource::Path(name) => name,
            AliasSource::Body => request.model.clone().ok_or_else(|| {
                GatewayError::InvalidRequest("missing required field `model`".into())
            })?,
        };
        let dispatch = Dispatch {
            runtime: runtime.clone(),
            operation,
            dialect,
            continues_cut_streams: false,
        };
        Ok(Call {
            dispatch,
            caller,
            name,
            request,
        })
    }

    async fn run(mut self, exchange: &mut Exchange) -> Result<Response<Body>, GatewayError> {
        let runtime = self.dispatch.runtime.clone();
        let snapshot = &runtime.snapshot;
        exchange.alias = Some(self.name.clone());
        let (alias, alias_index) = resolve(snapshot, &self.name, self.caller.tenant)?;
        let operation = self.dispatch.operation;
        let plan = router::plan(&runtime, alias, &self.name, self.caller.tenant, operation);
        self.dispatch.continues_cut_streams = alias.continue_cut_streams && self.request.stream;
        let fallbacks: Vec<Candidate> = match self.dispatch.continues_cut_streams {
            true => plan
                .candidates
                .iter()
                .filter(|c| c.accepts_prefill)
                .cloned()
                .collect(),
            false => Vec::new(),
        };
        let deadline = Instant::now() + snapshot.routing.timeouts.total;
        let tokens = self.request.estimated_tokens(operation);
        let failover = Failover::new(&runtime, &self.name, alias_index, plan, deadline, tokens);
        let (dispatch, request) = (&self.dispatch, &self.request);
        let outcome = failover
            .run(&mut exchange.trail, |candidate| async move {
                dispatch.attempt(request, &candidate, deadline, None).await
            })
            .await;
        match outcome {
            Ok((candidate, Answer::Stream(relay))) if self.dispatch.continues_cut_streams => {
                exchange.backend = Some(candidate.backend);
                let continuation = Continuation {
                    dispatch: self.dispatch.clone(),
                    request: self.request.clone(),
                    fallbacks: fallbacks
                        .into_iter()
                        .filter(|c| !c.same_target(&candidate))
                        .collect(),
                    deadline,
                };
                Ok(stream_response(
                    relay.continued_by(Box::new(continuation)).into_body(),
                ))
            }
            Ok((candidate, answer)) => {
                exchange.backend = Some(candidate.backend);
                Ok(respond(answer))
            }
            Err(Ending::Error(error)) => Err(error),
            Err(Ending::Upstream { backend, failure }) => {
                exchange.backend = Some(backend);
                Ok(passthrough(failure))
            }
        }
    }
}

/// The alias a name means for this tenant: a configured alias, or the `"*"` discovery alias.
fn resolve<'s>(
    snapshot: &'s Snapshot,
    name: &str,
    tenant: &Tenant,
) -> Result<(&'s Alias, Option<usize>), GatewayError> {
    if let Some(&index) = snapshot.alias_by_name.get(name) {
        if !tenant.may_use(name) {
            return Err(GatewayError::ModelNotAllowed(name.to_owned()));
        }
        let alias = snapshot
            .aliases
            .get(index)
            .ok_or_else(|| GatewayError::ModelNotFound(name.to_owned()))?;
        return Ok((alias, Some(index)));
    }
    match &snapshot.wildcard {
        Some(wildcard) if tenant.may_use("*") => Ok((wildcard, None)),
        _ => Err(GatewayError::ModelNotFound(name.to_owned())),
    }
}

fn respond(answer: Answer) -> Response<Body> {
    match answer {
        Answer::Whole {
            status,
            content_type,
            body,
        } => {
            let measured = measured_tokens(&body).is_some();
            let mut response = Response::new(full(body));
            *response.status_mut() = status;
            let headers = response.headers_mut();
            if let Some(content_type) = content_type {
                headers.insert(header::CONTENT_TYPE, content_type);
            }
            if measured {
                headers.insert("x-onedoor-usage", HeaderValue::from_static("measured"));
            }
            response
        }
        Answer::Stream(relay) => stream_response(relay.into_body()),
    }
}

/// The response head of an SSE stream to the caller.
fn stream_response(body: Body) -> Response<Body> {
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

/// An upstream's own client error, as it came (status, content type and body).
fn passthrough(failure: Failure) -> Response<Body> {
    let Failure::Status {
        status,
        headers,
        body,
    } = failure
    else {
        return GatewayError::UpstreamFailed("the request".into()).into_response();
    };
    let mut response = Response::new(full(body));
    *response.status_mut() = status;
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, content_type);
    response
}

fn decorate(
    mut response: Response<Body>,
    id: &str,
    exchange: &Exchange,
    snapshot: &Snapshot,
) -> Response<Body> {
    let headers = response.headers_mut();
    let mut put = |name: &'static str, value: &str| {
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(name, value);
        }
    };
    put("x-onedoor-request-id", id);
    put("x-onedoor-attempts", &exchange.trail.header());
    if let Some(backend) = exchange.backend.and_then(|b| snapshot.backends.get(b)) {
        put("x-onedoor-backend", &backend.name);
        put("x-onedoor-region", &backend.region);
    }
    response
}
