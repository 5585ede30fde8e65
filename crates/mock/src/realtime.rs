//! Realtime over WebSocket (wire reference section 5), as Azure and OpenAI serve it: the
//! handshake at `/openai/realtime?api-version=..&deployment=..` (Azure beta),
//! `/openai/v1/realtime?model=..` (Azure GA) and `/v1/realtime?model=..` (OpenAI), checked like
//! any request (faults, credential, deployment) and refused with a plain HTTP answer in the
//! dialect's error shape; then a session that greets with `session.created`, answers
//! `response.create` with text deltas and a `response.done` that carries the usage, echoes binary
//! frames, and obeys a few `mock.*` commands (close with a code, drop the connection, echo).
//!
//! The handshake is answered by the HTTP dispatcher; the connection loop then takes the socket
//! back from hyper (see [`Upgrade`]) and runs the session on it with tungstenite.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use hyper::header::HeaderValue;
use hyper::http::request::Parts;
use hyper::{HeaderMap, Method, Response, StatusCode};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio::sync::Notify;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use crate::dialect::{self, Ctx, Reject};
use crate::reply::Reply;
use crate::response::{plain_json, put};
use crate::state::{lock, Shared};
use crate::stream::Body;
use crate::{ident, Behavior, Dialect};

/// The prefix of the browser-style credential subprotocol (`openai-insecure-api-key.KEY`).
const KEY_PROTOCOL: &str = "openai-insecure-api-key.";

/// Whether a request asks to become a WebSocket.
pub fn is_upgrade(parts: &Parts) -> bool {
    parts.method == Method::GET
        && parts
            .headers
            .get("upgrade")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// What an accepted handshake leaves for the connection to run: which deployment, which protocol.
#[derive(Debug, Clone)]
pub struct Accepted {
    deployment: String,
    model: String,
    /// The beta protocol (`response.text.delta`) rather than GA (`response.output_text.delta`).
    beta: bool,
    behavior: Behavior,
}

/// Where the dispatcher leaves an accepted handshake: hyper hands the connection back after the
/// 101, and the connection loop finds here what to run on it.
#[derive(Default)]
pub struct Upgrade(Mutex<Option<Accepted>>);

impl Upgrade {
    pub fn take(&self) -> Option<Accepted> {
        lock(&self.0).take()
    }
}

/// What the last handshake carried, for tests that check what the gateway sent upstream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RealtimeHandshake {
    pub path: String,
    pub query: String,
    /// The `Sec-WebSocket-Protocol` entries offered, credential entries shown as `<key>`.
    pub subprotocols: Vec<String>,
    pub openai_beta: Option<String>,
    /// `api-key`, `bearer`, `subprotocol` or `none`: where the credential came.
    pub credential_in: &'static str,
    /// The W3C `traceparent` the handshake carried, if any.
    pub traceparent: Option<String>,
}

/// Realtime counters of one endpoint.
#[derive(Default)]
pub struct RealtimeCounters {
    /// Sessions accepted since the start (or the last counter reset).
    pub sessions: AtomicU64,
    /// Sessions open now.
    pub open: AtomicU64,
    pub last_handshake: Mutex<Option<RealtimeHandshake>>,
    /// The code and reason of the last close frame a client sent (`None` for a close without a
    /// status code).
    pub last_close: Mutex<Option<Option<(u16, String)>>>,
}

/// A refused handshake: an HTTP answer, or a fault that gives none.
pub enum Refusal {
    Answer(Response<Body>),
    Reset,
    Hang,
}

