//! JWT callers through real HTTP (`client_auth.jwt`, tenants' `principals`): a token from the
//! simulated OIDC issuer is served as its tenant's principal, held to the tenant's limits,
//! aliases and regions and recorded under the principal's id; each bad token is refused 401
//! `invalid_token` saying which check failed; a key rotation is picked up without a restart; a
//! storm of forged kids refetches the issuer's keys at most once per interval; an issuer that
//! cannot be reached is said so, and its tokens are served once it answers.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The harness re-exports more than these tests use.
#![allow(unused_imports)]

mod common;

use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use common::*;
use http::Method;
use onedoor_mock::{Issuer, Mint};
use serde_json::json;

fn azure(name: &str, region: &str) -> EndpointSpec {
    EndpointSpec::azure(name, region).deployment(DeploymentSpec::new("gpt-4o"))
}

/// The tenant `legal` (rpm 3, alias `chat` only, region `eu`) has two principals; `keyed` has
/// the key `KEY`. `issuer_line` is the `client_auth.jwt` entry.
fn config(issuer_line: &str, usage: &str) -> String {
    format!(
        "{usage}client_auth:
  jwt:
    - {issuer_line}
regions: {{ eu: [swedencentral] }}
backends:
  - {{ name: se, provider: azure, region: swedencentral, url: \"{{url:se}}\" }}
  - {{ name: us, provider: azure, region: eastus, url: \"{{url:us}}\" }}
models:
  - name: chat
    targets:
      - {{ backend: us, deployment: gpt-4o, priority: 1 }}
      - {{ backend: se, deployment: gpt-4o, priority: 2 }}
  - name: other
    targets: [{{ backend: se, deployment: gpt-4o }}]
tenants:
  - name: legal
    models: [chat]
    regions: [eu]
    limits: {{ rpm: 3 }}
    principals:
      - {{ id: legal-app, claim: azp, equals: app-1 }}
      - {{ id: legal-ops, claim: roles, equals: Ops.Admin }}
  - name: keyed
    keys: [{{ id: team-key, sha256: {} }}]
",
        key_hash(KEY)
    )
}

async fn start(issuer: &Issuer, extra: &str, usage: &str) -> Harness {
    start_at(&issuer.url(), extra, usage).await
}

async fn start_at(issuer: &str, extra: &str, usage: &str) -> Harness {
    let line = format!("{{ issuer: \"{issuer}\", audience: api://onedoor{extra} }}");
    Harness::start(
        vec![azure("se", "swedencentral"), azure("us", "eastus")],
        &config(&line, usage),
    )
    .await
}

fn minted(issuer: &Issuer, ask: serde_json::Value) -> String {
    let ask: Mint = serde_json::from_value(ask).unwrap();
    issuer.mint(&ask).unwrap()
}

async fn chat_with(h: &Harness, header: &str, credential: &str, model: &str) -> Answer {
    let value = match header {
        "authorization" => format!("Bearer {credential}"),
        _ => credential.to_owned(),
    };
    h.send(
        Method::POST,
        h.url("/v1/chat/completions"),
        &[(header, &value), ("content-type", "application/json")],
        Bytes::from(chat_body(model, false).to_string()),
    )
    .await
}

async fn chat_as(h: &Harness, token: &str) -> Answer {
    chat_with(h, "authorization", token, "chat").await
}

fn segment(value: serde_json::Value) -> String {
    URL_SAFE_NO_PAD.encode(value.to_string())
}

#[tokio::test]
async fn a_valid_token_is_served_as_its_principal_and_held_to_its_tenants_limits() {
    let issuer = Issuer::start(None).await.unwrap();
    let dir = std::env::temp_dir().join(format!("onedoor-jwt-usage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("usage.db");
    let _ = std::fs::remove_file(&db);
    let usage = format!("usage: {{ store: \"sqlite://{}\" }}\n", db.display());
    let h = start(&issuer, "", &usage).await;
    let rsa = minted(&issuer, json!({"claims": {"azp": "app-1"}}));
    let ec = minted(
        &issuer,
        json!({"key": "ec", "claims": {"roles": ["Reader", "Ops.Admin"]}}),
    );

    let first = chat_as(&h, &rsa).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!(first.header("x-ratelimit-limit-requests"), "3");
    assert_eq!(first.header("x-ratelimit-remaining-requests"), "2");
    assert_eq!(
        first.attempts(),
        "se=200",
        "held to eu: the us target is never asked"
    );
    // ES256, a list claim, and the Azure header all name the same tenant's meter.
    let second = chat_with(&h, "api-key", &ec, "chat").await;
    assert_eq!(second.status, 200, "{}", second.body);
    assert_eq!(second.header("x-ratelimit-remaining-requests"), "1");
    let refused = chat_with(&h, "authorization", &rsa, "other").await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(refused.code(), "model_not_allowed");
    assert_eq!(chat_as(&h, &rsa).await.status, 200);
    let limited = chat_as(&h, &rsa).await;
    assert_eq!(limited.status, 429, "{}", limited.body);
    assert_eq!(limited.code(), "rate_limited");
    assert!(
        limited.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant `legal`"),
        "{}",
        limited.body
    );
    // A key caller beside it is untouched.
    assert_eq!(h.chat("chat").await.status, 200);
    let ids: Vec<String> = [&first, &second]
        .iter()
        .map(|a| a.header("x-onedoor-request-id").to_owned())
        .collect();

    let Harness { gateway, fleet, .. } = h;
    gateway.shutdown().await;
    fleet.shutdown().await;
    let connection = rusqlite::Connection::open(&db).unwrap();
    for (id, principal) in ids.iter().zip(["legal-app", "legal-ops"]) {
        let (tenant, key_id): (String, String) = connection
            .query_row(
                "SELECT tenant, key_id FROM usage_records WHERE request_id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!((tenant.as_str(), key_id.as_str()), ("legal", principal));
    }
}

#[tokio::test]
async fn each_bad_token_is_refused_401_invalid_token_saying_which_check_failed() {
    let issuer = Issuer::start(None).await.unwrap();
    let h = start(&issuer, "", "").await;
    let app = json!({"azp": "app-1"});
    let good = minted(&issuer, json!({"claims": app}));
    let [header, payload, _]: [&str; 3] = good.split('.').collect::<Vec<_>>().try_into().unwrap();
    let other_signature = minted(&issuer, json!({"claims": {"azp": "app-2"}}))
        .rsplit('.')
        .next()
        .unwrap()
        .to_owned();
    let in_an_hour = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let cases: Vec<(&str, String, &str)> = vec![
        (
            "expired",
            minted(&issuer, json!({"claims": app, "lifetime": -600})),
            "expired: its exp is past",
        ),
        (
            "not yet valid",
            minted(
                &issuer,
                json!({"claims": {"azp": "app-1", "nbf": in_an_hour}}),
            ),
            "not yet valid",
        ),
        (
            "wrong audience",
            minted(
                &issuer,
                json!({"claims": {"azp": "app-1", "aud": "api://else"}}),
            ),
            "wrong audience: its aud names none of api://onedoor",
        ),
        (
            "wrong issuer",
            minted(
                &issuer,
                json!({"claims": {"azp": "app-1", "iss": "https://evil.example.com"}}),
            ),
            "wrong issuer: \"https://evil.example.com\"",
        ),
        (
            "bad signature",
            format!("{header}.{payload}.{other_signature}"),
            "bad signature: it does not verify with the issuer's key \"rsa-1\"",
        ),
        (
            "alg none",
            format!(
                "{}.{payload}.",
                segment(json!({"alg": "none", "typ": "JWT"}))
            ),
            "alg \"none\"",
        ),
        (
            "HMAC",
            format!(
                "{}.{payload}.{other_signature}",
                segment(json!({"alg": "HS256", "kid": "rsa-1"}))
            ),
            "HMAC-signed tokens (HS256) are refused",
        ),
        (
            "unknown kid",
            minted(&issuer, json!({"claims": app, "kid": "forged-kid"})),
            "unknown kid \"forged-kid\"",
        ),
        (
            "no principal",
            minted(&issuer, json!({"claims": {"azp": "stranger"}})),
            "no tenant's principal matches it (principals name its azp or roles)",
        ),
        (
            "string nbf",
            minted(&issuer, json!({"claims": {"azp": "app-1", "nbf": "0"}})),
            "nbf is not a number",
        ),
    ];
    for (what, token, reason) in cases {
        let answer = chat_as(&h, &token).await;
        assert_eq!(answer.status, 401, "{what}: {}", answer.body);
        assert_eq!(answer.code(), "invalid_token", "{what}");
        assert_eq!(answer.header("x-onedoor-error"), "invalid_token", "{what}");
        assert_eq!(
            answer.header("www-authenticate"),
            "Bearer error=\"invalid_token\"",
            "{what}"
        );
        let message = answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.contains(reason), "{what}: {message}");
        assert!(
            !message.contains(&token) && !message.contains(payload),
            "{what}: {message}"
        );
        assert_eq!(answer.attempts(), "", "{what}: no upstream is asked");
    }
    assert_eq!(chat_as(&h, &good).await.status, 200);
}

#[tokio::test]
async fn a_key_rotation_in_the_jwks_is_picked_up_without_a_restart() {
    let issuer = Issuer::start(None).await.unwrap();
    let h = start(&issuer, ", refetch_interval: 1ms", "").await;
    let before = minted(&issuer, json!({"claims": {"azp": "app-1"}}));
    assert_eq!(chat_as(&h, &before).await.status, 200);

    let kids = issuer.rotate().unwrap();
    assert_eq!(kids, ["rsa-2", "ec-2"]);
    for key in ["rsa", "ec"] {
        let after = minted(&issuer, json!({"key": key, "claims": {"azp": "app-1"}}));
        let answer = chat_as(&h, &after).await;
        assert_eq!(answer.status, 200, "{key}: {}", answer.body);
    }
    // The withdrawn key is no longer trusted.
    let old = chat_as(&h, &before).await;
    assert_eq!(old.status, 401);
    assert!(
        old.body.contains("unknown kid \\\"rsa-1\\\""),
        "{}",
        old.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_forged_kids_refetches_the_keys_at_most_once_per_interval() {
    let issuer = Issuer::start(None).await.unwrap();
    let interval = Duration::from_secs(2);
    let extra = format!(
        ", jwks_url: \"{}/keys\", refetch_interval: {}ms",
        issuer.url(),
        interval.as_millis()
    );
    let h = start(&issuer, &extra, "").await;
    // The gateway fetches the keys at start, without waiting for a token.
    assert!(eventually(|| issuer.jwks_fetches() == 1).await);
    let good = minted(&issuer, json!({"claims": {"azp": "app-1"}}));
    assert_eq!(chat_as(&h, &good).await.status, 200);
    assert_eq!(issuer.jwks_fetches(), 1, "a cached key is not refetched");

    tokio::time::sleep(interval).await;
    let forged: Vec<String> = (0..100)
        .map(|i| {
            minted(
                &issuer,
                json!({"claims": {"azp": "app-1"}, "kid": format!("forged-{i}")}),
            )
        })
        .collect();
    for round in 0..2 {
        let answers = futures_util::future::join_all(forged.iter().map(|t| chat_as(&h, t))).await;
        assert!(answers
            .iter()
            .all(|a| a.status == 401 && a.code() == "invalid_token"));
        assert_eq!(
            issuer.jwks_fetches(),
            2,
            "round {round}: one refetch for them all"
        );
    }
    assert_eq!(chat_as(&h, &good).await.status, 200);
}

#[tokio::test]
async fn an_issuer_that_cannot_be_reached_refuses_its_tokens_until_it_answers() {
    let first = Issuer::start(None).await.unwrap();
    let (addr, url) = (first.addr(), first.url());
    let token = minted(&first, json!({"claims": {"azp": "app-1"}}));
    first.shutdown();
    let h = start_at(&url, ", refetch_interval: 1ms", "").await;
    let refused = chat_as(&h, &token).await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    assert_eq!(refused.code(), "invalid_token");
    assert!(
        refused
            .body
            .contains("the issuer's signing keys could not be fetched"),
        "{}",
        refused.body
    );

    // Its port frees once the aborted listener is dropped.
    let rebind = async {
        loop {
            match Issuer::start(Some(addr)).await {
                Ok(issuer) => break issuer,
                Err(_) => tokio::task::yield_now().await,
            }
        }
    };
    let back = tokio::time::timeout(Duration::from_secs(10), rebind)
        .await
        .expect("the issuer's port frees");
    let served = chat_as(&h, &minted(&back, json!({"claims": {"azp": "app-1"}}))).await;
    assert_eq!(served.status, 200, "{}", served.body);
}
