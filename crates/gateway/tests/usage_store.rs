//! Usage records through the whole gateway: one record per request, whose tokens are exactly the
//! usage blocks the simulated fleet sent; a cut stream is recorded as cut; and a Postgres outage in
//! the middle of 1,000 requests loses none of them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::{Path, PathBuf};

use common::*;
use futures_util::future::join_all;
use onedoor_usage::testing::PrivatePostgres;
use onedoor_usage::{GroupBy, ReportQuery, StoreUrl};
use serde_json::{json, Value};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-usage-gw-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `flaky` fails a quarter of its requests with 500s, so some answers come from `steady` after a
/// failover; `chat` is priced, `embed` is not.
fn fleet() -> Vec<EndpointSpec> {
    let deployments = |spec: EndpointSpec| {
        spec.deployment(DeploymentSpec::new("gpt-4o"))
            .deployment(DeploymentSpec::new("text-embedding-3-large"))
    };
    vec![
        deployments(EndpointSpec::azure("flaky", "swedencentral")).behavior(Behavior {
            error_rate: 0.25,
            ..Behavior::default()
        }),
        deployments(EndpointSpec::azure("steady", "francecentral")),
    ]
}

fn config(store: &str, journal_dir: &Path) -> String {
    format!(
        r#"usage: {{ store: "{store}", journal_dir: "{}" }}
backends:
  - {{ name: flaky, provider: azure, region: swedencentral, url: "{{url:flaky}}" }}
  - {{ name: steady, provider: azure, region: francecentral, url: "{{url:steady}}" }}
models:
  - name: chat
    price: {{ input_per_1m: 2.5, output_per_1m: 10 }}
    targets:
      - {{ backend: flaky, deployment: gpt-4o, priority: 1 }}
      - {{ backend: steady, deployment: gpt-4o, priority: 2 }}
  - name: embed
    targets:
      - {{ backend: steady, deployment: text-embedding-3-large }}
"#,
        journal_dir.display()
    )
}

/// The tokens the upstream reported in one answer: its usage block, or a stream's usage chunk.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Sent {
    requests: u64,
    prompt: u64,
    completion: u64,
}

impl Sent {
    fn add(&mut self, answer: &Answer) {
        self.requests += 1;
        let usage = match answer
            .header("content-type")
            .starts_with("text/event-stream")
        {
            true => answer
                .body
                .lines()
                .filter_map(|line| line.strip_prefix("data: "))
                .filter_map(|data| serde_json::from_str::<Value>(data).ok())
                .map(|chunk| chunk["usage"].clone())
                .find(Value::is_object)
                .unwrap_or(Value::Null),
            false => {
                serde_json::from_str::<Value>(&answer.body).unwrap_or_default()["usage"].clone()
            }
        };
        self.prompt += usage["prompt_tokens"].as_u64().unwrap_or(0);
        self.completion += usage["completion_tokens"].as_u64().unwrap_or(0);
    }
}

fn chat(n: u64, stream: bool) -> Value {
    let words = "word ".repeat((n % 5) as usize + 1);
    json!({
        "model": "chat",
        "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!("Hello {words}")}]
    })
}

/// Sends request `n` of a scripted mix: whole chats, streams, embeddings and unknown models.
async fn send(harness: &Harness, n: u64) -> Answer {
    let answer = match n % 10 {
        0..=4 => harness.post("/v1/chat/completions", chat(n, false)).await,
        5..=7 => harness.post("/v1/chat/completions", chat(n, true)).await,
        8 => {
            let body = json!({"model": "embed", "input": format!("text {n}")});
            harness.post("/v1/embeddings", body).await
        }
        _ => harness.chat("no-such-alias").await,
    };
    let expected = if n % 10 == 9 { 404 } else { 200 };
    assert_eq!(answer.status, expected, "{}", answer.body);
    answer
}

