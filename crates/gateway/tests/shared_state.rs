//! Two and three gateway instances, each with its own runtime, sharing one real Redis
//! (127.0.0.1:6379, a key prefix of their own per run): a tenant's rpm, tpm, max_in_flight and
//! tokens_per_day hold exactly across all of them under concurrent load, a 404 learned by one is
//! skipped by the other without asking, and a target's breaker tripped on one is open on the
//! other. The memory-state twin of the first test shows why Redis is there: each instance counts
//! alone.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod instances;

use std::sync::Arc;

use common::*;
use instances::*;

fn backend(name: &str) -> String {
    format!(
        "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\" }}\n"
    )
}

/// One backend `a` serving `chat`, and the team limited by `limits`, with `state`.
fn limited(limits: &str, state: &str) -> String {
    format!(
        "{state}backends:\n{}models:\n  - {{ name: chat, targets: [{{ backend: a, deployment: gpt-4o }}] }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {limits}\n",
        backend("a"),
        key_hash(KEY)
    )
}

async fn two_instances(config: &str) -> (Arc<Harness>, Vec<Arc<onedoor_gateway::Running>>) {
    instances(2, Behavior::default(), config).await
}

/// `count` instances with `config` in front of backend `a`, which answers with `behavior`.
async fn instances(
    count: usize,
    behavior: Behavior,
    config: &str,
) -> (Arc<Harness>, Vec<Arc<onedoor_gateway::Running>>) {
    let h = Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o"))
            .behavior(behavior)],
        config,
    )
    .await;
    let mut gateways = Vec::with_capacity(count);
    for _ in 0..count {
        gateways.push(Arc::new(another(&h, config).await));
    }
    (Arc::new(h), gateways)
}

#[tokio::test]
async fn rpm_100_across_two_instances_sharing_redis_admits_exactly_100_of_300() {
    let config = limited("{ rpm: 100 }", &shared_state("rpm"));
    let (h, gateways) = two_instances(&config).await;
    let answers = spread(&h, &gateways, chat_body("chat", false), 300, 16).await;
    assert_eq!(tally(&answers), (100, 200, 0));
    let refused = answers.iter().find(|a| a.status == 429).unwrap();
    assert_eq!(refused.code(), "rate_limited");
    assert_eq!(refused.header("x-onedoor-error"), "rate_limited");
    assert!(!refused.header("retry-after").is_empty());
    assert_eq!(refused.header("x-ratelimit-limit-requests"), "100");
    assert_eq!(refused.header("x-ratelimit-remaining-requests"), "0");
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 100);
}

#[tokio::test]
async fn rpm_100_across_two_instances_with_memory_state_admits_200_of_300() {
    // Why Redis exists: each instance holds the limit on its own, so two of them admit twice.
    let (h, gateways) = two_instances(&limited("{ rpm: 100 }", "")).await;
    let answers = spread(&h, &gateways, chat_body("chat", false), 300, 16).await;
    assert_eq!(tally(&answers), (200, 100, 0));
}

/// A prompt whose o200k count (12 with the chat overhead, as tiktoken counts it) is also what the
/// simulated upstream reports, and a `max_tokens` it uses whole: reserved and measured are both
/// 20 tokens, so the count of admitted requests does not depend on when each one settles.
fn twenty_tokens() -> serde_json::Value {
    serde_json::json!({
        "model": "chat",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there, internationalization"}]
    })
}

#[tokio::test]
async fn tpm_1000_across_two_instances_sharing_redis_admits_exactly_50_requests_of_20_tokens() {
    let config = limited("{ tpm: 1000 }", &shared_state("tpm"));
    let (h, gateways) = two_instances(&config).await;
    let first = chat_on(&h, &gateways[0], &twenty_tokens()).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.json()["usage"]["total_tokens"], 20);
    assert_eq!(first.header("x-ratelimit-limit-tokens"), "1000");
    assert_eq!(first.header("x-ratelimit-remaining-tokens"), "980");
    let answers = spread(&h, &gateways, twenty_tokens(), 149, 16).await;
    assert_eq!(tally(&answers), (49, 100, 0));
    let refused = answers.iter().find(|a| a.status == 429).unwrap();
    assert_eq!(refused.code(), "rate_limited");
    assert!(
        refused.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("prompt estimate 12 + completion budget 8"),
        "{}",
        refused.body
    );
}

