//! The operator dashboard through real HTTP: the page carries no data and a strict
//! Content-Security-Policy; `GET /admin/dashboard` needs the admin token, and after a scripted mix
//! of answers and errors shows the tripped breaker, the errors by code and the last ones, the
//! tenants' limits and an hour of history.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;

fn azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
}

/// `bad` answers 500 and trips after three; `chat` fails over to `good`, `solo` has only `bad`.
fn config() -> String {
    format!(
        r#"circuit_breakers: {{ default: {{ rules: [{{ name: server-errors, failures: {{ count: 3, within: 60s, status: [500-599] }}, trip: 60s }}] }} }}
backends:
  - {{ name: bad, provider: azure, region: swedencentral, url: "{{url:bad}}", circuit_breaker: default }}
  - {{ name: good, provider: azure, region: swedencentral, url: "{{url:good}}", limits: {{ rpm: 600, tpm: 100000 }} }}
models:
  - name: chat
    price: {{ input_per_1m: 2.5, output_per_1m: 10 }}
    targets: [{{ backend: good, deployment: gpt-4o, priority: 1 }}, {{ backend: bad, deployment: gpt-4o, priority: 2 }}]
  - name: solo
    targets: [{{ backend: bad, deployment: gpt-4o }}]
tenants:
  - name: team
    limits: {{ rpm: 1000, tokens_per_day: 1000000 }}
    keys: [{{ id: team-key, sha256: {} }}]
"#,
        key_hash(KEY)
    )
}

async fn start() -> Harness {
    let bad = azure("bad").behavior(Behavior {
        status: Some(500),
        ..Behavior::default()
    });
    Harness::start(vec![bad, azure("good")], &config()).await
}

