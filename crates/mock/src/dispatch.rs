//! The order in which one upstream request is counted, checked and answered, for every dialect:
//! route, faults, credentials, deployment, body, context window, quota, then the answer.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::http::request::Parts;
use hyper::{Request, Response, StatusCode};
use serde_json::Value;
use tokio::sync::Notify;

use crate::dialect::{self, Ctx, Op, Payload, Reject, Route, Wire};
use crate::quota::{Limits, Snapshot};
use crate::realtime::{self, Upgrade};
use crate::reply::Reply;
use crate::request::Chat;
use crate::state::{lock, Deployment, Shared};
use crate::stream::{self, Body, Watch};
use crate::{control, embeddings, openai, response, Behavior};

/// Serves one request. `kill` asks the connection to die without an answer; an accepted
/// WebSocket handshake leaves its session in `upgrade` for the connection to run.
pub async fn handle(
    shared: Arc<Shared>,
    kill: Arc<Notify>,
    upgrade: Arc<Upgrade>,
    request: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = request.into_parts();
    // A body that cannot be read means the client is gone; nobody will see this answer.
    let Ok(body) = body.collect().await.map(|c| c.to_bytes()) else {
        return Ok(response::plain_json(StatusCode::BAD_REQUEST, &Value::Null));
    };
    if parts.uri.path().starts_with("/_mock/") {
        return Ok(control::answer(&shared, &parts, &body));
    }
    if realtime::is_upgrade(&parts) {
        return Ok(match realtime::handshake(&shared, &parts, &upgrade).await {
            Ok(switching) => switching,
            Err(refusal) => realtime::refused(refusal, &kill).await,
        });
    }
    if crate::batch::route(shared.spec.dialect, parts.uri.path()).is_some() {
        return Ok(crate::batch::answer(&shared, &parts, &body).await);
    }
    shared.remember_request(&parts.headers, &body);
    let watch = Watch::new(shared.counters.clone());
    Ok(Exchange::new(&shared, &parts, &body)
        .answer(watch, &kill)
        .await)
}

/// How a request ends other than with an answer body of its own.
enum Failure {
    /// The snapshot (boxed: it is rare and large) feeds the rate-limit headers of a quota 429.
    Reject(Reject, Option<Box<Snapshot>>),
    /// Drop the connection with no response at all.
    Reset,
    /// Never answer.
    Hang,
}

impl From<Reject> for Failure {
    fn from(r: Reject) -> Self {
        Failure::Reject(r, None)
    }
}

struct Exchange<'a> {
    shared: &'a Shared,
    wire: &'static dyn Wire,
    parts: &'a Parts,
    route: Result<Route, Reject>,
    body: Result<Value, Reject>,
    /// The deployment (or model) the request names, known or not.
    name: Option<String>,
    behavior: Behavior,
    ctx: Ctx,
}

impl<'a> Exchange<'a> {
    /// Routes, reads and counts the request; nothing is refused yet.
    fn new(shared: &'a Shared, parts: &'a Parts, body: &Bytes) -> Self {
        let wire = dialect::wire(shared.spec.dialect);
        let route = wire.route(&parts.method, parts.uri.path(), parts.uri.query());
        let body = parse_body(body);
        let name = route.as_ref().ok().and_then(|r| {
            let from_body = || {
                body.as_ref()
                    .ok()?
                    .get("model")?
                    .as_str()
                    .map(str::to_owned)
            };
            r.deployment.clone().or_else(from_body)
        });
        shared.count(name.as_deref());
        let ctx = Ctx {
            request_id: wire.request_id(),
            client_request_id: parts.headers.get("x-ms-client-request-id").cloned(),
            region: shared.spec.region.clone(),
            target: format!("{} {}", parts.method, parts.uri.path()),
            op: route.as_ref().ok().map(|r| r.op),
            api_version: route.as_ref().ok().and_then(|r| r.api_version.clone()),
            model: name.clone(),
        };
        let mut behavior = shared.behavior_for(name.as_deref());
        let seen = name.as_deref().map_or(0, |d| shared.requests(d));
        if behavior.cut_first.is_some_and(|first| seen > first) {
            behavior.cut_after = None;
        }
        Exchange {
            behavior,
            shared,
            wire,
            parts,
            route,
            body,
            name,
            ctx,
        }
    }

