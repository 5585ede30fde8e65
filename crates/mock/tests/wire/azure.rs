use onedoor_mock::{DeploymentSpec, EndpointSpec, Fleet};
use serde_json::{json, Value};

use crate::client::{post, post_stream, user};

const VERSION: &str = "api-version=2024-10-21";

async fn fleet(d: DeploymentSpec) -> Fleet {
    let spec = EndpointSpec::azure("sub1-se", "Sweden Central").deployment(d);
    Fleet::start(vec![spec]).await.unwrap()
}

fn chat_url(fleet: &Fleet, deployment: &str) -> String {
    let base = fleet.endpoint("sub1-se").unwrap().url();
    format!("{base}/openai/deployments/{deployment}/chat/completions?{VERSION}")
}

fn hello() -> Value {
    json!({"messages": [user("hi there")]})
}

#[tokio::test]
async fn unknown_deployment_is_deployment_not_found() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o")).await;
    let answer = post(&chat_url(&fleet, "nope"), &[], &hello()).await;
    assert_eq!(answer.status, 404);
    assert_eq!(
        answer.json(),
        json!({"error": {"code": "DeploymentNotFound", "message": "The API deployment for this resource does not exist. If you created the deployment within the last 5 minutes, please wait a moment and try again."}})
    );
    assert!(answer.header("apim-request-id").is_some());
    assert_eq!(answer.header("x-ms-region"), Some("Sweden Central"));
    let endpoint = fleet.endpoint("sub1-se").unwrap();
    assert_eq!(
        (endpoint.requests("nope"), endpoint.requests("gpt-4o")),
        (1, 0)
    );
}

#[tokio::test]
async fn missing_api_version_is_resource_not_found() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o")).await;
    let base = fleet.endpoint("sub1-se").unwrap().url();
    let answer = post(
        &format!("{base}/openai/deployments/gpt-4o/chat/completions"),
        &[],
        &hello(),
    )
    .await;
    assert_eq!(answer.status, 404);
    assert_eq!(
        answer.json(),
        json!({"error": {"code": "404", "message": "Resource not found"}})
    );
}

#[tokio::test]
async fn answer_names_its_upstream_and_carries_filter_results() {
    let fleet = fleet(
        DeploymentSpec::new("gpt-4o")
            .model("gpt-4o-2024-11-20")
            .rpm(10)
            .tpm(1000),
    )
    .await;
    let answer = post(
        &chat_url(&fleet, "gpt-4o"),
        &[("x-ms-client-request-id", "abc-123")],
        &hello(),
    )
    .await;
    assert_eq!(answer.status, 200);
    let body = answer.json();
    assert_eq!(body["model"], "gpt-4o-2024-11-20");
    assert_eq!(body["object"], "chat.completion");
    let choice = &body["choices"][0];
    assert_eq!(
        choice["message"]["content"],
        "Hello from sub1-se/gpt-4o this is a simulated reply"
    );
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["content_filter_results"]["hate"]["severity"], "safe");
    assert_eq!(body["prompt_filter_results"][0]["prompt_index"], 0);
    // "hi there" is 8 chars = 2 tokens, plus 3 for the message.
    assert_eq!(body["usage"]["prompt_tokens"], 5);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(answer.header("x-ms-client-request-id"), Some("abc-123"));
    assert_eq!(answer.header("x-ratelimit-remaining-requests"), Some("9"));
    // 5 prompt tokens + the default 16 max tokens charged at admission.
    assert_eq!(answer.header("x-ratelimit-remaining-tokens"), Some("979"));
}

#[tokio::test]
async fn stream_opens_with_the_filter_only_chunk_and_ends_with_usage() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o").model("gpt-4o-2024-11-20")).await;
    let body = json!({"messages": [user("hi")], "stream": true, "stream_options": {"include_usage": true}});
    let streamed = post_stream(&chat_url(&fleet, "gpt-4o"), &[], &body).await;
    assert_eq!(streamed.status, 200);
    assert!(streamed.clean_end);
    assert!(streamed.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(streamed.data().last(), Some(&"[DONE]"));
    let chunks = streamed.chunks();
    let (filter, rest) = chunks.split_first().unwrap();
    assert_eq!(filter["choices"], json!([]));
    assert_eq!(filter["id"], "");
    assert!(filter["prompt_filter_results"].is_array());
    assert_eq!(rest[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = rest.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    let finish = &rest[rest.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let text: String = rest
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello from sub1-se/gpt-4o this is a simulated reply");
    assert!(rest.iter().all(|c| c["id"] == rest[0]["id"]
        && c["model"] == "gpt-4o-2024-11-20"
        && c["created"] == rest[0]["created"]));
}

#[tokio::test]
async fn stream_without_include_usage_has_no_usage_chunk() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o")).await;
    let body = json!({"messages": [user("hi")], "stream": true});
    let chunks = post_stream(&chat_url(&fleet, "gpt-4o"), &[], &body)
        .await
        .chunks();
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[tokio::test]
async fn rpm_quota_answers_429_with_retry_after() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o").rpm(2)).await;
    let url = chat_url(&fleet, "gpt-4o");
    for _ in 0..2 {
        assert_eq!(post(&url, &[], &hello()).await.status, 200);
    }
    let refused = post(&url, &[], &hello()).await;
    assert_eq!(refused.status, 429);
    let seconds: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((59..=60).contains(&seconds), "{seconds}");
    assert_eq!(
        refused.header("retry-after-ms"),
        Some(&*(seconds * 1000).to_string())
    );
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), Some("0"));
    let body = refused.json();
    assert_eq!(body["error"]["code"], "429");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("API version 2024-10-21 have exceeded call rate limit"),
        "{message}"
    );
    assert!(
        message.contains(&format!("Please retry after {seconds} seconds")),
        "{message}"
    );
    assert_eq!(fleet.endpoint("sub1-se").unwrap().requests("gpt-4o"), 3);
}

