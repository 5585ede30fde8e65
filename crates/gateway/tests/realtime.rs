//! Realtime over WebSocket through the gateway, with a real WebSocket client and the simulated
//! realtime upstreams: frames both ways (text, binary, 1 MiB), pings, close codes each way, the
//! credential swap, failover while the upstream handshake has not succeeded, `max_sessions`,
//! the idle and maximum durations, shutdown, the usage record from `response.done`, and each
//! response counted against the tenant's and key's token limits (memory and Redis state).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod instances;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::handshake::client::Response;
use tokio_tungstenite::tungstenite::http::{HeaderName, HeaderValue};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::{Error, Message};
use tokio_tungstenite::WebSocketStream;

type Socket = WebSocketStream<TcpStream>;

const UPSTREAM_KEY: &str = "upstream-secret";
const AZURE_BETA: &str = "/openai/realtime?api-version=2024-10-01-preview&deployment=voice";

fn realtime(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral")
        .api_key(UPSTREAM_KEY)
        .deployment(DeploymentSpec::new("gpt-rt").model("gpt-4o-realtime-preview"))
}

/// An alias `voice` over `names` (Azure backends with the upstream key), in priority order.
fn config(names: &[&str], extra: &str) -> String {
    let mut yaml = String::from("backends:\n");
    for name in names {
        yaml.push_str(&format!(
            "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\", api_key: {UPSTREAM_KEY} }}\n"
        ));
    }
    yaml.push_str("models:\n  - name: voice\n    targets:\n");
    for (i, name) in names.iter().enumerate() {
        yaml.push_str(&format!(
            "      - {{ backend: {name}, deployment: gpt-rt, priority: {} }}\n",
            i + 1
        ));
    }
    yaml.push_str(extra);
    yaml
}

async fn connect_with(
    h: &Harness,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(Socket, Response), Error> {
    let mut request = format!("ws://{}{}", h.gateway.addr(), path)
        .into_client_request()
        .unwrap();
    for (name, value) in headers {
        request.headers_mut().insert(
            HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    let stream = TcpStream::connect(h.gateway.addr()).await.unwrap();
    tokio_tungstenite::client_async(request, stream).await
}

/// Connects an Azure-style client with the team's key and the `realtime` subprotocol.
async fn connect(h: &Harness) -> (Socket, Response) {
    connect_with(
        h,
        AZURE_BETA,
        &[("api-key", KEY), ("sec-websocket-protocol", "realtime")],
    )
    .await
    .expect("the gateway upgrades")
}

/// The refused handshake's HTTP answer: status, JSON body and `x-onedoor-attempts`.
async fn refusal(h: &Harness, path: &str, headers: &[(&str, &str)]) -> (u16, Value, String) {
    match connect_with(h, path, headers).await {
        Err(Error::Http(response)) => {
            let body = response.body().clone().unwrap_or_default();
            let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
            let attempts = response
                .headers()
                .get("x-onedoor-attempts")
                .map(|v| v.to_str().unwrap().to_owned())
                .unwrap_or_default();
            (response.status().as_u16(), json, attempts)
        }
        Ok(_) => panic!("the handshake was accepted"),
        Err(other) => panic!("no HTTP answer: {other}"),
    }
}

/// The refused handshake's status and JSON body.
async fn refused(h: &Harness, path: &str, headers: &[(&str, &str)]) -> (u16, Value) {
    let (status, body, _) = refusal(h, path, headers).await;
    (status, body)
}

async fn next(socket: &mut Socket) -> Message {
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), socket.next())
            .await
            .expect("a frame within 10 s")
            .expect("the socket is open")
            .expect("a valid frame");
        if !matches!(message, Message::Ping(_) | Message::Pong(_)) {
            return message;
        }
    }
}

async fn event(socket: &mut Socket) -> Value {
    match next(socket).await {
        Message::Text(text) => serde_json::from_str(text.as_str()).unwrap(),
        other => panic!("expected a text event, got {other:?}"),
    }
}

async fn send(socket: &mut Socket, event: Value) {
    socket.send(Message::text(event.to_string())).await.unwrap();
}

/// The close frame the gateway sends, after any frames still on the way.
async fn closed(socket: &mut Socket) -> CloseFrame {
    loop {
        match next(socket).await {
            Message::Close(Some(frame)) => return frame,
            Message::Close(None) => panic!("a close without a status code"),
            _ => {}
        }
    }
}

