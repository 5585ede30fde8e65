//! Routing and failover through real HTTP (contract section 2.1): priority then weights, failover
//! on each failure kind, the same-target rule, the not-served cache, Retry-After cooldowns, and
//! upstream client errors passed through once.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn azure(name: &str, region: &str, deployments: &[&str]) -> EndpointSpec {
    deployments
        .iter()
        .fold(EndpointSpec::azure(name, region), |spec, d| {
            spec.deployment(DeploymentSpec::new(d))
        })
}

fn failing(status: u16) -> Behavior {
    Behavior {
        status: Some(status),
        ..Behavior::default()
    }
}

fn backend(name: &str) -> String {
    format!(
        "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\" }}\n"
    )
}

fn backends(names: &[&str]) -> String {
    let mut out = String::from("backends:\n");
    for name in names {
        out.push_str(&backend(name));
    }
    out
}

#[tokio::test]
async fn priority_one_serves_while_it_is_healthy() {
    let h = Harness::start(
        vec![azure("ptu", "swedencentral", &["gpt-4o"]), azure("paygo", "swedencentral", &["gpt-4o"])],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: ptu, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: paygo, deployment: gpt-4o, priority: 2 }}\n",
            backends(&["ptu", "paygo"])
        ),
    )
    .await;
    for _ in 0..20 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-backend"), "ptu");
        assert_eq!(answer.attempts(), "ptu=200");
    }
    assert_eq!(h.endpoint("paygo").total_requests(), 0);
}

#[tokio::test]
async fn weights_split_a_priority_group_three_to_one() {
    let h = Harness::start(
        vec![azure("a", "swedencentral", &["gpt-4o"]), azure("b", "swedencentral", &["gpt-4o"])],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: a, deployment: gpt-4o, weight: 3 }}\n      - {{ backend: b, deployment: gpt-4o, weight: 1 }}\n",
            backends(&["a", "b"])
        ),
    )
    .await;
    let h = std::sync::Arc::new(h);
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..125 {
                assert_eq!(h.chat("chat").await.status, 200);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
    let a = h.endpoint("a").requests("gpt-4o") as f64;
    let b = h.endpoint("b").requests("gpt-4o") as f64;
    assert_eq!(a + b, 1000.0);
    assert!((a / 1000.0 - 0.75).abs() <= 0.05, "a={a} b={b}");
}

#[tokio::test]
async fn a_5xx_fails_over_to_another_target_of_the_group_at_once() {
    let h = Harness::start(
        vec![
            azure("broken", "swedencentral", &["gpt-4o"]).behavior(failing(500)),
            azure("healthy", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: broken, deployment: gpt-4o }}\n      - {{ backend: healthy, deployment: gpt-4o }}\n",
            backends(&["broken", "healthy"])
        ),
    )
    .await;
    let started = Instant::now();
    for _ in 0..4 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-backend"), "healthy");
        assert!(
            answer.attempts() == "healthy=200" || answer.attempts() == "broken=500,healthy=200",
            "{}",
            answer.attempts()
        );
    }
    assert!(h.endpoint("broken").total_requests() >= 1);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "failover paused: {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_connection_error_and_a_reset_fail_over() {
    let (_refusing, down) = onedoor_mock::refusing_port().unwrap();
    let h = Harness::start(
        vec![
            azure("resets", "swedencentral", &["gpt-4o"]).behavior(Behavior {
                reset: true,
                ..Behavior::default()
            }),
            azure("healthy", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "routing: {{ max_attempts: 5 }}\nbackends:\n  - {{ name: down, provider: azure, region: swedencentral, url: \"http://127.0.0.1:{down}\" }}\n{}{}models:\n  - name: chat\n    targets:\n      - {{ backend: down, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: resets, deployment: gpt-4o, priority: 2 }}\n      - {{ backend: healthy, deployment: gpt-4o, priority: 3 }}\n",
            backend("resets"),
            backend("healthy")
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    // Each failing target was alone in its group, so the same-target rule gives it one more try.
    assert_eq!(
        answer.attempts(),
        "down=connect_error,down=connect_error,resets=reset,resets=reset,healthy=200"
    );
}

#[tokio::test]
async fn the_same_target_rule_retries_a_lone_target_once_before_the_next_group() {
    let h = Harness::start(
        vec![
            azure("ptu", "swedencentral", &["gpt-4o"]).behavior(failing(503)),
            azure("paygo", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: ptu, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: paygo, deployment: gpt-4o, priority: 2 }}\n",
            backends(&["ptu", "paygo"])
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.attempts(), "ptu=503,ptu=503,paygo=200");
}

#[tokio::test]
async fn a_short_retry_after_on_a_lone_target_is_waited_for_and_a_long_one_is_not() {
    let h = Harness::start(
        vec![
            azure("ptu", "swedencentral", &["gpt-4o"]).behavior(Behavior {
                status: Some(429),
                retry_after_s: Some(1),
                ..Behavior::default()
            }),
            azure("paygo", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "routing: {{ max_retry_wait: 2s }}\n{}models:\n  - name: chat\n    targets:\n      - {{ backend: ptu, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: paygo, deployment: gpt-4o, priority: 2 }}\n",
            backends(&["ptu", "paygo"])
        ),
    )
    .await;
    let started = Instant::now();
    let answer = h.chat("chat").await;
    assert_eq!(answer.attempts(), "ptu=429,ptu=429,paygo=200");
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "did not wait for Retry-After"
    );
    // The cooldown now keeps ptu out of rotation altogether.
    let answer = h.chat("chat").await;
    assert_eq!(answer.attempts(), "paygo=200");

    h.endpoint("ptu").set_behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(30),
        ..Behavior::default()
    });
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let started = Instant::now();
    let answer = h.chat("chat").await;
    assert_eq!(answer.attempts(), "ptu=429,paygo=200");
    assert!(
        started.elapsed() < Duration::from_millis(900),
        "waited for a long Retry-After"
    );
}

