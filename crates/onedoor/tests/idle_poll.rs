//! `ONEDOOR_IDLE_POLL` on the real binary: a bad window is refused at start; with a window the
//! gateway answers as without one, and once traffic stops its lanes sleep instead of polling on.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;
use std::time::Duration;

use onedoor_mock::{DeploymentSpec, EndpointSpec, Fleet};
use sha2::{Digest, Sha256};

mod common;
use common::{free_addr, http, Gateway};

const KEY: &str = "idle-poll-client-key";

fn config(upstream: &str) -> String {
    format!(
        "listen: {}\nbackends:\n  - {{ name: se, provider: azure, region: swedencentral, url: \"{upstream}\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: se, deployment: gpt-4o }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        hex::encode(Sha256::digest(KEY.as_bytes()))
    )
}

fn chat() -> String {
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"Hello"}]}"#;
    format!(
        "POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[test]
fn serve_refuses_a_window_that_is_not_a_duration() {
    let dir = common::temp_dir("idle-poll", "refused");
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, config("http://127.0.0.1:9")).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_onedoor"))
        .args(["serve", "--config"])
        .arg(&path)
        .env("ONEDOOR_IDLE_POLL", "fast")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("ONEDOOR_IDLE_POLL=\"fast\" is not a duration"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_polling_gateway_answers_and_spends_no_cpu_once_traffic_stops() {
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("se", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let endpoint = fleet.endpoint("se").unwrap();
    let dir = common::temp_dir("idle-poll", "answers");
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, config(&endpoint.url())).unwrap();
    let gateway = Gateway::start_with(&path, "poll", &[("ONEDOOR_IDLE_POLL", "2ms")]).await;

    for _ in 0..50 {
        let (status, body) = http(gateway.addr, chat()).await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("\"choices\""), "{body}");
    }
    assert_eq!(endpoint.total_requests(), 50);

    tokio::time::sleep(Duration::from_millis(300)).await;
    let settled = gateway.cpu_ticks();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spent = gateway.cpu_ticks() - settled;
    // Lanes that polled on would spend most of the second on each CPU: about 100 ticks a lane.
    assert!(
        spent <= 10,
        "an idle gateway spent {spent} ticks of CPU in 1 s"
    );
    drop(gateway);
    fleet.shutdown().await;
}