fn normal() -> CloseFrame {
    CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    }
}

/// One `response.create`, answered up to its `response.done`; returns the text and the usage.
async fn respond(socket: &mut Socket) -> (String, Value) {
    send(socket, json!({"type": "response.create"})).await;
    let mut text = String::new();
    loop {
        let event = event(socket).await;
        match event["type"].as_str().unwrap() {
            "response.text.delta" | "response.output_text.delta" => {
                text.push_str(event["delta"].as_str().unwrap())
            }
            "response.done" => return (text, event["response"]["usage"].clone()),
            _ => {}
        }
    }
}

#[tokio::test]
async fn text_and_binary_frames_flow_both_ways_with_the_backends_own_credential() {
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], "")).await;
    let (mut socket, head) = connect(&h).await;
    assert_eq!(head.headers()["sec-websocket-protocol"], "realtime");
    assert_eq!(head.headers()["x-onedoor-backend"], "rt-se");
    assert_eq!(head.headers()["x-onedoor-attempts"], "rt-se=200");
    assert_eq!(head.headers()["x-onedoor-request-id"].len(), 32);
    let created = event(&mut socket).await;
    assert_eq!(created["type"], "session.created");
    assert_eq!(created["session"]["model"], "gpt-4o-realtime-preview");
    send(
        &mut socket,
        json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello there"}]}}),
    )
    .await;
    assert_eq!(
        event(&mut socket).await["type"],
        "conversation.item.created"
    );
    let (text, usage) = respond(&mut socket).await;
    assert_eq!(text, "Hello from rt-se/gpt-rt this is a simulated reply");
    assert_eq!(usage["output_tokens"], 8);
    let audio: Vec<u8> = (0..=255).cycle().take(50_000).collect();
    socket.send(Message::binary(audio.clone())).await.unwrap();
    assert_eq!(next(&mut socket).await, Message::binary(audio));
    let seen = h.endpoint("rt-se").last_realtime_handshake().unwrap();
    assert_eq!(seen.path, "/openai/realtime");
    assert_eq!(
        seen.query,
        "api-version=2024-10-01-preview&deployment=gpt-rt"
    );
    assert_eq!(seen.credential_in, "api-key");
    assert_eq!(seen.subprotocols, ["realtime"]);
    assert_eq!(seen.openai_beta.as_deref(), Some("realtime=v1"));
}

#[tokio::test]
async fn one_mebibyte_frames_and_pings_pass() {
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], "")).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    let big = "a".repeat(1 << 20);
    let echo = json!({"type": "mock.echo", "audio": big}).to_string();
    socket.send(Message::text(echo.clone())).await.unwrap();
    assert_eq!(next(&mut socket).await, Message::text(echo));
    let blob = vec![0x5au8; 1 << 20];
    socket.send(Message::binary(blob.clone())).await.unwrap();
    assert_eq!(next(&mut socket).await, Message::binary(blob));
    socket
        .send(Message::Ping("still there?".into()))
        .await
        .unwrap();
    let pong = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Message::Pong(data) = socket.next().await.unwrap().unwrap() {
                return data;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(pong, "still there?");
}

#[tokio::test]
async fn a_client_close_reaches_the_upstream_with_its_code_and_reason() {
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], "")).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    assert_eq!(h.endpoint("rt-se").realtime_open(), 1);
    let bye = CloseFrame {
        code: CloseCode::from(4001),
        reason: "user hung up".into(),
    };
    socket.close(Some(bye)).await.unwrap();
    assert_eq!(u16::from(closed(&mut socket).await.code), 4001);
    assert!(eventually(|| h.endpoint("rt-se").realtime_open() == 0).await);
    assert_eq!(
        h.endpoint("rt-se").last_realtime_close(),
        Some(Some((4001, "user hung up".to_owned())))
    );
}