#[tokio::test]
async fn rpm_100_across_three_instances_sharing_redis_admits_exactly_100_of_300() {
    let config = limited("{ rpm: 100 }", &shared_state("rpm-3"));
    let (h, gateways) = instances(3, Behavior::default(), &config).await;
    let answers = spread(&h, &gateways, chat_body("chat", false), 300, 24).await;
    assert_eq!(tally(&answers), (100, 200, 0));
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 100);
}

#[tokio::test]
async fn tpm_1000_across_three_instances_sharing_redis_admits_exactly_50_requests_of_20_tokens() {
    let config = limited("{ tpm: 1000 }", &shared_state("tpm-3"));
    let (h, gateways) = instances(3, Behavior::default(), &config).await;
    let answers = spread(&h, &gateways, twenty_tokens(), 150, 24).await;
    assert_eq!(tally(&answers), (50, 100, 0));
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 50);
}

/// `count` instances sharing tokens_per_day 1000: of 150 requests of 20 tokens sent 24 at a
/// time, exactly 50 are admitted and the rest answered 403 quota_exceeded.
async fn tokens_per_day_holds_across(count: usize) {
    let test = format!("tokens-per-day-{count}");
    let config = limited("{ tokens_per_day: 1000 }", &shared_state(&test));
    let (h, gateways) = instances(count, Behavior::default(), &config).await;
    let answers = spread(&h, &gateways, twenty_tokens(), 150, 24).await;
    assert_eq!(tally(&answers), (50, 0, 100));
    assert!(answers
        .iter()
        .filter(|a| a.status != 200)
        .all(|a| a.status == 403 && a.code() == "quota_exceeded"));
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 50);
}

#[tokio::test]
async fn tokens_per_day_1000_across_two_instances_sharing_redis_admits_exactly_50_of_150() {
    tokens_per_day_holds_across(2).await;
}

#[tokio::test]
async fn tokens_per_day_1000_across_three_instances_sharing_redis_admits_exactly_50_of_150() {
    tokens_per_day_holds_across(3).await;
}

/// `count` instances sharing max_in_flight 4, in front of an upstream that takes 800 ms: of 24
/// requests sent at once, exactly 4 are admitted; once they are answered, their slots are free
/// on every instance.
async fn max_in_flight_holds_across(count: usize) {
    let test = format!("in-flight-{count}");
    let config = limited("{ max_in_flight: 4 }", &shared_state(&test));
    let slow = Behavior {
        ttft_ms: 800,
        ..Behavior::default()
    };
    let (h, gateways) = instances(count, slow, &config).await;
    let answers = spread(&h, &gateways, chat_body("chat", false), 24, 24).await;
    assert_eq!(tally(&answers), (4, 20, 0));
    let refused = answers.iter().find(|a| a.status == 429).unwrap();
    assert!(
        refused.body.contains("4 requests in flight"),
        "{}",
        refused.body
    );
    assert_eq!(h.endpoint("a").requests("gpt-4o"), 4);
    for gateway in &gateways {
        let freed = until(std::time::Duration::from_secs(3), || async {
            chat_on(&h, gateway, &chat_body("chat", false)).await.status == 200
        })
        .await;
        assert!(freed, "the slots are free again on {}", gateway.addr());
    }
}

#[tokio::test]
async fn max_in_flight_4_across_two_instances_sharing_redis_admits_exactly_4_of_24_at_once() {
    max_in_flight_holds_across(2).await;
}

