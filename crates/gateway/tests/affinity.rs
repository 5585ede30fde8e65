//! Session affinity (`session_affinity: true`): the first answer carries a session token, every
//! request that brings it back lands on the same backend, and when that backend cannot take it
//! the caller is told the session cannot continue instead of being moved.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::BTreeMap;

use bytes::Bytes;
use common::*;
use http::Method;

fn fleet() -> Vec<EndpointSpec> {
    ["a", "b"]
        .into_iter()
        .map(|name| {
            EndpointSpec::azure(name, "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
        })
        .collect()
}

fn config(backends: &[&str]) -> String {
    let mut yaml = String::from(
        "circuit_breakers:\n  quick:\n    rules:\n      - { name: errors, failures: { count: 1, within: 60s, status: [500-599] }, trip: 60s }\nbackends:\n",
    );
    for name in backends {
        yaml.push_str(&format!(
            "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{{url:{name}}}\", circuit_breaker: quick }}\n"
        ));
    }
    for (alias, affinity) in [("assistants", true), ("chat", false)] {
        yaml.push_str(&format!(
            "{}  - name: {alias}\n    session_affinity: {affinity}\n    targets:\n",
            if alias == "assistants" {
                "models:\n"
            } else {
                ""
            }
        ));
        for name in backends {
            yaml.push_str(&format!(
                "      - {{ backend: {name}, deployment: gpt-4o }}\n"
            ));
        }
    }
    yaml
}

/// A chat completion for `model` with `key`, carrying `extra` headers.
async fn ask(h: &Harness, model: &str, key: &str, extra: &[(&str, &str)]) -> Answer {
    let auth = format!("Bearer {key}");
    let mut headers = vec![
        ("authorization", auth.as_str()),
        ("content-type", "application/json"),
    ];
    headers.extend_from_slice(extra);
    let body = Bytes::from(chat_body(model, false).to_string());
    h.send(Method::POST, h.url("/v1/chat/completions"), &headers, body)
        .await
}

/// Starts a session on `assistants`: its token and the backend that holds it.
async fn start_session(h: &Harness) -> (String, String) {
    let first = ask(h, "assistants", KEY, &[]).await;
    assert_eq!(first.status, 200, "{}", first.body);
    let token = first.header("x-onedoor-session").to_owned();
    assert!(token.starts_with("ods_"), "{token:?}");
    let cookie = first.header("set-cookie");
    assert!(
        cookie.starts_with(&format!("onedoor-session={token};")),
        "{cookie}"
    );
    assert!(cookie.contains("HttpOnly"));
    (token, first.header("x-onedoor-backend").to_owned())
}

#[tokio::test]
async fn a_hundred_requests_with_one_session_token_land_on_one_backend_while_a_plain_alias_spreads()
{
    let h = Harness::start(fleet(), &config(&["a", "b"])).await;
    let (token, holder) = start_session(&h).await;
    let cookie = format!("theme=dark; onedoor-session={token}");
    let mut pinned = BTreeMap::new();
    for i in 0..100 {
        let carried = match i % 2 {
            0 => ("x-onedoor-session", token.as_str()),
            _ => ("cookie", cookie.as_str()),
        };
        let answer = ask(&h, "assistants", KEY, &[carried]).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-session"), token);
        *pinned
            .entry(answer.header("x-onedoor-backend").to_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(pinned, BTreeMap::from([(holder, 100)]));
    let mut spread = BTreeMap::new();
    for _ in 0..100 {
        let answer = ask(&h, "chat", KEY, &[("x-onedoor-session", &token)]).await;
        assert_eq!(
            answer.header("x-onedoor-session"),
            "",
            "a plain alias issues no token"
        );
        *spread
            .entry(answer.header("x-onedoor-backend").to_owned())
            .or_insert(0) += 1;
    }
    assert_eq!(spread.len(), 2, "{spread:?}");
    assert!(spread.values().all(|n| *n >= 30), "{spread:?}");
}

#[tokio::test]
async fn a_session_whose_backend_is_drained_cannot_continue_and_is_not_moved() {
    let h = Harness::start(fleet(), &config(&["a", "b"])).await;
    let (token, holder) = start_session(&h).await;
    assert_eq!(
        h.admin_post(&format!("/admin/backends/{holder}/drain"))
            .await
            .status,
        200
    );
    let served_before = h.endpoint(&holder).total_requests();
    let answer = ask(&h, "assistants", KEY, &[("x-onedoor-session", &token)]).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.code(), "no_backend_available");
    let message = answer.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains(&format!("`{holder}`, which is drained")),
        "{message}"
    );
    assert!(message.contains("cannot continue"), "{message}");
    assert_eq!(answer.attempts(), "");
    assert_eq!(h.endpoint(&holder).total_requests(), served_before);
    // Without the token a new session starts elsewhere.
    let fresh = ask(&h, "assistants", KEY, &[]).await;
    assert_eq!(fresh.status, 200);
    assert_ne!(fresh.header("x-onedoor-backend"), holder);
    assert_ne!(fresh.header("x-onedoor-session"), token);
}

#[tokio::test]
async fn a_failing_session_backend_is_retried_in_place_then_its_open_breaker_ends_the_session() {
    let h = Harness::start(fleet(), &config(&["a", "b"])).await;
    let (token, holder) = start_session(&h).await;
    h.endpoint(&holder).set_behavior(Behavior {
        status: Some(500),
        ..Behavior::default()
    });
    let failed = ask(&h, "assistants", KEY, &[("x-onedoor-session", &token)]).await;
    assert_eq!(failed.status, 502, "{}", failed.body);
    assert!(
        failed
            .attempts()
            .split(',')
            .all(|a| a.starts_with(&format!("{holder}="))),
        "never another backend: {}",
        failed.attempts()
    );
    let open = ask(&h, "assistants", KEY, &[("x-onedoor-session", &token)]).await;
    assert_eq!(open.status, 503, "{}", open.body);
    assert_eq!(open.code(), "no_backend_available");
    assert!(open.body.contains("open circuit breaker"), "{}", open.body);
}

#[tokio::test]
async fn a_token_means_nothing_to_another_tenant_or_once_forged() {
    let h = Harness::start(fleet(), &config(&["a", "b"])).await;
    let (token, _) = start_session(&h).await;
    let other = ask(
        &h,
        "assistants",
        OTHER_KEY,
        &[("x-onedoor-session", &token)],
    )
    .await;
    assert_eq!(other.status, 400, "{}", other.body);
    assert_eq!(other.code(), "invalid_request");
    assert!(other.body.contains("cannot continue"), "{}", other.body);
    let forged = format!("ods_{:032x}", 42u128);
    let answer = ask(&h, "assistants", KEY, &[("x-onedoor-session", &forged)]).await;
    assert_eq!(answer.status, 400);
    let junk = ask(
        &h,
        "assistants",
        KEY,
        &[("x-onedoor-session", "../../admin")],
    )
    .await;
    assert_eq!(junk.status, 400);
}

#[tokio::test]
async fn a_session_on_a_backend_removed_from_the_config_cannot_continue() {
    let h = Harness::start_from_file(fleet(), &config(&["a", "b"])).await;
    let (token, holder) = start_session(&h).await;
    let kept = if holder == "a" { "b" } else { "a" };
    h.write_config(&config(&[kept]));
    h.gateway.reload().await.unwrap();
    let answer = ask(&h, "assistants", KEY, &[("x-onedoor-session", &token)]).await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(
        answer.body.contains("no longer configured"),
        "{}",
        answer.body
    );
}