#[tokio::test]
async fn an_upstream_close_reaches_the_client_and_codes_that_may_not_be_sent_become_1011() {
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], "")).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    send(
        &mut socket,
        json!({"type": "mock.close", "code": 4002, "reason": "call ended"}),
    )
    .await;
    let frame = closed(&mut socket).await;
    assert_eq!(
        (u16::from(frame.code), frame.reason.as_str()),
        (4002, "call ended")
    );

    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    send(
        &mut socket,
        json!({"type": "mock.close", "code": 1006, "reason": "abnormal"}),
    )
    .await;
    assert_eq!(u16::from(closed(&mut socket).await.code), 1011);

    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    send(&mut socket, json!({"type": "mock.drop"})).await;
    let frame = closed(&mut socket).await;
    assert_eq!(u16::from(frame.code), 1011);
    assert!(frame.reason.as_str().contains("upstream"), "{frame:?}");
}

#[tokio::test]
async fn a_handshake_refused_by_the_first_backend_succeeds_on_the_second() {
    let down = realtime("rt-a").behavior(Behavior {
        status: Some(503),
        ..Behavior::default()
    });
    let h = Harness::start(vec![down, realtime("rt-b")], &config(&["rt-a", "rt-b"], "")).await;
    let (mut socket, head) = connect(&h).await;
    assert_eq!(head.headers()["x-onedoor-backend"], "rt-b");
    assert_eq!(
        head.headers()["x-onedoor-attempts"],
        "rt-a=503,rt-a=503,rt-b=200"
    );
    event(&mut socket).await;
    let (text, _) = respond(&mut socket).await;
    assert!(text.contains("rt-b/gpt-rt"), "{text}");
    assert_eq!(h.endpoint("rt-a").realtime_sessions(), 0);
    assert_eq!(h.endpoint("rt-b").realtime_sessions(), 1);
}

#[tokio::test]
async fn refusals_are_http_answers_before_any_upgrade() {
    let throttled = realtime("rt-a").behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(7),
        ..Behavior::default()
    });
    let h = Harness::start(vec![throttled], &config(&["rt-a"], "")).await;
    let (status, body) = refused(&h, AZURE_BETA, &[]).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let (status, body) = refused(
        &h,
        "/v1/realtime?model=nope",
        &[("authorization", &format!("Bearer {KEY}"))],
    )
    .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (status, body) = refused(&h, AZURE_BETA, &[("api-key", KEY)]).await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "upstream_rate_limited");
    let plain = h
        .send(
            http::Method::GET,
            h.url(AZURE_BETA),
            &[("api-key", KEY)],
            bytes::Bytes::new(),
        )
        .await;
    assert_eq!(plain.status, 400, "{}", plain.body);
    assert!(plain.body.contains("WebSocket"), "{}", plain.body);
}

#[tokio::test]
async fn openai_clients_and_backends_speak_bearer_and_the_ga_protocol() {
    let spec = EndpointSpec::openai("oai", "eastus")
        .api_key(UPSTREAM_KEY)
        .deployment(DeploymentSpec::new("gpt-realtime"));
    let yaml = format!(
        "backends:\n  - {{ name: oai, provider: openai, region: eastus, url: \"{{url:oai}}\", api_key: {UPSTREAM_KEY} }}\nmodels:\n  - name: voice\n    targets: [{{ backend: oai, deployment: gpt-realtime }}]\n"
    );
    let h = Harness::start(vec![spec], &yaml).await;
    let bearer = format!("Bearer {KEY}");
    let (mut socket, head) = connect_with(
        &h,
        "/v1/realtime?model=voice",
        &[("authorization", &bearer)],
    )
    .await
    .unwrap();
    assert!(!head.headers().contains_key("sec-websocket-protocol"));
    assert_eq!(event(&mut socket).await["session"]["type"], "realtime");
    let (text, _) = respond(&mut socket).await;
    assert!(text.starts_with("Hello from oai/gpt-realtime"));
    let seen = h.endpoint("oai").last_realtime_handshake().unwrap();
    assert_eq!(seen.path, "/v1/realtime");
    assert_eq!(seen.query, "model=gpt-realtime");
    assert_eq!(seen.credential_in, "bearer");
    assert_eq!(seen.openai_beta, None);
}

