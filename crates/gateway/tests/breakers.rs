//! Circuit breakers through real HTTP (contract section 2 `circuit_breakers`, section 2.1 rule 1):
//! a tripped backend gets no traffic, then one probe at a time, then rejoins; `accept_retry_after`
//! trips for exactly the upstream's Retry-After; every breaker open answers 503 `circuit_open`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;

fn azure(name: &str, deployments: &[&str]) -> EndpointSpec {
    deployments
        .iter()
        .fold(EndpointSpec::azure(name, "swedencentral"), |spec, d| {
            spec.deployment(DeploymentSpec::new(d))
        })
}

fn failing(status: u16) -> Behavior {
    Behavior {
        status: Some(status),
        ..Behavior::default()
    }
}

/// `backends:` with each (name, policy) behind that circuit breaker policy.
fn backends(list: &[(&str, &str)]) -> String {
    let mut out = String::from("backends:\n");
    for (name, policy) in list {
        out.push_str(&format!(
            "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\", circuit_breaker: {policy} }}\n"
        ));
    }
    out
}

/// An alias `name` over `deployment` on each backend, all in one priority group.
fn alias(name: &str, deployment: &str, on: &[&str]) -> String {
    let mut out = format!("  - name: {name}\n    targets:\n");
    for backend in on {
        out.push_str(&format!(
            "      - {{ backend: {backend}, deployment: {deployment} }}\n"
        ));
    }
    out
}

/// The `breaker` object of `backend` in `GET /admin/backends`.
async fn breaker(h: &Harness, backend: &str) -> serde_json::Value {
    let answer = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["backends"]
        .as_array()
        .and_then(|list| list.iter().find(|b| b["name"] == backend))
        .map(|b| b["breaker"].clone())
        .unwrap_or_else(|| panic!("no backend {backend}: {}", answer.body))
}

/// Polls the admin API until `backend`'s breaker is in `state`, for up to 5 s.
async fn until_breaker(h: &Harness, backend: &str, state: &str) {
    for _ in 0..250 {
        if breaker(h, backend).await["state"] == state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{backend}'s breaker never became {state}");
}

#[tokio::test]
async fn a_backend_returning_500s_is_tripped_gets_no_traffic_then_one_probe_then_rejoins() {
    let h = Harness::start(
        vec![
            azure("bad", &["gpt-4o"]).behavior(failing(500)),
            azure("good", &["gpt-4o"]),
        ],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: server-errors, failures: {{ count: 3, within: 60s, status: [500-599] }}, trip: 1s }}] }} }}\n{}models:\n{}",
            backends(&[("bad", "default"), ("good", "default")]),
            alias("chat", "gpt-4o", &["bad", "good"])
        ),
    )
    .await;
    let bad = h.endpoint("bad");
    for _ in 0..20 {
        if bad.total_requests() == 3 {
            break;
        }
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    assert_eq!(bad.total_requests(), 3);
    let tripped = Instant::now();
    let state = breaker(&h, "bad").await;
    assert_eq!(state["state"], "open", "{state}");
    assert_eq!(state["trips"], 1);
    assert!(state["next_probe_in_ms"]
        .as_u64()
        .is_some_and(|ms| ms <= 1000));

    for _ in 0..20 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.attempts(), "good=200");
    }
    assert!(
        tripped.elapsed() < Duration::from_millis(900),
        "too slow to prove the trip"
    );
    assert_eq!(bad.total_requests(), 3, "a tripped backend got traffic");

    // Healthy again but slow, so the probe is still in flight while a burst arrives: exactly one
    // request of the burst reaches it, the others pass it over.
    bad.set_behavior(Behavior {
        ttft_ms: 500,
        ..Behavior::default()
    });
    until_breaker(&h, "bad", "half_open").await;
    let h = Arc::new(h);
    let burst: Vec<_> = (0..20)
        .map(|_| {
            let h = h.clone();
            tokio::spawn(async move { h.chat("chat").await })
        })
        .collect();
    for request in burst {
        let answer = request.await.unwrap();
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    assert_eq!(h.endpoint("bad").total_requests(), 4, "exactly one probe");
    assert_eq!(breaker(&h, "bad").await["state"], "closed");

    h.endpoint("bad").set_behavior(Behavior::default());
    for _ in 0..100 {
        if h.endpoint("bad").total_requests() > 4 {
            break;
        }
        assert_eq!(h.chat("chat").await.status, 200);
    }
    assert!(
        h.endpoint("bad").total_requests() > 4,
        "did not rejoin rotation"
    );
}

