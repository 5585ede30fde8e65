//! Headroom-aware selection inside a priority group: backends near their quota (in the minute or
//! in Azure's ten-second periods) or at their in-flight cap are passed over before they answer
//! 429, a full group spills to the next priority, an upstream's "nothing left" holds only until
//! it may be asked again, and a retry prefers another region.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;

fn chat_with_budget(model: &str, max_tokens: u64) -> serde_json::Value {
    serde_json::json!({"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hello"}]})
}

#[tokio::test]
async fn a_ptu_backend_takes_traffic_until_its_headroom_is_gone_then_spills_without_a_429_and_returns(
) {
    let h = Harness::start(
        vec![
            EndpointSpec::azure("ptu", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o").tpm(6000).ten_second_windows()),
            EndpointSpec::azure("paygo", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        "backends:\n  - { name: ptu, provider: azure, region: swedencentral, url: \"{url:ptu}\", limits: { tpm: 6000 } }\n  - { name: paygo, provider: azure, region: swedencentral, url: \"{url:paygo}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: ptu, deployment: gpt-4o, priority: 1 }\n      - { backend: paygo, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let mut served_by = Vec::new();
    for _ in 0..12 {
        let answer = h
            .post("/v1/chat/completions", chat_with_budget("chat", 100))
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            !answer.attempts().contains("429"),
            "a 429 was met: {}",
            answer.attempts()
        );
        served_by.push(answer.header("x-onedoor-backend").to_owned());
    }
    let on_ptu = served_by.iter().take_while(|b| *b == "ptu").count();
    assert!(
        on_ptu >= 5,
        "PTU took too little before spilling: {served_by:?}"
    );
    assert!(
        served_by[on_ptu..].iter().all(|b| b == "paygo"),
        "{served_by:?}"
    );
    // When its ten seconds have passed, the PTU capacity is used first again.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let answer = h
        .post("/v1/chat/completions", chat_with_budget("chat", 100))
        .await;
    assert_eq!(answer.header("x-onedoor-backend"), "ptu");
}

#[tokio::test]
async fn a_backend_at_its_in_flight_cap_is_passed_over() {
    let slow = Behavior {
        ttft_ms: 400,
        ..Behavior::default()
    };
    let h = Harness::start(
        vec![
            EndpointSpec::azure("capped", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .behavior(slow.clone()),
            EndpointSpec::azure("spare", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .behavior(slow),
        ],
        "backends:\n  - { name: capped, provider: azure, region: swedencentral, url: \"{url:capped}\", limits: { max_in_flight: 1 } }\n  - { name: spare, provider: azure, region: swedencentral, url: \"{url:spare}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: capped, deployment: gpt-4o, priority: 1 }\n      - { backend: spare, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let h = Arc::new(h);
    let first = tokio::spawn({
        let h = h.clone();
        async move { h.chat("chat").await }
    });
    assert!(eventually(|| h.endpoint("capped").requests("gpt-4o") == 1).await);
    let second = h.chat("chat").await;
    assert_eq!(second.header("x-onedoor-backend"), "spare");
    assert_eq!(first.await.unwrap().header("x-onedoor-backend"), "capped");
    let admin = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert!(admin.body.contains("\"max_in_flight\":1"), "{}", admin.body);
}

#[tokio::test]
async fn a_retry_prefers_a_backend_in_another_region() {
    let h = Harness::start(
        vec![
            EndpointSpec::azure("se-a", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .behavior(Behavior {
                    status: Some(500),
                    ..Behavior::default()
                }),
            EndpointSpec::azure("se-b", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
            EndpointSpec::azure("fr", "francecentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        "backends:\n  - { name: se-a, provider: azure, region: swedencentral, url: \"{url:se-a}\" }\n  - { name: se-b, provider: azure, region: swedencentral, url: \"{url:se-b}\" }\n  - { name: fr, provider: azure, region: francecentral, url: \"{url:fr}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: se-a, deployment: gpt-4o, weight: 100 }\n      - { backend: se-b, deployment: gpt-4o, weight: 1 }\n      - { backend: fr, deployment: gpt-4o, weight: 1 }\n",
    )
    .await;
    for _ in 0..5 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200);
        if answer.attempts().starts_with("se-a=500") {
            assert_eq!(answer.attempts(), "se-a=500,fr=200");
        }
    }
    assert!(h.endpoint("se-a").total_requests() >= 1);
    assert_eq!(
        h.endpoint("se-b").total_requests(),
        0,
        "a retry stayed in the failed region"
    );
}

#[tokio::test]
async fn a_throttled_ptu_is_asked_first_again_as_soon_as_its_retry_after_has_passed() {
    let out_of_tokens = Behavior {
        status: Some(429),
        retry_after_s: Some(3),
        remaining_tokens: Some(0),
        ..Behavior::default()
    };
    let h = Harness::start(
        vec![
            EndpointSpec::azure("ptu", "swedencentral")
                .deployment(DeploymentSpec::new("gpt-4o"))
                .behavior(out_of_tokens),
            EndpointSpec::azure("paygo-a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
            EndpointSpec::azure("paygo-b", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        ],
        "backends:\n  - { name: ptu, provider: azure, region: swedencentral, url: \"{url:ptu}\" }\n  - { name: paygo-a, provider: azure, region: swedencentral, url: \"{url:paygo-a}\" }\n  - { name: paygo-b, provider: azure, region: swedencentral, url: \"{url:paygo-b}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: ptu, deployment: gpt-4o, priority: 1 }\n      - { backend: paygo-a, deployment: gpt-4o, priority: 2 }\n      - { backend: paygo-b, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let throttled = h.chat("chat").await;
    assert_eq!(throttled.status, 200, "{}", throttled.body);
    assert!(
        throttled.attempts().starts_with("ptu=429,paygo-"),
        "{}",
        throttled.attempts()
    );
    let admin = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    let backends = admin.json()["backends"].clone();
    let ptu = backends
        .as_array()
        .and_then(|list| list.iter().find(|b| b["name"] == "ptu"))
        .map(|b| b["load"]["upstream_remaining"].clone())
        .unwrap_or_else(|| panic!("no ptu in {}", admin.body));
    assert_eq!(ptu["tokens"], 0, "{ptu}");
    let valid_for = ptu["tokens_valid_for_ms"].as_u64().unwrap_or(u64::MAX);
    assert!((2_000..=3_000).contains(&valid_for), "{ptu}");
    h.endpoint("ptu").set_behavior(Behavior::default());
    tokio::time::sleep(Duration::from_millis(3_200)).await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "ptu=200");
}

#[tokio::test]
async fn a_burst_within_the_minutes_rpm_spreads_before_azures_ten_second_periods_refuse_it() {
    let rpm = 60;
    let deployment = || DeploymentSpec::new("gpt-4o").rpm(rpm).ten_second_windows();
    let h = Harness::start(
        vec![
            EndpointSpec::azure("ptu", "swedencentral").deployment(deployment()),
            EndpointSpec::azure("paygo", "swedencentral").deployment(deployment()),
        ],
        "backends:\n  - { name: ptu, provider: azure, region: swedencentral, url: \"{url:ptu}\", limits: { rpm: 60 } }\n  - { name: paygo, provider: azure, region: swedencentral, url: \"{url:paygo}\", limits: { rpm: 60 } }\nmodels:\n  - name: chat\n    targets:\n      - { backend: ptu, deployment: gpt-4o, priority: 1 }\n      - { backend: paygo, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let burst = rpm / 3;
    let started = tokio::time::Instant::now();
    let mut pace = tokio::time::interval(Duration::from_millis(2_000 / burst));
    let mut served_by = Vec::new();
    for _ in 0..burst {
        pace.tick().await;
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert!(
            !answer.attempts().contains("429"),
            "a ten-second period refused: {}",
            answer.attempts()
        );
        served_by.push(answer.header("x-onedoor-backend").to_owned());
    }
    assert!(started.elapsed() < Duration::from_secs(3));
    let on = |name: &str| served_by.iter().filter(|b| *b == name).count() as u64;
    assert_eq!(
        (on("ptu"), on("paygo")),
        (rpm / 6, rpm / 6),
        "{served_by:?}"
    );
    let upstream = h.endpoint("ptu").total_requests() + h.endpoint("paygo").total_requests();
    assert_eq!(upstream, burst, "every request was asked once");
}