#[tokio::test]
async fn a_browser_key_in_the_subprotocol_is_accepted_and_never_forwarded() {
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], "")).await;
    let offered = format!("realtime, openai-insecure-api-key.{KEY}, openai-beta.realtime-v1");
    let (mut socket, head) = connect_with(
        &h,
        "/openai/v1/realtime?model=voice",
        &[("sec-websocket-protocol", &offered)],
    )
    .await
    .unwrap();
    assert_eq!(head.headers()["sec-websocket-protocol"], "realtime");
    event(&mut socket).await;
    let seen = h.endpoint("rt-se").last_realtime_handshake().unwrap();
    assert_eq!(seen.subprotocols, ["realtime"]);
    assert_eq!(seen.credential_in, "api-key");
    // `openai-beta.realtime-v1` asked for the beta protocol: Azure's beta path.
    assert_eq!(seen.path, "/openai/realtime");
}

#[tokio::test]
async fn a_tenant_opens_at_most_max_sessions_at_once() {
    let tenants = format!(
        "tenants:\n  - name: team\n    limits: {{ max_sessions: 2 }}\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        key_hash(KEY)
    );
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], &tenants)).await;
    let (mut first, _) = connect(&h).await;
    let (_second, _) = connect(&h).await;
    let (status, body) = refused(
        &h,
        AZURE_BETA,
        &[("api-key", KEY), ("sec-websocket-protocol", "realtime")],
    )
    .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "rate_limited");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_sessions"));
    assert_eq!(h.endpoint("rt-se").realtime_sessions(), 2);
    first.close(Some(normal())).await.unwrap();
    closed(&mut first).await;
    let mut reopened = None;
    for _ in 0..100 {
        if let Ok(session) = connect_with(&h, AZURE_BETA, &[("api-key", KEY)]).await {
            reopened = Some(session);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reopened.is_some(), "a closed session gives its place back");
}

#[tokio::test]
async fn quiet_sessions_idle_out_and_every_session_ends_at_max_session() {
    let limits = "realtime: { idle: 300ms, max_session: 1s }\n";
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], limits)).await;
    let (mut quiet, _) = connect(&h).await;
    event(&mut quiet).await;
    let frame = closed(&mut quiet).await;
    assert_eq!(u16::from(frame.code), 1000);
    assert!(frame.reason.as_str().contains("realtime.idle"), "{frame:?}");

    let (mut busy, _) = connect(&h).await;
    event(&mut busy).await;
    let started = std::time::Instant::now();
    let frame = loop {
        send(&mut busy, json!({"type": "mock.echo"})).await;
        match next(&mut busy).await {
            Message::Close(Some(frame)) => break frame,
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert_eq!(u16::from(frame.code), 1008);
    assert!(frame.reason.as_str().contains("realtime.max_session"));
    assert!(started.elapsed() >= Duration::from_millis(800));
}

#[tokio::test]
async fn shutdown_gives_open_sessions_its_timeout_then_closes_them_with_going_away() {
    let stop = "shutdown: { timeout: 1s }\n";
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], stop)).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    let Harness { gateway, fleet, .. } = h;
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(gateway.shutdown());
    let frame = closed(&mut socket).await;
    assert!(started.elapsed() >= Duration::from_millis(900));
    assert_eq!(u16::from(frame.code), 1001);
    assert!(frame.reason.as_str().contains("shutting down"), "{frame:?}");
    tokio::time::timeout(Duration::from_secs(15), stopping)
        .await
        .expect("shutdown ends once sessions closed")
        .unwrap();
    assert!(eventually(|| fleet.endpoint("rt-se").unwrap().realtime_open() == 0).await);
}

