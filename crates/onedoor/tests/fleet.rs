//! A fleet under faults: three `onedoor serve` processes share a Redis of the test's own (its
//! append-only file on, so a stop and a start keep the counters, as a production Redis does) and
//! the machine's Postgres (a database made for the run, dropped after), behind 32 clients that go
//! round the three. The upstreams: one healthy, one throttling (429 with Retry-After), one
//! failing (500), one that lacks the deployment (404 DeploymentNotFound). For about 28 s of load
//! one gateway is killed with SIGKILL the moment it has answered and started again, Redis is
//! stopped for 5 s and started again (`on_store_error: fail_closed`, so the limits stay exact:
//! 503 `state_unavailable` meanwhile), and one gateway reloads its config. Then: the capped
//! tenant (40 rpm, reached in the first seconds) was admitted no more than 40 times across the
//! fleet; every answer a client received whole has exactly one usage record with its status
//! (the killed gateway's ledger included); the 404 and the breaker learned through one gateway
//! are obeyed by the others, the restarted one too, and the failing and lacking upstreams are
//! never asked again; no gateway panicked. Prints a table per phase and instance.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use onedoor_usage::testing::{drop_database, fresh_database, MACHINE_POSTGRES};
use sha2::{Digest, Sha256};

mod common;
use common::{free_addr, http, Gateway};

const INSTANCES: usize = 3;
const CAPPED_KEY: &str = "fleet-capped-key";
const STEADY_KEY: &str = "fleet-steady-key";
const PROBE_KEY: &str = "fleet-probe-key";
/// The capped tenant's requests per rolling minute, for the whole fleet; the load lasts less
/// than a minute, so every request it admits counts against it.
const CAPPED_RPM: usize = 40;
const CAPPED_CLIENTS: usize = 8;
const STEADY_CLIENTS: usize = 24;
const ADMIN_TOKEN: &str = "fleet-admin";

/// A `redis-server` of the test's own, persisting to an append-only file so that a stop and a
/// start keep the shared counters, breakers and not-served entries, as a production Redis does.
struct OwnRedis {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl OwnRedis {
    fn start(port: u16, dir: &Path) -> OwnRedis {
        let mut redis = OwnRedis {
            child: None,
            port,
            dir: dir.to_path_buf(),
        };
        redis.resume();
        redis
    }

    fn resume(&mut self) {
        let child = Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "yes"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot run redis-server ({e}); this test needs it: apt-get install -y redis-server")
            });
        self.child = Some(child);
        for _ in 0..250 {
            if answers_ping(self.port) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!(
            "redis-server on port {} did not answer PING within 5 s",
            self.port
        );
    }