async fn totals(store: &StoreUrl, by: Vec<GroupBy>) -> onedoor_usage::Report {
    let query = ReportQuery {
        by,
        ..ReportQuery::default()
    };
    onedoor_usage::report(store, &query).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_report_sums_exactly_the_usage_blocks_the_fleet_sent() {
    let dir = temp_dir("report");
    let store = StoreUrl::Sqlite(dir.join("usage.db"));
    let harness = Harness::start(
        fleet(),
        &config(
            &format!("sqlite://{}", dir.join("usage.db").display()),
            &dir,
        ),
    )
    .await;
    let mut sent = Sent::default();
    for n in 0..100 {
        sent.add(&send(&harness, n).await);
    }
    assert!(harness.endpoint("flaky").total_requests() > 0);
    let Harness { gateway, fleet, .. } = harness;
    gateway.shutdown().await;
    fleet.shutdown().await;

    let report = totals(&store, vec![GroupBy::Alias]).await;
    assert_eq!(report.total.requests, sent.requests);
    assert_eq!(report.total.input_tokens, sent.prompt, "{report:?}");
    assert_eq!(report.total.output_tokens, sent.completion, "{report:?}");
    let alias = |name: &str| report.rows.iter().find(|r| r.group[0] == name).unwrap();
    let chat = alias("chat");
    assert_eq!(chat.requests, 80);
    let price = (chat.input_tokens as f64 * 2.5 + chat.output_tokens as f64 * 10.0) / 1e6;
    assert!(
        (chat.cost_usd - price).abs() < 1e-9,
        "{} vs {price}",
        chat.cost_usd
    );
    assert_eq!(alias("embed").cost_usd, 0.0);
    let unknown = alias("no-such-alias");
    assert_eq!(
        (
            unknown.requests,
            unknown.estimated_requests,
            unknown.total_tokens()
        ),
        (10, 10, 0)
    );
    assert_eq!(
        chat.estimated_requests + alias("embed").estimated_requests,
        0
    );
    assert!(chat.drift().is_some());
    let by_backend = totals(&store, vec![GroupBy::Backend]).await;
    let backends: Vec<&str> = by_backend
        .rows
        .iter()
        .map(|r| r.group[0].as_str())
        .collect();
    assert_eq!(backends, ["-", "flaky", "steady"]);
}

/// A gateway recording to the SQLite file `db`, with the alias `chat` on one Azure endpoint that
/// answers as `behavior` says.
async fn recording_one_stream(behavior: Behavior, db: &Path) -> Harness {
    let spec = EndpointSpec::azure("upstream", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(behavior);
    Harness::start(
        vec![spec],
        &format!(
            "usage: {{ store: \"sqlite://{}\" }}\nbackends:\n  - {{ name: upstream, provider: azure, region: se, url: \"{{url:upstream}}\" }}\nmodels:\n  - name: chat\n    targets: [{{ backend: upstream, deployment: gpt-4o }}]\n",
            db.display()
        ),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_stream_is_recorded_as_cut_with_its_error_and_estimated_tokens() {
    let dir = temp_dir("cut");
    let db = dir.join("usage.db");
    let harness = recording_one_stream(
        Behavior {
            cut_after: Some(3),
            reply_words: Some(20),
            ..Behavior::default()
        },
        &db,
    )
    .await;
    let answer = harness.post("/v1/chat/completions", chat(1, true)).await;
    assert!(answer.body.contains("\"error\""), "{}", answer.body);
    let id = answer.header("x-onedoor-request-id").to_owned();
    let Harness { gateway, fleet, .. } = harness;
    gateway.shutdown().await;
    fleet.shutdown().await;

    let connection = rusqlite::Connection::open(&db).unwrap();
    let (cut, stream, source, output, ttft): (bool, bool, String, i64, Option<i64>) = connection
        .query_row(
            "SELECT stream_cut, stream, source, output_tokens, ttft_ms FROM usage_records WHERE request_id = ?1",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )
        .unwrap();
    assert!(cut && stream);
    // Its status line said 200; the record says what cut it.
    let (status, error): (i64, Option<String>) = connection
        .query_row(
            "SELECT status, error FROM usage_records WHERE request_id = ?1",
            [&id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((status, error.as_deref()), (200, Some("upstream_failed")));
    assert_eq!(source, "estimated");
    assert!(output > 0, "the content the caller got is counted");
    assert!(ttft.is_some());
}

#[tokio::test]
async fn a_stream_the_caller_leaves_is_recorded_with_the_text_it_received() {
    use tokio::io::AsyncReadExt;
    let dir = temp_dir("left");
    let db = dir.join("usage.db");
    let harness = recording_one_stream(
        Behavior {
            inter_token_ms: 50,
            reply_words: Some(40),
            ..Behavior::default()
        },
        &db,
    )
    .await;
    let mut client = harness
        .post_on_socket("/v1/chat/completions", &chat(1, true).to_string())
        .await;
    // Leave after a few words, long before the fortieth.
    let mut received = Vec::new();
    let mut buffer = [0u8; 4096];
    while received.windows(9).filter(|w| w == b"\"content\"").count() < 4 {
        let read = client.read(&mut buffer).await.unwrap();
        assert!(read > 0, "{}", String::from_utf8_lossy(&received));
        received.extend_from_slice(&buffer[..read]);
    }
    drop(client);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let Harness { gateway, fleet, .. } = harness;
    gateway.shutdown().await;
    fleet.shutdown().await;

    let connection = rusqlite::Connection::open(&db).unwrap();
    let (stream, source, input, output): (bool, String, i64, i64) = connection
        .query_row(
            "SELECT stream, source, input_tokens, output_tokens FROM usage_records",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap();
    assert!(stream);
    assert_eq!(
        source, "estimated",
        "no usage chunk came before the caller left"
    );
    assert!(input > 0, "the prompt is counted");
    assert!(
        (1..20).contains(&output),
        "the few words the caller got are counted, not the answer it left: {output}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_during_1000_requests_loses_no_record() {
    let server = PrivatePostgres::start().unwrap_or_else(|message| panic!("{message}"));
    let store = StoreUrl::parse(&server.url()).unwrap();
    let dir = temp_dir("outage");
    let harness = Harness::start(fleet(), &config(&server.url(), &dir)).await;
    let mut sent = Sent::default();
    for wave in 0..50u64 {
        if wave == 15 {
            server.stop().unwrap();
        }
        if wave == 35 {
            assert!(
                eventually(|| journal_len(&dir) > 0).await,
                "records did not spill to the journal while the store was down"
            );
            server.resume().unwrap();
        }
        let answers = join_all((0..20).map(|i| send(&harness, wave * 20 + i))).await;
        for answer in &answers {
            sent.add(answer);
        }
    }
    assert_eq!(sent.requests, 1_000);
    let Harness { gateway, fleet, .. } = harness;
    gateway.shutdown().await;
    fleet.shutdown().await;

    let report = totals(&store, Vec::new()).await;
    assert_eq!(
        report.total.requests,
        1_000,
        "{} journal bytes left",
        journal_len(&dir)
    );
    assert_eq!(
        (report.total.input_tokens, report.total.output_tokens),
        (sent.prompt, sent.completion)
    );
    assert_eq!(journal_len(&dir), 0, "the journal was not replayed");
}

/// The bytes waiting in the journal (and in a replay under way) in `dir`.
fn journal_len(dir: &Path) -> u64 {
    [
        "onedoor-usage.journal.jsonl",
        "onedoor-usage.journal.jsonl.replaying",
    ]
    .iter()
    .filter_map(|name| std::fs::metadata(dir.join(name)).ok())
    .map(|m| m.len())
    .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_recorder_unless_the_usage_store_changes() {
    let dir = temp_dir("reload");
    let store = |name: &str| format!("sqlite://{}", dir.join(name).display());
    let harness = Harness::start_from_file(fleet(), &config(&store("first.db"), &dir)).await;
    assert_eq!(
        harness
            .post("/v1/embeddings", json!({"model": "embed", "input": "a"}))
            .await
            .status,
        200
    );
    // Same store, other routing: the same recorder goes on.
    harness.write_config(&config(&store("first.db"), &dir).replace("priority: 2", "priority: 3"));
    assert_eq!(harness.admin_post("/admin/reload").await.status, 200);
    assert_eq!(
        harness
            .post("/v1/embeddings", json!({"model": "embed", "input": "b"}))
            .await
            .status,
        200
    );
    harness.write_config(&config(&store("second.db"), &dir));
    assert_eq!(harness.admin_post("/admin/reload").await.status, 200);
    assert_eq!(
        harness
            .post("/v1/embeddings", json!({"model": "embed", "input": "c"}))
            .await
            .status,
        200
    );
    let Harness { gateway, fleet, .. } = harness;
    gateway.shutdown().await;
    fleet.shutdown().await;

    let requests = |name: &str| {
        let store = StoreUrl::Sqlite(dir.join(name));
        async move { totals(&store, Vec::new()).await.total.requests }
    };
    assert_eq!(requests("first.db").await, 2);
    assert_eq!(requests("second.db").await, 1);
}
