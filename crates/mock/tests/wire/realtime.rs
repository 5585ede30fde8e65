use futures_util::{SinkExt, StreamExt};
use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::{self, HeaderValue};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::{Error, Message};
use tokio_tungstenite::WebSocketStream;

type Socket = WebSocketStream<TcpStream>;

async fn fleet(spec: EndpointSpec) -> Fleet {
    Fleet::start(vec![
        spec.deployment(DeploymentSpec::new("gpt-rt").model("gpt-realtime"))
    ])
    .await
    .unwrap()
}

/// Opens a WebSocket to `path` on the fleet's only endpoint with `headers`.
async fn connect(
    fleet: &Fleet,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<
    (
        Socket,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    Error,
> {
    let addr = fleet.endpoints()[0].addr();
    let mut request = format!("ws://{addr}{path}").into_client_request().unwrap();
    for (name, value) in headers {
        request.headers_mut().insert(
            http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
            HeaderValue::from_str(value).unwrap(),
        );
    }
    let stream = TcpStream::connect(addr).await.unwrap();
    tokio_tungstenite::client_async(request, stream).await
}

async fn event(socket: &mut Socket) -> Value {
    loop {
        match socket.next().await.unwrap().unwrap() {
            Message::Text(text) => return serde_json::from_str(text.as_str()).unwrap(),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("expected a text event, got {other:?}"),
        }
    }
}

async fn send(socket: &mut Socket, event: Value) {
    socket.send(Message::text(event.to_string())).await.unwrap();
}

/// Events until `response.done`, inclusive.
async fn response(socket: &mut Socket) -> Vec<Value> {
    send(socket, json!({"type": "response.create"})).await;
    let mut events = Vec::new();
    loop {
        let event = event(socket).await;
        let done = event["type"] == "response.done";
        events.push(event);
        if done {
            return events;
        }
    }
}

#[tokio::test]
async fn an_azure_beta_session_greets_answers_in_deltas_and_reports_usage() {
    let fleet = fleet(EndpointSpec::azure("rt-se", "swedencentral").api_key("k1")).await;
    let (mut socket, head) = connect(
        &fleet,
        "/openai/realtime?api-version=2024-10-01-preview&deployment=gpt-rt",
        &[("api-key", "k1"), ("sec-websocket-protocol", "realtime")],
    )
    .await
    .unwrap();
    assert_eq!(head.headers()["sec-websocket-protocol"], "realtime");
    assert!(head.headers().contains_key("apim-request-id"));
    let created = event(&mut socket).await;
    assert_eq!(created["type"], "session.created");
    assert_eq!(created["session"]["model"], "gpt-realtime");
    let item = json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "Say hello please"}]}});
    send(&mut socket, item).await;
    assert_eq!(
        event(&mut socket).await["type"],
        "conversation.item.created"
    );
    let events = response(&mut socket).await;
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.text.delta")
        .filter_map(|e| e["delta"].as_str())
        .collect();
    assert_eq!(text, "Hello from rt-se/gpt-rt this is a simulated reply");
    let usage = &events.last().unwrap()["response"]["usage"];
    // Ten for the session, 16 characters of text (4 tokens), one token a word.
    assert_eq!(usage["input_tokens"], 14);
    assert_eq!(usage["output_tokens"], 8);
    assert_eq!(usage["total_tokens"], 22);
    let seen = fleet.endpoints()[0].last_realtime_handshake().unwrap();
    assert_eq!(seen.credential_in, "api-key");
    assert_eq!(seen.subprotocols, ["realtime"]);
    assert_eq!(fleet.endpoints()[0].realtime_open(), 1);
}

#[tokio::test]
async fn the_ga_protocol_uses_output_text_deltas_and_a_bearer_key() {
    let fleet = fleet(EndpointSpec::openai("oai", "us").api_key("sk-1")).await;
    let path = "/v1/realtime?model=gpt-rt";
    let refused = connect(&fleet, path, &[("authorization", "Bearer nope")]).await;
    let Err(Error::Http(refusal)) = refused else {
        panic!("a wrong key is refused before the upgrade");
    };
    assert_eq!(refusal.status(), 401);
    let (mut socket, _) = connect(&fleet, path, &[("authorization", "Bearer sk-1")])
        .await
        .unwrap();
    assert_eq!(event(&mut socket).await["session"]["type"], "realtime");
    let events = response(&mut socket).await;
    assert!(events
        .iter()
        .any(|e| e["type"] == "response.output_text.delta"));
    assert!(!events.iter().any(|e| e["type"] == "response.text.delta"));
}

#[tokio::test]
async fn handshakes_are_refused_like_requests_with_the_dialects_bodies() {
    let fleet = fleet(EndpointSpec::azure("rt-se", "swedencentral")).await;
    let unknown = connect(&fleet, "/openai/v1/realtime?model=nope", &[]).await;
    let Err(Error::Http(refusal)) = unknown else {
        panic!("an unknown deployment is refused");
    };
    assert_eq!(refusal.status(), 404);
    let body: Value = serde_json::from_slice(refusal.body().as_deref().unwrap()).unwrap();
    assert_eq!(body["error"]["code"], "DeploymentNotFound");
    let wrong_protocol = connect(
        &fleet,
        "/openai/v1/realtime?model=gpt-rt",
        &[("sec-websocket-protocol", "chat")],
    )
    .await;
    assert!(matches!(wrong_protocol, Err(Error::Http(r)) if r.status() == 400));
    fleet.endpoints()[0].set_behavior(Behavior {
        status: Some(503),
        ..Behavior::default()
    });
    let down = connect(&fleet, "/openai/v1/realtime?model=gpt-rt", &[]).await;
    assert!(matches!(down, Err(Error::Http(r)) if r.status() == 503));
    assert_eq!(fleet.endpoints()[0].requests("gpt-rt"), 2);
    assert_eq!(fleet.endpoints()[0].realtime_sessions(), 0);
}

#[tokio::test]
async fn binary_frames_echo_pings_are_answered_and_a_command_closes_with_its_code() {
    let fleet = fleet(EndpointSpec::openai("oai", "us")).await;
    let (mut socket, _) = connect(&fleet, "/v1/realtime?model=gpt-rt", &[])
        .await
        .unwrap();
    event(&mut socket).await;
    let audio = vec![7u8; 200_000];
    socket.send(Message::binary(audio.clone())).await.unwrap();
    assert_eq!(
        socket.next().await.unwrap().unwrap(),
        Message::binary(audio)
    );
    socket
        .send(Message::Ping("are you there".into()))
        .await
        .unwrap();
    assert_eq!(
        socket.next().await.unwrap().unwrap(),
        Message::Pong("are you there".into())
    );
    send(
        &mut socket,
        json!({"type": "mock.close", "code": 4000, "reason": "told to"}),
    )
    .await;
    let Message::Close(Some(frame)) = socket.next().await.unwrap().unwrap() else {
        panic!("the session closes");
    };
    assert_eq!(frame.code, CloseCode::from(4000));
    assert_eq!(frame.reason.as_str(), "told to");
}
