//! Tenants and keys through real HTTP (contract sections 2 `tenants` and 3 errors): limits on the
//! tenant, tightened per key, answer 429 `rate_limited` or 403 `quota_exceeded` before any
//! upstream is asked; every answer carries the caller's `x-ratelimit-*`; `/admin/tenants` shows
//! the usage; a tenant held to `eu` never reaches a `us` backend, whatever fails.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;

use common::*;

fn azure(name: &str, region: &str) -> EndpointSpec {
    EndpointSpec::azure(name, region).deployment(DeploymentSpec::new("gpt-4o"))
}

/// Backend `a` serving `chat` (priced), and the team with `tenant` (YAML lines after `keys`).
fn config(tenant: &str, key_limits: &str) -> String {
    format!(
        "backends:\n  - {{ name: a, provider: azure, region: swedencentral, url: \"{{url:a}}\" }}\nmodels:\n  - name: chat\n    price: {{ input_per_1m: 2.5, output_per_1m: 10 }}\n    targets: [{{ backend: a, deployment: gpt-4o }}]\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {}{key_limits} }}]\n{tenant}",
        key_hash(KEY)
    )
}

/// 20 tokens reserved (12 prompt + 8 completion) and 20 measured, as in shared_state.rs.
fn twenty_tokens() -> serde_json::Value {
    serde_json::json!({
        "model": "chat",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there, internationalization"}]
    })
}

#[tokio::test]
async fn an_rpm_limit_answers_429_rate_limited_with_retry_after_and_never_asks_upstream() {
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config("    limits: { rpm: 3 }\n", ""),
    )
    .await;
    for left in ["2", "1", "0"] {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-ratelimit-limit-requests"), "3");
        assert_eq!(answer.header("x-ratelimit-remaining-requests"), left);
        assert_eq!(
            answer.header("x-ratelimit-limit-tokens"),
            "",
            "no tpm, no token headers"
        );
    }
    let refused = h.chat("chat").await;
    assert_eq!(refused.status, 429);
    assert_eq!(refused.code(), "rate_limited");
    assert_eq!(refused.json()["error"]["type"], "rate_limit_error");
    let wait: u64 = refused.header("retry-after").parse().unwrap();
    assert!((59..=60).contains(&wait), "retry-after {wait}");
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), "0");
    assert_eq!(refused.attempts(), "");
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 3);
}

#[tokio::test]
async fn a_key_limit_tightens_the_tenant_limit() {
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config("    limits: { rpm: 100 }\n", ", limits: { rpm: 2 }"),
    )
    .await;
    assert_eq!(
        h.chat("chat")
            .await
            .header("x-ratelimit-remaining-requests"),
        "1"
    );
    assert_eq!(h.chat("chat").await.status, 200);
    let refused = h.chat("chat").await;
    assert_eq!(refused.status, 429);
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("key `team-key` allows 2 requests per minute"),
        "{message}"
    );
}

#[tokio::test]
async fn tpm_counts_the_estimate_then_the_measured_usage() {
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config("    limits: { tpm: 50 }\n", ""),
    )
    .await;
    let first = h.post("/v1/chat/completions", twenty_tokens()).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.header("x-ratelimit-remaining-tokens"), "30");
    assert_eq!(
        h.post("/v1/chat/completions", twenty_tokens()).await.status,
        200
    );
    let refused = h.post("/v1/chat/completions", twenty_tokens()).await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    // A request that can never fit says so.
    let huge = serde_json::json!({"model": "chat", "max_tokens": 5000, "messages": [{"role": "user", "content": "hi"}]});
    let never = h.post("/v1/chat/completions", huge).await;
    assert_eq!(never.status, 429);
    assert!(never.body.contains("lower max_tokens"), "{}", never.body);
}

#[tokio::test]
async fn max_in_flight_refuses_the_request_over_the_cap_while_one_is_under_way() {
    let slow = Behavior {
        ttft_ms: 400,
        ..Behavior::default()
    };
    let h = Arc::new(
        Harness::start(
            vec![azure("a", "swedencentral").behavior(slow)],
            &config("    limits: { max_in_flight: 1 }\n", ""),
        )
        .await,
    );
    let first = tokio::spawn({
        let h = h.clone();
        async move { h.chat("chat").await }
    });
    assert!(eventually(|| h.endpoint("a").requests("gpt-4o") == 1).await);
    let second = h.chat("chat").await;
    assert_eq!(second.status, 429);
    assert!(
        second.body.contains("1 requests in flight"),
        "{}",
        second.body
    );
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(h.chat("chat").await.status, 200, "the slot is free again");
}

#[tokio::test]
async fn tokens_per_day_is_a_period_quota_answered_403_quota_exceeded() {
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config("    limits: { tokens_per_day: 45 }\n", ""),
    )
    .await;
    assert_eq!(
        h.post("/v1/chat/completions", twenty_tokens()).await.status,
        200
    );
    assert_eq!(
        h.post("/v1/chat/completions", twenty_tokens()).await.status,
        200
    );
    let refused = h.post("/v1/chat/completions", twenty_tokens()).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(refused.code(), "quota_exceeded");
    assert_eq!(refused.json()["error"]["type"], "permission_error");
    assert!(
        refused.body.contains("tokens_per_day of 45 has 40 used"),
        "{}",
        refused.body
    );
    let wait: u64 = refused.header("retry-after").parse().unwrap();
    assert!(wait <= 86_400);
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 2);
}

