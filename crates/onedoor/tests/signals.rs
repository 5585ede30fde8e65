//! `onedoor serve` as a process under its signals: Ctrl-C (SIGINT) stops accepting at once, with
//! no drain delay, and lets open streams finish before exiting 0; SIGHUP re-reads the config.
//! (SIGTERM's drain: `shutdown.rs`.) The upstreams are simulated in
//! the test process; the gateway is the real binary, spoken to over raw HTTP/1.0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;

mod common;
use common::{free_addr, http, Gateway};

const KEY: &str = "signals-client-key";

/// Writes `<dir>/onedoor.yaml` from `config` (with `{admin}` standing for a free admin address)
/// plus a listen address and one tenant, and starts the gateway on it; returns the admin address.
async fn start(dir: &Path, config: &str) -> (Gateway, SocketAddr) {
    let admin = free_addr();
    let path = dir.join("onedoor.yaml");
    let text = format!(
        "listen: {}\n{}tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        config.replace("{admin}", &admin.to_string()),
        hex::encode(Sha256::digest(KEY.as_bytes()))
    );
    std::fs::write(&path, text).unwrap();
    (Gateway::start(&path, "only").await, admin)
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    common::temp_dir("signals", name)
}

/// One azure backend `name` at `url`, and the alias `chat` on it.
fn one_backend(name: &str, url: &str) -> String {
    format!(
        "backends:\n  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{url}\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: {name}, deployment: gpt-4o }}\n"
    )
}

fn get(path: &str, token: Option<&str>) -> String {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    format!("GET {path} HTTP/1.0\r\nHost: onedoor\r\n{auth}\r\n")
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.0\r\nHost: onedoor\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_during_50_open_streams_lets_them_complete_and_exits_0() {
    // Three seconds per stream: long enough to still be open well after the signal.
    let slow = EndpointSpec::azure("slow", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(Behavior {
            inter_token_ms: 50,
            reply_words: Some(60),
            ..Behavior::default()
        });
    let fleet = Fleet::start(vec![slow]).await.unwrap();
    let endpoint = fleet.endpoint("slow").unwrap();
    let dir = temp_dir("sigterm");
    let (mut gateway, _admin) = start(
        &dir,
        &format!(
            "admin: {{ listen: \"{{admin}}\", token: t }}\n{}",
            one_backend("slow", &endpoint.url())
        ),
    )
    .await;

    let body =
        r#"{"model":"chat","stream":true,"messages":[{"role":"user","content":"Hello there"}]}"#;
    let streams: Vec<_> = (0..50)
        .map(|_| tokio::spawn(http(gateway.addr, post("/v1/chat/completions", body))))
        .collect();
    let started = Instant::now();
    while endpoint.total_requests() < 50 {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "only {} streams reached the upstream",
            endpoint.total_requests()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    gateway.signal("INT");

    let signalled = Instant::now();
    while TcpStream::connect(gateway.addr).await.is_ok() {
        assert!(
            signalled.elapsed() < Duration::from_secs(1),
            "still accepting 1 s after SIGINT"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let open = streams.iter().filter(|s| !s.is_finished()).count();
    assert_eq!(
        open, 50,
        "streams ended before the listener closed; the test proves nothing"
    );

    for stream in streams {
        let (status, body) = stream.await.unwrap().unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(
            body.trim_end().ends_with("data: [DONE]"),
            "a stream was cut:\n{body}"
        );
        assert!(!body.contains("\"error\""), "{body}");
    }
    let status = gateway.exit(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(0), "{}", gateway.log());
    assert_eq!(endpoint.cancelled(), 0);
    fleet.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_config() {
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("a", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let url = fleet.endpoint("a").unwrap().url();
    let dir = temp_dir("sighup");
    // The admin token is a `file:` secret: the file watch does not see it change, only a reload
    // that re-reads the config does.
    let token = dir.join("admin-token");
    std::fs::write(&token, "first-token\n").unwrap();
    let (mut gateway, admin) = start(
        &dir,
        &format!(
            "admin: {{ listen: \"{{admin}}\", token: \"file:{}\" }}\n{}",
            token.display(),
            one_backend("a", &url)
        ),
    )
    .await;
    let backends = |token: &'static str| http(admin, get("/admin/backends", Some(token)));
    assert_eq!(backends("first-token").await.unwrap().0, 200);

    std::fs::write(&token, "second-token\n").unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        backends("second-token").await.unwrap().0,
        401,
        "changed without a reload"
    );

    gateway.signal("HUP");
    let signalled = Instant::now();
    while backends("second-token").await.unwrap().0 != 200 {
        assert!(
            signalled.elapsed() < Duration::from_secs(5),
            "SIGHUP did not reload:\n{}",
            gateway.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(backends("first-token").await.unwrap().0, 401);
    let (status, body) = http(
        gateway.addr,
        post(
            "/v1/chat/completions",
            r#"{"model":"chat","messages":[{"role":"user","content":"Hi"}]}"#,
        ),
    )
    .await
    .unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(
        gateway.log().contains("config reloaded"),
        "{}",
        gateway.log()
    );

    gateway.signal("TERM");
    assert_eq!(
        gateway.exit(Duration::from_secs(10)).await.code(),
        Some(0),
        "{}",
        gateway.log()
    );
    fleet.shutdown().await;
}
