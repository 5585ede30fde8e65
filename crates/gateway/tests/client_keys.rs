//! Client keys made at runtime through the admin API, through real HTTP: two gateway instances
//! on one usage database (SQLite file or Postgres) and, where limits must hold across them, one
//! Redis prefix. A key made on one instance answers on the other within a second; a disabled
//! one is refused there as fast; a rotated secret keeps working for its grace and no longer; a
//! budget stops its key exactly at its limit; every change is in the audit; a restart keeps it all.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
// The shared harness re-exports more of the mock than these tests use.
#![allow(unused_imports)]

mod common;
mod instances;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::*;
use http::Method;
use instances::*;
use onedoor_gateway::Running;
use serde_json::{json, Value};

/// A tenant with limits a key may tighten, a second tenant, and `chat` priced at $1000 per
/// million tokens either way (so twenty tokens cost $0.02), on `store` with `state`.
fn config(store: &str, state: &str) -> String {
    format!(
        "{state}usage: {{ store: \"{store}\" }}
backends:
  - {{ name: a, provider: azure, region: swedencentral, url: \"{{url:a}}\" }}
models:
  - name: chat
    price: {{ input_per_1m: 1000, output_per_1m: 1000 }}
    targets: [{{ backend: a, deployment: gpt-4o }}]
  - name: mini
    targets: [{{ backend: a, deployment: gpt-4o }}]
tenants:
  - name: team
    keys: [{{ id: team-key, sha256: {} }}]
    limits: {{ rpm: 1000, usd_per_month: 100 }}
  - name: other
    models: [mini]
",
        key_hash(KEY)
    )
}

/// A fresh SQLite usage file.
fn sqlite_store() -> String {
    let dir: PathBuf = temp_config_path().parent().unwrap().to_path_buf();
    format!("sqlite://{}", dir.join("usage.db").display())
}

async fn start(store: &str, state: &str) -> (Harness, Running) {
    let config = config(store, state);
    let h = Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))],
        &config,
    )
    .await;
    let second = another(&h, &config).await;
    (h, second)
}

async fn admin(h: &Harness, gateway: &Running, method: Method, path: &str, body: Value) -> Answer {
    let url = format!("http://{}{path}", gateway.admin_addr());
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let body = match body {
        Value::Null => Bytes::new(),
        body => Bytes::from(body.to_string()),
    };
    h.send(
        method,
        url,
        &[("authorization", &auth), ("x-onedoor-actor", "ci-pipeline")],
        body,
    )
    .await
}

/// Creates a key on `gateway`; its id and secret.
async fn create(h: &Harness, gateway: &Running, body: Value) -> (String, String) {
    let made = admin(h, gateway, Method::POST, "/admin/keys", body).await;
    assert_eq!(made.status, 201, "{}", made.body);
    let made = made.json();
    (
        made["id"].as_str().unwrap().to_owned(),
        made["key"].as_str().unwrap().to_owned(),
    )
}

/// A chat completion on `gateway` with `key`.
async fn chat_with(h: &Harness, gateway: &Running, key: &str, body: &Value) -> Answer {
    let auth = format!("Bearer {key}");
    h.send(
        Method::POST,
        format!("http://{}/v1/chat/completions", gateway.addr()),
        &[
            ("authorization", &auth),
            ("content-type", "application/json"),
        ],
        Bytes::from(body.to_string()),
    )
    .await
}

/// Asks every 20 ms (a twenty-token request), for up to `within`, until `key` gets `status` on
/// `gateway`; how long that took.
async fn until_status(
    h: &Harness,
    gateway: &Running,
    key: &str,
    status: u16,
    within: Duration,
) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() <= within {
        if chat_with(h, gateway, key, &twenty_tokens()).await.status == status {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Twelve prompt tokens (as the gateway counts them, and as the simulated upstream reports them)
/// and a completion of eight: reserved and measured are both twenty tokens, $0.02 here.
fn twenty_tokens() -> Value {
    json!({
        "model": "chat",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "Hello there, internationalization"}]
    })
}

