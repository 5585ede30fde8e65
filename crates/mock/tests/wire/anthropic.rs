use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use serde_json::{json, Value};

use crate::client::{post, post_stream, user};

const VERSION: (&str, &str) = ("anthropic-version", "2023-06-01");

async fn fleet(d: DeploymentSpec) -> (Fleet, String) {
    let spec = EndpointSpec::anthropic("claude-eu", "eu").deployment(d);
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = format!("{}/v1/messages", fleet.endpoints()[0].url());
    (fleet, url)
}

fn ask(extra: Value) -> Value {
    let mut body =
        json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "messages": [user("hi")]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

#[tokio::test]
async fn stream_events_come_in_order() {
    let (_fleet, url) = fleet(DeploymentSpec::new("claude-sonnet-4-5")).await;
    let streamed = post_stream(&url, &[VERSION], &ask(json!({"stream": true}))).await;
    assert!(streamed.clean_end);
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(["content_block_delta"; 8]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(streamed.events(), expected);
    assert!(!streamed.text.contains("[DONE]"));
    let data = streamed.chunks();
    assert_eq!(data[0]["message"]["usage"]["input_tokens"], 4);
    assert_eq!(data[0]["message"]["content"], json!([]));
    let text: String = data
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(
        text,
        "Hello from claude-eu/claude-sonnet-4-5 this is a simulated reply"
    );
    let delta = &data[data.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], 8);
}

#[tokio::test]
async fn version_header_and_max_tokens_are_required() {
    let (_fleet, url) = fleet(DeploymentSpec::new("claude-sonnet-4-5")).await;
    let no_version = post(&url, &[], &ask(json!({}))).await;
    assert_eq!(no_version.status, 400);
    assert_eq!(no_version.json()["type"], "error");
    assert_eq!(no_version.json()["error"]["type"], "invalid_request_error");
    let mut body = ask(json!({}));
    body.as_object_mut().unwrap().remove("max_tokens");
    let no_max = post(&url, &[VERSION], &body).await;
    assert_eq!(no_max.status, 400);
    assert_eq!(
        no_max.json()["error"]["message"],
        "max_tokens: Field required"
    );
    let unknown = post(&url, &[VERSION], &ask(json!({"model": "claude-9"}))).await;
    assert_eq!(
        (unknown.status, unknown.json()["error"]["type"].clone()),
        (404, json!("not_found_error"))
    );
}

#[tokio::test]
async fn prefill_is_continued_and_max_tokens_stops_it() {
    let (_fleet, url) =
        fleet(DeploymentSpec::new("claude-sonnet-4-5").model("claude-sonnet-4-5-20250929")).await;
    let messages = json!([user("hi"), {"role": "assistant", "content": "Well,"}]);
    let answer = post(
        &url,
        &[VERSION],
        &ask(json!({"messages": messages, "max_tokens": 4})),
    )
    .await;
    assert_eq!(answer.status, 200);
    let body = answer.json();
    assert_eq!(body["type"], "message");
    assert_eq!(body["model"], "claude-sonnet-4-5-20250929");
    assert_eq!(
        body["content"][0]["text"],
        " continued by claude-eu/claude-sonnet-4-5 this"
    );
    assert_eq!(body["stop_reason"], "max_tokens");
    assert_eq!(body["usage"]["output_tokens"], 4);
    assert!(answer.header("request-id").unwrap().starts_with("req_"));
}

#[tokio::test]
async fn overloaded_and_rate_limited_shapes() {
    let (fleet, url) = fleet(DeploymentSpec::new("claude-sonnet-4-5").rpm(1)).await;
    assert_eq!(post(&url, &[VERSION], &ask(json!({}))).await.status, 200);
    let limited = post(&url, &[VERSION], &ask(json!({}))).await;
    assert_eq!(limited.status, 429);
    assert_eq!(limited.json()["error"]["type"], "rate_limit_error");
    assert!(limited.header("retry-after").is_some());
    assert_eq!(
        limited.header("anthropic-ratelimit-requests-remaining"),
        Some("0")
    );
    fleet.endpoints()[0].set_behavior(Behavior {
        status: Some(529),
        ..Behavior::default()
    });
    let overloaded = post(&url, &[VERSION], &ask(json!({}))).await;
    assert_eq!(overloaded.status, 529);
    assert_eq!(
        overloaded.json()["error"],
        json!({"type": "overloaded_error", "message": "Overloaded"})
    );
}
