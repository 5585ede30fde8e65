//! Metrics and decision traces through real HTTP (contract sections 3 and 4): `GET /metrics`
//! counts a scripted mix exactly and parses as the Prometheus text format; a traced request that
//! failed over twice shows both failures with their reasons and timings.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod instances;

use std::collections::HashMap;

use bytes::Bytes;
use common::*;
use http::Method;
use instances::*;

fn azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
}

fn failing(status: u16) -> Behavior {
    Behavior {
        status: Some(status),
        ..Behavior::default()
    }
}

fn backend(name: &str, breaker: bool) -> String {
    let policy = if breaker {
        ", circuit_breaker: default"
    } else {
        ""
    };
    format!("  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\"{policy} }}\n")
}

/// The scrape, parsed: every sample as `name{labels}` (labels sorted) to its value.
fn samples(text: &str) -> HashMap<String, f64> {
    let lines = text.lines().map(|l| Ok(l.to_owned()));
    let scrape = prometheus_parse::Scrape::parse(lines).expect("the text format parses");
    assert!(!scrape.samples.is_empty(), "no samples in {text}");
    let mut out = HashMap::new();
    for sample in scrape.samples {
        let mut labels: Vec<String> = sample
            .labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        labels.sort();
        let value = match sample.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(buckets) => {
                buckets.last().map(|b| b.count).unwrap_or(0.0)
            }
            prometheus_parse::Value::Summary(_) => continue,
        };
        out.insert(format!("{}{{{}}}", sample.metric, labels.join(",")), value);
    }
    out
}

fn value(samples: &HashMap<String, f64>, key: &str) -> f64 {
    *samples.get(key).unwrap_or_else(|| {
        panic!(
            "no sample {key} in {:#?}",
            samples.keys().collect::<Vec<_>>()
        )
    })
}

#[tokio::test]
async fn metrics_count_a_scripted_mix_exactly_and_parse_as_prometheus_text() {
    let h = Harness::start(
        vec![
            azure("flaky").behavior(failing(500)),
            azure("steady"),
            azure("busy").behavior(failing(429)),
        ],
        &format!(
            "circuit_breakers: {{ default: {{ rules: [{{ name: server-errors, failures: {{ count: 4, within: 60s, status: [500-599] }}, trip: 60s }}] }} }}\nbackends:\n{}{}{}models:\n  - name: chat\n    targets:\n      - {{ backend: flaky, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: steady, deployment: gpt-4o, priority: 2 }}\n  - name: throttled\n    targets:\n      - {{ backend: busy, deployment: gpt-4o }}\n",
            backend("flaky", true),
            backend("steady", false),
            backend("busy", false),
        ),
    )
    .await;
    // Two failovers, each after flaky's same-target retry (the second trips its breaker), then
    // one around the open breaker.
    let failover = "flaky=500,flaky=500,steady=200";
    for expected in [failover, failover, "steady=200"] {
        let answer = h.chat("chat").await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.attempts(), expected);
    }
    let stream = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(stream.status, 200, "{}", stream.body);
    assert_eq!(stream.attempts(), "steady=200");
    let throttled = h.chat("throttled").await;
    assert_eq!(throttled.status, 429, "{}", throttled.body);
    let unknown = h
        .send(
            Method::POST,
            h.url("/v1/chat/completions"),
            &[("authorization", "Bearer nope")],
            Bytes::from(chat_body("chat", false).to_string()),
        )
        .await;
    assert_eq!(unknown.status, 401);

    assert_eq!(h.admin_get("/metrics", None).await.status, 401);
    let scrape = h.admin_get("/metrics", Some(ADMIN_TOKEN)).await;
    assert_eq!(scrape.status, 200, "{}", scrape.body);
    assert!(scrape.header("content-type").contains("openmetrics-text"));
    assert!(!scrape.body.contains(KEY), "a key in the metrics");
    let s = samples(&scrape.body);

    let requests = |labels: &str| value(&s, &format!("onedoor_requests_total{{{labels}}}"));
    assert_eq!(requests("alias=chat,code=-,status=200,tenant=team"), 4.0);
    let busy = throttled.header("x-onedoor-error").to_owned();
    assert_eq!(
        requests(&format!(
            "alias=throttled,code={busy},status=429,tenant=team"
        )),
        1.0
    );
    assert_eq!(
        requests("alias=-,code=invalid_api_key,status=401,tenant=-"),
        1.0
    );

    let attempts =
        |labels: &str| value(&s, &format!("onedoor_upstream_attempts_total{{{labels}}}"));
    assert_eq!(attempts("backend=flaky,outcome=500"), 4.0);
    assert_eq!(attempts("backend=steady,outcome=200"), 4.0);
    let busy_attempts = throttled.attempts().split(',').count() as f64;
    assert_eq!(attempts("backend=busy,outcome=429"), busy_attempts);

    assert_eq!(
        value(
            &s,
            "onedoor_breaker_state{backend=flaky,deployment=gpt-4o,region=swedencentral}"
        ),
        2.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_breaker_state{backend=flaky,deployment=,region=swedencentral}"
        ),
        0.0,
        "the backend's own breaker saw no connection failure"
    );
    assert_eq!(
        value(
            &s,
            "onedoor_breaker_state{backend=steady,deployment=,region=swedencentral}"
        ),
        0.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_backend_in_flight{backend=steady,region=swedencentral}"
        ),
        0.0
    );
    assert_eq!(value(&s, "onedoor_tenant_in_flight{tenant=team}"), 0.0);
    assert_eq!(
        value(
            &s,
            "onedoor_breaker_transitions_total{backend=flaky,deployment=gpt-4o,to=open}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_breaker_transitions_total{backend=flaky,deployment=gpt-4o,to=close}"
        ),
        0.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_stream_events_dropped_total{backend=steady,region=swedencentral}"
        ),
        0.0
    );
    assert_eq!(value(&s, "onedoor_not_served_entries{}"), 0.0);
    assert_eq!(value(&s, "onedoor_usage_records{outcome=written}"), 0.0);
    // Every authenticated request is timed once it ended: four answers on chat (the stream's
    // at its end), one on throttled.
    assert_eq!(
        value(&s, "onedoor_request_duration_seconds{alias=chat}"),
        4.0
    );
    assert_eq!(
        value(&s, "onedoor_request_duration_seconds{alias=throttled}"),
        1.0
    );
    assert_eq!(
        value(&s, "onedoor_time_to_first_token_seconds{alias=chat}"),
        1.0
    );
    assert_eq!(value(&s, "onedoor_gateway_overhead_seconds{}"), 6.0);
    assert!(
        value(
            &s,
            "onedoor_tokens_total{alias=chat,kind=input,source=measured,tenant=team}"
        ) > 0.0
    );
    assert!(
        value(
            &s,
            "onedoor_tokens_total{alias=chat,kind=output,source=measured,tenant=team}"
        ) > 0.0
    );
}