#[tokio::test]
async fn usd_per_month_charges_the_measured_tokens_at_the_target_price() {
    // 12 prompt tokens at $2.50/M and 8 completion tokens at $10/M: $0.00011 a request.
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config("    limits: { usd_per_month: 0.0003 }\n", ""),
    )
    .await;
    for _ in 0..2 {
        assert_eq!(
            h.post("/v1/chat/completions", twenty_tokens()).await.status,
            200
        );
    }
    let refused = h.post("/v1/chat/completions", twenty_tokens()).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(refused.code(), "quota_exceeded");
    let admin = h.admin_get("/admin/tenants", Some(ADMIN_TOKEN)).await;
    let usd = &admin.json()["tenants"][0]["limits"]["usd_per_month"];
    assert!(
        (usd["used"].as_f64().unwrap() - 0.00022).abs() < 1e-9,
        "{}",
        admin.body
    );
    assert_eq!(usd["window"], "UTC month");
}

#[tokio::test]
async fn admin_tenants_shows_usage_against_every_limit_in_its_window() {
    let h = Harness::start(
        vec![azure("a", "swedencentral")],
        &config(
            "    limits: { rpm: 10, tpm: 1000, max_in_flight: 5, tokens_per_day: 100000 }\n",
            ", limits: { rpm: 5 }",
        ),
    )
    .await;
    h.post("/v1/chat/completions", twenty_tokens()).await;
    h.post("/v1/chat/completions", twenty_tokens()).await;
    let admin = h.admin_get("/admin/tenants", Some(ADMIN_TOKEN)).await;
    assert_eq!(admin.status, 200, "{}", admin.body);
    let body = admin.json();
    let team = &body["tenants"][0];
    assert_eq!(team["name"], "team");
    assert_eq!(team["limits"]["rpm"]["used"], 2);
    assert_eq!(team["limits"]["rpm"]["remaining"], 8);
    assert_eq!(team["limits"]["tpm"]["used"], 40);
    assert_eq!(team["limits"]["max_in_flight"]["used"], 0);
    assert_eq!(team["limits"]["tokens_per_day"]["used"], 40);
    assert!(
        team["limits"]["tokens_per_day"]["resets_in_ms"]
            .as_u64()
            .unwrap()
            <= 86_400_000
    );
    assert_eq!(team["keys"][0]["id"], "team-key");
    assert_eq!(team["keys"][0]["limits"]["rpm"]["used"], 2);
    assert_eq!(body["state_store"]["store"], "memory");
    let unauthorized = h.admin_get("/admin/tenants", None).await;
    assert_eq!(unauthorized.status, 401);
}

#[tokio::test]
async fn a_tenant_held_to_eu_never_reaches_a_us_backend_even_when_every_eu_backend_fails() {
    let failing = Behavior {
        status: Some(500),
        ..Behavior::default()
    };
    let h = Harness::start(
        vec![
            azure("se", "swedencentral").behavior(failing.clone()),
            azure("fr", "francecentral").behavior(failing),
            azure("us", "eastus"),
        ],
        &format!(
            "regions: {{ eu: [swedencentral, francecentral], us: [eastus] }}\nbackends:\n  - {{ name: se, provider: azure, region: swedencentral, url: \"{{url:se}}\" }}\n  - {{ name: fr, provider: azure, region: francecentral, url: \"{{url:fr}}\" }}\n  - {{ name: us, provider: azure, region: eastus, url: \"{{url:us}}\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: se, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: fr, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: us, deployment: gpt-4o, priority: 2 }}\ntenants:\n  - name: team\n    regions: [eu]\n    keys: [{{ id: team-key, sha256: {} }}]\n  - name: other\n    keys: [{{ id: other-key, sha256: {} }}]\n",
            key_hash(KEY),
            key_hash(OTHER_KEY)
        ),
    )
    .await;
    for _ in 0..20 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 502, "{}", answer.body);
        assert_eq!(answer.code(), "upstream_failed");
        assert!(!answer.attempts().contains("us="), "{}", answer.attempts());
        assert!(
            answer.body.contains("outside the regions this key may use"),
            "{}",
            answer.body
        );
    }
    // The counter-proof: the us backend was never asked, yet it works for a tenant allowed there.
    assert_eq!(h.endpoint("us").total_requests(), 0);
    assert!(h.endpoint("se").total_requests() + h.endpoint("fr").total_requests() >= 20);
    let auth = format!("Bearer {OTHER_KEY}");
    let other = h
        .send(
            http::Method::POST,
            h.url("/v1/chat/completions"),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            bytes::Bytes::from(chat_body("chat", false).to_string()),
        )
        .await;
    assert_eq!(other.status, 200);
    assert_eq!(other.header("x-onedoor-backend"), "us");
}

#[tokio::test]
async fn a_tenant_whose_regions_have_no_backend_gets_503_with_the_reason() {
    let h = Harness::start(
        vec![azure("us", "eastus")],
        &format!(
            "regions: {{ eu: [swedencentral], us: [eastus] }}\nbackends:\n  - {{ name: us, provider: azure, region: eastus, url: \"{{url:us}}\" }}\nmodels:\n  - {{ name: chat, targets: [{{ backend: us, deployment: gpt-4o }}] }}\ntenants:\n  - name: team\n    regions: [eu]\n    keys: [{{ id: team-key, sha256: {} }}]\n",
            key_hash(KEY)
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 503);
    assert_eq!(answer.code(), "no_backend_available");
    assert!(
        answer
            .body
            .contains("no backend in the regions this key may use serves `chat`"),
        "{}",
        answer.body
    );
    assert_eq!(h.endpoint("us").total_requests(), 0);
}