    async fn answer(self, mut watch: Watch, kill: &Notify) -> Response<Body> {
        match self.judge() {
            Err(Failure::Reset) => {
                watch.complete();
                kill.notify_one();
                std::future::pending().await
            }
            // The watch is dropped with this future when the client gives up: a cancellation.
            Err(Failure::Hang) => std::future::pending().await,
            Err(Failure::Reject(reject, quota)) => {
                self.pause().await;
                let (status, value) = self.wire.reject(&reject, &self.ctx);
                let mut response = response::json(status, &value, |b| stream::full(b, watch));
                if self.behavior.echo_key_error {
                    self.echo_key(response.headers_mut());
                }
                self.decorated(response, quota.as_deref(), reject.retry_after_s())
            }
            Ok((Payload::Json(value), quota)) => {
                self.pause().await;
                let hang = self.behavior.headers_then_hang;
                let body = |b| {
                    if hang {
                        stream::silent(watch)
                    } else {
                        stream::full(b, watch)
                    }
                };
                let response = response::json(StatusCode::OK, &value, body);
                self.decorated(response, quota.as_ref(), None)
            }
            Ok((Payload::Stream(mut script), quota)) => {
                if self.behavior.echo_key_in_stream {
                    let message = format!("The server failed; key: {}", self.presented_key());
                    let error =
                        serde_json::json!({"error": {"message": message, "type": "server_error"}});
                    script.tail = vec![stream::data_event(&error)];
                }
                let body = if self.behavior.headers_then_hang {
                    stream::silent(watch)
                } else {
                    stream::scripted(script, &self.behavior, watch)
                };
                let mut response =
                    response::with_body(StatusCode::OK, "text/event-stream; charset=utf-8", body);
                response::put(response.headers_mut(), "cache-control", "no-cache");
                self.decorated(response, quota.as_ref(), None)
            }
        }
    }

    fn presented_key(&self) -> &str {
        dialect::presented_key(&self.parts.headers).unwrap_or("none")
    }

    /// Quotes the presented key in the headers of an `echo_key_error` refusal.
    fn echo_key(&self, headers: &mut hyper::HeaderMap) {
        let key = self.presented_key();
        response::put(headers, "x-echoed-api-key", key);
        response::put(
            headers,
            "content-type",
            format!("application/json; key={key}"),
        );
    }

    /// Time to first byte, for answers whose first byte is their headers.
    async fn pause(&self) {
        if self.behavior.ttft_ms > 0 {
            tokio::time::sleep(Duration::from_millis(self.behavior.ttft_ms)).await;
        }
    }

    fn decorated(
        &self,
        mut response: Response<Body>,
        quota: Option<&Snapshot>,
        retry: Option<u64>,
    ) -> Response<Body> {
        self.wire
            .decorate(response.headers_mut(), &self.ctx, quota, retry);
        if let Some(left) = self.behavior.remaining_tokens {
            response
                .headers_mut()
                .insert("x-ratelimit-remaining-tokens", left.into());
        }
        response
    }

    fn judge(&self) -> Result<(Payload, Option<Snapshot>), Failure> {
        let route = self.route.as_ref().map_err(Clone::clone)?;
        self.faults()?;
        self.credentials()?;
        if route.op == Op::Models {
            return Ok((Payload::Json(openai::models(self.shared)), None));
        }
        let deployment = self.deployment()?;
        let body = self.body.as_ref().map_err(Clone::clone)?;
        match route.op {
            Op::Embeddings => self.embeddings(deployment, body),
            Op::Responses => self.responses(deployment, body),
            _ => self.chat(deployment, body),
        }
    }

