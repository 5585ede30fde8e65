//! A backend's own credential never reaches a client, through real HTTP: an upstream's 400 that
//! quotes the key it was sent (in its body and its headers) is passed back as it came, but with
//! the key replaced by `[redacted]`, still JSON in the caller's dialect and with a length that
//! fits; and no log line carries the key either.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use serde_json::json;

const MARKER: &str = "[redacted]";
const OPENAI_KEY: &str = "sk-compat-0123456789abcdefghij";
const AZURE_KEY: &str = "0f1e2d3c4b5a69788796a5b4c3d2e1f0";
const ANTHROPIC_KEY: &str = "sk-ant-api03-zyxwvutsrqponmlkjihg";

fn echoing() -> Behavior {
    Behavior {
        echo_key_error: true,
        ..Behavior::default()
    }
}

async fn harness() -> Harness {
    logs();
    let fleet = vec![
        EndpointSpec::openai("compat", "onprem")
            .deployment(DeploymentSpec::new("llama"))
            .api_key(OPENAI_KEY)
            .behavior(echoing()),
        EndpointSpec::openai("failing", "onprem")
            .deployment(DeploymentSpec::new("llama"))
            .api_key(OPENAI_KEY)
            .behavior(Behavior {
                echo_key_in_stream: true,
                ..Behavior::default()
            }),
        EndpointSpec::azure("az", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .api_key(AZURE_KEY)
            .behavior(echoing()),
        EndpointSpec::anthropic("claude", "europe")
            .deployment(DeploymentSpec::new("claude-sonnet-4-5"))
            .api_key(ANTHROPIC_KEY)
            .behavior(echoing()),
    ];
    let config = format!(
        "backends:
  - {{ name: compat, provider: openai, region: onprem, url: \"{{url:compat}}\", api_key: {OPENAI_KEY} }}
  - {{ name: failing, provider: openai, region: onprem, url: \"{{url:failing}}\", api_key: {OPENAI_KEY} }}
  - {{ name: az, provider: azure, region: swedencentral, url: \"{{url:az}}\", api_key: {AZURE_KEY} }}
  - {{ name: claude, provider: anthropic, region: europe, url: \"{{url:claude}}\", api_key: {ANTHROPIC_KEY} }}
models:
  - name: llama
    targets: [{{ backend: compat, model: llama }}]
  - name: failing
    targets: [{{ backend: failing, model: llama }}]
  - name: gpt
    targets: [{{ backend: az, deployment: gpt-4o }}]
  - name: claude
    targets: [{{ backend: claude, model: claude-sonnet-4-5 }}]
"
    );
    Harness::start(fleet, &config).await
}

/// The answer is the upstream's own 400, its key replaced: in the body, which is still JSON and
/// as long as its `content-length` says, and in every header.
fn assert_redacted(answer: &Answer, key: &str) -> serde_json::Value {
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(
        !answer.body.contains(&key[..8]),
        "the key reached the client: {}",
        answer.body
    );
    assert!(answer.body.contains(MARKER), "{}", answer.body);
    let length: usize = answer.header("content-length").parse().unwrap();
    assert_eq!(length, answer.body.len());
    for (name, value) in &answer.headers {
        let value = String::from_utf8_lossy(value.as_bytes());
        assert!(!value.contains(&key[..8]), "the key in `{name}: {value}`");
    }
    assert!(answer
        .header("content-type")
        .starts_with("application/json"));
    answer.json()
}

#[tokio::test]
async fn an_openai_caller_gets_an_upstream_400_with_the_backends_key_redacted() {
    let h = harness().await;
    let answer = h.chat("llama").await;
    let body = assert_redacted(&answer, OPENAI_KEY);
    assert_eq!(
        body["error"]["message"],
        "Incorrect API key provided: [redacted]. You can find your API key in your account."
    );
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(answer.attempts(), "compat=400", "never retried");
}

#[tokio::test]
async fn an_azure_caller_gets_an_upstream_400_with_the_backends_key_redacted() {
    let h = harness().await;
    let answer = h
        .post(
            "/openai/deployments/gpt/chat/completions?api-version=2024-10-21",
            chat_body("gpt", false),
        )
        .await;
    let body = assert_redacted(&answer, AZURE_KEY);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("provided: [redacted]."));
}

#[tokio::test]
async fn an_anthropic_caller_gets_an_upstream_400_with_the_backends_key_redacted() {
    let h = harness().await;
    let messages = json!({
        "model": "claude",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Hello there"}]
    });
    let answer = h.post("/v1/messages", messages.clone()).await;
    let body = assert_redacted(&answer, ANTHROPIC_KEY);
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("provided: [redacted]."));
    // An Anthropic caller of an OpenAI-shaped backend, whose error the gateway translates.
    let mut to_llama = messages;
    to_llama["model"] = json!("llama");
    let translated = h.post("/v1/messages", to_llama).await;
    let body = assert_redacted(&translated, OPENAI_KEY);
    assert_eq!(body["type"], "error");
}

#[tokio::test]
async fn a_header_echoing_the_backends_key_is_redacted_on_the_answer() {
    let h = harness().await;
    let answer = h.chat("llama").await;
    assert_redacted(&answer, OPENAI_KEY);
    assert_eq!(
        answer.header("content-type"),
        "application/json; key=[redacted]"
    );
    assert_eq!(answer.header("x-echoed-api-key"), "", "not copied at all");
}

#[tokio::test]
async fn an_error_event_ending_a_stream_has_the_backends_key_redacted() {
    let h = harness().await;
    let answer = h
        .post("/v1/chat/completions", chat_body("failing", true))
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(!answer.body.contains(&OPENAI_KEY[..8]), "{}", answer.body);
    let error = answer
        .body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .find(|d| d.contains("\"error\""))
        .unwrap_or_else(|| panic!("no error event: {}", answer.body));
    let error: serde_json::Value = serde_json::from_str(error).unwrap();
    assert_eq!(
        error["error"]["message"],
        "The server failed; key: [redacted]"
    );
}

#[tokio::test]
async fn no_log_line_carries_a_key_an_upstream_quoted() {
    let h = harness().await;
    assert_eq!(h.chat("llama").await.status, 400);
    let refused = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[("authorization", "Bearer not-a-client-key")],
            Bytes::from(chat_body("llama", false).to_string()),
        )
        .await;
    assert_eq!(refused.status, 401);
    let (access, debug) = logs();
    let mut text = String::new();
    for _ in 0..250 {
        text = std::fs::read_to_string(access).unwrap_or_default();
        if text.contains("\"status\":400") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        text.contains("\"status\":400"),
        "no access log line: {text}"
    );
    let debug = String::from_utf8_lossy(&debug.lock().unwrap()).into_owned();
    assert!(debug.contains("attempt failed"), "no debug log: {debug}");
    for key in [OPENAI_KEY, AZURE_KEY, ANTHROPIC_KEY] {
        assert!(!text.contains(&key[..8]), "a key in the access log: {text}");
        assert!(
            !debug.contains(&key[..8]),
            "a key in the debug log: {debug}"
        );
    }
}

/// Where this process's logs go, set before its first gateway starts (both destinations are
/// read once per process): the access log's file, and the debug log in memory.
fn logs() -> (&'static PathBuf, Arc<Mutex<Vec<u8>>>) {
    static LOGS: OnceLock<(PathBuf, Arc<Mutex<Vec<u8>>>)> = OnceLock::new();
    let (path, debug) = LOGS.get_or_init(|| {
        let path = temp_config_path().with_file_name("access.log");
        std::env::set_var("ONEDOOR_ACCESS_LOG", &path);
        let debug = Arc::new(Mutex::new(Vec::new()));
        let sink = Sink(debug.clone());
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::DEBUG)
            .with_writer(move || sink.clone())
            .finish();
        tracing::subscriber::set_global_default(subscriber).unwrap();
        (path, debug)
    });
    (path, debug.clone())
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