#[tokio::test]
async fn a_session_opens_during_the_drain_and_gets_the_timeout_before_its_going_away() {
    let stop = "shutdown: { drain_delay: 1s, timeout: 1s }\n";
    let h = Harness::start(vec![realtime("rt-se")], &config(&["rt-se"], stop)).await;
    let addr = h.gateway.addr();
    let Harness { gateway, fleet, .. } = h;
    let started = std::time::Instant::now();
    let stopping = tokio::spawn(gateway.drain_and_shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut request = format!("ws://{addr}{AZURE_BETA}")
        .into_client_request()
        .unwrap();
    let headers = request.headers_mut();
    headers.insert("api-key", HeaderValue::from_static(KEY));
    headers.insert(
        "sec-websocket-protocol",
        HeaderValue::from_static("realtime"),
    );
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut socket, response) = tokio_tungstenite::client_async(request, stream)
        .await
        .expect("the gateway upgrades while it drains");
    // The 101 keeps its `connection: upgrade`, though answers now say `connection: close`.
    assert_eq!(response.status().as_u16(), 101);
    event(&mut socket).await;
    let frame = closed(&mut socket).await;
    assert_eq!(u16::from(frame.code), 1001);
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "cut before drain and timeout"
    );
    tokio::time::timeout(Duration::from_secs(15), stopping)
        .await
        .expect("the stop ends once the session closed")
        .unwrap();
    assert!(eventually(|| fleet.endpoint("rt-se").unwrap().realtime_open() == 0).await);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-rt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_recorded_once_with_the_tokens_of_its_response_done_events() {
    let dir = temp_dir("usage");
    let db = dir.join("usage.db");
    let extra = format!(
        "usage: {{ store: \"sqlite://{}\", journal_dir: \"{}\" }}\n",
        db.display(),
        dir.display()
    );
    let mut yaml = config(&["rt-se"], "");
    yaml = yaml.replace(
        "      - { backend: rt-se, deployment: gpt-rt, priority: 1 }\n",
        "      - { backend: rt-se, deployment: gpt-rt, priority: 1 }\n    price: { input_per_1m: 5, output_per_1m: 20 }\n",
    );
    yaml.push_str(&extra);
    let h = Harness::start(vec![realtime("rt-se")], &yaml).await;
    let (mut socket, head) = connect(&h).await;
    let request_id = head.headers()["x-onedoor-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    event(&mut socket).await;
    let (mut input, mut output) = (0, 0);
    for _ in 0..3 {
        let (_, usage) = respond(&mut socket).await;
        input += usage["input_tokens"].as_u64().unwrap();
        output += usage["output_tokens"].as_u64().unwrap();
    }
    socket.close(Some(normal())).await.unwrap();
    closed(&mut socket).await;
    assert!(eventually(|| h.endpoint("rt-se").realtime_open() == 0).await);
    let Harness { gateway, fleet, .. } = h;
    gateway.shutdown().await;
    fleet.shutdown().await;
    let db = rusqlite::Connection::open(&db).unwrap();
    let row: (String, String, i64, i64, i64, String, f64, i64) = db
        .query_row(
            "SELECT request_id, backend, status, input_tokens, output_tokens, source, cost_usd, stream FROM usage_records",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?)),
        )
        .unwrap();
    assert_eq!(row.0, request_id);
    assert_eq!((row.1.as_str(), row.2), ("rt-se", 101));
    assert_eq!((row.3 as u64, row.4 as u64), (input, output));
    assert_eq!(row.5, "measured");
    let price = (input as f64 * 5.0 + output as f64 * 20.0) / 1e6;
    assert!((row.6 - price).abs() < 1e-12, "{} vs {price}", row.6);
    assert_eq!(row.7, 1);
}

#[tokio::test]
async fn a_wss_backend_is_reached_over_tls_and_a_failed_tls_handshake_is_a_connect_error() {
    // Whatever answers here is no TLS server: it takes the connection and hangs up.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            drop(stream);
        }
    });
    let yaml = format!(
        "backends:\n  - {{ name: tls, provider: azure, region: swedencentral, url: \"https://127.0.0.1:{port}\" }}\nmodels:\n  - name: voice\n    targets: [{{ backend: tls, deployment: gpt-rt }}]\nrouting: {{ same_target_retries: 0 }}\n"
    );
    let h = Harness::start(vec![], &yaml).await;
    let (status, body, attempts) = refusal(&h, AZURE_BETA, &[("api-key", KEY)]).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(body["error"]["code"], "upstream_failed");
    assert_eq!(attempts, "tls=connect_error");
}

/// The team with `tenant_limits`, its key with `key_limits`.
fn limited_team(tenant_limits: &str, key_limits: &str) -> String {
    format!(
        "tenants:\n  - name: team\n    limits: {{ {tenant_limits} }}\n    keys: [{{ id: team-key, sha256: {}, limits: {{ {key_limits} }} }}]\n",
        key_hash(KEY)
    )
}

/// The error event that answers a `response.create` sent while a quota is spent.
async fn refused_response(socket: &mut Socket, event_id: &str) -> Value {
    send(
        socket,
        json!({"type": "response.create", "event_id": event_id}),
    )
    .await;
    let error = event(socket).await;
    assert_eq!(error["type"], "error", "{error}");
    assert_eq!(error["error"]["code"], "quota_exceeded", "{error}");
    assert_eq!(error["error"]["event_id"], event_id, "{error}");
    error
}