#[tokio::test]
async fn a_429_cools_the_target_down_for_its_retry_after() {
    let h = Harness::start(
        vec![
            azure("hot", "swedencentral", &["gpt-4o"]).behavior(Behavior {
                status: Some(429),
                retry_after_s: Some(30),
                ..Behavior::default()
            }),
            azure("cool", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: hot, deployment: gpt-4o }}\n      - {{ backend: cool, deployment: gpt-4o }}\n",
            backends(&["hot", "cool"])
        ),
    )
    .await;
    for _ in 0..10 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.header("x-onedoor-backend"), "cool");
    }
    assert_eq!(
        h.endpoint("hot").total_requests(),
        1,
        "a cooling target was asked again"
    );
    let admin = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert!(admin.body.contains("cooling_down"), "{}", admin.body);
}

#[tokio::test]
async fn when_every_target_is_throttled_the_caller_gets_the_soonest_retry_after() {
    let throttled = |s| Behavior {
        status: Some(429),
        retry_after_s: Some(s),
        ..Behavior::default()
    };
    let h = Harness::start(
        vec![
            azure("a", "swedencentral", &["gpt-4o"]).behavior(throttled(20)),
            azure("b", "swedencentral", &["gpt-4o"]).behavior(throttled(7)),
        ],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: a, deployment: gpt-4o }}\n      - {{ backend: b, deployment: gpt-4o }}\n",
            backends(&["a", "b"])
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.code(), "upstream_rate_limited");
    assert_eq!(answer.header("x-onedoor-error"), "upstream_rate_limited");
    let retry: u64 = answer.header("retry-after").parse().unwrap();
    assert!((6..=7).contains(&retry), "retry-after {retry}");
    // Both now cool down: the next request is answered without asking anyone.
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 429);
    assert_eq!(answer.attempts(), "");
    assert_eq!(
        h.endpoint("a").total_requests() + h.endpoint("b").total_requests(),
        2
    );
}

#[tokio::test]
async fn the_not_served_cache_skips_a_backend_that_lacks_the_deployment() {
    let h = Harness::start(
        vec![azure("lacks", "swedencentral", &["other"]), azure("has", "swedencentral", &["gpt-4.1"])],
        &format!(
            "{}models:\n  - name: \"*\"\n    targets:\n      - {{ backend: lacks, priority: 1 }}\n      - {{ backend: has, priority: 2 }}\n",
            backends(&["lacks", "has"])
        ),
    )
    .await;
    let first = h.chat("gpt-4.1").await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.attempts(), "lacks=404,has=200");
    for _ in 0..5 {
        let next = h.chat("gpt-4.1").await;
        assert_eq!(next.attempts(), "has=200");
    }
    assert_eq!(
        h.endpoint("lacks").requests("gpt-4.1"),
        1,
        "the not-served backend was asked again"
    );
    let admin = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert!(
        admin
            .body
            .contains(r#""not_served":[{"deployment":"gpt-4.1""#),
        "{}",
        admin.body
    );
}