/// Checks a WebSocket handshake and answers it: 101 with the session left in `upgrade`, or the
/// refusal the dialect gives.
pub async fn handshake(
    shared: &Shared,
    parts: &Parts,
    upgrade: &Upgrade,
) -> Result<Response<Body>, Refusal> {
    let wire = dialect::wire(shared.spec.dialect);
    let query = parts.uri.query().unwrap_or("");
    let route = route(shared.spec.dialect, parts.uri.path(), query, &parts.headers);
    let name = route.as_ref().ok().map(|(name, _)| name.clone());
    shared.count(name.as_deref());
    let behavior = shared.behavior_for(name.as_deref());
    let ctx = Ctx {
        request_id: wire.request_id(),
        client_request_id: None,
        region: shared.spec.region.clone(),
        target: format!("GET {}", parts.uri.path()),
        op: None,
        api_version: query_param(query, "api-version"),
        model: name.clone(),
    };
    let refuse = |reject: Reject| {
        let (status, body) = wire.reject(&reject, &ctx);
        let mut response = plain_json(status, &body);
        let retry = reject.retry_after_s();
        wire.decorate(response.headers_mut(), &ctx, None, retry);
        Refusal::Answer(response)
    };
    if behavior.ttft_ms > 0 {
        tokio::time::sleep(Duration::from_millis(behavior.ttft_ms)).await;
    }
    let (deployment, beta) = route.map_err(refuse)?;
    match behavior.status {
        _ if behavior.reset => return Err(Refusal::Reset),
        _ if behavior.hang => return Err(Refusal::Hang),
        Some(429) => {
            return Err(refuse(Reject::RateLimited {
                throttle: None,
                retry_after_s: behavior.retry_after_s.unwrap_or(1),
            }))
        }
        Some(status) => return Err(refuse(Reject::Status(status))),
        None => {}
    }
    let offered = subprotocols(&parts.headers);
    let seen = RealtimeHandshake {
        path: parts.uri.path().to_owned(),
        query: query.to_owned(),
        subprotocols: offered
            .iter()
            .map(|p| match p.starts_with(KEY_PROTOCOL) {
                true => "<key>".to_owned(),
                false => p.clone(),
            })
            .collect(),
        openai_beta: header(&parts.headers, "openai-beta").map(str::to_owned),
        credential_in: credential_in(&parts.headers, &offered),
        traceparent: header(&parts.headers, "traceparent").map(str::to_owned),
    };
    *lock(&shared.realtime.last_handshake) = Some(seen);
    let subprotocol_key = offered
        .iter()
        .find_map(|p| p.strip_prefix(KEY_PROTOCOL))
        .map(str::to_owned);
    match (shared.spec.dialect, subprotocol_key) {
        // An endpoint that takes Entra ID tokens checks the bearer token.
        _ if shared.spec.entra_audience.is_some() => {
            crate::identity::check(shared, wire, &parts.headers).map_err(refuse)?
        }
        // Browsers that cannot set headers put the key in a subprotocol (OpenAI only).
        (Dialect::OpenAi, Some(key)) => {
            dialect::check_key(shared.spec.api_key.as_deref(), Some(&key)).map_err(refuse)?
        }
        _ => wire
            .check_headers(&parts.headers, shared.spec.api_key.as_deref())
            .map_err(refuse)?,
    }
    if !offered.is_empty() && !offered.iter().any(|p| p == "realtime") {
        let message = format!(
            "Unsupported WebSocket subprotocol(s) {offered:?}: the Realtime API speaks `realtime`."
        );
        return Err(refuse(Reject::Invalid(message)));
    }
    let d = shared
        .deployment(&deployment)
        .ok_or_else(|| refuse(Reject::UnknownDeployment(deployment.clone())))?;
    let accept = websocket_accept(&parts.headers).ok_or_else(|| {
        refuse(Reject::Invalid(
            "A WebSocket handshake needs Sec-WebSocket-Key and Sec-WebSocket-Version: 13.".into(),
        ))
    })?;
    *lock(&upgrade.0) = Some(Accepted {
        deployment: d.spec.name.clone(),
        model: d.spec.model.clone(),
        beta,
        behavior,
    });
    let mut response = Response::new(crate::stream::full(
        Bytes::new(),
        crate::stream::Watch::detached(),
    ));
    *response.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = response.headers_mut();
    put(headers, "upgrade", "websocket");
    put(headers, "connection", "Upgrade");
    put(headers, "sec-websocket-accept", accept);
    if !offered.is_empty() {
        put(headers, "sec-websocket-protocol", "realtime");
    }
    wire.decorate(headers, &ctx, None, None);
    Ok(response)
}