#[tokio::test]
async fn a_key_made_on_one_instance_answers_on_another_within_a_second() {
    let (h, second) = start(&sqlite_store(), "").await;
    let (id, secret) = create(
        &h,
        &h.gateway,
        json!({"tenant": "team", "name": "billing-app"}),
    )
    .await;
    assert!(secret.starts_with("od-") && secret.len() == 43, "{secret}");
    // The instance that made it knows it at once.
    let here = chat_with(&h, &h.gateway, &secret, &chat_body("chat", false)).await;
    assert_eq!(here.status, 200, "{}", here.body);
    let took = until_status(&h, &second, &secret, 200, Duration::from_secs(1)).await;
    let took = took.expect("the key answers on the second instance within a second");
    eprintln!("a new key answered on the second instance after {took:?}");
    // The config's key goes on working beside it.
    assert_eq!(
        chat_on(&h, &second, &chat_body("chat", false)).await.status,
        200
    );
    // Listed with its tenant and name, never with its secret or its hash.
    let listed = admin(&h, &second, Method::GET, "/admin/keys", Value::Null).await;
    assert_eq!(listed.status, 200);
    let keys = listed.json()["keys"].as_array().unwrap().clone();
    assert_eq!(keys.len(), 1);
    assert_eq!(keys[0]["id"], id.as_str());
    assert_eq!(keys[0]["tenant"], "team");
    assert_eq!(keys[0]["name"], "billing-app");
    assert_eq!(keys[0]["state"], "active");
    assert!(keys[0]["last_used_at"].is_string(), "{}", keys[0]);
    let hash = key_hash(&secret);
    assert!(
        !listed.body.contains(&secret) && !listed.body.contains(&hash),
        "{}",
        listed.body
    );
    // A usage record names the key by its id.
    let unknown = chat_with(&h, &second, "od-not-a-key", &chat_body("chat", false)).await;
    assert_eq!(
        (unknown.status.as_u16(), unknown.code()),
        (401, "invalid_api_key".into())
    );
}

#[tokio::test]
async fn a_disabled_key_is_refused_everywhere_within_a_second() {
    let (h, second) = start(&sqlite_store(), "").await;
    let (id, secret) = create(&h, &h.gateway, json!({"tenant": "team"})).await;
    until_status(&h, &second, &secret, 200, Duration::from_secs(1))
        .await
        .expect("known on the second instance");
    let changed = admin(
        &h,
        &h.gateway,
        Method::PATCH,
        &format!("/admin/keys/{id}"),
        json!({"disabled": true}),
    )
    .await;
    assert_eq!(changed.status, 200, "{}", changed.body);
    assert_eq!(changed.json()["state"], "disabled");
    let refused = chat_with(&h, &h.gateway, &secret, &chat_body("chat", false)).await;
    assert_eq!(refused.status, 401);
    assert_eq!(refused.code(), "invalid_api_key");
    assert!(refused.body.contains("is disabled"), "{}", refused.body);
    let took = until_status(&h, &second, &secret, 401, Duration::from_secs(1)).await;
    let took = took.expect("the second instance refuses the disabled key within a second");
    eprintln!("the second instance refused the disabled key after {took:?}");
    // And back.
    admin(
        &h,
        &h.gateway,
        Method::PATCH,
        &format!("/admin/keys/{id}"),
        json!({"disabled": false}),
    )
    .await;
    until_status(&h, &second, &secret, 200, Duration::from_secs(1))
        .await
        .expect("enabled again");
}

