use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper::Method;
use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::client::{eventually, post, post_stream, send, user};

async fn fleet(behavior: Behavior) -> (Fleet, String) {
    let spec = EndpointSpec::openai("oai", "us")
        .deployment(DeploymentSpec::new("a"))
        .deployment(DeploymentSpec::new("b"))
        .behavior(behavior);
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = format!("{}/chat/completions", fleet.endpoints()[0].url());
    (fleet, url)
}

fn ask(model: &str, stream: bool) -> Value {
    json!({"model": model, "messages": [user("hi")], "stream": stream})
}

#[tokio::test]
async fn cut_after_drops_the_stream_without_done() {
    let (fleet, url) = fleet(Behavior {
        cut_after: Some(2),
        ..Behavior::default()
    })
    .await;
    let streamed = post_stream(&url, &[], &ask("a", true)).await;
    assert_eq!(streamed.status, 200);
    assert!(!streamed.clean_end, "the body must fail, not end");
    let chunks = streamed.chunks();
    let words: Vec<_> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(words, ["", "Hello", " from"]);
    assert!(!streamed.text.contains("[DONE]"));
    assert!(chunks
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert_eq!(fleet.endpoints()[0].cancelled(), 0);
}

#[tokio::test]
async fn reset_gives_a_connection_error() {
    let (fleet, url) = fleet(Behavior {
        reset: true,
        ..Behavior::default()
    })
    .await;
    let body = ask("a", false);
    let outcome = send(Method::POST, &url, &[], Some(&body)).await;
    assert!(
        outcome.is_err(),
        "got an HTTP answer: {:?}",
        outcome.map(|r| r.status())
    );
    assert_eq!(fleet.endpoints()[0].requests("a"), 1);
    assert_eq!(fleet.endpoints()[0].cancelled(), 0);
    // On the wire it is a TCP reset, not an orderly close.
    let mut socket = raw_request(fleet.endpoints()[0].addr(), &body).await;
    let mut buf = [0u8; 64];
    let read = socket.read(&mut buf).await.map_err(|e| e.kind());
    assert_eq!(read, Err(std::io::ErrorKind::ConnectionReset));
}

/// Writes a chat request on a plain socket, for tests that watch the connection itself.
async fn raw_request(addr: std::net::SocketAddr, body: &Value) -> TcpStream {
    let body = body.to_string();
    let mut socket = TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).await.unwrap();
    socket
}

#[tokio::test]
async fn hang_counts_a_cancellation_when_the_client_leaves() {
    let (fleet, _) = fleet(Behavior {
        hang: true,
        ..Behavior::default()
    })
    .await;
    let endpoint = &fleet.endpoints()[0];
    let socket = raw_request(endpoint.addr(), &ask("a", false)).await;
    eventually(|| endpoint.total_requests() == 1).await;
    assert_eq!(endpoint.cancelled(), 0);
    drop(socket);
    eventually(|| endpoint.cancelled() == 1).await;
}

#[tokio::test]
async fn headers_then_hang_sends_headers_and_no_body() {
    let (fleet, url) = fleet(Behavior {
        headers_then_hang: true,
        ..Behavior::default()
    })
    .await;
    for stream in [false, true] {
        let body = ask("a", stream);
        let response = send(Method::POST, &url, &[], Some(&body)).await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let waited = tokio::time::timeout(Duration::from_millis(100), body.frame()).await;
        assert!(waited.is_err(), "a body byte arrived");
    }
    eventually(|| fleet.endpoints()[0].cancelled() == 2).await;
}

#[tokio::test]
async fn error_rate_fails_an_exact_fraction() {
    let (_fleet, url) = fleet(Behavior {
        error_rate: 0.5,
        ..Behavior::default()
    })
    .await;
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(post(&url, &[], &ask("a", false)).await.status);
    }
    assert_eq!(statuses, [200, 500, 200, 500]);
}

#[tokio::test]
async fn pacing_delays_first_byte_and_tokens() {
    let (fleet, url) = fleet(Behavior {
        ttft_ms: 120,
        ..Behavior::default()
    })
    .await;
    let started = Instant::now();
    assert_eq!(post(&url, &[], &ask("a", false)).await.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(120));
    let paced = Behavior {
        ttft_ms: 50,
        inter_token_ms: 10,
        reply_words: Some(3),
        ..Behavior::default()
    };
    fleet.endpoints()[0].set_behavior(paced);
    let started = Instant::now();
    let streamed = post_stream(&url, &[], &ask("a", true)).await;
    // First event after 50 ms, then two more words and the finish 10 ms apart.
    assert!(
        started.elapsed() >= Duration::from_millis(80),
        "{:?}",
        started.elapsed()
    );
    assert!(streamed.clean_end);
}

#[tokio::test]
async fn behaviour_changes_at_runtime_and_per_deployment() {
    let (fleet, url) = fleet(Behavior::default()).await;
    let endpoint = &fleet.endpoints()[0];
    endpoint.set_deployment_behavior(
        "a",
        Behavior {
            status: Some(503),
            ..Behavior::default()
        },
    );
    let unavailable = post(&url, &[], &ask("a", false)).await;
    assert_eq!(unavailable.status, 503);
    assert_eq!(unavailable.json()["error"]["type"], "server_error");
    assert_eq!(post(&url, &[], &ask("b", false)).await.status, 200);
    endpoint.set_behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(7),
        ..Behavior::default()
    });
    assert_eq!(post(&url, &[], &ask("a", false)).await.status, 503);
    let limited = post(&url, &[], &ask("b", false)).await;
    assert_eq!(
        (limited.status, limited.header("retry-after")),
        (429, Some("7"))
    );
    endpoint.set_behavior(Behavior::default());
    assert_eq!(post(&url, &[], &ask("b", false)).await.status, 200);
}

#[tokio::test]
async fn counters_see_every_routed_request() {
    let (fleet, url) = fleet(Behavior::default()).await;
    let endpoint = &fleet.endpoints()[0];
    endpoint.set_deployment_behavior(
        "b",
        Behavior {
            status: Some(500),
            ..Behavior::default()
        },
    );
    for model in ["a", "a", "b", "ghost"] {
        post(&url, &[], &ask(model, false)).await;
    }
    assert_eq!(
        (
            endpoint.requests("a"),
            endpoint.requests("b"),
            endpoint.requests("ghost")
        ),
        (2, 1, 1)
    );
    assert_eq!(endpoint.total_requests(), 4);
    endpoint.reset_counters();
    assert_eq!((endpoint.requests("a"), endpoint.total_requests()), (0, 0));
}