/// The deployment a realtime URL names and whether it speaks the beta protocol.
fn route(
    dialect: Dialect,
    path: &str,
    query: &str,
    headers: &HeaderMap,
) -> Result<(String, bool), Reject> {
    let beta_header = header(headers, "openai-beta").is_some_and(|v| v.contains("realtime=v1"));
    let named = |key: &str| query_param(query, key).filter(|v| !v.is_empty());
    match (dialect, path.trim_end_matches('/')) {
        (Dialect::Azure, "/openai/realtime") => {
            named("api-version").ok_or(Reject::NoRoute)?;
            let deployment = named("deployment").ok_or(Reject::Missing("deployment"))?;
            Ok((deployment, true))
        }
        (Dialect::Azure, "/openai/v1/realtime") => {
            Ok((named("model").ok_or(Reject::Missing("model"))?, beta_header))
        }
        (Dialect::OpenAi, "/v1/realtime") => {
            Ok((named("model").ok_or(Reject::Missing("model"))?, beta_header))
        }
        _ => Err(Reject::NoRoute),
    }
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

fn subprotocols(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

fn credential_in(headers: &HeaderMap, offered: &[String]) -> &'static str {
    if headers.contains_key("api-key") {
        "api-key"
    } else if dialect::bearer(headers).is_some() {
        "bearer"
    } else if offered.iter().any(|p| p.starts_with(KEY_PROTOCOL)) {
        "subprotocol"
    } else {
        "none"
    }
}

fn websocket_accept(headers: &HeaderMap) -> Option<String> {
    let version_ok = header(headers, "sec-websocket-version").is_some_and(|v| v.trim() == "13");
    let key = headers
        .get("sec-websocket-key")
        .map(HeaderValue::as_bytes)?;
    version_ok.then(|| derive_accept_key(key))
}

/// A query parameter, percent-decoded (`+` is a space).
fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then(|| percent_decode(v))
    })
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], escaped) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Runs an accepted session on the socket hyper handed back (with the bytes it had read past
/// the handshake), until either side closes.
pub async fn run(stream: TcpStream, read_ahead: Bytes, accepted: Accepted, shared: Arc<Shared>) {
    let config = WebSocketConfig::default();
    let ws = WebSocketStream::from_partially_read(
        stream,
        read_ahead.to_vec(),
        Role::Server,
        Some(config),
    )
    .await;
    let counters = &shared.realtime;
    counters.sessions.fetch_add(1, Ordering::Relaxed);
    counters.open.fetch_add(1, Ordering::Relaxed);
    let who = format!("{}/{}", shared.spec.name, accepted.deployment);
    Session::new(ws, accepted, who, shared.clone())
        .serve()
        .await;
    counters.open.fetch_sub(1, Ordering::Relaxed);
}

/// What one session keeps: the socket, the text said so far (for the usage), the protocol.
struct Session {
    ws: WebSocketStream<TcpStream>,
    shared: Arc<Shared>,
    accepted: Accepted,
    who: String,
    session_id: String,
    /// Characters of user text and instructions, for the input token count.
    input_chars: usize,
}

/// How a session's loop goes on after one client event.
enum Next {
    Continue,
    /// Close with this frame (a `mock.close` command).
    Close(CloseFrame),
    /// Drop the connection without a close frame, as a crashed upstream would.
    Drop,
}

impl Session {
    fn new(
        ws: WebSocketStream<TcpStream>,
        accepted: Accepted,
        who: String,
        shared: Arc<Shared>,
    ) -> Self {
        Session {
            ws,
            shared,
            accepted,
            who,
            session_id: ident::token("sess_", 24),
            input_chars: 0,
        }
    }

    async fn serve(mut self) {
        let created = self.event("session.created", json!({"session": self.session()}));
        if self.send(created).await.is_err() {
            return;
        }
        while let Some(message) = self.ws.next().await {
            let next = match message {
                Ok(Message::Text(text)) => self.answer(text.as_str()).await,
                Ok(Message::Binary(data)) => match self.ws.send(Message::Binary(data)).await {
                    Ok(()) => Next::Continue,
                    Err(_) => return,
                },
                // Pings are answered by tungstenite itself; a close is replied to the same way.
                Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_)) => Next::Continue,
                Ok(Message::Close(frame)) => {
                    let seen = frame.map(|f| (u16::from(f.code), f.reason.as_str().to_owned()));
                    *lock(&self.shared.realtime.last_close) = Some(seen);
                    Next::Continue
                }
                Err(_) => return,
            };
            match next {
                Next::Continue => {}
                Next::Close(frame) => {
                    let _ = self.ws.close(Some(frame)).await;
                }
                Next::Drop => {
                    let _ = self.ws.get_mut().set_zero_linger();
                    return;
                }
            }
        }
    }

    /// Answers one client event.
    async fn answer(&mut self, text: &str) -> Next {
        let Ok(event) = serde_json::from_str::<Value>(text) else {
            let error = self.error("invalid_request_error", "The event is not valid JSON.");
            return self.sent(error).await;
        };
        let kind = event["type"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "session.update" => {
                self.input_chars += event["session"]["instructions"]
                    .as_str()
                    .map_or(0, |t| t.chars().count());
                let updated = self.event("session.updated", json!({"session": self.session()}));
                self.sent(updated).await
            }
            "conversation.item.create" => {
                self.input_chars += item_chars(&event["item"]);
                let mut item = event["item"].clone();
                if item["id"].is_null() {
                    item["id"] = json!(ident::token("item_", 20));
                }
                item["object"] = json!("realtime.item");
                item["status"] = json!("completed");
                let created = self.event(
                    "conversation.item.created",
                    json!({"previous_item_id": null, "item": item}),
                );
                self.sent(created).await
            }
            "input_audio_buffer.append" => Next::Continue,
            "input_audio_buffer.commit" => {
                let committed = self.event(
                    "input_audio_buffer.committed",
                    json!({"previous_item_id": null, "item_id": ident::token("item_", 20)}),
                );
                self.sent(committed).await
            }
            "response.create" => self.respond().await,
            "mock.echo" => match self.ws.send(Message::text(text.to_owned())).await {
                Ok(()) => Next::Continue,
                Err(_) => Next::Drop,
            },
            "mock.close" => Next::Close(CloseFrame {
                code: CloseCode::from(event["code"].as_u64().map_or(1000, |c| c as u16)),
                reason: event["reason"].as_str().unwrap_or("").to_owned().into(),
            }),
            "mock.drop" => Next::Drop,
            other => {
                let message = format!("Invalid value: '{other}'. Supported values are: 'session.update', 'input_audio_buffer.append', 'input_audio_buffer.commit', 'conversation.item.create', 'response.create'.");
                let error = self.error("invalid_request_error", &message);
                self.sent(error).await
            }
        }
    }

    /// A whole response: created, the text as deltas (paced by `inter_token_ms`), the done
    /// events, and `response.done` with the usage.
    async fn respond(&mut self) -> Next {
        let reply = Reply::compose(&self.who, self.accepted.behavior.reply_words, false, None);
        let response_id = ident::token("resp_", 24);
        let item_id = ident::token("item_", 20);
        let (delta, done, part_type) = match self.accepted.beta {
            true => ("response.text.delta", "response.text.done", "text"),
            false => (
                "response.output_text.delta",
                "response.output_text.done",
                "output_text",
            ),
        };
        let at = json!({"response_id": response_id, "item_id": item_id, "output_index": 0, "content_index": 0});
        let item = |status: &str, text: &str| {
            json!({"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                   "status": status, "content": [{"type": part_type, "text": text}]})
        };
        let response = |status: &str, output: Value, usage: Value| {
            json!({"id": response_id, "object": "realtime.response", "status": status,
                   "status_details": null, "output": output, "usage": usage})
        };
        let mut events = vec![
            self.event(
                "response.created",
                json!({"response": response("in_progress", json!([]), Value::Null)}),
            ),
            self.event(
                "response.output_item.added",
                json!({"response_id": response_id, "output_index": 0, "item": item("in_progress", "")}),
            ),
            self.event(
                "response.content_part.added",
                merged(&at, json!({"part": {"type": part_type, "text": ""}})),
            ),
        ];
        for event in events.drain(..) {
            if self.send(event).await.is_err() {
                return Next::Drop;
            }
        }
        let gap = Duration::from_millis(self.accepted.behavior.inter_token_ms);
        for chunk in &reply.chunks {
            if !gap.is_zero() {
                tokio::time::sleep(gap).await;
            }
            let event = self.event(delta, merged(&at, json!({"delta": chunk})));
            if self.send(event).await.is_err() {
                return Next::Drop;
            }
        }
        let text = reply.text();
        let usage = self.usage(reply.tokens());
        let tail = vec![
            self.event(done, merged(&at, json!({"text": text}))),
            self.event(
                "response.content_part.done",
                merged(&at, json!({"part": {"type": part_type, "text": text}})),
            ),
            self.event(
                "response.output_item.done",
                json!({"response_id": response_id, "output_index": 0, "item": item("completed", &text)}),
            ),
            self.event(
                "response.done",
                json!({"response": response("completed", json!([item("completed", &text)]), usage)}),
            ),
        ];
        for event in tail {
            if self.send(event).await.is_err() {
                return Next::Drop;
            }
        }
        Next::Continue
    }

    /// The usage block of `response.done`: input is the text said so far (four characters a
    /// token, plus ten for the session's own setup), output one token a word.
    fn usage(&self, output: u64) -> Value {
        let input = 10 + self.input_chars.div_ceil(4) as u64;
        json!({
            "total_tokens": input + output,
            "input_tokens": input,
            "output_tokens": output,
            "input_token_details": {"cached_tokens": 0, "text_tokens": input, "audio_tokens": 0},
            "output_token_details": {"text_tokens": output, "audio_tokens": 0},
        })
    }

    fn session(&self) -> Value {
        let mut session = json!({
            "id": self.session_id, "object": "realtime.session", "model": self.accepted.model,
            "expires_at": ident::unix_now() + 1800, "instructions": "",
        });
        match self.accepted.beta {
            true => session["modalities"] = json!(["text", "audio"]),
            false => {
                session["type"] = json!("realtime");
                session["output_modalities"] = json!(["text"]);
            }
        }
        session
    }

    fn event(&self, kind: &str, fields: Value) -> Value {
        merged(
            &json!({"type": kind, "event_id": ident::token("event_", 20)}),
            fields,
        )
    }

    fn error(&self, kind: &str, message: &str) -> Value {
        self.event(
            "error",
            json!({"error": {"type": kind, "code": null, "message": message, "param": null, "event_id": null}}),
        )
    }

    async fn send(&mut self, event: Value) -> Result<(), ()> {
        self.ws
            .send(Message::text(event.to_string()))
            .await
            .map_err(|_| ())
    }

    async fn sent(&mut self, event: Value) -> Next {
        match self.send(event).await {
            Ok(()) => Next::Continue,
            Err(()) => Next::Drop,
        }
    }
}

/// `base` with the fields of `extra` added.
fn merged(base: &Value, extra: Value) -> Value {
    let mut out = base.clone();
    if let (Some(out), Value::Object(extra)) = (out.as_object_mut(), extra) {
        out.extend(extra);
    }
    out
}

/// The characters of text in a conversation item's content parts.
fn item_chars(item: &Value) -> usize {
    item["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|part| {
            part["text"]
                .as_str()
                .or_else(|| part["transcript"].as_str())
        })
        .map(|t| t.chars().count())
        .sum()
}