#[tokio::test]
async fn accept_retry_after_keeps_a_429ing_backend_out_for_its_retry_after_no_longer() {
    let h = Harness::start(
        vec![
            azure("hot", &["gpt-4o", "gpt-4o-mini"]).behavior(Behavior {
                status: Some(429),
                retry_after_s: Some(1),
                ..Behavior::default()
            }),
            azure("cool", &["gpt-4o", "gpt-4o-mini"]),
        ],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: throttled, failures: {{ count: 1, within: 10s, status: [429] }}, trip: 10s, accept_retry_after: true }}] }} }}\n{}models:\n{}{}",
            backends(&[("hot", "default"), ("cool", "default")]),
            alias("chat", "gpt-4o", &["hot", "cool"]),
            alias("mini", "gpt-4o-mini", &["hot", "cool"])
        ),
    )
    .await;
    let hot = h.endpoint("hot");
    for _ in 0..10 {
        if hot.total_requests() == 1 {
            break;
        }
        assert_eq!(h.chat("chat").await.status, 200);
    }
    assert_eq!(hot.requests("gpt-4o"), 1);
    let tripped = Instant::now();
    hot.set_behavior(Behavior::default());
    // The 429 cooled down only (hot, gpt-4o); the breaker keeps all of hot out, so `mini`
    // requests show how long it stays out.
    while hot.requests("gpt-4o-mini") == 0 && tripped.elapsed() < Duration::from_secs(5) {
        let answer = h.chat("mini").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let out_for = tripped.elapsed();
    assert_eq!(hot.requests("gpt-4o-mini"), 1, "hot never came back");
    assert!(
        out_for >= Duration::from_millis(900),
        "back after {out_for:?}, before its Retry-After"
    );
    assert!(
        out_for < Duration::from_secs(2),
        "back after {out_for:?}, longer than its Retry-After"
    );
    let state = breaker(&h, "hot").await;
    assert_eq!(state["state"], "closed", "{state}");
    assert_eq!(state["trips"], 1);
}

#[tokio::test]
async fn every_backend_open_answers_circuit_open_with_the_soonest_half_open() {
    let h = Harness::start(
        vec![
            azure("a", &["gpt-4o"]).behavior(failing(500)),
            azure("b", &["gpt-4o"]).behavior(failing(503)),
        ],
        &format!(
            "circuit_breakers:\n  quick: {{ rules: [{{ name: any-5xx, failures: {{ count: 1, within: 60s, status: [5xx] }}, trip: 3s }}] }}\n  slow: {{ rules: [{{ name: any-5xx, failures: {{ count: 1, within: 60s, status: [5xx] }}, trip: 30s }}] }}\n{}models:\n{}",
            backends(&[("a", "quick"), ("b", "slow")]),
            alias("chat", "gpt-4o", &["a", "b"])
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 502, "{}", answer.body);
    assert_eq!(answer.code(), "upstream_failed");

    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.code(), "circuit_open");
    assert_eq!(answer.header("x-onedoor-error"), "circuit_open");
    assert_eq!(answer.attempts(), "");
    assert_eq!(answer.header("retry-after"), "3");
    let ms: u64 = answer.header("retry-after-ms").parse().unwrap();
    assert!((2000..=3000).contains(&ms), "retry-after-ms {ms}");
    assert_eq!(
        h.endpoint("a").total_requests() + h.endpoint("b").total_requests(),
        2
    );
}
