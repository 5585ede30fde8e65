//! Circuit breakers through real HTTP (contract section 2 `circuit_breakers`, section 2.1 rule 1):
//! a tripped target gets no traffic, then one probe at a time, then rejoins; one deployment's
//! failures open only its target's breaker, connection refusals the whole backend's; a target
//! that recovers after a long outage is back within the backoff's cap; `accept_retry_after` trips
//! for exactly the upstream's Retry-After; every breaker open answers 503 `circuit_open`.

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

/// An alias `name` over `deployment` on each backend, each a priority after the one before.
fn prioritized(name: &str, deployment: &str, on: &[&str]) -> String {
    let mut out = format!("  - name: {name}\n    targets:\n");
    for (i, backend) in on.iter().enumerate() {
        out.push_str(&format!(
            "      - {{ backend: {backend}, deployment: {deployment}, priority: {} }}\n",
            i + 1
        ));
    }
    out
}

/// The breaker of target (`backend`, `deployment`) in `GET /admin/backends`.
async fn target_breaker(h: &Harness, backend: &str, deployment: &str) -> serde_json::Value {
    let state = breaker(h, backend).await;
    state["targets"]
        .as_array()
        .and_then(|list| list.iter().find(|t| t["deployment"] == deployment))
        .cloned()
        .unwrap_or_else(|| panic!("no target {backend}/{deployment}: {state}"))
}

/// Polls the admin API until the breaker of (`backend`, `deployment`) is in `state`, for up to 5 s.
async fn until_target_breaker(h: &Harness, backend: &str, deployment: &str, state: &str) {
    for _ in 0..250 {
        if target_breaker(h, backend, deployment).await["state"] == state {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{backend}/{deployment}'s breaker never became {state}");
}

/// The `breaker` object of `backend` in `GET /admin/backends`: its own, with its `targets`.
async fn breaker(h: &Harness, backend: &str) -> serde_json::Value {
    let answer = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["backends"]
        .as_array()
        .and_then(|list| list.iter().find(|b| b["name"] == backend))
        .map(|b| b["breaker"].clone())
        .unwrap_or_else(|| panic!("no backend {backend}: {}", answer.body))
}

#[tokio::test]
async fn a_target_returning_500s_is_tripped_gets_no_traffic_then_one_probe_then_rejoins() {
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
    let state = target_breaker(&h, "bad", "gpt-4o").await;
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
    until_target_breaker(&h, "bad", "gpt-4o", "half_open").await;
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
    assert_eq!(target_breaker(&h, "bad", "gpt-4o").await["state"], "closed");
    let own = breaker(&h, "bad").await;
    assert_eq!(
        (&own["state"], &own["trips"]),
        (&"closed".into(), &0.into()),
        "{own}"
    );

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
async fn accept_retry_after_keeps_a_429ing_target_out_for_its_retry_after_and_leaves_its_neighbour_in(
) {
    let h = Harness::start(
        vec![
            azure("hot", &["gpt-4o", "gpt-4o-mini"]),
            azure("cool", &["gpt-4o", "gpt-4o-mini"]),
        ],
        &format!(
            "routing: {{ same_target_retries: 0 }}\ncircuit_breakers: {{ default: {{ rules: [{{ name: throttled, failures: {{ count: 1, within: 10s, status: [429] }}, trip: 10s, accept_retry_after: true }}] }} }}\n{}models:\n{}{}",
            backends(&[("hot", "default"), ("cool", "default")]),
            prioritized("chat", "gpt-4o", &["hot", "cool"]),
            prioritized("mini", "gpt-4o-mini", &["hot", "cool"])
        ),
    )
    .await;
    let hot = h.endpoint("hot");
    hot.set_deployment_behavior(
        "gpt-4o",
        Behavior {
            status: Some(429),
            retry_after_s: Some(1),
            ..Behavior::default()
        },
    );
    // The breaker trips between these two instants.
    let sent = Instant::now();
    let first = h.chat("chat").await;
    assert_eq!(first.attempts(), "hot=429,cool=200");
    let tripped = Instant::now();
    hot.set_deployment_behavior("gpt-4o", Behavior::default());
    let state = target_breaker(&h, "hot", "gpt-4o").await;
    assert_eq!(state["state"], "open", "{state}");
    assert!(
        state["next_probe_in_ms"]
            .as_u64()
            .is_some_and(|ms| (500..=1000).contains(&ms)),
        "{state}"
    );
    // The other deployment on the same backend is served there all along.
    let answer = h.chat("mini").await;
    assert_eq!(answer.attempts(), "hot=200", "{}", answer.body);
    while hot.requests("gpt-4o") == 1 && tripped.elapsed() < Duration::from_secs(5) {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (out_for, at_most) = (tripped.elapsed(), sent.elapsed());
    assert_eq!(hot.requests("gpt-4o"), 2, "hot's gpt-4o never came back");
    assert!(
        at_most >= Duration::from_millis(900),
        "back after {at_most:?} at most, before its Retry-After"
    );
    assert!(
        out_for < Duration::from_secs(2),
        "back after {out_for:?}, longer than its Retry-After"
    );
    let state = target_breaker(&h, "hot", "gpt-4o").await;
    assert_eq!(state["state"], "closed", "{state}");
    assert_eq!(state["trips"], 1);
    assert_eq!(breaker(&h, "hot").await["state"], "closed");
}

#[tokio::test]
async fn one_deployments_503s_open_its_targets_breaker_and_leave_the_backends_other_deployments_served(
) {
    let h = Harness::start(
        vec![
            azure("wall", &["a", "b"]),
            azure("fallback", &["a", "b"]),
        ],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: server-errors, failures: {{ count: 3, within: 30s, status: [500-599, connect_error, timeout] }}, trip: 5s }}] }} }}\n{}models:\n{}{}",
            backends(&[("wall", "default"), ("fallback", "default")]),
            prioritized("alias-a", "a", &["wall", "fallback"]),
            prioritized("alias-b", "b", &["wall", "fallback"])
        ),
    )
    .await;
    let wall = h.endpoint("wall");
    wall.set_deployment_behavior("a", failing(503));
    for _ in 0..5 {
        let answer = h.chat("alias-a").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        if target_breaker(&h, "wall", "a").await["state"] == "open" {
            break;
        }
    }
    assert_eq!(wall.requests("a"), 3, "three 503s trip the target");
    let sent = wall.requests("a");
    for _ in 0..5 {
        let answer = h.chat("alias-a").await;
        assert_eq!(answer.attempts(), "fallback=200", "{}", answer.body);
        let answer = h.chat("alias-b").await;
        assert_eq!(answer.attempts(), "wall=200", "{}", answer.body);
    }
    assert_eq!(wall.requests("a"), sent, "an open target got traffic");
    assert_eq!(wall.requests("b"), 5);
    let state = breaker(&h, "wall").await;
    assert_eq!(state["state"], "closed", "{state}");
    assert_eq!(target_breaker(&h, "wall", "b").await["state"], "closed");

    let metrics = h.admin_get("/metrics", Some(ADMIN_TOKEN)).await.body;
    for line in [
        r#"onedoor_breaker_state{backend="wall",region="swedencentral",deployment=""} 0"#,
        r#"onedoor_breaker_state{backend="wall",region="swedencentral",deployment="a"} 2"#,
        r#"onedoor_breaker_state{backend="wall",region="swedencentral",deployment="b"} 0"#,
        r#"onedoor_breaker_transitions_total{backend="wall",deployment="a",to="open"} 1"#,
    ] {
        assert!(metrics.contains(line), "no {line} in\n{metrics}");
    }
}

