//! Files and batches through real HTTP: a tenant's files and batches are its own; a batch goes
//! to one backend, moves on when one refuses it at creation, is refused before upload when it
//! does not fit its tenant's quota, and is refused with the line number of a bad line; its end
//! is recorded as usage at batch prices; and with Redis it is still found after a restart.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
mod instances;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use instances::*;
use serde_json::{json, Value};

/// A batch runs this long on the simulated fleet.
const RUN_MS: u64 = 300;

fn openai(name: &str) -> EndpointSpec {
    EndpointSpec::openai(name, "eastus")
        .deployment(DeploymentSpec::new("gpt-4o-mini"))
        .behavior(Behavior {
            batch_ms: Some(RUN_MS),
            ..Behavior::default()
        })
}

fn azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o-batch"))
        .behavior(Behavior {
            batch_ms: Some(RUN_MS),
            ..Behavior::default()
        })
}

/// `chat` on `a` first, `b` second, both OpenAI-shaped and priced; `extra` goes before it.
fn two_backends(extra: &str) -> String {
    format!(
        r#"{extra}batch: {{ poll_interval: 100ms }}
backends:
  - {{ name: a, provider: openai, region: eastus, url: "{{url:a}}" }}
  - {{ name: b, provider: openai, region: eastus, url: "{{url:b}}" }}
models:
  - name: chat
    price: {{ input_per_1m: 2, output_per_1m: 8 }}
    targets:
      - {{ backend: a, model: gpt-4o-mini, priority: 1 }}
      - {{ backend: b, model: gpt-4o-mini, priority: 2 }}
"#
    )
}

fn line(custom_id: &str, alias: &str) -> Value {
    json!({
        "custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": alias, "max_tokens": 20, "messages": [{"role": "user", "content": format!("Summarise ticket {custom_id}")}]}
    })
}

fn jsonl(lines: &[Value]) -> String {
    lines.iter().map(|l| format!("{l}\n")).collect()
}

fn three_lines() -> String {
    jsonl(&[line("r1", "chat"), line("r2", "chat"), line("r3", "chat")])
}

/// One caller of one gateway instance.
struct Caller<'h> {
    h: &'h Harness,
    addr: SocketAddr,
    key: &'static str,
    /// `/v1` or `/openai` (with `?api-version=` on each call).
    azure: bool,
}

impl<'h> Caller<'h> {
    fn of(h: &'h Harness, key: &'static str) -> Self {
        Caller {
            h,
            addr: h.gateway.addr(),
            key,
            azure: false,
        }
    }

    fn url(&self, path: &str) -> String {
        match self.azure {
            true => format!("http://{}/openai{path}?api-version=2024-10-21", self.addr),
            false => format!("http://{}/v1{path}", self.addr),
        }
    }

    async fn send(&self, method: Method, path: &str, content_type: &str, body: Bytes) -> Answer {
        let auth = format!("Bearer {}", self.key);
        let headers = [
            ("authorization", auth.as_str()),
            ("content-type", content_type),
        ];
        self.h.send(method, self.url(path), &headers, body).await
    }

    async fn get(&self, path: &str) -> Answer {
        self.send(Method::GET, path, "application/json", Bytes::new())
            .await
    }

    async fn post(&self, path: &str, body: Value) -> Answer {
        self.send(
            Method::POST,
            path,
            "application/json",
            Bytes::from(body.to_string()),
        )
        .await
    }

    async fn upload(&self, content: &str) -> Answer {
        let boundary = "testboundary7f3a";
        let body = format!(
            "--{boundary}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n--{boundary}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"tickets.jsonl\"\r\ncontent-type: application/octet-stream\r\n\r\n{content}\r\n--{boundary}--\r\n"
        );
        let kind = format!("multipart/form-data; boundary={boundary}");
        self.send(Method::POST, "/files", &kind, Bytes::from(body))
            .await
    }

    async fn upload_ok(&self, content: &str) -> String {
        let answer = self.upload(content).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer.json()["id"].as_str().unwrap().to_owned()
    }

