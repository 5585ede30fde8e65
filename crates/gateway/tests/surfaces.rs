//! The client surface through real HTTP: paths and dialects, keys, every gateway error code, the
//! `x-onedoor-*` headers on every answer, streaming pass-through, input limits, the admin token.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use tokio::io::AsyncWriteExt;

const CONFIG: &str = r#"max_request_body: 4KiB
regions:
  eu: [swedencentral]
backends:
  - { name: se, provider: azure, region: swedencentral, url: "{url:se}", api_key: se-upstream-secret }
  - { name: us, provider: azure, region: eastus, url: "{url:us}" }
  - { name: compat, provider: openai, region: onprem, url: "{url:compat}", api_key: compat-secret }
models:
  - name: chat
    targets:
      - { backend: se, deployment: gpt-4o }
  - name: embed
    targets:
      - { backend: se, deployment: text-embedding-3-large }
  - name: us-only
    targets:
      - { backend: us, deployment: gpt-4o }
  - name: local
    targets:
      - { backend: compat, model: llama-3.1-70b }
  - name: slow
    targets:
      - { backend: us, deployment: slow }
tenants:
  - name: team
    keys: [{ id: team-key, sha256: KEYHASH }]
  - name: eu-only
    regions: [eu]
    models: [chat, us-only]
    keys: [{ id: eu-key, sha256: OTHERHASH }]
admin: { token: test-admin-token }
"#;

async fn harness() -> Harness {
    harness_with(CONFIG).await
}

async fn harness_with(config: &str) -> Harness {
    let config = config
        .replace("KEYHASH", &key_hash(KEY))
        .replace("OTHERHASH", &key_hash(OTHER_KEY));
    Harness::start(
        vec![
            EndpointSpec::azure("se", "swedencentral")
                .api_key("se-upstream-secret")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .deployment(DeploymentSpec::new("text-embedding-3-large")),
            EndpointSpec::azure("us", "eastus")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .deployment(DeploymentSpec::new("slow")),
            EndpointSpec::openai("compat", "onprem")
                .api_key("compat-secret")
                .deployment(DeploymentSpec::new("llama-3.1-70b")),
        ],
        &config,
    )
    .await
}

async fn as_other(h: &Harness, model: &str) -> Answer {
    let auth = format!("Bearer {OTHER_KEY}");
    h.send(
        Method::POST,
        h.url("/v1/chat/completions"),
        &[("authorization", &auth)],
        Bytes::from(chat_body(model, false).to_string()),
    )
    .await
}

#[tokio::test]
async fn a_chat_completion_answers_with_the_gateway_headers() {
    let h = harness().await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-backend"), "se");
    assert_eq!(answer.header("x-onedoor-region"), "swedencentral");
    assert_eq!(answer.attempts(), "se=200");
    assert_eq!(answer.header("x-onedoor-request-id").len(), 32);
    assert_eq!(answer.header("x-onedoor-usage"), "measured");
    let body = answer.json();
    assert_eq!(body["object"], "chat.completion");
    assert!(body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .contains("se/gpt-4o"));
}

#[tokio::test]
async fn the_key_is_accepted_in_each_of_the_three_headers() {
    let h = harness().await;
    let body = Bytes::from(chat_body("chat", false).to_string());
    let bearer = format!("Bearer {KEY}");
    for header in [
        ("authorization", bearer.as_str()),
        ("api-key", KEY),
        ("x-api-key", KEY),
    ] {
        let answer = h
            .send(
                Method::POST,
                h.url("/v1/chat/completions"),
                &[header],
                body.clone(),
            )
            .await;
        assert_eq!(answer.status, 200, "{}: {}", header.0, answer.body);
    }
}