#[tokio::test]
async fn connection_refusals_open_the_backends_breaker_for_every_target_on_it() {
    let (_refusing, port) = onedoor_mock::refusing_port().unwrap();
    let h = Harness::start(
        vec![azure("fallback", &["a", "b"])],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: unreachable, failures: {{ count: 2, within: 30s, status: [500-599, connect_error] }}, trip: 30s }}] }} }}\nbackends:\n  - {{ name: down, provider: azure, region: swedencentral, url: \"http://127.0.0.1:{port}\", circuit_breaker: default }}\n  - {{ name: fallback, provider: azure, region: swedencentral, url: \"{{url:fallback}}\" }}\nmodels:\n{}{}",
            prioritized("alias-a", "a", &["down", "fallback"]),
            prioritized("alias-b", "b", &["down", "fallback"])
        ),
    )
    .await;
    let first = h.chat("alias-a").await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert!(
        first.attempts().starts_with("down=connect_error"),
        "{}",
        first.attempts()
    );
    let mut tries = 0;
    while breaker(&h, "down").await["state"] != "open" && tries < 5 {
        assert_eq!(h.chat("alias-a").await.status, 200);
        tries += 1;
    }
    let state = breaker(&h, "down").await;
    assert_eq!(state["state"], "open", "{state}");
    assert!(
        state["next_probe_in_ms"]
            .as_u64()
            .is_some_and(|ms| ms > 25_000),
        "{state}"
    );
    // Its other deployment is not asked either; its targets' own breakers saw no failure.
    for alias in ["alias-b", "alias-a"] {
        let answer = h.chat(alias).await;
        assert_eq!(answer.attempts(), "fallback=200", "{}", answer.body);
    }
    for target in ["a", "b"] {
        assert_eq!(target_breaker(&h, "down", target).await["state"], "closed");
    }
}

#[tokio::test]
async fn a_target_that_recovers_after_a_long_outage_is_used_again_within_one_probe_interval() {
    let h = Harness::start(
        vec![azure("wall", &["a"]), azure("fallback", &["a"])],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: server-errors, failures: {{ count: 1, within: 10s, status: [5xx] }}, trip: 100ms, backoff: {{ factor: 2, max: 400ms }} }}] }} }}\n{}models:\n{}",
            backends(&[("wall", "default"), ("fallback", "default")]),
            prioritized("chat", "a", &["wall", "fallback"])
        ),
    )
    .await;
    let wall = h.endpoint("wall");
    wall.set_behavior(failing(503));
    // An outage of 2.5 s: every probe fails, the waits grow 200, 400 ms and stay at the cap.
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_millis(2500) {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let state = target_breaker(&h, "wall", "a").await;
    assert!(state["reopens"].as_u64().is_some_and(|n| n >= 4), "{state}");
    assert!(
        state["next_probe_in_ms"]
            .as_u64()
            .is_some_and(|ms| ms <= 400),
        "{state}"
    );
    let failed = wall.total_requests();
    assert!(
        failed <= 12,
        "{failed} attempts during the outage: probes only"
    );

    wall.set_behavior(Behavior::default());
    let recovered = Instant::now();
    loop {
        let answer = h.chat("chat").await;
        if answer.attempts() == "wall=200" {
            break;
        }
        assert!(
            recovered.elapsed() < Duration::from_secs(2),
            "not back after {:?}",
            recovered.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let back_after = recovered.elapsed();
    assert!(
        back_after <= Duration::from_millis(400 + 300),
        "back after {back_after:?}, more than the 400 ms cap"
    );
    assert_eq!(target_breaker(&h, "wall", "a").await["state"], "closed");
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
