//! Usage records across processes: the real `onedoor serve` stopped by SIGTERM while its Postgres
//! is down keeps every record in its journal, and the next start puts them in the store; killed
//! with SIGKILL before its store took the records of answered requests, it leaves them in its
//! ledger, and the next start puts them in the store; and
//! `onedoor usage report` prints totals that equal the usage blocks the simulated fleet sent.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use onedoor_usage::testing::{drop_database, fresh_database, PrivatePostgres, MACHINE_POSTGRES};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

mod common;
use common::{free_addr, http, Gateway};

const KEY: &str = "usage-client-key";

fn temp_dir(name: &str) -> PathBuf {
    common::temp_dir("usage-cli", name)
}

/// A config for one azure backend at `url` behind the alias `chat`, recording to `store`.
fn write_config(dir: &Path, url: &str, store: &str) -> PathBuf {
    let path = dir.join("onedoor.yaml");
    let text = format!(
        "listen: {}\nadmin: {{ listen: \"{}\", token: t }}\nusage: {{ store: \"{store}\", journal_dir: \"{}\" }}\nshutdown: {{ drain_delay: 0ms }}\nbackends:\n  - {{ name: up, provider: azure, region: swedencentral, url: \"{url}\" }}\nmodels:\n  - name: chat\n    price: {{ input_per_1m: 1, output_per_1m: 4 }}\n    targets: [{{ backend: up, deployment: gpt-4o }}]\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        free_addr(),
        dir.display(),
        hex::encode(Sha256::digest(KEY.as_bytes()))
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Tokens the fleet reported, summed from the answers' usage blocks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sent {
    requests: u64,
    prompt: u64,
    completion: u64,
}

impl Sent {
    fn add(&mut self, body: &str) {
        self.requests += 1;
        let whole = serde_json::from_str::<Value>(body)
            .ok()
            .map(|v| v["usage"].clone());
        let usage = whole.filter(Value::is_object).or_else(|| {
            body.lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .filter_map(|d| serde_json::from_str::<Value>(d).ok())
                .map(|c| c["usage"].clone())
                .find(Value::is_object)
        });
        let usage = usage.unwrap_or_else(|| panic!("an answer without usage: {body}"));
        self.prompt += usage["prompt_tokens"].as_u64().unwrap();
        self.completion += usage["completion_tokens"].as_u64().unwrap();
    }
}

async fn chat(addr: SocketAddr, n: u64, stream: bool) -> String {
    let body = json!({
        "model": "chat",
        "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!("Hello {}", "there ".repeat((n % 4) as usize))}]
    })
    .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let (status, body) = http(addr, request).await.unwrap();
    assert_eq!(status, 200, "{body}");
    body
}

/// `count` requests, eight at a time, every third one streamed.
async fn traffic(addr: SocketAddr, from: u64, count: u64, sent: &mut Sent) {
    for wave in (from..from + count).collect::<Vec<_>>().chunks(8) {
        let answers = futures_join(wave.iter().map(|&n| chat(addr, n, n % 3 == 0))).await;
        for body in answers {
            sent.add(&body);
        }
    }
}

async fn futures_join<F: std::future::Future<Output = String> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<String> {
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for handle in handles {
        out.push(handle.await.unwrap());
    }
    out
}

fn onedoor(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onedoor"))
        .args(args)
        .output()
        .unwrap()
}

fn report_json(args: &[&str]) -> Value {
    let mut all = vec!["usage", "report", "--format", "json"];
    all.extend_from_slice(args);
    let output = onedoor(&all);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_postgres_is_down_keeps_every_record_for_the_next_start() {
    let server = PrivatePostgres::start().unwrap_or_else(|message| panic!("{message}"));
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("up", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let dir = temp_dir("sigterm");
    let config = write_config(&dir, &fleet.endpoint("up").unwrap().url(), &server.url());
    let mut sent = Sent::default();

    let first = Gateway::start(&config, "first").await;
    traffic(first.addr, 0, 120, &mut sent).await;
    server.stop().unwrap();
    traffic(first.addr, 120, 120, &mut sent).await;
    // Streams still open when the signal comes are finished, then recorded.
    fleet.endpoint("up").unwrap().set_behavior(Behavior {
        inter_token_ms: 40,
        reply_words: Some(20),
        ..Behavior::default()
    });
    let open: Vec<_> = (240..256)
        .map(|n| tokio::spawn(chat(first.addr, n, true)))
        .collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = first.log_path();
    let status = first.terminate().await;
    let log = std::fs::read_to_string(log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    for stream in open {
        sent.add(&stream.await.unwrap());
    }
    assert!(log.contains("usage records wait in the journal"), "{log}");

    fleet
        .endpoint("up")
        .unwrap()
        .set_behavior(Behavior::default());
    server.resume().unwrap();
    let second = Gateway::start(&config, "second").await;
    traffic(second.addr, 256, 64, &mut sent).await;
    assert_eq!(second.terminate().await.code(), Some(0));

    assert_eq!(sent.requests, 320);
    let report = report_json(&["--store", &server.url(), "--by", ""]);
    assert_eq!(report["total"]["requests"], sent.requests, "{report}");
    assert_eq!(report["total"]["input_tokens"], sent.prompt, "{report}");
    assert_eq!(
        report["total"]["output_tokens"], sent.completion,
        "{report}"
    );
    assert_eq!(report["total"]["estimated_requests"], 0, "{report}");
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_before_the_store_took_the_records_loses_none_of_them() {
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("up", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let url = fleet.endpoint("up").unwrap().url();
    let dir = temp_dir("kill");
    // A "Postgres" that accepts connections and never answers: the writer holds the records it
    // took (its connect waits up to 5 s) and the rest wait in memory, as in the moments before
    // any batch write.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_url = format!("postgres://postgres@{}/never", silent.local_addr().unwrap());
    let mut sent = Sent::default();
    let first = Gateway::start(&write_config(&dir, &url, &silent_url), "first").await;
    traffic(first.addr, 0, 48, &mut sent).await;
    first.signal("KILL");

    let database = fresh_database(MACHINE_POSTGRES, "kill9")
        .await
        .unwrap_or_else(|message| panic!("{message}"));
    let second = Gateway::start(&write_config(&dir, &url, &database), "second").await;
    let log = second.log_path();
    assert_eq!(second.terminate().await.code(), Some(0));
    let log = std::fs::read_to_string(log).unwrap();
    assert!(log.contains("did not stop cleanly"), "{log}");

    let report = report_json(&["--store", &database, "--by", ""]);
    drop_database(MACHINE_POSTGRES, &database).await;
    assert_eq!(report["total"]["requests"], sent.requests, "{report}");
    assert_eq!(report["total"]["input_tokens"], sent.prompt, "{report}");
    assert_eq!(
        report["total"]["output_tokens"], sent.completion,
        "{report}"
    );
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_report_reads_the_configured_sqlite_store_in_every_format() {
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("up", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let dir = temp_dir("sqlite");
    // A relative path: the gateway and the report both resolve it from their working directory.
    let config = write_config(
        &dir,
        &fleet.endpoint("up").unwrap().url(),
        "sqlite://usage.db",
    );
    let mut sent = Sent::default();
    let gateway = Gateway::start(&config, "only").await;
    traffic(gateway.addr, 0, 30, &mut sent).await;
    assert_eq!(gateway.terminate().await.code(), Some(0));

    let store = format!("sqlite://{}", dir.join("usage.db").display());
    let report = report_json(&[
        "--store",
        &store,
        "--by",
        "tenant,alias,backend,model,day,month",
    ]);
    let row = &report["rows"][0];
    assert_eq!(
        (row["tenant"].as_str(), row["model"].as_str()),
        (Some("team"), Some("gpt-4o"))
    );
    assert_eq!(report["total"]["requests"], sent.requests);
    assert_eq!(report["total"]["input_tokens"], sent.prompt);
    assert_eq!(report["total"]["output_tokens"], sent.completion);
    let cost = (sent.prompt as f64 + 4.0 * sent.completion as f64) / 1e6;
    assert!(
        (report["total"]["cost_usd"].as_f64().unwrap() - cost).abs() < 1e-9,
        "{report}"
    );

    let csv = Command::new(env!("CARGO_BIN_EXE_onedoor"))
        .args(["usage", "report", "--config"])
        .arg(&config)
        .args(["--format", "csv", "--by", "tenant"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(
        csv.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&csv.stderr)
    );
    let csv = String::from_utf8(csv.stdout).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(
        lines[0].starts_with("tenant,requests,input_tokens,output_tokens"),
        "{csv}"
    );
    assert!(
        lines[1].starts_with(&format!(
            "team,{},{},{}",
            sent.requests, sent.prompt, sent.completion
        )),
        "{csv}"
    );

    let table = onedoor(&[
        "usage",
        "report",
        "--store",
        &store,
        "--since",
        "2000-01-01",
    ]);
    let table = String::from_utf8(table.stdout).unwrap();
    assert!(
        table.lines().last().unwrap().starts_with("total"),
        "{table}"
    );
    let nothing = report_json(&["--store", &store, "--until", "2000-01-01"]);
    assert_eq!(nothing["total"]["requests"], 0);
    fleet.shutdown().await;
}

#[test]
fn usage_report_refuses_bad_flags_and_missing_stores_with_exit_1() {
    let dir = temp_dir("refuse");
    let missing = format!("sqlite://{}", dir.join("nothing-here.db").display());
    let output = onedoor(&["usage", "report", "--store", &missing]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("there is no usage store"));
    let output = onedoor(&["usage", "report", "--store", &missing, "--by", "week"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("unknown group `week`"));
    let output = onedoor(&[
        "usage",
        "report",
        "--store",
        &missing,
        "--since",
        "last tuesday",
    ]);
    assert_eq!(output.status.code(), Some(1));
    let help = String::from_utf8(onedoor(&["usage", "report", "--help"]).stdout).unwrap();
    for flag in [
        "--store", "--config", "--since", "--until", "--by", "--format",
    ] {
        assert!(
            help.contains(flag),
            "--help does not explain {flag}:\n{help}"
        );
    }
}
