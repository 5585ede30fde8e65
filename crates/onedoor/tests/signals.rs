//! `onedoor serve` as a process under its signals: SIGTERM stops accepting at once and lets open
//! streams finish before exiting 0; SIGHUP re-reads the config. The upstreams are simulated in
//! the test process; the gateway is the real binary, spoken to over raw HTTP/1.0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const KEY: &str = "signals-client-key";

/// The gateway process; killed if a test ends without stopping it.
struct Gateway {
    child: Child,
    addr: SocketAddr,
    admin: SocketAddr,
    log: PathBuf,
}

impl Gateway {
    /// Starts `onedoor serve --config <dir>/onedoor.yaml` and waits until it answers.
    async fn start(dir: &Path, config: &str) -> Gateway {
        let addr = free_addr();
        let admin = free_addr();
        let path = dir.join("onedoor.yaml");
        let text = format!(
            "listen: {addr}\n{}tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
            config.replace("{admin}", &admin.to_string()),
            hex::encode(Sha256::digest(KEY.as_bytes()))
        );
        std::fs::write(&path, text).unwrap();
        let log = dir.join("gateway.log");
        let child = Command::new(env!("CARGO_BIN_EXE_onedoor"))
            .args(["serve", "--config"])
            .arg(&path)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let gateway = Gateway {
            child,
            addr,
            admin,
            log,
        };
        let started = Instant::now();
        while http(addr, get("/healthz", None)).await.ok().map(|(s, _)| s) != Some(200) {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the gateway did not come up:\n{}",
                gateway.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        gateway
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{name} failed");
    }

    /// Waits up to `within` for the process to exit.
    async fn exit(&mut self, within: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < within,
                "the gateway did not exit within {within:?}:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-signals-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
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

/// Sends one HTTP/1.0 request and reads the answer to the end of the connection (so a stream's
/// body is all of it, without chunked framing).
async fn http(addr: SocketAddr, request: String) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_50_open_streams_lets_them_complete_and_exits_0() {
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
    let mut gateway = Gateway::start(
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
    gateway.signal("TERM");

    let signalled = Instant::now();
    while TcpStream::connect(gateway.addr).await.is_ok() {
        assert!(
            signalled.elapsed() < Duration::from_secs(1),
            "still accepting 1 s after SIGTERM"
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
    let mut gateway = Gateway::start(
        &dir,
        &format!(
            "admin: {{ listen: \"{{admin}}\", token: \"file:{}\" }}\n{}",
            token.display(),
            one_backend("a", &url)
        ),
    )
    .await;
    let backends = |token: &'static str| http(gateway.admin, get("/admin/backends", Some(token)));
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
