//! Changing a running gateway (contract section 4): reloading the config (admin API and file
//! change) without dropping what is under way, refusing an invalid file, draining backends, and
//! active health checks taking a backend out of rotation and back.

#![allow(clippy::panic)]

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use common::*;

fn azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
}

fn backend(name: &str) -> String {
    format!(
        "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\" }}\n"
    )
}

/// One alias `chat` over `names`, all in one priority group.
fn config(names: &[&str]) -> String {
    let mut out = String::from("backends:\n");
    for name in names {
        out.push_str(&backend(name));
    }
    out.push_str("models:\n  - name: chat\n    targets:\n");
    for name in names {
        out.push_str(&format!(
            "      - {{ backend: {name}, deployment: gpt-4o }}\n"
        ));
    }
    out
}

/// Polls an async `condition` every 50 ms for up to `within`.
async fn eventually_async<F, Fut>(within: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let until = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < until {
        if condition().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    condition().await
}

/// The entry of `name` in `GET /admin/backends`.
async fn admin_backend(h: &Harness, name: &str) -> serde_json::Value {
    let answer = h.admin_get("/admin/backends", Some(ADMIN_TOKEN)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()["backends"]
        .as_array()
        .and_then(|list| list.iter().find(|b| b["name"] == name).cloned())
        .unwrap_or_else(|| panic!("no backend {name} in {}", answer.body))
}

#[tokio::test]
async fn reloading_a_config_with_a_new_alias_serves_it_without_dropping_a_concurrent_stream() {
    let slow = azure("slow").behavior(Behavior {
        inter_token_ms: 50,
        reply_words: Some(40),
        ..Behavior::default()
    });
    let h =
        Arc::new(Harness::start_from_file(vec![slow, azure("fresh")], &config(&["slow"])).await);
    let streaming = h.clone();
    let stream = tokio::spawn(async move {
        streaming
            .post("/v1/chat/completions", chat_body("chat", true))
            .await
    });
    assert!(eventually(|| h.endpoint("slow").total_requests() == 1).await);
    assert_eq!(h.chat("chat-new").await.code(), "model_not_found");

    let mut next = config(&["slow", "fresh"]);
    next.push_str(
        "  - name: chat-new\n    targets:\n      - { backend: fresh, deployment: gpt-4o }\n",
    );
    h.write_config(&next);
    let reload = h.admin_post("/admin/reload").await;
    assert_eq!(reload.status, 200, "{}", reload.body);
    assert_eq!(reload.json()["aliases"], 2, "{}", reload.body);
    let answer = h.chat("chat-new").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-backend"), "fresh");
    assert!(
        !stream.is_finished(),
        "the stream ended before the reload was done; the test proves nothing"
    );

    let streamed = stream.await.unwrap();
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    assert!(
        streamed.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        streamed.body
    );
    assert!(!streamed.body.contains("\"error\""), "{}", streamed.body);
    assert_eq!(h.endpoint("slow").cancelled(), 0);
}

#[tokio::test]
async fn an_invalid_reload_is_refused_and_the_old_config_keeps_serving() {
    let h = Harness::start_from_file(vec![azure("a")], &config(&["a"])).await;
    h.write_raw_config(
        "routing:\n  max_atempts: 4\nbackends:\n  - { name: a, provider: azure, region: r, url: \"http://127.0.0.1:1\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: nowhere, deployment: gpt-4o }\n",
    );
    let refused = h.admin_post("/admin/reload").await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    let body = refused.json();
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("running config stays")),
        "{}",
        refused.body
    );
    let problems: Vec<&str> = body["problems"]
        .as_array()
        .map(|list| list.iter().filter_map(|p| p.as_str()).collect())
        .unwrap_or_default();
    let file = h.config_file().display().to_string();
    assert_eq!(problems.len(), 2, "{}", refused.body);
    assert!(
        problems[0].starts_with(&format!("{file}:2:")) && problems[0].contains("max_atempts"),
        "{}",
        problems[0]
    );
    assert!(
        problems[1].starts_with(&format!("{file}:8:")) && problems[1].contains("nowhere"),
        "{}",
        problems[1]
    );

    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-backend"), "a");
    assert_eq!(admin_backend(&h, "a").await["url"], h.endpoint("a").url());
}

#[tokio::test]
async fn a_changed_config_file_is_picked_up() {
    let h = Harness::start_from_file(vec![azure("a")], &config(&["a"])).await;
    assert_eq!(h.chat("later").await.code(), "model_not_found");
    let mut next = config(&["a"]);
    next.push_str("  - name: later\n    targets:\n      - { backend: a, deployment: gpt-4o }\n");
    h.write_config(&next);
    let served = eventually_async(Duration::from_secs(5), || async {
        h.chat("later").await.status == 200
    })
    .await;
    assert!(
        served,
        "the new alias was not served within 5 s of the file change"
    );
    assert_eq!(h.chat("chat").await.status, 200);
}