#[tokio::test]
async fn metrics_can_be_public_and_count_reloads() {
    let h = Harness::start_from_file(
        vec![azure("steady")],
        &format!(
            "admin: {{ token: {ADMIN_TOKEN}, metrics_public: true }}\nbackends:\n{}models:\n  - name: chat\n    targets: [{{ backend: steady, deployment: gpt-4o }}]\n",
            backend("steady", false)
        ),
    )
    .await;
    assert!(h.gateway.reload().await.is_ok());
    h.write_raw_config("backends: [");
    assert!(h.gateway.reload().await.is_err());
    let scrape = h.admin_get("/metrics", None).await;
    assert_eq!(scrape.status, 200, "{}", scrape.body);
    let s = samples(&scrape.body);
    assert_eq!(
        value(&s, "onedoor_config_reloads_total{outcome=applied}"),
        1.0
    );
    assert_eq!(
        value(&s, "onedoor_config_reloads_total{outcome=refused}"),
        1.0
    );
    assert_eq!(h.admin_get("/admin/backends", None).await.status, 401);
}

fn traced_config(trace_until: &str) -> String {
    format!(
        "routing: {{ max_attempts: 5 }}\nbackends:\n{}{}{}models:\n  - name: chat\n    targets:\n      - {{ backend: first, deployment: gpt-4o, priority: 1 }}\n      - {{ backend: second, deployment: gpt-4o, priority: 2 }}\n      - {{ backend: third, deployment: gpt-4o, priority: 3 }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {}{trace_until} }}]\n  - name: other\n    keys: [{{ id: other-key, sha256: {} }}]\n",
        backend("first", false),
        backend("second", false),
        backend("third", false),
        key_hash(KEY),
        key_hash(OTHER_KEY),
    )
}

async fn traced_chat(h: &Harness, key: &str) -> Answer {
    let auth = format!("Bearer {key}");
    h.send(
        Method::POST,
        h.url("/v1/chat/completions"),
        &[("authorization", &auth), ("x-onedoor-trace", "true")],
        Bytes::from(chat_body("chat", false).to_string()),
    )
    .await
}