    async fn create(&self, file: &str) -> Answer {
        let endpoint = match self.azure {
            true => "/chat/completions",
            false => "/v1/chat/completions",
        };
        let body = json!({"input_file_id": file, "endpoint": endpoint, "completion_window": "24h"});
        self.post("/batches", body).await
    }

    /// Reads the batch until it has ended; its last object.
    async fn until_ended(&self, id: &str) -> Value {
        for _ in 0..200 {
            let batch = self.get(&format!("/batches/{id}")).await;
            assert_eq!(batch.status, 200, "{}", batch.body);
            let batch = batch.json();
            if ["completed", "failed", "cancelled", "expired"]
                .contains(&batch["status"].as_str().unwrap_or(""))
            {
                return batch;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("the batch {id} did not end within 10 s");
    }
}

#[tokio::test]
async fn a_batch_runs_to_completion_and_its_output_reads_back_under_gateway_ids() {
    let h = Harness::start(vec![openai("a"), openai("b")], &two_backends("")).await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    assert!(file.starts_with("file-"));
    let created = team.create(&file).await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(created.attempts(), "a=200");
    let batch = created.json();
    let id = batch["id"].as_str().unwrap();
    assert_eq!(
        (batch["object"].as_str(), batch["input_file_id"].as_str()),
        (Some("batch"), Some(file.as_str()))
    );
    assert!(!created.body.contains("gpt-4o-mini"), "{}", created.body);
    let ended = team.until_ended(id).await;
    assert_eq!(ended["status"], "completed", "{ended}");
    assert_eq!(ended["request_counts"]["completed"], 3);
    // The backend found its deployment in every line: the alias was rewritten on the way.
    assert_eq!(
        (
            ended["request_counts"]["failed"].as_u64(),
            ended["error_file_id"].as_str()
        ),
        (Some(0), None)
    );
    let output = ended["output_file_id"].as_str().unwrap();
    assert!(output.starts_with("file-"), "{ended}");
    let content = team.get(&format!("/files/{output}/content")).await;
    assert_eq!(content.status, 200, "{}", content.body);
    let ids: Vec<String> = content
        .body
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["custom_id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    assert_eq!(ids, ["r1", "r2", "r3"]);
    let input = team.get(&format!("/files/{file}/content")).await;
    assert_eq!(input.body, three_lines());
    assert_eq!(h.endpoint("b").total_requests(), 0);
}

#[tokio::test]
async fn two_tenants_on_one_backend_see_only_their_own_files_and_batches() {
    let h = Harness::start(vec![openai("a"), openai("b")], &two_backends("")).await;
    let (team, other) = (Caller::of(&h, KEY), Caller::of(&h, OTHER_KEY));
    let file = team.upload_ok(&three_lines()).await;
    let batch = team.create(&file).await.json();
    let id = batch["id"].as_str().unwrap();
    let theirs = other.upload_ok(&jsonl(&[line("x", "chat")])).await;

    let listed = other.get("/files").await.json();
    let files: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["id"].as_str().unwrap())
        .collect();
    assert_eq!(files, [theirs.as_str()]);
    assert_eq!(other.get("/batches").await.json()["data"], json!([]));
    for path in [
        format!("/files/{file}"),
        format!("/files/{file}/content"),
        format!("/batches/{id}"),
    ] {
        let refused = other.get(&path).await;
        assert_eq!(
            (refused.status.as_u16(), refused.code()),
            (404, "object_not_found".to_owned()),
            "{path}: {}",
            refused.body
        );
    }
    let cancel = other
        .post(&format!("/batches/{id}/cancel"), json!({}))
        .await;
    assert_eq!(cancel.status, 404);
    let delete = other
        .send(
            Method::DELETE,
            &format!("/files/{file}"),
            "application/json",
            Bytes::new(),
        )
        .await;
    assert_eq!(delete.status, 404);
    let borrowed = other.create(&file).await;
    assert_eq!(borrowed.status, 404, "{}", borrowed.body);

    assert_eq!(team.get(&format!("/files/{file}")).await.status, 200);
    let mine = team.get("/batches").await.json();
    assert_eq!(mine["data"][0]["id"], id);
}

#[tokio::test]
async fn a_batch_refused_at_creation_moves_to_the_next_backend_with_its_file() {
    let h = Harness::start(vec![openai("a"), openai("b")], &two_backends("")).await;
    h.endpoint("a").set_behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(30),
        ..Behavior::default()
    });
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let created = team.create(&file).await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(created.attempts(), "a=429,b=200");
    assert_eq!(created.header("x-onedoor-backend"), "b");
    let ended = team
        .until_ended(created.json()["id"].as_str().unwrap())
        .await;
    assert_eq!(ended["status"], "completed");
    // The 429 cooled `a` down for its Retry-After: the next batch is not offered to it.
    let again = team.create(&file).await;
    assert_eq!(again.attempts(), "b=200", "{}", again.body);
}

