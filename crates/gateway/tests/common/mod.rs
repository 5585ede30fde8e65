//! The test harness: a simulated fleet, a gateway in front of it on ephemeral ports, and a small
//! HTTP client, so a failover test reads as a few sentences.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

pub mod raw;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use onedoor_gateway::Running;
pub use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

pub const KEY: &str = "test-client-key";
pub const OTHER_KEY: &str = "other-tenant-key";
pub const ADMIN_TOKEN: &str = "test-admin-token";

pub fn key_hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

pub struct Harness {
    pub fleet: Fleet,
    pub gateway: Running,
    client: Client<HttpConnector, Full<Bytes>>,
    /// The config file, for gateways started with `start_from_file`.
    config_file: Option<PathBuf>,
}

pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: String,
}

impl Answer {
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    pub fn attempts(&self) -> &str {
        self.header("x-onedoor-attempts")
    }

    /// The error code of a gateway error answer.
    pub fn code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// A loopback port free when asked, for a process the test then starts on it. Nothing holds it:
/// for a backend that must stay down, take `onedoor_mock::refusing_port`.
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl Harness {
    /// Starts `specs` and a gateway whose config is `config` with `{url:NAME}` replaced by each
    /// endpoint's URL. The tenants `team` (key `KEY`) and `other` (key `OTHER_KEY`) are appended
    /// unless the config has its own `tenants:`.
    pub async fn start(specs: Vec<EndpointSpec>, config: &str) -> Harness {
        let fleet = Fleet::start(specs).await.expect("fleet starts");
        Harness::start_with(fleet, config, &|_| None).await
    }

    /// Like `start`, on a fleet already started, the config read with `env` as its environment.
    pub async fn start_with(
        fleet: Fleet,
        config: &str,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Harness {
        let yaml = render(&fleet, config);
        let snapshot = match onedoor_config::parse(&yaml, Path::new("test.yaml"), env) {
            Ok(snapshot) => snapshot,
            Err(problems) => panic!("test config invalid: {problems:#?}\n{yaml}"),
        };
        let client_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = onedoor_gateway::start_on(snapshot, client_listener, admin_listener);
        let client = Client::builder(TokioExecutor::new()).build_http();
        Harness {
            fleet,
            gateway,
            client,
            config_file: None,
        }
    }

    /// Like `start`, but the config is a file in a fresh temporary directory that the gateway
    /// reloads from (`write_config` changes it).
    pub async fn start_from_file(specs: Vec<EndpointSpec>, config: &str) -> Harness {
        let fleet = Fleet::start(specs).await.expect("fleet starts");
        let path = temp_config_path();
        std::fs::write(&path, render(&fleet, config)).unwrap();
        let snapshot = match onedoor_config::load(&path) {
            Ok(snapshot) => snapshot,
            Err(problems) => panic!("test config invalid: {problems:#?}"),
        };
        let client_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let admin_listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway = onedoor_gateway::start_on_file(snapshot, client_listener, admin_listener);
        Harness {
            fleet,
            gateway,
            client: Client::builder(TokioExecutor::new()).build_http(),
            config_file: Some(path),
        }
    }

    /// Replaces the config file's content (`{url:NAME}` and the default tenants as in `start`).
    pub fn write_config(&self, config: &str) {
        let path = self
            .config_file
            .as_ref()
            .expect("started with start_from_file");
        std::fs::write(path, render(&self.fleet, config)).unwrap();
    }

    /// Writes the file as given, without substitutions (for broken configs).
    pub fn write_raw_config(&self, text: &str) {
        let path = self
            .config_file
            .as_ref()
            .expect("started with start_from_file");
        std::fs::write(path, text).unwrap();
    }

    pub fn config_file(&self) -> &Path {
        self.config_file
            .as_deref()
            .expect("started with start_from_file")
    }

    pub fn endpoint(&self, name: &str) -> &onedoor_mock::Endpoint {
        self.fleet
            .endpoint(name)
            .unwrap_or_else(|| panic!("no endpoint {name}"))
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.gateway.addr(), path)
    }

    pub async fn send(
        &self,
        method: Method,
        url: String,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Answer {
        let mut request = Request::builder().method(method).uri(url);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request.body(Full::new(body)).unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), self.client.request(request))
            .await
            .expect("the gateway answers within 30 s")
            .expect("the gateway answers");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body").to_bytes();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: String::from_utf8_lossy(&body).into_owned(),
        }
    }

    /// POSTs JSON to the client port with the team's key.
    pub async fn post(&self, path: &str, body: serde_json::Value) -> Answer {
        let auth = format!("Bearer {KEY}");
        self.send(
            Method::POST,
            self.url(path),
            &[
                ("authorization", &auth),
                ("content-type", "application/json"),
            ],
            Bytes::from(body.to_string()),
        )
        .await
    }

    /// POSTs JSON text to the client port with the team's key on a socket of its own, and hands
    /// the socket back open: the test reads as much of the answer as it wants, or goes away.
    pub async fn post_on_socket(&self, path: &str, body: &str) -> tokio::net::TcpStream {
        use tokio::io::AsyncWriteExt;
        let mut socket = tokio::net::TcpStream::connect(self.gateway.addr())
            .await
            .unwrap();
        let request = format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        socket.write_all(request.as_bytes()).await.unwrap();
        socket
    }

    /// A chat completion on `/v1` for `model`.
    pub async fn chat(&self, model: &str) -> Answer {
        self.post("/v1/chat/completions", chat_body(model, false))
            .await
    }

    /// POSTs to the admin port with the admin token.
    pub async fn admin_post(&self, path: &str) -> Answer {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        let url = format!("http://{}{}", self.gateway.admin_addr(), path);
        self.send(Method::POST, url, &[("authorization", &auth)], Bytes::new())
            .await
    }

    pub async fn admin_get(&self, path: &str, token: Option<&str>) -> Answer {
        let auth = token.map(|t| format!("Bearer {t}"));
        let headers: Vec<(&str, &str)> =
            auth.iter().map(|a| ("authorization", a.as_str())).collect();
        let url = format!("http://{}{}", self.gateway.admin_addr(), path);
        self.send(Method::GET, url, &headers, Bytes::new()).await
    }
}

/// `config` with `{url:NAME}` replaced by each endpoint's URL, and the default tenants, admin
/// token and (off) usage store appended unless it has its own.
pub fn render(fleet: &Fleet, config: &str) -> String {
    let mut yaml = config.to_owned();
    for endpoint in fleet.endpoints() {
        yaml = yaml.replace(&format!("{{url:{}}}", endpoint.name()), &endpoint.url());
    }
    if !yaml.contains("tenants:") {
        yaml.push_str(&format!(
            "tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n  - name: other\n    keys: [{{ id: other-key, sha256: {} }}]\n",
            key_hash(KEY),
            key_hash(OTHER_KEY)
        ));
    }
    if !yaml.contains("admin:") {
        yaml.push_str(&format!("admin: {{ token: {ADMIN_TOKEN} }}\n"));
    }
    // Usage records only where a test asks for them, never in a shared default file.
    if !yaml.contains("usage:") {
        yaml.push_str("usage: { store: \"off\" }\n");
    }
    yaml
}

/// A fresh `onedoor.yaml` path in its own temporary directory.
pub fn temp_config_path() -> PathBuf {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("onedoor-test-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("onedoor.yaml")
}

pub fn chat_body(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Hello there"}]
    })
}

/// Polls `condition` every 10 ms for up to 5 s.
pub async fn eventually(mut condition: impl FnMut() -> bool) -> bool {
    for _ in 0..500 {
        if condition() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    condition()
}