    /// Injected faults come before anything else: a broken upstream does not check keys.
    fn faults(&self) -> Result<(), Failure> {
        let b = &self.behavior;
        if b.reset {
            return Err(Failure::Reset);
        }
        if b.hang {
            return Err(Failure::Hang);
        }
        match b.status {
            Some(429) => Err(Reject::RateLimited {
                throttle: None,
                retry_after_s: b.retry_after_s.unwrap_or(1),
            }
            .into()),
            Some(status) => Err(Reject::Status(status).into()),
            None if b.echo_key_error => Err(Reject::Invalid(format!(
                "Incorrect API key provided: {}. You can find your API key in your account.",
                self.presented_key()
            ))
            .into()),
            None if self.shared.roll_error(b.error_rate) => Err(Reject::Status(500).into()),
            None => Ok(()),
        }
    }

    fn credentials(&self) -> Result<(), Reject> {
        crate::identity::check(self.shared, self.wire, &self.parts.headers)
    }

    fn deployment(&self) -> Result<&'a Deployment, Reject> {
        let name = self.name.as_deref().ok_or(Reject::Missing("model"))?;
        self.shared
            .deployment(name)
            .ok_or_else(|| Reject::UnknownDeployment(name.to_owned()))
    }

    fn chat(&self, d: &Deployment, body: &Value) -> Result<(Payload, Option<Snapshot>), Failure> {
        let mut chat = self.wire.parse_chat(body)?;
        if let Some(prefix) = chat.cached_prefix.as_mut() {
            prefix.read = self.shared.cache_prefix(prefix.key);
        }
        if let Some(limit) = d.spec.context_window.filter(|&l| chat.prompt_tokens > l) {
            return Err(Reject::ContextTooLong {
                limit,
                tokens: chat.prompt_tokens,
            }
            .into());
        }
        let quota = self.admit(d, chat.cost())?;
        let who = format!("{}/{}", self.shared.spec.name, d.spec.name);
        let mut reply = Reply::answer(&who, self.behavior.reply_words, &chat);
        reply.quirks = self.behavior.compat_quirks;
        Ok((self.wire.chat(&chat, &reply, &d.spec.model), Some(quota)))
    }

    /// The Responses API: a follow-up must name a response this endpoint stored.
    fn responses(
        &self,
        d: &Deployment,
        body: &Value,
    ) -> Result<(Payload, Option<Snapshot>), Failure> {
        let chat = Chat::responses(body)?;
        if let Some(previous) = &chat.previous_response_id {
            if !self.shared.has_response(previous) {
                return Err(Reject::UnknownResponse(previous.clone()).into());
            }
        }
        let quota = self.admit(d, chat.cost())?;
        let who = format!("{}/{}", self.shared.spec.name, d.spec.name);
        let reply = Reply::compose(&who, self.behavior.reply_words, false, chat.max_tokens);
        let id = crate::ident::token("resp_", 40);
        if body["store"].as_bool() != Some(false) {
            self.shared.store_response(&id);
        }
        let payload = crate::responses::answer(&chat, &reply, &d.spec.model, &id);
        Ok((payload, Some(quota)))
    }

    fn embeddings(
        &self,
        d: &Deployment,
        body: &Value,
    ) -> Result<(Payload, Option<Snapshot>), Failure> {
        let inputs = embeddings::inputs(body)?;
        let quota = self.admit(d, embeddings::tokens(&inputs))?;
        Ok((
            Payload::Json(embeddings::response(&inputs, &d.spec.model)),
            Some(quota),
        ))
    }

    fn admit(&self, d: &Deployment, cost: u64) -> Result<Snapshot, Failure> {
        let limits = Limits {
            rpm: d.spec.rpm,
            tpm: d.spec.tpm,
            ten_second_windows: d.spec.ten_second_windows,
        };
        lock(&d.window)
            .admit(limits, cost, Instant::now())
            .map_err(|refused| {
                let (throttle, quota) = *refused;
                let retry_after_s = self
                    .behavior
                    .retry_after_s
                    .unwrap_or(throttle.retry_after_s);
                let reject = Reject::RateLimited {
                    throttle: Some(throttle),
                    retry_after_s,
                };
                Failure::Reject(reject, Some(Box::new(quota)))
            })
    }
}

/// An empty body is fine for GETs; anything else must be JSON.
fn parse_body(body: &Bytes) -> Result<Value, Reject> {
    if body.is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_slice(body).map_err(|e| {
        Reject::Invalid(format!(
            "We could not parse the JSON body of your request. ({e})"
        ))
    })
}