#[tokio::test]
async fn an_azure_deployment_over_its_enqueued_tokens_loses_the_batch_to_the_next() {
    let config = r#"batch: { poll_interval: 100ms }
backends:
  - { name: se, provider: azure, region: swedencentral, url: "{url:se}", api_version: 2024-10-21 }
  - { name: fr, provider: azure, region: swedencentral, url: "{url:fr}", api_version: 2024-10-21 }
models:
  - name: chat
    targets:
      - { backend: se, deployment: gpt-4o-batch, priority: 1, batch: true }
      - { backend: fr, deployment: gpt-4o-batch, priority: 2, batch: true }
"#;
    let h = Harness::start(vec![azure("se"), azure("fr")], config).await;
    h.endpoint("se").set_behavior(Behavior {
        enqueued_token_limit: Some(10),
        batch_ms: Some(RUN_MS),
        ..Behavior::default()
    });
    let mut team = Caller::of(&h, KEY);
    team.azure = true;
    let file = team.upload_ok(&three_lines()).await;
    let created = team.create(&file).await;
    assert_eq!(created.status, 200, "{}", created.body);
    assert_eq!(created.attempts(), "se=token_limit_exceeded,fr=200");
    let ended = team
        .until_ended(created.json()["id"].as_str().unwrap())
        .await;
    assert_eq!(ended["status"], "completed", "{ended}");
    // A batch deployment takes no synchronous calls.
    let chat = h
        .post("/v1/chat/completions", chat_body("chat", false))
        .await;
    assert_eq!(chat.status, 503, "{}", chat.body);
}

#[tokio::test]
async fn a_batch_over_its_tenants_daily_tokens_is_refused_before_anything_is_uploaded() {
    let tenants = format!(
        "tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {{ tokens_per_day: 50 }}\n",
        key_hash(KEY)
    );
    let h = Harness::start(
        vec![openai("a"), openai("b")],
        &format!("{}{tenants}", two_backends("")),
    )
    .await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let refused = team.create(&file).await;
    assert_eq!(refused.status, 403, "{}", refused.body);
    assert_eq!(refused.code(), "quota_exceeded");
    assert!(
        refused.body.contains("tokens_per_day of 50") && refused.body.contains("3 lines"),
        "{}",
        refused.body
    );
    assert_eq!(
        h.endpoint("a").total_requests() + h.endpoint("b").total_requests(),
        0
    );
}