#[tokio::test]
async fn azure_style_paths_and_an_openai_compatible_backend_answer() {
    let h = harness().await;
    let azure = h
        .post(
            "/openai/deployments/chat/chat/completions?api-version=2024-10-21",
            serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(azure.status, 200, "{}", azure.body);
    let embed = h
        .post(
            "/openai/deployments/embed/embeddings?api-version=2024-10-21",
            serde_json::json!({"input": "hello"}),
        )
        .await;
    assert_eq!(embed.status, 200, "{}", embed.body);
    assert_eq!(embed.json()["object"], "list");
    let v1_embed = h
        .post(
            "/v1/embeddings",
            serde_json::json!({"model": "embed", "input": ["a", "b"]}),
        )
        .await;
    assert_eq!(v1_embed.json()["data"].as_array().unwrap().len(), 2);
    let v1_azure = h
        .post("/openai/v1/chat/completions", chat_body("chat", false))
        .await;
    assert_eq!(v1_azure.status, 200, "{}", v1_azure.body);
    // The OpenAI-compatible backend gets its own model name in the body, and its own key.
    let local = h.chat("local").await;
    assert_eq!(local.status, 200, "{}", local.body);
    assert!(local.body.contains("llama-3.1-70b"), "{}", local.body);
    assert_eq!(h.endpoint("compat").requests("llama-3.1-70b"), 1);
}

#[tokio::test]
async fn models_lists_only_the_aliases_the_key_may_use() {
    let h = harness().await;
    let auth = format!("Bearer {OTHER_KEY}");
    let answer = h
        .send(
            Method::GET,
            h.url("/v1/models"),
            &[("authorization", &auth)],
            Bytes::new(),
        )
        .await;
    assert_eq!(answer.status, 200);
    let ids: Vec<String> = answer.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["chat", "us-only"]);
}

#[tokio::test]
async fn every_gateway_error_has_its_status_code_and_headers() {
    let h = harness().await;
    let no_key = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[],
            Bytes::from("{}"),
        )
        .await;
    let bad_key = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[("authorization", "Bearer nope")],
            Bytes::from(chat_body("chat", false).to_string()),
        )
        .await;
    let not_allowed = as_other(&h, "embed").await;
    let unknown = h.chat("no-such-alias").await;
    let outside_regions = as_other(&h, "us-only").await;
    let malformed = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[("api-key", KEY)],
            Bytes::from_static(b"{\"model\": \"chat\", "),
        )
        .await;
    let missing_messages = h
        .post("/v1/chat/completions", serde_json::json!({"model": "chat"}))
        .await;
    let too_large = h
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(5000)}]}),
        )
        .await;
    let cases = [
        (&no_key, 401, "invalid_api_key"),
        (&bad_key, 401, "invalid_api_key"),
        (&not_allowed, 403, "model_not_allowed"),
        (&unknown, 404, "model_not_found"),
        (&outside_regions, 503, "no_backend_available"),
        (&malformed, 400, "invalid_request"),
        (&missing_messages, 400, "invalid_request"),
        (&too_large, 413, "request_too_large"),
    ];
    for (answer, status, code) in cases {
        assert_eq!(answer.status, status, "{code}: {}", answer.body);
        assert_eq!(answer.code(), code, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-error"), code);
        assert_eq!(answer.header("x-onedoor-request-id").len(), 32);
        assert!(answer.headers.contains_key("x-onedoor-attempts"));
        assert!(!answer.body.contains(KEY) && !answer.body.contains("se-upstream-secret"));
    }
    assert!(
        malformed.body.contains("not valid JSON"),
        "{}",
        malformed.body
    );
    assert!(
        outside_regions.body.contains("regions"),
        "{}",
        outside_regions.body
    );
    assert_eq!(
        h.endpoint("us").total_requests(),
        0,
        "a request left the tenant's regions"
    );
}

#[tokio::test]
async fn a_declared_body_over_the_limit_is_refused_before_it_is_read() {
    let h = harness().await;
    let mut stream = tokio::net::TcpStream::connect(h.gateway.addr())
        .await
        .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-length: 10000000\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut reply = vec![0u8; 4096];
    let n = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut stream, &mut reply),
    )
    .await
    .expect("answered without the body")
    .unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
}