#[tokio::test]
async fn a_drained_backend_gets_no_traffic_and_undrain_brings_it_back() {
    let h = Harness::start(vec![azure("a"), azure("b")], &config(&["a", "b"])).await;
    let drained = h.admin_post("/admin/backends/a/drain").await;
    assert_eq!(drained.status, 200, "{}", drained.body);
    assert_eq!(admin_backend(&h, "a").await["drained"], true);
    assert_eq!(admin_backend(&h, "b").await["drained"], false);
    for _ in 0..10 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-backend"), "b");
    }
    assert_eq!(h.endpoint("a").total_requests(), 0);

    assert_eq!(h.admin_post("/admin/backends/b/drain").await.status, 200);
    let nothing = h.chat("chat").await;
    assert_eq!(nothing.status, 503, "{}", nothing.body);
    assert_eq!(nothing.code(), "no_backend_available");
    assert!(
        nothing.json()["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drained")),
        "{}",
        nothing.body
    );
    assert_eq!(h.endpoint("b").total_requests(), 10);

    let undrained = h.admin_post("/admin/backends/a/undrain").await;
    assert_eq!(undrained.status, 200, "{}", undrained.body);
    assert_eq!(admin_backend(&h, "a").await["drained"], false);
    for _ in 0..4 {
        assert_eq!(h.chat("chat").await.header("x-onedoor-backend"), "a");
    }
    let unknown = h.admin_post("/admin/backends/nowhere/drain").await;
    assert_eq!(unknown.status, 404, "{}", unknown.body);
    assert!(unknown.json()["error"]["message"]
        .as_str()
        .is_some_and(|m| m.contains("nowhere")));
}

#[tokio::test]
async fn a_drain_survives_a_reload_that_keeps_the_backend() {
    let h = Harness::start_from_file(
        vec![azure("a"), azure("b"), azure("c")],
        &config(&["a", "b"]),
    )
    .await;
    assert_eq!(h.admin_post("/admin/backends/a/drain").await.status, 200);
    h.write_config(&config(&["c", "a", "b"]));
    let reload = h.admin_post("/admin/reload").await;
    assert_eq!(reload.status, 200, "{}", reload.body);
    assert_eq!(admin_backend(&h, "a").await["drained"], true);
    assert_eq!(admin_backend(&h, "c").await["drained"], false);
    for _ in 0..9 {
        assert_eq!(h.chat("chat").await.status, 200);
    }
    assert_eq!(h.endpoint("a").total_requests(), 0);
    assert!(h.endpoint("c").total_requests() > 0);
}

#[tokio::test]
async fn an_unhealthy_backend_leaves_rotation_until_its_probe_passes() {
    let probed = EndpointSpec::openai("probed", "onprem")
        .api_key("probed-secret")
        .deployment(DeploymentSpec::new("gpt-4o"));
    let h = Harness::start(
        vec![probed, azure("spare")],
        "backends:\n  - { name: probed, provider: openai, region: onprem, url: \"{url:probed}\", api_key: probed-secret, health_check: { path: /models, interval: 100ms } }\n  - { name: spare, provider: azure, region: swedencentral, url: \"{url:spare}\" }\nmodels:\n  - name: chat\n    targets:\n      - { backend: probed, deployment: gpt-4o, priority: 1 }\n      - { backend: spare, deployment: gpt-4o, priority: 2 }\n",
    )
    .await;
    let checked = eventually_async(Duration::from_secs(5), || async {
        admin_backend(&h, "probed").await["last_check"]["passed"] == true
    })
    .await;
    assert!(checked, "{}", admin_backend(&h, "probed").await);
    assert_eq!(h.chat("chat").await.header("x-onedoor-backend"), "probed");

    h.endpoint("probed").set_behavior(Behavior {
        status: Some(500),
        ..Behavior::default()
    });
    let left = eventually_async(Duration::from_secs(5), || async {
        admin_backend(&h, "probed").await["healthy"] == false
    })
    .await;
    let entry = admin_backend(&h, "probed").await;
    assert!(left, "{entry}");
    assert_eq!(entry["last_check"]["outcome"], "500", "{entry}");
    let before = h.endpoint("probed").requests("gpt-4o");
    for _ in 0..5 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.attempts(), "spare=200");
    }
    assert_eq!(h.endpoint("probed").requests("gpt-4o"), before);
    assert!(
        h.endpoint("probed").total_requests() > before,
        "no probe reached the backend"
    );

    h.endpoint("probed").set_behavior(Behavior::default());
    let back = eventually_async(Duration::from_secs(5), || async {
        admin_backend(&h, "probed").await["healthy"] == true
    })
    .await;
    assert!(back, "{}", admin_backend(&h, "probed").await);
    assert_eq!(h.chat("chat").await.header("x-onedoor-backend"), "probed");
}