#[tokio::test]
async fn fifteen_endpoints_one_serving_it_is_found_in_one_request_and_remembered() {
    let names: Vec<String> = (1..=15).map(|i| format!("ep{i:02}")).collect();
    let specs = names
        .iter()
        .map(|n| {
            azure(
                n,
                "swedencentral",
                if n == "ep15" {
                    &["gpt-new"]
                } else {
                    &["gpt-4o"]
                },
            )
        })
        .collect();
    let list = names.join(", ");
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let h = Harness::start(
        specs,
        &format!(
            "{}models:\n  - name: \"*\"\n    targets:\n      - {{ backends: [{list}] }}\n",
            backends(&refs)
        ),
    )
    .await;
    let started = Instant::now();
    let first = h.chat("gpt-new").await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-onedoor-backend"), "ep15");
    assert!(
        first.attempts().ends_with("ep15=200"),
        "{}",
        first.attempts()
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let next = h.chat("gpt-new").await;
    assert_eq!(next.attempts(), "ep15=200");
    assert_eq!(next.header("x-onedoor-attempts").split(',').count(), 1);
}

#[tokio::test]
async fn a_context_length_error_moves_to_a_target_with_a_different_model() {
    let long_prompt = "word ".repeat(400);
    let h = Harness::start(
        vec![
            EndpointSpec::azure("small", "swedencentral").deployment(DeploymentSpec::new("gpt-small").context_window(50)),
            azure("large", "swedencentral", &["gpt-large"]),
        ],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: small, deployment: gpt-small, priority: 1 }}\n      - {{ backend: large, deployment: gpt-large, priority: 2 }}\n  - name: only-small\n    targets:\n      - {{ backend: small, deployment: gpt-small }}\n",
            backends(&["small", "large"])
        ),
    )
    .await;
    let body = |model: &str| serde_json::json!({"model": model, "messages": [{"role": "user", "content": long_prompt}]});
    let answer = h.post("/v1/chat/completions", body("chat")).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "small=400,large=200");
    let answer = h.post("/v1/chat/completions", body("only-small")).await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.code(), "context_length_exceeded");
    assert_eq!(answer.attempts(), "small=400");
    assert_eq!(answer.header("x-onedoor-backend"), "small");
}

#[tokio::test]
async fn an_upstream_content_filter_400_is_returned_as_it_came_and_never_retried() {
    let h = Harness::start(
        vec![azure("a", "swedencentral", &["gpt-4o"]), azure("b", "swedencentral", &["gpt-4o"])],
        &format!(
            "{}models:\n  - name: chat\n    targets:\n      - {{ backend: a, deployment: gpt-4o }}\n      - {{ backend: b, deployment: gpt-4o }}\n",
            backends(&["a", "b"])
        ),
    )
    .await;
    let body = serde_json::json!({"model": "chat", "messages": [{"role": "user", "content": "say forbidden-word"}]});
    let answer = h.post("/v1/chat/completions", body).await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.json()["error"]["code"], "content_filter");
    assert_eq!(
        answer.attempts().split(',').count(),
        1,
        "{}",
        answer.attempts()
    );
    assert_eq!(
        h.endpoint("a").total_requests() + h.endpoint("b").total_requests(),
        1
    );
}