/// Ends a refused handshake's connection as the fault says, or answers it.
pub async fn refused(refusal: Refusal, kill: &Notify) -> Response<Body> {
    match refusal {
        Refusal::Answer(response) => response,
        Refusal::Reset => {
            kill.notify_one();
            std::future::pending().await
        }
        Refusal::Hang => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_dialect_names_its_deployment_where_its_clients_put_it() {
        let none = HeaderMap::new();
        let azure = route(
            Dialect::Azure,
            "/openai/realtime",
            "api-version=2024-10-01-preview&deployment=gpt%2D4o-rt",
            &none,
        );
        assert_eq!(azure.ok(), Some(("gpt-4o-rt".to_owned(), true)));
        let ga = route(Dialect::Azure, "/openai/v1/realtime", "model=rt", &none);
        assert_eq!(ga.ok(), Some(("rt".to_owned(), false)));
        let mut beta = HeaderMap::new();
        beta.insert("openai-beta", HeaderValue::from_static("realtime=v1"));
        let openai = route(Dialect::OpenAi, "/v1/realtime", "model=gpt-realtime", &beta);
        assert_eq!(openai.ok(), Some(("gpt-realtime".to_owned(), true)));
        assert!(matches!(
            route(Dialect::Azure, "/openai/realtime", "deployment=x", &none),
            Err(Reject::NoRoute)
        ));
        assert!(matches!(
            route(Dialect::Anthropic, "/v1/realtime", "model=x", &none),
            Err(Reject::NoRoute)
        ));
    }

    #[test]
    fn the_accept_key_is_the_rfc_example() {
        let mut headers = HeaderMap::new();
        headers.insert(
            "sec-websocket-key",
            HeaderValue::from_static("dGhlIHNhbXBsZSBub25jZQ=="),
        );
        headers.insert("sec-websocket-version", HeaderValue::from_static("13"));
        assert_eq!(
            websocket_accept(&headers).as_deref(),
            Some("s3pPLMBiTxaQ9kYGzzhZRbK+xOo=")
        );
    }
}