#[tokio::test]
async fn a_rotated_secret_works_in_its_grace_period_and_not_after() {
    let (h, second) = start(&sqlite_store(), "").await;
    let (id, old) = create(&h, &h.gateway, json!({"tenant": "team"})).await;
    let rotate = |grace: Value| {
        let path = format!("/admin/keys/{id}/rotate");
        let h = &h;
        async move {
            let rotated = admin(h, &h.gateway, Method::POST, &path, grace).await;
            assert_eq!(rotated.status, 200, "{}", rotated.body);
            rotated.json()
        }
    };
    // An hour of grace: both secrets work, on both instances.
    let rotated = rotate(json!({"grace": "1h"})).await;
    let new = rotated["key"].as_str().unwrap().to_owned();
    assert_ne!(new, old);
    assert_eq!(
        rotated["rotated_secrets_valid_until"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    until_status(&h, &second, &new, 200, Duration::from_secs(1))
        .await
        .expect("the new secret on the second instance");
    for gateway in [&h.gateway, &second] {
        for secret in [&old, &new] {
            let answer = chat_with(&h, gateway, secret, &chat_body("chat", false)).await;
            assert_eq!(answer.status, 200, "{}", answer.body);
        }
    }
    // Another rotation with a grace of one second shortens the first one's too: after it, only
    // the newest secret works. Taken before the rotation, `asked_at` is at most its start.
    let asked_at = Instant::now();
    let newest = rotate(json!({"grace": "1s"})).await["key"]
        .as_str()
        .unwrap()
        .to_owned();
    let refused = until_status(&h, &second, &old, 401, Duration::from_secs(5)).await;
    assert!(
        refused.is_some(),
        "the first secret is refused after its grace"
    );
    assert!(asked_at.elapsed() >= Duration::from_secs(1));
    for gateway in [&h.gateway, &second] {
        let status = |secret: &str| {
            let secret = secret.to_owned();
            let h = &h;
            async move {
                chat_with(h, gateway, &secret, &chat_body("chat", false))
                    .await
                    .status
            }
        };
        assert_eq!(status(&old).await, 401);
        assert_eq!(status(&new).await, 401);
        assert_eq!(status(&newest).await, 200);
    }
    // Without a grace, the secret in use stops at once.
    rotate(Value::Null).await;
    let stopped = chat_with(&h, &h.gateway, &newest, &chat_body("chat", false)).await;
    assert_eq!(stopped.status, 401);
}

#[tokio::test]
async fn a_budget_stops_its_key_exactly_at_its_limit_across_instances() {
    let state = shared_state("keys-budget");
    let (h, second) = start(&sqlite_store(), &state).await;
    let body = json!({"tenant": "team", "usd_budget": 0.1, "budget_period": "month"});
    let (id, secret) = create(&h, &h.gateway, body).await;
    until_status(&h, &second, &secret, 200, Duration::from_secs(1))
        .await
        .expect("known on the second instance");
    // That check spent one request ($0.02) or more: count from what the meter says now.
    let spent = |answer: &Answer| answer.json()["spend_usd"].as_f64().unwrap();
    let before = spent(
        &admin(
            &h,
            &second,
            Method::GET,
            &format!("/admin/keys/{id}"),
            Value::Null,
        )
        .await,
    );
    let room = ((0.1 - before) / 0.02 + 1e-9).floor() as usize;
    let mut answers = Vec::new();
    for i in 0..room + 2 {
        let gateway = if i % 2 == 0 { &h.gateway } else { &second };
        answers.push(chat_with(&h, gateway, &secret, &twenty_tokens()).await);
    }
    let statuses: Vec<u16> = answers.iter().map(|a| a.status.as_u16()).collect();
    let mut expected = vec![200; room];
    expected.extend([429, 429]);
    assert_eq!(
        statuses, expected,
        "spent ${before} before; room for {room}"
    );
    let refused = &answers[room];
    assert_eq!(refused.code(), "budget_exceeded");
    assert_eq!(refused.header("x-onedoor-error"), "budget_exceeded");
    let message = refused.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains(&format!("the key `{id}` has spent $")),
        "{message}"
    );
    assert!(message.contains("of its $0.10 budget"), "{message}");
    let after = spent(
        &admin(
            &h,
            &h.gateway,
            Method::GET,
            &format!("/admin/keys/{id}"),
            Value::Null,
        )
        .await,
    );
    assert!(
        (after - (before + 0.02 * room as f64)).abs() < 1e-9,
        "{after}"
    );
    // The config's key of the same tenant is not held by the runtime key's budget.
    assert_eq!(chat_on(&h, &second, &twenty_tokens()).await.status, 200);
    // A bigger budget lets it through again.
    let raised = admin(
        &h,
        &h.gateway,
        Method::PATCH,
        &format!("/admin/keys/{id}"),
        json!({"usd_budget": 1}),
    )
    .await;
    assert_eq!(raised.status, 200, "{}", raised.body);
    until_status(&h, &second, &secret, 200, Duration::from_secs(1))
        .await
        .expect("a raised budget admits it again");
}

#[tokio::test]
async fn a_key_keeps_to_its_models_and_its_own_limits() {
    let (h, _second) = start(&sqlite_store(), "").await;
    let body = json!({"tenant": "team", "models": ["mini"], "limits": {"rpm": 2}});
    let (id, secret) = create(&h, &h.gateway, body).await;
    let chat = chat_with(&h, &h.gateway, &secret, &chat_body("chat", false)).await;
    assert_eq!(
        (chat.status.as_u16(), chat.code()),
        (403, "model_not_allowed".into())
    );
    let mini = chat_body("mini", false);
    for _ in 0..2 {
        assert_eq!(chat_with(&h, &h.gateway, &secret, &mini).await.status, 200);
    }
    let limited = chat_with(&h, &h.gateway, &secret, &mini).await;
    assert_eq!(limited.status, 429, "{}", limited.body);
    assert_eq!(limited.code(), "rate_limited");
    assert!(
        limited.body.contains("allows 2 requests per minute"),
        "{}",
        limited.body
    );
    let auth = format!("Bearer {secret}");
    let models = h
        .send(
            Method::GET,
            h.url("/v1/models"),
            &[("authorization", &auth)],
            Bytes::new(),
        )
        .await;
    let ids: Vec<String> = models.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["mini"]);
    // Its use against its own limit is shown with the tenant's, as a config key's is.
    let tenants = admin(&h, &h.gateway, Method::GET, "/admin/tenants", Value::Null).await;
    let team = tenants.json()["tenants"][0].clone();
    let key = team["keys"]
        .as_array()
        .unwrap()
        .iter()
        .find(|k| k["id"] == id.as_str())
        .cloned();
    let key = key.unwrap_or_else(|| panic!("{team}"));
    assert_eq!(key["runtime"], true);
    assert_eq!(
        (
            key["limits"]["rpm"]["limit"].as_u64(),
            key["limits"]["rpm"]["used"].as_u64()
        ),
        (Some(2), Some(2))
    );
}