#[tokio::test]
async fn a_backend_rejecting_its_own_credential_is_passed_over() {
    let h = Harness::start(
        vec![
            azure("wrong-key", "swedencentral", &["gpt-4o"]).api_key("the-real-key"),
            azure("right-key", "swedencentral", &["gpt-4o"]).api_key("upstream-secret"),
        ],
        "backends:\n  - { name: wrong-key, provider: azure, region: swedencentral, url: \"{url:wrong-key}\", api_key: stale }\n  - { name: right-key, provider: azure, region: swedencentral, url: \"{url:right-key}\", api_key: upstream-secret }\nmodels:\n  - name: chat\n    targets:\n      - { backend: wrong-key, deployment: gpt-4o, priority: 1 }\n      - { backend: right-key, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "wrong-key=401,right-key=200");
    assert!(!answer.body.contains("upstream-secret") && !answer.body.contains(KEY));
}

/// How long a request whose first target times out at 300 ms may take, failover to a healthy
/// target included. Far below the next timeout that could end it instead (the 60 s default of
/// `first_token`), and with room for a loaded machine: under the whole suite on 2 cores, a
/// connection has been seen to stall for over a second (a lost SYN is sent again after 1 s).
const WITHIN_FIRST_TOKEN_TIMEOUT: Duration = Duration::from_millis(300 + 2_700);

#[tokio::test]
async fn a_first_token_timeout_fails_over_and_that_target_is_not_tried_again() {
    let h = Harness::start(
        vec![
            azure("slow", "swedencentral", &["gpt-4o"]).behavior(Behavior {
                hang: true,
                ..Behavior::default()
            }),
            azure("fast", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "routing: {{ timeouts: {{ first_token: 300ms }} }}\n{}models:\n  - name: chat\n    targets:\n      - {{ backend: slow, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: fast, deployment: gpt-4o, priority: 2 }}\n",
            backends(&["slow", "fast"])
        ),
    )
    .await;
    let started = Instant::now();
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200);
    assert!(
        started.elapsed() < WITHIN_FIRST_TOKEN_TIMEOUT,
        "took {:?}: more than the timeout and one normal request",
        started.elapsed()
    );
    // Alone in its group, but a timed-out target gets no second try.
    assert_eq!(answer.attempts(), "slow=first_token_timeout,fast=200");
    // The abandoned upstream request was cancelled.
    let slow = h.endpoint("slow");
    assert!(
        eventually(|| slow.cancelled() == 1).await,
        "cancelled = {}",
        slow.cancelled()
    );
}

#[tokio::test]
async fn a_model_that_sends_headers_and_then_thinks_is_caught_by_the_first_token_timeout() {
    let h = Harness::start(
        vec![
            azure("thinker", "swedencentral", &["gpt-4o"]).behavior(Behavior {
                headers_then_hang: true,
                ..Behavior::default()
            }),
            azure("fast", "swedencentral", &["gpt-4o"]),
        ],
        &format!(
            "routing: {{ timeouts: {{ first_token: 300ms }} }}\n{}models:\n  - name: chat\n    targets:\n      - {{ backend: thinker, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: fast, deployment: gpt-4o, priority: 2 }}\n",
            backends(&["thinker", "fast"])
        ),
    )
    .await;
    let started = Instant::now();
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert!(
        started.elapsed() < WITHIN_FIRST_TOKEN_TIMEOUT,
        "took {:?}",
        started.elapsed()
    );
    assert_eq!(answer.status, 200);
    assert_eq!(answer.attempts(), "thinker=first_token_timeout,fast=200");
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
}

#[tokio::test]
async fn attempts_are_bounded_by_max_attempts_and_end_in_upstream_failed() {
    let names = ["a", "b", "c", "d", "e"];
    let specs = names
        .iter()
        .map(|n| azure(n, "swedencentral", &["gpt-4o"]).behavior(failing(500)))
        .collect();
    let targets: String = names
        .iter()
        .map(|n| format!("      - {{ backend: {n}, deployment: gpt-4o }}\n"))
        .collect();
    let h = Harness::start(
        specs,
        &format!(
            "routing: {{ max_attempts: 3 }}\n{}models:\n  - name: chat\n    targets:\n{targets}",
            backends(&names)
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 502);
    assert_eq!(answer.code(), "upstream_failed");
    assert_eq!(
        answer.attempts().split(',').count(),
        3,
        "{}",
        answer.attempts()
    );
    assert!(answer.attempts().split(',').all(|a| a.ends_with("=500")));
    assert_eq!(answer.header("x-onedoor-backend"), "");
}

#[tokio::test]
async fn running_out_of_total_time_answers_upstream_timeout() {
    let h = Harness::start(
        vec![azure("hangs", "swedencentral", &["gpt-4o"]).behavior(Behavior {
            hang: true,
            ..Behavior::default()
        })],
        &format!(
            "routing: {{ timeouts: {{ first_token: 10s, total: 300ms }} }}\n{}models:\n  - name: chat\n    targets:\n      - {{ backend: hangs, deployment: gpt-4o }}\n",
            backends(&["hangs"])
        ),
    )
    .await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 504);
    assert_eq!(answer.code(), "upstream_timeout");
    assert_eq!(answer.attempts(), "hangs=timeout");
}

#[tokio::test]
async fn a_name_no_reachable_backend_serves_is_model_not_found_on_the_discovery_alias() {
    let (_refusing, down) = onedoor_mock::refusing_port().unwrap();
    let h = Harness::start(
        vec![azure("a", "swedencentral", &["gpt-4o"]), azure("b", "swedencentral", &["gpt-4o"])],
        &format!(
            "backends:\n  - {{ name: down, provider: azure, region: swedencentral, url: \"http://127.0.0.1:{down}\" }}\n{}{}models:\n  - name: \"*\"\n    targets:\n      - {{ backends: [down, a, b] }}\n",
            backend("a"),
            backend("b")
        ),
    )
    .await;
    for _ in 0..2 {
        let answer = h.chat("no-such-model").await;
        assert_eq!(answer.status, 404, "{}", answer.body);
        assert_eq!(answer.code(), "model_not_found");
    }
    assert_eq!(
        h.endpoint("a").requests("no-such-model"),
        1,
        "the not-served answer was not remembered"
    );
}