#[tokio::test]
async fn tpm_charges_prompt_and_max_tokens_at_admission() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o").tpm(100)).await;
    let url = chat_url(&fleet, "gpt-4o");
    let body = json!({"messages": [user("hi")], "max_tokens": 60});
    assert_eq!(post(&url, &[], &body).await.status, 200);
    let refused = post(&url, &[], &body).await;
    assert_eq!(refused.status, 429);
    assert!(refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("token rate limit"));
    assert_eq!(refused.header("x-ratelimit-remaining-tokens"), Some("36"));
}

#[tokio::test]
async fn flagged_prompt_and_long_prompt_are_400s() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o").context_window(10)).await;
    let url = chat_url(&fleet, "gpt-4o");
    let flagged = post(
        &url,
        &[],
        &json!({"messages": [user("say forbidden-word")]}),
    )
    .await;
    assert_eq!(flagged.status, 400);
    assert_eq!(flagged.json()["error"]["code"], "content_filter");
    assert_eq!(
        flagged.json()["error"]["innererror"]["code"],
        "ResponsibleAIPolicyViolation"
    );
    let long = post(&url, &[], &json!({"messages": [user(&"x".repeat(40))]})).await;
    assert_eq!(long.status, 400);
    let error = &long.json()["error"];
    assert_eq!(
        (&error["code"], &error["type"], &error["param"]),
        (
            &json!("context_length_exceeded"),
            &json!("invalid_request_error"),
            &json!("messages")
        )
    );
    assert!(error["message"].as_str().unwrap().starts_with("This model's maximum context length is 10 tokens. However, your messages resulted in 13 tokens."));
}

#[tokio::test]
async fn api_key_is_required_when_configured() {
    let spec = EndpointSpec::azure("sub1-se", "eastus")
        .api_key("k1")
        .deployment(DeploymentSpec::new("gpt-4o"));
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = chat_url(&fleet, "gpt-4o");
    let refused = post(&url, &[("api-key", "wrong")], &hello()).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.json()["error"]["code"], "401");
    assert_eq!(post(&url, &[], &hello()).await.status, 401);
    assert_eq!(post(&url, &[("api-key", "k1")], &hello()).await.status, 200);
    assert_eq!(
        post(&url, &[("authorization", "Bearer k1")], &hello())
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn v1_surface_takes_the_deployment_from_the_body() {
    let fleet = fleet(DeploymentSpec::new("gpt-4o")).await;
    let base = fleet.endpoint("sub1-se").unwrap().url();
    let answer = post(
        &format!("{base}/openai/v1/chat/completions"),
        &[],
        &json!({"model": "gpt-4o", "messages": [user("hi")]}),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert!(answer.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .starts_with("Hello from sub1-se/gpt-4o"));
}

#[tokio::test]
async fn embeddings_are_deterministic_vectors() {
    let fleet = fleet(DeploymentSpec::new("embed").model("text-embedding-3-small")).await;
    let base = fleet.endpoint("sub1-se").unwrap().url();
    let url = format!("{base}/openai/deployments/embed/embeddings?{VERSION}");
    let body = json!({"input": ["first text", "second text"]});
    let answer = post(&url, &[], &body).await.json();
    assert_eq!(answer["object"], "list");
    assert_eq!(answer["model"], "text-embedding-3-small");
    assert_eq!(answer["data"][1]["index"], 1);
    assert_eq!(answer["data"][0]["embedding"].as_array().unwrap().len(), 8);
    assert_eq!(
        answer["usage"],
        json!({"prompt_tokens": 6, "total_tokens": 6})
    );
    assert_eq!(post(&url, &[], &body).await.json()["data"], answer["data"]);
}