    /// SIGTERM: Redis writes its append-only file and exits.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let _ = child.wait();
        assert!(
            !answers_ping(self.port),
            "redis-server still answers after SIGTERM"
        );
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn answers_ping(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut reply = [0u8; 7];
    stream.write_all(b"PING\r\n").is_ok()
        && stream.read_exact(&mut reply).is_ok()
        && &reply == b"+PONG\r\n"
}

/// Where one gateway instance listens, and its config file.
struct Instance {
    listen: SocketAddr,
    admin: SocketAddr,
    config: PathBuf,
}

fn hash(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

/// Instance `index`'s config; `max_attempts` is what a reload changes.
fn config_text(
    instance: &Instance,
    journal: &Path,
    redis: &str,
    usage: &str,
    fleet: &Fleet,
    max_attempts: u32,
) -> String {
    let url = |name: &str| fleet.endpoint(name).unwrap().url();
    let backend = |name: &str, extra: &str| {
        format!(
            "  - {{ name: {name}, provider: azure, region: swedencentral, url: \"{}\"{extra} }}\n",
            url(name)
        )
    };
    let target = |backend: &str, priority: u32| {
        format!("      - {{ backend: {backend}, deployment: gpt-4o, priority: {priority} }}\n")
    };
    format!(
        "listen: {}\n\
         admin: {{ listen: \"{}\", token: {ADMIN_TOKEN} }}\n\
         state: {{ store: redis, redis_url: \"{redis}\", on_store_error: fail_closed, key_prefix: fleet }}\n\
         usage: {{ store: \"{usage}\", journal_dir: \"{}\" }}\n\
         shutdown: {{ drain_delay: 0ms, timeout: 10s }}\n\
         routing: {{ max_attempts: {max_attempts}, timeouts: {{ total: 5s }} }}\n\
         circuit_breakers:\n  trip-once:\n    rules: [{{ name: server-errors, failures: {{ count: 1, within: 60s, status: [500-599] }}, trip: 120s }}]\n\
         backends:\n{}{}{}{}\
         models:\n\
         \x20 - name: chat\n    targets:\n{}{}{}{}\
         \x20 - name: probe-404\n    targets:\n{}{}\
         \x20 - name: probe-5xx\n    targets:\n{}{}\
         tenants:\n\
         \x20 - name: capped\n    keys: [{{ id: capped-key, sha256: {} }}]\n    limits: {{ rpm: {CAPPED_RPM}, max_in_flight: 3 }}\n\
         \x20 - name: steady\n    keys: [{{ id: steady-key, sha256: {} }}]\n    limits: {{ max_in_flight: 12 }}\n\
         \x20 - name: probe\n    keys: [{{ id: probe-key, sha256: {} }}]\n",
        instance.listen,
        instance.admin,
        journal.display(),
        backend("healthy", ""),
        backend("throttled", ""),
        backend("failing", ", circuit_breaker: trip-once"),
        backend("lacking", ""),
        target("throttled", 1),
        target("failing", 1),
        target("lacking", 1),
        target("healthy", 2),
        target("lacking", 1),
        target("healthy", 2),
        target("failing", 1),
        target("healthy", 2),
        hash(CAPPED_KEY),
        hash(STEADY_KEY),
        hash(PROBE_KEY),
    )
}

async fn upstreams() -> Fleet {
    let gpt = || DeploymentSpec::new("gpt-4o");
    Fleet::start(vec![
        EndpointSpec::azure("healthy", "swedencentral")
            .deployment(gpt())
            .behavior(Behavior {
                ttft_ms: 5,
                reply_words: Some(6),
                ..Behavior::default()
            }),
        // One request a minute, then 429s whose Retry-After (3 s) is longer than
        // `max_retry_wait`: the target cools down fleet-wide and requests go on elsewhere.
        EndpointSpec::azure("throttled", "swedencentral")
            .deployment(gpt().rpm(1))
            .behavior(Behavior {
                retry_after_s: Some(3),
                ..Behavior::default()
            }),
        EndpointSpec::azure("failing", "swedencentral")
            .deployment(gpt())
            .behavior(Behavior {
                status: Some(500),
                ..Behavior::default()
            }),
        EndpointSpec::azure("lacking", "swedencentral").deployment(DeploymentSpec::new("other")),
    ])
    .await
    .unwrap()
}

/// What one request got.
#[derive(Debug, Clone)]
enum Got {
    Answered {
        status: u16,
        /// `x-onedoor-error`.
        code: String,
        id: String,
        /// The body came to its end (a stream's with `[DONE]`).
        whole: bool,
    },
    /// No answer: the gateway was down or the connection broke.
    Failed,
}

#[derive(Debug, Clone)]
struct Sent {
    /// Seconds from the start of the load.
    at: f64,
    instance: usize,
    capped: bool,
    got: Got,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

async fn send(client: &HttpClient, addr: SocketAddr, key: &str, model: &str, stream: bool) -> Got {
    let body = serde_json::json!({
        "model": model,
        "stream": stream,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": "Hello there"}]
    });
    let request = hyper::Request::post(format!("http://{addr}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let exchange = async {
        let response = client.request(request).await.ok()?;
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let (status, code, id) = (
            response.status().as_u16(),
            header("x-onedoor-error"),
            header("x-onedoor-request-id"),
        );
        let whole = match response.into_body().collect().await {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
                !stream || status != 200 || text.trim_end().ends_with("data: [DONE]")
            }
            Err(_) => false,
        };
        Some(Got::Answered {
            status,
            code,
            id,
            whole,
        })
    };
    match tokio::time::timeout(Duration::from_secs(15), exchange).await {
        Ok(Some(got)) => got,
        _ => Got::Failed,
    }
}

/// A client going round the instances until `stop`, every fourth request streamed; it pauses
/// briefly after a refusal so that refusals do not take the machine's two cores.
async fn client(
    index: usize,
    capped: bool,
    addrs: Vec<SocketAddr>,
    started: Instant,
    stop: Arc<AtomicBool>,
) -> Vec<Sent> {
    let http: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let key = if capped { CAPPED_KEY } else { STEADY_KEY };
    let mut sent = Vec::new();
    let mut n = index;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let instance = n % INSTANCES;
        let got = send(&http, addrs[instance], key, "chat", n.is_multiple_of(4)).await;
        let pause = !matches!(got, Got::Answered { status: 200, .. });
        sent.push(Sent {
            at: started.elapsed().as_secs_f64(),
            instance,
            capped,
            got,
        });
        if pause {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    sent
}

/// The request id of a 200 from `addr`, asking again while it refuses (its limits are met).
async fn answered_by(addr: SocketAddr) -> String {
    let http: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    for _ in 0..500 {
        if let Got::Answered {
            status: 200,
            id,
            whole: true,
            ..
        } = send(&http, addr, STEADY_KEY, "chat", false).await
        {
            return id;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{addr} answered no request with 200 in 500 tries");
}

/// `x-onedoor-attempts` of one request for `model` through `addr`, by the probe tenant (no
/// limits), asked again while Redis is too slow to answer in time (503 `state_unavailable`
/// under `fail_closed`, on a loaded machine).
async fn attempts(addr: SocketAddr, model: &str) -> String {
    let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        .to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nAuthorization: Bearer {PROBE_KEY}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut text = String::new();
    for _ in 0..100 {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.unwrap();
        text = String::from_utf8_lossy(&answer).into_owned();
        if !text.contains("x-onedoor-error: state_unavailable") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200"),
        "{text}"
    );
    text.lines()
        .find_map(|l| l.strip_prefix("x-onedoor-attempts: "))
        .unwrap_or_default()
        .trim()
        .to_owned()
}

async fn admin(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    http(
        addr,
        format!("{method} {path} HTTP/1.0\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nContent-Length: 0\r\n\r\n"),
    )
    .await
    .unwrap()
}

/// The learned-once facts, checked on every instance: the 404 and the 500 taught through
/// instance 0 make the others skip those targets without asking.
async fn learn_and_check_sharing(instances: &[Instance]) {
    let first = attempts(instances[0].listen, "probe-404").await;
    assert!(first.starts_with("lacking=404"), "{first}");
    let first = attempts(instances[0].listen, "probe-5xx").await;
    assert!(first.starts_with("failing=500"), "{first}");
    for other in &instances[1..] {
        assert_eq!(attempts(other.listen, "probe-404").await, "healthy=200");
        assert_eq!(attempts(other.listen, "probe-5xx").await, "healthy=200");
        let (status, body) = admin(other.admin, "GET", "/admin/backends").await;
        assert_eq!(status, 200, "{body}");
        let view: serde_json::Value = serde_json::from_str(&body).unwrap();
        let backend = |name: &str| {
            view["backends"]
                .as_array()
                .unwrap()
                .iter()
                .find(|b| b["name"] == name)
                .unwrap()
                .clone()
        };
        assert_eq!(
            backend("lacking")["not_served"][0]["deployment"],
            "gpt-4o",
            "{body}"
        );
        assert_eq!(
            backend("failing")["breaker"]["targets"][0]["state"],
            "open",
            "{body}"
        );
    }
}

/// The phases of the load, each from its start (seconds from the load's start).
#[derive(Default)]
struct Phases(Mutex<Vec<(f64, &'static str)>>);

impl Phases {
    fn begin(&self, started: Instant, name: &'static str) {
        self.0
            .lock()
            .unwrap()
            .push((started.elapsed().as_secs_f64(), name));
    }

    fn of(&self, at: f64) -> &'static str {
        let phases = self.0.lock().unwrap();
        phases
            .iter()
            .rev()
            .find(|(from, _)| *from <= at)
            .map_or("before", |(_, name)| name)
    }

    fn names(&self) -> Vec<&'static str> {
        self.0.lock().unwrap().iter().map(|(_, n)| *n).collect()
    }
}

/// One row of the table: a phase on an instance.
#[derive(Default)]
struct Row {
    sent: u64,
    answered_2xx: u64,
    /// A 2xx head whose body broke off (a stream under way when its gateway was killed).
    cut_2xx: u64,
    limited_429: u64,
    upstream_429: u64,
    errors_5xx: BTreeMap<String, u64>,
    failed: u64,
    records: u64,
}

fn table(sent: &[Sent], phases: &Phases, records: &HashMap<String, Record>) -> String {
    let mut rows: BTreeMap<(usize, usize), Row> = BTreeMap::new();
    let names = phases.names();
    for s in sent {
        let phase = names
            .iter()
            .position(|n| *n == phases.of(s.at))
            .unwrap_or(0);
        let row = rows.entry((phase, s.instance)).or_default();
        row.sent += 1;
        let Got::Answered {
            status,
            code,
            id,
            whole,
        } = &s.got
        else {
            row.failed += 1;
            continue;
        };
        match status {
            200..=299 if *whole => row.answered_2xx += 1,
            200..=299 => row.cut_2xx += 1,
            429 if code == "rate_limited" => row.limited_429 += 1,
            429 => row.upstream_429 += 1,
            500.. => {
                *row.errors_5xx
                    .entry(format!("{status} {code}"))
                    .or_default() += 1
            }
            _ => {}
        }
        row.records += u64::from(records.contains_key(id));
    }
    let mut out = format!(
        "{:<16} {:>4} {:>6} {:>6} {:>7} {:>9} {:>9} {:>7} {:>8}  5xx by code\n",
        "phase", "gw", "sent", "2xx", "2xx cut", "429 limit", "429 other", "no answ", "records"
    );
    for ((phase, instance), row) in &rows {
        let errors: Vec<String> = row
            .errors_5xx
            .iter()
            .map(|(c, n)| format!("{c}: {n}"))
            .collect();
        out.push_str(&format!(
            "{:<16} {:>4} {:>6} {:>6} {:>7} {:>9} {:>9} {:>7} {:>8}  {}\n",
            names.get(*phase).copied().unwrap_or("?"),
            instance,
            row.sent,
            row.answered_2xx,
            row.cut_2xx,
            row.limited_429,
            row.upstream_429,
            row.failed,
            row.records,
            errors.join(", ")
        ));
    }
    out
}

/// A usage record as the assertions need it.
struct Record {
    tenant: String,
    status: u16,
    error: Option<String>,
}

async fn usage_records(url: &str) -> (HashMap<String, Record>, i64) {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let rows = client
        .query(
            "SELECT request_id, tenant, status, error FROM usage_records",
            &[],
        )
        .await
        .unwrap();
    let mut records = HashMap::new();
    for row in &rows {
        records.insert(
            row.get::<_, String>(0),
            Record {
                tenant: row.get(1),
                status: row.get::<_, i32>(2) as u16,
                error: row.get(3),
            },
        );
    }
    drop(client);
    let _ = connection.await;
    (records, rows.len() as i64)
}

/// Requests of the capped tenant that passed its limits: those with a record that does not
/// say they were refused, and those answered otherwise than refused.
fn capped_admitted(sent: &[Sent], records: &HashMap<String, Record>) -> usize {
    let refused = |code: &str| code == "rate_limited" || code == "state_unavailable";
    let mut admitted: std::collections::HashSet<&str> = records
        .iter()
        .filter(|(_, r)| r.tenant == "capped" && !r.error.as_deref().is_some_and(refused))
        .map(|(id, _)| id.as_str())
        .collect();
    for s in sent.iter().filter(|s| s.capped) {
        if let Got::Answered { code, id, .. } = &s.got {
            if !refused(code) {
                admitted.insert(id);
            }
        }
    }
    admitted.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_under_kill_9_a_redis_outage_and_a_reload_holds_limits_and_records_every_answer() {
    let dir = common::temp_dir("fleet", "faults");
    let redis_dir = dir.join("redis");
    std::fs::create_dir_all(&redis_dir).unwrap();
    let mut redis = OwnRedis::start(free_addr().port(), &redis_dir);
    let database = fresh_database(MACHINE_POSTGRES, "fleet")
        .await
        .unwrap_or_else(|message| panic!("{message}"));
    let fleet = upstreams().await;
    let instances: Vec<Instance> = (0..INSTANCES)
        .map(|i| Instance {
            listen: free_addr(),
            admin: free_addr(),
            config: dir.join(format!("gw{i}")).join("onedoor.yaml"),
        })
        .collect();
    let redis_url = redis.url();
    let write_config = |i: usize, max_attempts: u32| {
        let instance = &instances[i];
        let journal = instance.config.parent().unwrap();
        std::fs::create_dir_all(journal).unwrap();
        let text = config_text(
            instance,
            journal,
            &redis_url,
            &database,
            &fleet,
            max_attempts,
        );
        std::fs::write(&instance.config, text).unwrap();
    };
    let mut gateways = Vec::new();
    for (i, instance) in instances.iter().enumerate() {
        write_config(i, 4);
        gateways.push(Gateway::start(&instance.config, &format!("gw{i}")).await);
    }
    learn_and_check_sharing(&instances).await;
    let taught = (
        fleet.endpoint("lacking").unwrap().total_requests(),
        fleet.endpoint("failing").unwrap().total_requests(),
    );

    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let phases = Arc::new(Phases::default());
    phases.begin(started, "steady");
    let addrs: Vec<SocketAddr> = instances.iter().map(|i| i.listen).collect();
    let clients: Vec<_> = (0..CAPPED_CLIENTS + STEADY_CLIENTS)
        .map(|i| {
            tokio::spawn(client(
                i,
                i < CAPPED_CLIENTS,
                addrs.clone(),
                started,
                stop.clone(),
            ))
        })
        .collect();
    let mut logs = Vec::new();
    let until =
        |seconds: u64| tokio::time::sleep_until((started + Duration::from_secs(seconds)).into());

    until(5).await;
    // Killed the moment it has answered: that answer's record is most likely still waiting for
    // the writer (20 ms and a batch insert), in memory and in the ledger.
    let last_answer = answered_by(instances[1].listen).await;
    gateways[1].kill_at_once();
    phases.begin(started, "gw1 kill -9");
    gateways[1].exit(Duration::from_secs(10)).await;
    logs.push(gateways[1].log_path());
    gateways[1] = Gateway::start(&instances[1].config, "gw1-restarted").await;
    phases.begin(started, "gw1 restarted");

    until(11).await;
    phases.begin(started, "redis down");
    redis.stop();
    until(16).await;
    redis.resume();
    phases.begin(started, "redis back");

    until(20).await;
    write_config(2, 3);
    let (status, body) = admin(instances[2].admin, "POST", "/admin/reload").await;
    assert_eq!(status, 200, "{body}");
    phases.begin(started, "gw2 reloaded");

    until(28).await;
    stop.store(true, Ordering::Relaxed);
    let mut sent = Vec::new();
    for client in clients {
        sent.extend(client.await.unwrap());
    }
    phases.begin(started, "end");

    // After the outage and the restart the learned facts still hold on every instance.
    for instance in &instances {
        assert_eq!(attempts(instance.listen, "probe-404").await, "healthy=200");
    }
    for gateway in gateways {
        logs.push(gateway.log_path());
        let status = gateway.terminate().await;
        assert_eq!(status.code(), Some(0));
    }
    let (records, rows) = usage_records(&database).await;
    drop_database(MACHINE_POSTGRES, &database).await;
    println!("{}", table(&sent, &phases, &records));
    let logs: Vec<(PathBuf, String)> = logs
        .into_iter()
        .map(|p| (p.clone(), std::fs::read_to_string(&p).unwrap_or_default()))
        .collect();
    let recovered: Vec<&str> = logs
        .iter()
        .flat_map(|(_, log)| log.lines())
        .filter(|l| l.contains("did not stop cleanly"))
        .collect();
    println!("usage records: {rows}; ledger recoveries: {recovered:#?}");
    let unrecorded: Vec<String> = sent
        .iter()
        .filter_map(|s| match &s.got {
            Got::Answered {
                status,
                code,
                id,
                whole,
            } if !records.contains_key(id) => Some(format!(
                "{:.3}s gw{} {status} {code} {id:?} whole={whole}",
                s.at, s.instance
            )),
            _ => None,
        })
        .collect();
    println!("answers without a record: {unrecorded:#?}");

    for (path, log) in &logs {
        assert!(!log.contains("panicked"), "{}:\n{log}", path.display());
    }
    let admitted = capped_admitted(&sent, &records);
    let answered_by_phase = |phase: &str| {
        sent.iter()
            .filter(|s| s.capped && phases.of(s.at) == phase)
            .filter(|s| matches!(&s.got, Got::Answered { status: 200, .. }))
            .count()
    };
    let by_phase: Vec<String> = phases
        .names()
        .iter()
        .map(|p| format!("{p}: {}", answered_by_phase(p)))
        .collect();
    println!(
        "capped tenant: {admitted} admitted of rpm {CAPPED_RPM}; answered 200 by phase: {}",
        by_phase.join(", ")
    );
    assert!(
        admitted <= CAPPED_RPM,
        "{admitted} admitted over rpm {CAPPED_RPM}"
    );
    let limited = |capped: bool| {
        sent.iter()
            .filter(|s| s.capped == capped)
            .filter(|s| matches!(&s.got, Got::Answered { code, .. } if code == "rate_limited"))
            .count()
    };
    assert!(
        limited(true) > 0 && limited(false) > 0,
        "the load never met a limit"
    );
    assert!(
        records.contains_key(&last_answer),
        "no usage record for {last_answer}, answered just before its gateway was killed"
    );
    let mut answered = 0;
    for s in &sent {
        if let Got::Answered {
            status: status @ 200..=299,
            id,
            whole: true,
            ..
        } = &s.got
        {
            answered += 1;
            let record = records.get(id);
            assert!(record.is_some(), "no usage record for the answered {id}");
            assert_eq!(record.map(|r| r.status), Some(*status), "{id}");
        }
    }
    assert!(answered > 0);
    assert_eq!(rows as usize, records.len(), "a request id recorded twice");
    assert!(
        sent.iter()
            .any(|s| matches!(&s.got, Got::Answered { code, .. } if code == "state_unavailable")),
        "the Redis outage was never seen"
    );
    // Learned once, through instance 0: no instance asked those targets again.
    assert_eq!(
        (
            fleet.endpoint("lacking").unwrap().total_requests(),
            fleet.endpoint("failing").unwrap().total_requests(),
        ),
        taught
    );
    assert!(fleet.endpoint("throttled").unwrap().total_requests() > 1);
    fleet.shutdown().await;
    drop(redis);
    // Kept when an assertion failed: the gateways' logs are there.
    let _ = std::fs::remove_dir_all(&dir);
}