/// The session stays open, and the refused `response.create` never reached the upstream: the
/// next thing the upstream sends is the echo of the next event.
async fn still_open_and_unasked(socket: &mut Socket) {
    send(socket, json!({"type": "mock.echo", "n": 1})).await;
    assert_eq!(event(socket).await, json!({"type": "mock.echo", "n": 1}));
}

async fn a_spent_daily_token_quota_refuses_the_next_response_and_handshake(state: &str) {
    let yaml = format!(
        "{state}{}",
        config(&["rt-se"], &limited_team("tokens_per_day: 30", ""))
    );
    let h = Harness::start(vec![realtime("rt-se")], &yaml).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    // Each response is 10 input and 8 output tokens: the second spends the day's 30.
    let (_, usage) = respond(&mut socket).await;
    assert_eq!(usage["total_tokens"], 18);
    let admin = h.admin_get("/admin/tenants", Some(ADMIN_TOKEN)).await;
    let limits = &admin.json()["tenants"][0]["limits"];
    assert_eq!(limits["tokens_per_day"]["used"], 18, "{}", admin.body);
    respond(&mut socket).await;
    let error = refused_response(&mut socket, "evt_client_3").await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("tokens_per_day") && message.contains("tenant `team`"),
        "{message}"
    );
    still_open_and_unasked(&mut socket).await;
    // The tenant's other requests see the spent day too.
    let chat = h.chat("voice").await;
    assert_eq!(
        (chat.status.as_u16(), chat.code()),
        (403, "quota_exceeded".into())
    );
    let (status, body) = refused(
        &h,
        AZURE_BETA,
        &[("api-key", KEY), ("sec-websocket-protocol", "realtime")],
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("tokens_per_day"));
    socket.close(Some(normal())).await.unwrap();
    closed(&mut socket).await;
}

#[tokio::test]
async fn a_spent_daily_token_quota_refuses_the_next_response_create_and_handshake() {
    a_spent_daily_token_quota_refuses_the_next_response_and_handshake("").await;
}

#[tokio::test]
async fn a_spent_daily_token_quota_refuses_the_next_response_create_and_handshake_with_redis() {
    let state = instances::shared_state("realtime-quota");
    a_spent_daily_token_quota_refuses_the_next_response_and_handshake(&state).await;
}

#[tokio::test]
async fn responses_are_charged_at_the_alias_price_to_the_keys_monthly_dollars_and_the_tenants_tpm()
{
    let mut yaml = config(
        &["rt-se"],
        &limited_team("rpm: 1000, tpm: 100000", "usd_per_month: 0.0005"),
    );
    yaml = yaml.replace(
        "      - { backend: rt-se, deployment: gpt-rt, priority: 1 }\n",
        "      - { backend: rt-se, deployment: gpt-rt, priority: 1 }\n    price: { input_per_1m: 5, output_per_1m: 20 }\n",
    );
    let h = Harness::start(vec![realtime("rt-se")], &yaml).await;
    let (mut socket, _) = connect(&h).await;
    event(&mut socket).await;
    // 10 input and 8 output tokens: 210 millionths of a dollar each; the third spends $0.0005.
    for _ in 0..3 {
        respond(&mut socket).await;
    }
    let error = refused_response(&mut socket, "evt_client_4").await;
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("usd_per_month") && message.contains("key `team-key`"),
        "{message}"
    );
    still_open_and_unasked(&mut socket).await;
    let admin = h.admin_get("/admin/tenants", Some(ADMIN_TOKEN)).await;
    let team = &admin.json()["tenants"][0];
    assert_eq!(team["limits"]["tpm"]["used"], 54, "{}", admin.body);
    // Responses are tokens, not requests.
    assert_eq!(team["limits"]["rpm"]["used"], 0, "{}", admin.body);
    let spent = team["keys"][0]["limits"]["usd_per_month"]["used"]
        .as_f64()
        .unwrap();
    assert!((spent - 0.00063).abs() < 1e-9, "{}", admin.body);
    let (status, body) = refused(&h, AZURE_BETA, &[("api-key", KEY)]).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body["error"]["code"], "quota_exceeded");
}