async fn dashboard(h: &Harness) -> serde_json::Value {
    let answer = h.admin_get("/admin/dashboard", Some(ADMIN_TOKEN)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    answer.json()
}

/// Polls the dashboard's data until `ready` holds, for up to 5 s.
async fn dashboard_when(
    h: &Harness,
    ready: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    for _ in 0..250 {
        let data = dashboard(h).await;
        if ready(&data) {
            return data;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the dashboard never showed it: {}", dashboard(h).await);
}

fn count_of(data: &serde_json::Value, code: &str, status: u16) -> u64 {
    data["errors"]["by_code"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["code"] == code && c["status"] == status)
        .and_then(|c| c["count"].as_u64())
        .unwrap_or(0)
}

#[tokio::test]
async fn the_page_is_served_without_a_token_and_carries_no_data() {
    let h = start().await;
    let page = h.admin_get("/dashboard", None).await;
    assert_eq!(page.status, 200);
    assert_eq!(page.header("content-type"), "text/html; charset=utf-8");
    let policy = page.header("content-security-policy");
    assert!(policy.starts_with("default-src 'none'"), "{policy}");
    assert!(
        policy.contains("script-src 'self'") && !policy.contains("unsafe"),
        "{policy}"
    );
    assert!(
        !page.body.contains("bad") && !page.body.contains("team"),
        "{}",
        page.body
    );
    assert!(page.body.contains(r#"src="/dashboard/dashboard.js""#));
    for (path, content_type) in [
        ("/dashboard/dashboard.js", "text/javascript; charset=utf-8"),
        ("/dashboard/dashboard.css", "text/css; charset=utf-8"),
        ("/dashboard/icon.svg", "image/svg+xml"),
        ("/dashboard/keys", "text/html; charset=utf-8"),
        ("/dashboard/keys.js", "text/javascript; charset=utf-8"),
    ] {
        let asset = h.admin_get(path, None).await;
        assert_eq!(asset.status, 200, "{path}");
        assert_eq!(asset.header("content-type"), content_type, "{path}");
        assert!(!asset.body.is_empty(), "{path}");
    }
}

#[tokio::test]
async fn the_dashboard_data_needs_the_admin_token() {
    let h = start().await;
    for token in [None, Some("not-the-token"), Some(KEY)] {
        let answer = h.admin_get("/admin/dashboard", token).await;
        assert_eq!(answer.status, 401, "{token:?}: {}", answer.body);
        assert!(!answer.body.contains("backends"), "{}", answer.body);
    }
}

#[tokio::test]
async fn after_a_mix_of_answers_and_errors_the_dashboard_shows_the_open_breaker_the_errors_and_history(
) {
    let h = start().await;
    for _ in 0..3 {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    // Three 500s from `bad` trip its breaker; then `solo` has nowhere to go.
    let mut failed: u64 = 0;
    loop {
        let answer = h.chat("solo").await;
        if answer.code() == "circuit_open" {
            assert_eq!(answer.status, 503);
            break;
        }
        assert_eq!(answer.status, 502, "{}", answer.body);
        assert_eq!(answer.code(), "upstream_failed");
        failed += 1;
        assert!(failed <= 3, "the breaker did not trip");
    }
    assert_eq!(h.endpoint("bad").total_requests(), 3);
    assert_eq!(h.chat("no-such-model").await.code(), "model_not_found");
    let stranger = h
        .send(
            http::Method::POST,
            h.url("/v1/chat/completions"),
            &[("authorization", "Bearer wrong-key")],
            bytes::Bytes::from(chat_body("chat", false).to_string()),
        )
        .await;
    assert_eq!(stranger.status, 401);

    let data = dashboard_when(&h, |d| {
        d["history"]["points"]
            .as_array()
            .and_then(|p| p.last())
            .is_some_and(|p| p["output_tokens"].as_u64() > Some(0))
    })
    .await;

    let backends = data["backends"].as_array().unwrap();
    let bad = backends.iter().find(|b| b["name"] == "bad").unwrap();
    // Its 500s opened the breaker of the target that answered them, not the backend's own.
    assert_eq!(bad["breaker"]["state"], "closed", "{bad}");
    let target = &bad["breaker"]["targets"][0];
    assert_eq!(target["deployment"], "gpt-4o", "{bad}");
    assert_eq!(target["state"], "open", "{bad}");
    assert!(target["next_probe_in_ms"]
        .as_u64()
        .is_some_and(|ms| ms <= 60_000));
    let good = backends.iter().find(|b| b["name"] == "good").unwrap();
    assert_eq!(good["breaker"]["state"], "closed");
    assert_eq!(good["load"]["window"]["rpm_limit"], 600);
    assert_eq!(good["load"]["window"]["requests"], 3);

    assert_eq!(
        count_of(&data, "upstream_failed", 502),
        failed,
        "{}",
        data["errors"]
    );
    assert_eq!(count_of(&data, "circuit_open", 503), 1);
    assert_eq!(count_of(&data, "model_not_found", 404), 1);
    assert_eq!(count_of(&data, "invalid_api_key", 401), 1);
    let recent = data["errors"]["recent"].as_array().unwrap();
    assert_eq!(recent.len() as u64, failed + 3, "{recent:?}");
    assert_eq!(recent[0]["code"], "invalid_api_key", "newest first");
    assert_eq!(recent[0]["tenant"], serde_json::Value::Null);
    let open = recent.iter().find(|e| e["code"] == "circuit_open").unwrap();
    assert_eq!(open["status"], 503);
    assert_eq!(open["alias"], "solo");
    assert_eq!(open["tenant"], "team");
    let upstream = recent
        .iter()
        .find(|e| e["code"] == "upstream_failed")
        .unwrap();
    assert_eq!(
        upstream["backend"],
        serde_json::Value::Null,
        "no backend answered"
    );
    assert!(
        upstream["attempts"].as_str().unwrap().contains("bad=500"),
        "{upstream}"
    );
    assert!(
        !data["errors"].to_string().contains("Hello there"),
        "no prompt in the errors"
    );

    let team = &data["tenants"][0];
    assert_eq!(team["name"], "team");
    assert_eq!(team["limits"]["rpm"]["limit"], 1000);
    assert_eq!(team["limits"]["rpm"]["used"], 3 + failed + 1, "{team}");
    assert!(team["limits"]["tokens_per_day"]["used"].as_u64() > Some(0));

    let history = &data["history"];
    assert_eq!(history["every_ms"], 10_000);
    let points = history["points"].as_array().unwrap();
    assert!(points.len() >= 2, "the first sample and now: {history}");
    let (first, last) = (&points[0], &points[points.len() - 1]);
    assert!(first["at_ms"].as_u64() <= last["at_ms"].as_u64());
    assert_eq!(last["requests"], 3 + failed + 1 + 2);
    assert_eq!(last["server_errors"], failed + 1);
    assert_eq!(last["client_errors"], 2);
    assert!(last["input_tokens"].as_u64() > Some(0));
    assert!(last["cost_usd"].as_f64() > Some(0.0), "{last}");
}