#[tokio::test]
async fn a_trace_of_a_request_that_failed_over_twice_lists_both_failures_with_reasons_and_timings()
{
    let h = Harness::start(
        vec![
            azure("first").behavior(failing(500)),
            azure("second").behavior(failing(503)),
            azure("third"),
        ],
        &traced_config(", trace_until: 2100-01-01T00:00:00Z"),
    )
    .await;
    let answer = traced_chat(&h, KEY).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    // Each failing target gets its same-target retry before the request moves on.
    assert_eq!(
        answer.attempts(),
        "first=500,first=500,second=503,second=503,third=200"
    );
    let id = answer.header("x-onedoor-trace-id").to_owned();
    assert_eq!(id, answer.header("x-onedoor-request-id"));

    assert_eq!(
        h.admin_get(&format!("/admin/traces/{id}"), None)
            .await
            .status,
        401
    );
    let trace = h
        .admin_get(&format!("/admin/traces/{id}"), Some(ADMIN_TOKEN))
        .await;
    assert_eq!(trace.status, 200, "{}", trace.body);
    let trace = trace.json();
    assert_eq!(trace["alias"]["resolved"], "chat", "{trace}");
    assert_eq!(trace["candidates"].as_array().unwrap().len(), 3, "{trace}");
    assert_eq!(trace["limits"]["tenant"], "team");
    assert!(trace["tokens_estimated"]["prompt"].as_u64().is_some());
    assert!(trace["tokens_measured"]["input"].as_u64().is_some());
    let attempts = trace["attempts"].as_array().unwrap();
    let outcomes: Vec<&str> = attempts
        .iter()
        .map(|a| a["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["500", "500", "503", "503", "200"], "{trace}");
    for failure in &attempts[..4] {
        assert!(
            failure["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{trace}"
        );
        assert!(failure["duration_ms"].as_f64().is_some(), "{trace}");
        assert!(failure["start_ms"].as_f64().is_some(), "{trace}");
        assert_eq!(failure["fitness"]["headroom"], true);
    }
    let starts: Vec<f64> = attempts
        .iter()
        .map(|a| a["start_ms"].as_f64().unwrap())
        .collect();
    assert!(starts.windows(2).all(|w| w[0] <= w[1]), "{trace}");

    let unknown = h.admin_get("/admin/traces/nope", Some(ADMIN_TOKEN)).await;
    assert_eq!(unknown.status, 404);
}

#[tokio::test]
async fn only_a_key_with_a_future_trace_until_that_asks_gets_a_trace() {
    let h = Harness::start(
        vec![azure("first"), azure("second"), azure("third")],
        &traced_config(", trace_until: 2020-01-01T00:00:00Z"),
    )
    .await;
    let expired = traced_chat(&h, KEY).await;
    assert_eq!(expired.status, 200, "{}", expired.body);
    assert_eq!(expired.header("x-onedoor-trace-id"), "");
    let never = traced_chat(&h, OTHER_KEY).await;
    assert_eq!(never.status, 200, "{}", never.body);
    assert_eq!(never.header("x-onedoor-trace-id"), "");
    let id = expired.header("x-onedoor-request-id");
    let trace = h
        .admin_get(&format!("/admin/traces/{id}"), Some(ADMIN_TOKEN))
        .await;
    assert_eq!(trace.status, 404);
}

#[tokio::test]
async fn a_trace_made_on_one_instance_is_read_on_another_sharing_redis() {
    let config = format!(
        "{}{}",
        shared_state("traces"),
        traced_config(", trace_until: 2100-01-01T00:00:00Z")
    );
    let h = Harness::start(
        vec![azure("first"), azure("second"), azure("third")],
        &config,
    )
    .await;
    let other = another(&h, &config).await;
    let answer = traced_chat(&h, KEY).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let id = answer.header("x-onedoor-trace-id");
    assert!(!id.is_empty());
    let trace = admin_get_on(&h, &other, &format!("/admin/traces/{id}")).await;
    assert_eq!(trace.status, 200, "{}", trace.body);
    assert_eq!(trace.json()["attempts"][0]["outcome"], "200");
    other.shutdown().await;
}

#[tokio::test]
async fn a_tenant_over_its_rpm_counts_as_a_rate_rejection() {
    let h = Harness::start(
        vec![azure("steady")],
        &format!(
            "backends:\n{}models:\n  - name: chat\n    targets: [{{ backend: steady, deployment: gpt-4o }}]\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {{ rpm: 1 }}\n",
            backend("steady", false),
            key_hash(KEY)
        ),
    )
    .await;
    assert_eq!(h.chat("chat").await.status, 200);
    let refused = h.chat("chat").await;
    assert_eq!(refused.status, 429, "{}", refused.body);
    assert_eq!(refused.code(), "rate_limited");
    let s = samples(&h.admin_get("/metrics", Some(ADMIN_TOKEN)).await.body);
    assert_eq!(
        value(&s, "onedoor_limiter_rejections_total{kind=rate}"),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_requests_total{alias=chat,code=rate_limited,status=429,tenant=team}"
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "onedoor_upstream_attempts_total{backend=steady,outcome=200}"
        ),
        1.0
    );
}