#[tokio::test]
async fn max_in_flight_4_across_three_instances_sharing_redis_admits_exactly_4_of_24_at_once() {
    max_in_flight_holds_across(3).await;
}

#[tokio::test]
async fn a_deployment_one_instance_learned_is_missing_is_skipped_by_the_other_without_asking() {
    let config = format!(
        "{}backends:\n{}{}models:\n  - name: chat\n    targets:\n      - {{ backend: lacks, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: has, deployment: gpt-4o, priority: 2 }}\n",
        shared_state("not-served"),
        backend("lacks"),
        backend("has"),
    );
    let h = Harness::start(
        vec![
            EndpointSpec::azure("lacks", "swedencentral").deployment(DeploymentSpec::new("other")),
            EndpointSpec::azure("has", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        &config,
    )
    .await;
    let b = another(&h, &config).await;
    let first = h.chat("chat").await;
    assert_eq!(first.attempts(), "lacks=404,has=200");
    let on_b = chat_on(&h, &b, &chat_body("chat", false)).await;
    assert_eq!(on_b.status, 200);
    assert_eq!(on_b.attempts(), "has=200");
    assert_eq!(
        h.endpoint("lacks").requests("gpt-4o"),
        1,
        "B asked the backend A learned from"
    );
    let admin = admin_get_on(&h, &b, "/admin/backends").await;
    assert!(
        admin
            .body
            .contains("\"not_served\":[{\"deployment\":\"gpt-4o\""),
        "{}",
        admin.body
    );
}

#[tokio::test]
async fn a_targets_breaker_tripped_on_one_instance_is_open_on_the_other_and_its_backend_stays_served(
) {
    let config = format!(
        "{}circuit_breakers:\n  trip-once:\n    rules: [{{ name: server-errors, failures: {{ count: 1, within: 60s, status: [500-599] }}, trip: 30s }}]\nbackends:\n  - {{ name: bad, provider: azure, region: swedencentral, url: \"{{url:bad}}\", circuit_breaker: trip-once }}\n{}models:\n  - name: chat\n    targets:\n      - {{ backend: bad, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: good, deployment: gpt-4o, priority: 2 }}\n  - name: mini\n    targets:\n      - {{ backend: bad, deployment: gpt-4o-mini, priority: 1 }}\n      - {{ backend: good, deployment: gpt-4o, priority: 2 }}\n",
        shared_state("breaker"),
        backend("good"),
    );
    let h = Harness::start(
        vec![
            EndpointSpec::azure("bad", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .deployment(DeploymentSpec::new("gpt-4o-mini")),
            EndpointSpec::azure("good", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        &config,
    )
    .await;
    h.endpoint("bad").set_deployment_behavior(
        "gpt-4o",
        Behavior {
            status: Some(500),
            ..Behavior::default()
        },
    );
    let b = another(&h, &config).await;
    let first = h.chat("chat").await;
    assert_eq!(first.status, 200);
    assert_eq!(first.attempts(), "bad=500,good=200");
    for _ in 0..5 {
        let on_b = chat_on(&h, &b, &chat_body("chat", false)).await;
        assert_eq!(on_b.attempts(), "good=200");
        let on_b = chat_on(&h, &b, &chat_body("mini", false)).await;
        assert_eq!(on_b.attempts(), "bad=200");
    }
    assert_eq!(h.endpoint("bad").requests("gpt-4o"), 1);
    let admin = admin_get_on(&h, &b, "/admin/backends").await;
    let bad = &admin.json()["backends"][0];
    assert_eq!(bad["name"], "bad");
    let breaker = &bad["breaker"];
    assert_eq!(breaker["state"], "closed", "{}", admin.body);
    assert_eq!(breaker["targets"][0]["deployment"], "gpt-4o");
    assert_eq!(breaker["targets"][0]["state"], "open", "{}", admin.body);
    assert_eq!(breaker["targets"][0]["trips"], 1);
    assert_eq!(breaker["targets"][1]["state"], "closed");
}
