//! The access log through real HTTP: one JSON line per request (a stream's once it ended), with
//! ids, routing, tokens and timings, and never the prompt, the completion or the key.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;

#[tokio::test]
async fn every_request_gets_one_json_line_without_prompts_or_keys() {
    // The log's destination is read once per process: this binary has this one test.
    let path = temp_config_path().with_file_name("access.log");
    std::env::set_var("ONEDOOR_ACCESS_LOG", &path);
    let h = Harness::start(
        vec![EndpointSpec::azure("steady", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(Behavior {
                inter_token_ms: 2,
                ..Behavior::default()
            })],
        "backends:\n  - { name: steady, provider: azure, region: swedencentral, url: \"{url:steady}\" }\nmodels:\n  - name: chat\n    targets: [{ backend: steady, deployment: gpt-4o }]\n",
    )
    .await;
    let whole = h.chat("chat").await;
    assert_eq!(whole.status, 200, "{}", whole.body);
    let stream = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(stream.status, 200, "{}", stream.body);
    let refused = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[("authorization", "Bearer wrong-key")],
            Bytes::from(chat_body("chat", false).to_string()),
        )
        .await;
    assert_eq!(refused.status, 401);
    // A stream the caller leaves after its first event: its line says it was cut, and why.
    let body = chat_body("chat", true).to_string();
    let mut left = h.post_on_socket("/v1/chat/completions", &body).await;
    let mut head = [0u8; 512];
    let read = tokio::io::AsyncReadExt::read(&mut left, &mut head)
        .await
        .unwrap();
    assert!(read > 0);
    drop(left);

    let mut text = String::new();
    for _ in 0..250 {
        text = std::fs::read_to_string(&path).unwrap_or_default();
        if text.lines().count() >= 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        !text.contains(KEY) && !text.contains("wrong-key"),
        "a key in the log: {text}"
    );
    assert!(!text.contains("Hello there"), "a prompt in the log: {text}");

    let line = |id: &str| {
        lines
            .iter()
            .find(|l| l["request_id"] == id)
            .unwrap_or_else(|| panic!("no line for {id}: {text}"))
    };
    let first = line(whole.header("x-onedoor-request-id"));
    assert_eq!(first["tenant"], "team");
    assert_eq!(first["key_id"], "team-key");
    assert_eq!(first["alias"], "chat");
    assert_eq!(first["backend"], "steady");
    assert_eq!(first["region"], "swedencentral");
    assert_eq!(first["attempts"], "steady=200");
    assert_eq!(first["status"], 200);
    assert_eq!(first["tokens_source"], "measured");
    assert!(first["input_tokens"].as_u64().unwrap() > 0);
    assert!(first["duration_ms"].as_u64().is_some());

    let streamed = line(stream.header("x-onedoor-request-id"));
    assert_eq!(streamed["stream"], true);
    let ttft = streamed["ttft_ms"].as_u64().unwrap();
    assert!(
        ttft <= streamed["duration_ms"].as_u64().unwrap(),
        "{streamed}"
    );
    assert!(
        streamed["output_tokens"].as_u64().unwrap() > 0,
        "{streamed}"
    );

    let cut = lines
        .iter()
        .find(|l| l["stream_cut"] == true)
        .unwrap_or_else(|| panic!("no cut stream: {text}"));
    assert_eq!(cut["status"], 200, "{cut}");
    assert_eq!(cut["error"], "client_closed", "{cut}");
    assert_eq!(streamed["stream_cut"], false, "{streamed}");
    assert_eq!(streamed["error"], serde_json::Value::Null, "{streamed}");

    let unknown = line(refused.header("x-onedoor-request-id"));
    assert_eq!(unknown["status"], 401);
    assert_eq!(unknown["error"], "invalid_api_key");
    assert_eq!(unknown["tenant"], serde_json::Value::Null);
}