#[tokio::test]
async fn a_large_body_from_an_unknown_key_is_refused_at_its_key_without_being_read() {
    let h = harness_with(&CONFIG.replace("max_request_body: 4KiB", "max_request_body: 1MiB")).await;
    let mut stream = tokio::net::TcpStream::connect(h.gateway.addr())
        .await
        .unwrap();
    // 600 KB declared (under the limit), 100 KB sent: an answer needs no more of it.
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer nope\r\ncontent-length: 600000\r\n\r\n";
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&[b'x'; 100_000]).await.unwrap();
    let mut reply = vec![0u8; 4096];
    let n = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::io::AsyncReadExt::read(&mut stream, &mut reply),
    )
    .await
    .expect("answered without the rest of the body")
    .unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]);
    assert!(reply.starts_with("HTTP/1.1 401"), "{reply}");
    assert!(reply.contains("invalid_api_key"), "{reply}");
    let known = h
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "x".repeat(100_000)}]}),
        )
        .await;
    assert_eq!(known.status, 200, "{}", known.body);
}

#[tokio::test]
async fn a_stream_passes_through_and_azure_filter_chunks_are_dropped_on_v1_only() {
    let h = harness().await;
    let v1 = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(v1.status, 200);
    assert_eq!(v1.header("content-type"), "text/event-stream");
    assert!(v1.body.ends_with("data: [DONE]\n\n"), "{}", v1.body);
    assert!(!v1.body.contains("prompt_filter_results"), "{}", v1.body);
    assert!(
        v1.body.contains("\"finish_reason\":\"stop\""),
        "{}",
        v1.body
    );
    let azure = h
        .post(
            "/openai/deployments/chat/chat/completions?api-version=2024-10-21",
            serde_json::json!({"stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    let first = azure.body.split("\n\n").next().unwrap_or("");
    assert!(
        first.contains("\"choices\":[]") && first.contains("prompt_filter_results"),
        "{}",
        azure.body
    );
    assert!(azure.body.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn a_stream_cut_after_content_ends_with_an_explicit_error_event() {
    let h = harness().await;
    h.endpoint("se").set_behavior(Behavior {
        cut_after: Some(3),
        ..Behavior::default()
    });
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(answer.status, 200);
    let last = answer.body.trim_end().lines().last().unwrap_or("");
    assert!(last.starts_with("data: {\"error\""), "{}", answer.body);
    assert!(!answer.body.contains("[DONE]"), "{}", answer.body);
    assert!(
        !answer.body.contains("\"finish_reason\":\"stop\""),
        "{}",
        answer.body
    );
}

#[tokio::test]
async fn a_client_that_goes_away_cancels_the_upstream_call() {
    let h = harness().await;
    h.endpoint("us").set_behavior(Behavior {
        hang: true,
        ..Behavior::default()
    });
    let body = chat_body("slow", false).to_string();
    let stream = h.post_on_socket("/v1/chat/completions", &body).await;
    let us = h.endpoint("us");
    assert!(eventually(|| us.requests("slow") == 1).await);
    drop(stream);
    assert!(
        eventually(|| us.cancelled() == 1).await,
        "the upstream call was not cancelled"
    );
}

#[tokio::test]
async fn health_and_readiness_answer_without_a_key() {
    let h = harness().await;
    for path in ["/healthz", "/readyz"] {
        let answer = h.send(Method::GET, h.url(path), &[], Bytes::new()).await;
        assert_eq!(answer.status, 200, "{path}");
        assert!(answer.headers.contains_key("x-onedoor-request-id"));
    }
    let unknown = h
        .send(Method::GET, h.url("/v2/nothing"), &[], Bytes::new())
        .await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test]
async fn the_admin_api_requires_its_token() {
    let h = harness().await;
    assert_eq!(h.admin_get("/admin/backends", None).await.status, 401);
    assert_eq!(
        h.admin_get("/admin/backends", Some("wrong")).await.status,
        401
    );
    assert_eq!(h.admin_get("/admin/backends", Some(KEY)).await.status, 401);
    let answer = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["backends"].as_array().unwrap().len(), 3);
    assert!(!answer.body.contains("se-upstream-secret"));
}