#[tokio::test]
async fn an_expired_key_is_refused() {
    let (h, _second) = start(&sqlite_store(), "").await;
    let soon = std::time::SystemTime::now() + Duration::from_millis(800);
    let expires_at = humantime::format_rfc3339_millis(soon).to_string();
    let (id, secret) = create(
        &h,
        &h.gateway,
        json!({"tenant": "team", "expires_at": expires_at}),
    )
    .await;
    assert_eq!(
        chat_with(&h, &h.gateway, &secret, &chat_body("chat", false))
            .await
            .status,
        200
    );
    until_status(&h, &h.gateway, &secret, 401, Duration::from_secs(3))
        .await
        .expect("refused once expired");
    let refused = chat_with(&h, &h.gateway, &secret, &chat_body("chat", false)).await;
    assert!(
        refused
            .body
            .contains(&format!("the API key `{id}` has expired")),
        "{}",
        refused.body
    );
    let shown = admin(
        &h,
        &h.gateway,
        Method::GET,
        &format!("/admin/keys/{id}"),
        Value::Null,
    )
    .await;
    assert_eq!(shown.json()["state"], "expired");
}

#[tokio::test]
async fn bad_input_gets_a_clear_error() {
    let (h, _second) = start(&sqlite_store(), "").await;
    let cases = [
        (json!({"name": "x"}), "`tenant` is required"),
        (
            json!({"tenant": "nobody"}),
            "unknown tenant `nobody` (known: team, other)",
        ),
        (
            json!({"tenant": "team", "limits": {"rpm": 5000}}),
            "limits.rpm 5000 is looser than the tenant `team`'s 1000",
        ),
        (
            json!({"tenant": "team", "usd_budget": 5}),
            "`usd_budget` needs a `budget_period`",
        ),
        (
            json!({"tenant": "team", "expires_at": "2020-01-01T00:00:00Z"}),
            "`expires_at` 2020-01-01T00:00:00Z is in the past",
        ),
        (
            json!({"tenant": "other", "models": ["chat"]}),
            "the tenant `other` may not use the model \"chat\"",
        ),
        (
            json!({"tenant": "team", "colour": "red"}),
            "unknown field `colour`",
        ),
    ];
    for (body, expected) in cases {
        let answer = admin(&h, &h.gateway, Method::POST, "/admin/keys", body.clone()).await;
        assert_eq!(answer.status, 400, "{body}: {}", answer.body);
        let message = answer.json()["error"]["message"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(message.contains(expected), "{body}: {message}");
    }
    let not_json = h
        .send(
            Method::POST,
            format!("http://{}/admin/keys", h.gateway.admin_addr()),
            &[("authorization", &format!("Bearer {ADMIN_TOKEN}"))],
            Bytes::from_static(b"{"),
        )
        .await;
    assert_eq!(not_json.status, 400);
    let missing = admin(
        &h,
        &h.gateway,
        Method::PATCH,
        "/admin/keys/key-000000000000",
        json!({"disabled": true}),
    )
    .await;
    assert_eq!(missing.status, 404, "{}", missing.body);
    let unauthorized = h.admin_get("/admin/keys", Some("wrong")).await;
    assert_eq!(unauthorized.status, 401);
    // Nothing was made, and nothing is in the audit.
    let listed = admin(&h, &h.gateway, Method::GET, "/admin/keys", Value::Null).await;
    assert_eq!(listed.json()["keys"], json!([]));
    let audit = admin(&h, &h.gateway, Method::GET, "/admin/audit", Value::Null).await;
    assert_eq!(audit.json()["audit"], json!([]));
}

#[tokio::test]
async fn the_audit_lists_every_change_with_who_and_never_a_secret() {
    let (h, second) = start(&sqlite_store(), "").await;
    let (id, first) = create(&h, &h.gateway, json!({"tenant": "team", "name": "etl"})).await;
    admin(
        &h,
        &second,
        Method::PATCH,
        &format!("/admin/keys/{id}"),
        json!({"limits": {"rpm": 10}}),
    )
    .await;
    let rotated = admin(
        &h,
        &h.gateway,
        Method::POST,
        &format!("/admin/keys/{id}/rotate"),
        json!({"grace": "1m"}),
    )
    .await;
    let second_secret = rotated.json()["key"].as_str().unwrap().to_owned();
    let deleted = admin(
        &h,
        &second,
        Method::DELETE,
        &format!("/admin/keys/{id}"),
        Value::Null,
    )
    .await;
    assert_eq!(deleted.status, 200, "{}", deleted.body);
    let audit = admin(&h, &second, Method::GET, "/admin/audit", Value::Null).await;
    assert_eq!(audit.status, 200);
    let records = audit.json()["audit"].as_array().unwrap().clone();
    let actions: Vec<&str> = records
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["delete", "rotate", "update", "create"]);
    assert!(
        records
            .iter()
            .all(|r| r["key_id"] == id.as_str() && r["actor"] == "admin.token (ci-pipeline)"),
        "{records:?}"
    );
    assert!(records
        .iter()
        .all(|r| r["at"].as_str().unwrap().ends_with('Z')));
    assert_eq!(records[2]["detail"]["changed"]["limits"]["rpm"], 10);
    assert_eq!(records[3]["detail"]["tenant"], "team");
    for secret in [&first, &second_secret] {
        assert!(!audit.body.contains(secret.as_str()) && !audit.body.contains(&key_hash(secret)));
    }
    // Deleted: refused on both instances, and gone from the list.
    until_status(&h, &second, &second_secret, 401, Duration::from_secs(1))
        .await
        .expect("a deleted key is refused");
    let listed = admin(&h, &h.gateway, Method::GET, "/admin/keys", Value::Null).await;
    assert_eq!(listed.json()["keys"], json!([]));
    let limited = admin(
        &h,
        &h.gateway,
        Method::GET,
        "/admin/audit?limit=1",
        Value::Null,
    )
    .await;
    assert_eq!(limited.json()["audit"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn a_restart_loses_no_key_setting_or_audit_record() {
    let store = sqlite_store();
    let config = config(&store, "");
    let (h, second) = start(&store, "").await;
    let (kept, secret) = create(
        &h,
        &h.gateway,
        json!({"tenant": "team", "limits": {"rpm": 7}, "usd_budget": 3, "budget_period": "month"}),
    )
    .await;
    let (off, off_secret) = create(&h, &h.gateway, json!({"tenant": "team"})).await;
    admin(
        &h,
        &h.gateway,
        Method::PATCH,
        &format!("/admin/keys/{off}"),
        json!({"disabled": true}),
    )
    .await;
    assert_eq!(
        chat_with(&h, &h.gateway, &secret, &chat_body("chat", false))
            .await
            .status,
        200
    );
    second.shutdown().await;
    let before = admin(
        &h,
        &h.gateway,
        Method::GET,
        &format!("/admin/keys/{kept}"),
        Value::Null,
    )
    .await
    .json();
    let restarted = another(&h, &config).await;
    let took = until_status(&h, &restarted, &secret, 200, Duration::from_secs(2)).await;
    assert!(took.is_some(), "the key works after a restart");
    assert_eq!(
        chat_with(&h, &restarted, &off_secret, &chat_body("chat", false))
            .await
            .status,
        401
    );
    let after = admin(
        &h,
        &restarted,
        Method::GET,
        &format!("/admin/keys/{kept}"),
        Value::Null,
    )
    .await
    .json();
    for field in [
        "limits",
        "usd_budget",
        "budget_period",
        "tenant",
        "created_at",
    ] {
        assert_eq!(after[field], before[field], "{field}");
    }
    let audit = admin(&h, &restarted, Method::GET, "/admin/audit", Value::Null)
        .await
        .json();
    assert_eq!(audit["audit"].as_array().unwrap().len(), 3);
    restarted.shutdown().await;
}

#[tokio::test]
async fn runtime_keys_on_postgres_reach_a_second_instance_and_stop_there_when_disabled() {
    let url =
        onedoor_usage::testing::fresh_database(onedoor_usage::testing::MACHINE_POSTGRES, "keys")
            .await
            .unwrap_or_else(|message| panic!("{message}"));
    let (h, second) = start(&url, &shared_state("keys-pg")).await;
    let (id, secret) = create(
        &h,
        &h.gateway,
        json!({"tenant": "team", "limits": {"rpm": 3}}),
    )
    .await;
    let took = until_status(&h, &second, &secret, 200, Duration::from_secs(1)).await;
    let took = took.expect("known on the second instance");
    eprintln!("with Postgres and a Redis notice, a new key answered on the second instance after {took:?}");
    // The key's rpm holds across both instances (the check above spent one request).
    let mut statuses = Vec::new();
    for gateway in [&h.gateway, &second, &h.gateway] {
        statuses.push(
            chat_with(&h, gateway, &secret, &chat_body("chat", false))
                .await
                .status
                .as_u16(),
        );
    }
    assert_eq!(statuses, [200, 200, 429]);
    admin(
        &h,
        &h.gateway,
        Method::PATCH,
        &format!("/admin/keys/{id}"),
        json!({"disabled": true}),
    )
    .await;
    until_status(&h, &second, &secret, 401, Duration::from_secs(1))
        .await
        .expect("disabled on the second instance");
    let audit = admin(&h, &second, Method::GET, "/admin/audit", Value::Null)
        .await
        .json();
    assert_eq!(audit["audit"].as_array().unwrap().len(), 2);
    second.shutdown().await;
    onedoor_usage::testing::drop_database(onedoor_usage::testing::MACHINE_POSTGRES, &url).await;
}

#[tokio::test]
async fn the_openapi_description_names_every_admin_route_and_each_one_answers() {
    let (h, _second) = start(&sqlite_store(), "").await;
    let (id, _) = create(&h, &h.gateway, json!({"tenant": "team"})).await;
    let described = h.admin_get("/admin/openapi.json", None).await;
    assert_eq!(described.status, 200);
    let paths = described.json()["paths"].as_object().unwrap().clone();
    let mut routes = Vec::new();
    for (path, item) in &paths {
        for method in ["get", "post", "patch", "delete"] {
            if item.get(method).is_some() {
                routes.push((method.to_uppercase(), path.clone()));
            }
        }
    }
    // Every route the admin port serves is described.
    let served = [
        ("GET", "/healthz"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("GET", "/dashboard"),
        ("GET", "/dashboard/keys"),
        ("GET", "/admin/openapi.json"),
        ("GET", "/admin/backends"),
        ("POST", "/admin/backends/{name}/drain"),
        ("POST", "/admin/backends/{name}/undrain"),
        ("GET", "/admin/tenants"),
        ("GET", "/admin/dashboard"),
        ("GET", "/admin/traces/{id}"),
        ("POST", "/admin/reload"),
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("GET", "/admin/keys/{id}"),
        ("PATCH", "/admin/keys/{id}"),
        ("DELETE", "/admin/keys/{id}"),
        ("POST", "/admin/keys/{id}/rotate"),
        ("GET", "/admin/audit"),
    ];
    let mut described_routes: Vec<(String, String)> = routes.clone();
    described_routes.sort();
    let mut expected: Vec<(String, String)> = served
        .iter()
        .map(|(m, p)| (m.to_string(), p.to_string()))
        .collect();
    expected.sort();
    assert_eq!(described_routes, expected);
    // And each described route is served: none answers "no such admin endpoint" (the delete
    // goes last, so the routes of the key it removes find it).
    routes.sort_by_key(|(method, _)| method == "DELETE");
    for (method, path) in routes {
        let concrete = path.replace("{name}", "a").replace(
            "{id}",
            if path.starts_with("/admin/keys") {
                &id
            } else {
                "unknown"
            },
        );
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let body = if method == Method::PATCH {
            json!({"name": "renamed"})
        } else if path == "/admin/keys" && method == Method::POST {
            json!({"tenant": "team"})
        } else {
            Value::Null
        };
        let answer = admin(&h, &h.gateway, method.clone(), &concrete, body).await;
        assert!(
            !answer.body.contains("no such admin endpoint"),
            "{method} {concrete}: {}",
            answer.body
        );
        assert!(
            answer.status != 404 || concrete.starts_with("/admin/traces/"),
            "{method} {concrete}: {} {}",
            answer.status,
            answer.body
        );
        assert!(answer.status != 405, "{method} {concrete}");
    }
}

#[tokio::test]
async fn a_runtime_key_never_shadows_a_config_key() {
    // The API only ever makes fresh secrets; a row written straight into the database with the
    // digest of the config's key (for the tenant `other`, which may not use `chat`) is the
    // worst case, and the config's key must still be the team's.
    let store = sqlite_store();
    let (h, _second) = start(&store, "").await;
    let path = store.trim_start_matches("sqlite://");
    let keys = onedoor_usage::KeyStore::open(&onedoor_usage::StoreUrl::Sqlite(path.into()))
        .await
        .unwrap()
        .unwrap();
    let key = onedoor_usage::StoredKey {
        id: "key-shadow".into(),
        tenant: "other".into(),
        name: None,
        settings: "{}".into(),
        created_at_ms: 0,
        updated_at_ms: 0,
        last_used_ms: None,
    };
    let change = onedoor_usage::Change {
        write: onedoor_usage::KeyWrite::Create {
            key,
            sha256: key_hash(KEY),
        },
        actor: "test".into(),
        at_ms: 0,
        detail: "{}".into(),
    };
    keys.apply(change).await.unwrap();
    let listed = admin(&h, &h.gateway, Method::GET, "/admin/keys", Value::Null).await;
    assert_eq!(listed.json()["keys"][0]["id"], "key-shadow");
    let chat = h.chat("chat").await;
    assert_eq!(chat.status, 200, "{}", chat.body);
}

#[tokio::test]
async fn a_jwt_with_an_admin_role_manages_keys_where_the_config_allows_it() {
    let issuer = onedoor_mock::Issuer::start(None).await.unwrap();
    let config = format!(
        "client_auth:\n  jwt:\n    - {{ issuer: \"{}\", audience: api://onedoor }}\nadmin: {{ token: {ADMIN_TOKEN}, jwt_roles: [Onedoor.Admin] }}\n{}",
        issuer.url(),
        config(&sqlite_store(), "")
    );
    let h = Harness::start(
        vec![EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))],
        &config,
    )
    .await;
    let mint = |claims: Value| {
        let ask: onedoor_mock::Mint = serde_json::from_value(json!({ "claims": claims })).unwrap();
        issuer.mint(&ask).unwrap()
    };
    let admin_token = mint(json!({"sub": "ops-pipeline", "roles": ["Reader", "Onedoor.Admin"]}));
    let reader_token = mint(json!({"sub": "someone", "roles": ["Reader"]}));
    let url = format!("http://{}/admin/keys", h.gateway.admin_addr());
    let body = Bytes::from(json!({"tenant": "team"}).to_string());
    let with = |token: &str| format!("Bearer {token}");
    let made = h
        .send(
            Method::POST,
            url.clone(),
            &[("authorization", &with(&admin_token))],
            body.clone(),
        )
        .await;
    assert_eq!(made.status, 201, "{}", made.body);
    let refused = h
        .send(
            Method::POST,
            url,
            &[("authorization", &with(&reader_token))],
            body,
        )
        .await;
    assert_eq!(refused.status, 401, "{}", refused.body);
    let audit = admin(&h, &h.gateway, Method::GET, "/admin/audit", Value::Null)
        .await
        .json();
    let records = audit["audit"].as_array().unwrap();
    assert_eq!(records.len(), 1);
    assert_eq!(
        records[0]["actor"],
        format!("jwt ops-pipeline ({})", issuer.url())
    );
}
