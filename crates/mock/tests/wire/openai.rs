use hyper::Method;
use onedoor_mock::{DeploymentSpec, EndpointSpec, Fleet};
use serde_json::json;

use crate::client::{call, get, post, post_stream, user};

async fn fleet(spec: EndpointSpec) -> (Fleet, String) {
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = fleet.endpoints()[0].url();
    (fleet, url)
}

fn spec() -> EndpointSpec {
    EndpointSpec::openai("oai", "us")
        .deployment(DeploymentSpec::new("gpt-4o-mini").rpm(1).tpm(1000))
}

#[tokio::test]
async fn base_url_ends_in_v1_and_lists_models() {
    let (_fleet, url) = fleet(spec()).await;
    assert!(
        url.starts_with("http://127.0.0.1:") && url.ends_with("/v1"),
        "{url}"
    );
    let models = get(&format!("{url}/models")).await.json();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "gpt-4o-mini");
}

#[tokio::test]
async fn unknown_model_is_model_not_found() {
    let (fleet, url) = fleet(spec()).await;
    let answer = post(
        &format!("{url}/chat/completions"),
        &[],
        &json!({"model": "x", "messages": [user("hi")]}),
    )
    .await;
    assert_eq!(answer.status, 404);
    assert_eq!(
        answer.json(),
        json!({"error": {"message": "The model `x` does not exist or you do not have access to it.", "type": "invalid_request_error", "param": null, "code": "model_not_found"}})
    );
    assert!(answer.header("x-request-id").unwrap().starts_with("req_"));
    assert_eq!(fleet.endpoints()[0].requests("x"), 1);
}

#[tokio::test]
async fn rate_limit_headers_and_429() {
    let (_fleet, url) = fleet(spec()).await;
    let url = format!("{url}/chat/completions");
    let body =
        json!({"model": "gpt-4o-mini", "messages": [user("hi")], "max_completion_tokens": 10});
    let ok = post(&url, &[], &body).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.header("x-ratelimit-limit-requests"), Some("1"));
    assert_eq!(ok.header("x-ratelimit-remaining-requests"), Some("0"));
    assert_eq!(ok.header("x-ratelimit-limit-tokens"), Some("1000"));
    assert_eq!(ok.header("x-ratelimit-remaining-tokens"), Some("986"));
    let reset = ok.header("x-ratelimit-reset-requests").unwrap();
    assert!(reset == "1m0s" || reset.starts_with("59."), "{reset}");
    let refused = post(&url, &[], &body).await;
    assert_eq!(refused.status, 429);
    assert!(refused.header("retry-after").is_some());
    let error = &refused.json()["error"];
    assert_eq!(
        (&error["type"], &error["code"]),
        (&json!("requests"), &json!("rate_limit_exceeded"))
    );
    assert!(error["message"]
        .as_str()
        .unwrap()
        .starts_with("Rate limit reached for gpt-4o-mini"));
}

#[tokio::test]
async fn stream_has_role_chunk_first_and_no_filter_chunk() {
    let (_fleet, url) = fleet(spec()).await;
    let body = json!({"model": "gpt-4o-mini", "messages": [user("hi")], "stream": true, "stream_options": {"include_usage": true}});
    let streamed = post_stream(&format!("{url}/chat/completions"), &[], &body).await;
    assert!(streamed.clean_end);
    let chunks = streamed.chunks();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["usage"], json!(null));
    assert!(chunks
        .iter()
        .all(|c| c.get("prompt_filter_results").is_none()));
    assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 4 + 8);
    assert_eq!(streamed.data().last(), Some(&"[DONE]"));
}

#[tokio::test]
async fn max_tokens_truncates_with_length() {
    let (_fleet, url) = fleet(spec()).await;
    let body = json!({"model": "gpt-4o-mini", "messages": [user("hi")], "max_tokens": 3});
    let answer = post(&format!("{url}/chat/completions"), &[], &body)
        .await
        .json();
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "Hello from oai/gpt-4o-mini"
    );
    assert_eq!(answer["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn bearer_key_is_checked() {
    let (_fleet, url) = fleet(spec().api_key("sk-good")).await;
    let url = format!("{url}/models");
    let refused = call(
        Method::GET,
        &url,
        &[("authorization", "Bearer sk-bad")],
        None,
    )
    .await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.json()["error"]["code"], "invalid_api_key");
    let ok = call(
        Method::GET,
        &url,
        &[("authorization", "Bearer sk-good")],
        None,
    )
    .await;
    assert_eq!(ok.status, 200);
}