#[tokio::test]
async fn a_malformed_batch_file_is_refused_with_the_number_of_its_bad_line() {
    let h = Harness::start(vec![openai("a"), openai("b")], &two_backends("")).await;
    let team = Caller::of(&h, KEY);
    let duplicate = jsonl(&[line("r1", "chat"), line("r2", "chat"), line("r2", "chat")]);
    let refused = team.upload(&duplicate).await;
    assert_eq!(
        (refused.status.as_u16(), refused.code()),
        (400, "invalid_request".to_owned())
    );
    assert!(
        refused.body.contains("line 3 of the batch input file"),
        "{}",
        refused.body
    );
    let not_jsonl = team
        .upload("{\"custom_id\": \"a\"}\nnot json at all\n")
        .await;
    assert!(
        not_jsonl.body.contains("line 1") || not_jsonl.body.contains("line 2"),
        "{}",
        not_jsonl.body
    );
    let other_alias = team
        .upload(&jsonl(&[line("r1", "chat"), line("r2", "embed")]))
        .await;
    assert!(other_alias.body.contains("line 2"), "{}", other_alias.body);
    assert_eq!(h.endpoint("a").total_requests(), 0);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-batch-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_batch_is_one_usage_record_at_batch_prices_and_settles_its_reservation() {
    let dir = temp_dir("usage");
    let db = dir.join("usage.db");
    let usage = format!(
        "usage: {{ store: \"sqlite://{}\", journal_dir: \"{}\" }}\n",
        db.display(),
        dir.display()
    );
    let tenants = format!(
        "tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {{ tokens_per_day: 100000 }}\n",
        key_hash(KEY)
    );
    let h = Harness::start(
        vec![openai("a"), openai("b")],
        &format!("{usage}{}{tenants}", two_backends("")),
    )
    .await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let created = team.create(&file).await.json();
    let id = created["id"].as_str().unwrap().to_owned();
    let day_tokens = || async {
        let view = h
            .admin_get("/admin/tenants", Some(ADMIN_TOKEN))
            .await
            .json();
        view["tenants"][0]["limits"]["tokens_per_day"]["used"]
            .as_u64()
            .unwrap()
    };
    let reserved = day_tokens().await;
    assert!(
        reserved >= 60,
        "three lines reserve at least their 3 x 20 completion tokens: {reserved}"
    );
    let ended = team.until_ended(&id).await;
    let output = team
        .get(&format!(
            "/files/{}/content",
            ended["output_file_id"].as_str().unwrap()
        ))
        .await;
    let (mut input, mut out) = (0, 0);
    for line in output.body.lines() {
        let usage = &serde_json::from_str::<Value>(line).unwrap()["response"]["body"]["usage"];
        input += usage["prompt_tokens"].as_u64().unwrap();
        out += usage["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(
        day_tokens().await,
        input + out,
        "the reservation of {reserved} is settled at the measured usage"
    );
    let Harness { gateway, fleet, .. } = h;
    gateway.shutdown().await;
    fleet.shutdown().await;
    let report = onedoor_usage::report(
        &onedoor_usage::StoreUrl::Sqlite(db.clone()),
        &onedoor_usage::ReportQuery::default(),
    )
    .await
    .unwrap();
    assert_eq!(report.total.requests, 1, "{report:?}");
    assert_eq!(
        (report.total.input_tokens, report.total.output_tokens),
        (input, out)
    );
    let lines: Option<i64> = rusqlite::Connection::open(&db)
        .unwrap()
        .query_row("SELECT lines FROM usage_records", [], |row| row.get(0))
        .unwrap();
    assert_eq!(lines, Some(3), "the batch's record counts its three lines");
    let batch_price = (input as f64 * 1.0 + out as f64 * 4.0) / 1e6;
    assert!(
        (report.total.cost_usd - batch_price).abs() < 1e-9,
        "{} vs {batch_price}",
        report.total.cost_usd
    );
}

#[tokio::test]
async fn a_batch_is_still_found_after_a_restart_with_redis() {
    let config = two_backends(&shared_state("batch-restart"));
    let h = Harness::start(vec![openai("a"), openai("b")], &config).await;
    let first = another(&h, &config).await;
    let team = Caller {
        h: &h,
        addr: first.addr(),
        key: KEY,
        azure: false,
    };
    let file = team.upload_ok(&three_lines()).await;
    let id = team.create(&file).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    first.shutdown().await;

    let second = another(&h, &config).await;
    let team = Caller {
        h: &h,
        addr: second.addr(),
        key: KEY,
        azure: false,
    };
    let ended = team.until_ended(&id).await;
    assert_eq!(
        (ended["id"].as_str(), ended["status"].as_str()),
        (Some(id.as_str()), Some("completed"))
    );
    assert_eq!(
        team.get(&format!("/files/{file}/content")).await.body,
        three_lines()
    );
    let other = Caller {
        h: &h,
        addr: second.addr(),
        key: OTHER_KEY,
        azure: false,
    };
    assert_eq!(other.get(&format!("/batches/{id}")).await.status, 404);
}

#[tokio::test]
async fn a_cancelled_batch_ends_cancelled() {
    let h = Harness::start(
        vec![
            openai("a").behavior(Behavior {
                batch_ms: Some(5_000),
                ..Behavior::default()
            }),
            openai("b"),
        ],
        &two_backends(""),
    )
    .await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let id = team.create(&file).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let dashboard = h
        .admin_get("/admin/dashboard", Some(ADMIN_TOKEN))
        .await
        .json();
    let open = &dashboard["open_batches"];
    assert_eq!(
        (
            open[0]["id"].as_str(),
            open[0]["tenant"].as_str(),
            open[0]["backend"].as_str()
        ),
        (Some(id.as_str()), Some("team"), Some("a")),
        "{open}"
    );
    let cancelling = team.post(&format!("/batches/{id}/cancel"), json!({})).await;
    assert_eq!(cancelling.status, 200, "{}", cancelling.body);
    assert_eq!(cancelling.json()["status"], "cancelling");
    assert_eq!(team.until_ended(&id).await["status"], "cancelled");
    let dashboard = h
        .admin_get("/admin/dashboard", Some(ADMIN_TOKEN))
        .await
        .json();
    assert_eq!(dashboard["open_batches"], json!([]));
}

#[tokio::test]
async fn a_batch_its_backend_no_longer_has_ends_failed_and_is_polled_no_more() {
    let h = Harness::start(vec![openai("a"), openai("b")], &two_backends("")).await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let id = team.create(&file).await.json()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let reset = h
        .send(
            Method::POST,
            format!(
                "{}/_mock/reset",
                h.endpoint("a").url().trim_end_matches("/v1")
            ),
            &[],
            Bytes::new(),
        )
        .await;
    assert_eq!(reset.status, 200, "{}", reset.body);
    let ended = team.until_ended(&id).await;
    assert_eq!(ended["status"], "failed", "{ended}");
    assert_eq!(ended["errors"]["data"][0]["code"], "batch_lost");
    let dashboard = h
        .admin_get("/admin/dashboard", Some(ADMIN_TOKEN))
        .await
        .json();
    assert_eq!(dashboard["open_batches"], json!([]));
}

#[tokio::test]
async fn a_held_batch_leaves_its_tenants_minute_free_for_synchronous_calls() {
    minute_stays_free("").await;
}

#[tokio::test]
async fn a_held_batch_leaves_the_minute_free_in_redis_too() {
    minute_stays_free(&shared_state("batch-minute")).await;
}

/// A batch that reserves more than the tenant's tpm is held against its day only.
async fn minute_stays_free(state: &str) {
    let tenants = format!(
        "tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n    limits: {{ tokens_per_day: 100000, tpm: 50 }}\n",
        key_hash(KEY)
    );
    let h = Harness::start(
        vec![openai("a"), openai("b")],
        &format!("{}{tenants}", two_backends(state)),
    )
    .await;
    let team = Caller::of(&h, KEY);
    let file = team.upload_ok(&three_lines()).await;
    let created = team.create(&file).await;
    assert_eq!(created.status, 200, "{}", created.body);
    let chat = json!({"model": "chat", "max_tokens": 5, "messages": [{"role": "user", "content": "Hello"}]});
    let answer = h.post("/v1/chat/completions", chat).await;
    assert_eq!(
        answer.status, 200,
        "the batch's 60+ tokens are not in the 50-token minute: {}",
        answer.body
    );
    let view = h
        .admin_get("/admin/tenants", Some(ADMIN_TOKEN))
        .await
        .json();
    let day = view["tenants"][0]["limits"]["tokens_per_day"]["used"]
        .as_u64()
        .unwrap();
    assert!(day >= 60, "the batch stays held against the day: {view}");
}
