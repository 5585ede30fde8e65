//! `onedoor serve` stopped the way Kubernetes stops a pod: SIGTERM while 50 clients send
//! continuously (half streaming, on keep-alive HTTP/1.1 connections). `/readyz` answers 503 at
//! once; for `shutdown.drain_delay` the gateway goes on accepting and answering, each answer
//! saying `connection: close`; then the listener closes, the requests and streams under way
//! finish, the process exits 0, and the usage store holds a record for every answered request.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use sha2::{Digest, Sha256};
use tokio::net::TcpStream;

mod common;
use common::{free_addr, http, Gateway};

const KEY: &str = "shutdown-client-key";
const CLIENTS: usize = 50;
const DRAIN: Duration = Duration::from_secs(2);
/// Requests begun this close to the listener's close may meet it (a connection accepted by the
/// kernel but not yet read is closed unread, as in any server); earlier ones must all be answered.
const RACE: Duration = Duration::from_millis(250);

/// One request as a client saw it, its times from the SIGTERM.
#[derive(Debug)]
struct Outcome {
    began: f64,
    ended: f64,
    stream: bool,
    /// On a connection the client opened for it.
    fresh: bool,
    what: What,
}

#[derive(Debug)]
enum What {
    /// An answer: its status, whether its body came whole, its request id, `connection: close`.
    Answered {
        status: u16,
        whole: bool,
        id: String,
        close: bool,
    },
    /// The connect was refused: the listener is closed.
    Refused,
    /// The connection failed before an answer.
    Failed(String),
}

fn write_config(dir: &Path, url: &str, admin: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("onedoor.yaml");
    let text = format!(
        "listen: {}\nadmin: {{ listen: \"{admin}\", token: t }}\nusage: {{ store: \"sqlite://{}\", journal_dir: \"{}\" }}\nshutdown: {{ drain_delay: {}ms, timeout: 10s }}\nbackends:\n  - {{ name: up, provider: azure, region: swedencentral, url: \"{url}\" }}\nmodels:\n  - name: chat\n    targets: [{{ backend: up, deployment: gpt-4o }}]\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        dir.join("usage.db").display(),
        dir.display(),
        DRAIN.as_millis(),
        hex::encode(Sha256::digest(KEY.as_bytes()))
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn chat(n: usize, stream: bool) -> hyper::Request<Full<Bytes>> {
    let body = serde_json::json!({
        "model": "chat",
        "stream": stream,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": format!("Hello number {n}")}]
    });
    hyper::Request::post("/v1/chat/completions")
        .header("host", "onedoor")
        .header("authorization", format!("Bearer {KEY}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// A new keep-alive connection, or `None` when the connect is refused.
async fn open(addr: SocketAddr) -> Option<Result<SendRequest<Full<Bytes>>, String>> {
    let stream = TcpStream::connect(addr).await.ok()?;
    let handshake = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await;
    Some(match handshake {
        Ok((sender, connection)) => {
            tokio::spawn(connection);
            Ok(sender)
        }
        Err(error) => Err(error.to_string()),
    })
}

/// One request on `sender`: its answer, read whole.
async fn exchange(sender: &mut SendRequest<Full<Bytes>>, n: usize, stream: bool) -> What {
    if let Err(error) = sender.ready().await {
        return What::Failed(format!("the connection closed before the request: {error}"));
    }
    let response = match sender.send_request(chat(n, stream)).await {
        Ok(response) => response,
        Err(error) => return What::Failed(error.to_string()),
    };
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let id = header("x-onedoor-request-id");
    let close = header("connection").eq_ignore_ascii_case("close");
    let whole = match response.into_body().collect().await {
        Ok(body) => {
            let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
            !stream || text.trim_end().ends_with("data: [DONE]")
        }
        Err(_) => false,
    };
    What::Answered {
        status,
        whole,
        id,
        close,
    }
}

/// A client sending request after request (every other one streamed) on a keep-alive
/// connection, opening a new one when an answer says `connection: close`, until a connect is
/// refused or `until` (from `signal`) passes.
async fn client(
    index: usize,
    addr: SocketAddr,
    signal: Arc<tokio::sync::OnceCell<Instant>>,
    until: Duration,
) -> Vec<Outcome> {
    let base = Instant::now();
    let since = move |at: Instant| match signal.get() {
        Some(&sent) if at >= sent => (at - sent).as_secs_f64(),
        Some(&sent) => -(sent - at).as_secs_f64(),
        None => (at - base).as_secs_f64() - 1000.0,
    };
    let mut outcomes = Vec::new();
    let mut connection: Option<SendRequest<Full<Bytes>>> = None;
    for n in 0.. {
        let began = Instant::now();
        if since(began) > until.as_secs_f64() {
            break;
        }
        let stream = (index + n).is_multiple_of(2);
        let fresh = connection.is_none();
        let what = match connection.take() {
            Some(sender) => Ok(sender),
            None => match open(addr).await {
                None => Err(What::Refused),
                Some(Ok(sender)) => Ok(sender),
                Some(Err(error)) => Err(What::Failed(error)),
            },
        };
        let what = match what {
            Ok(mut sender) => {
                let what = exchange(&mut sender, index * 10_000 + n, stream).await;
                if matches!(what, What::Answered { close: false, .. }) {
                    connection = Some(sender);
                }
                what
            }
            Err(what) => what,
        };
        let refused = matches!(what, What::Refused);
        outcomes.push(Outcome {
            began: since(began),
            ended: since(Instant::now()),
            stream,
            fresh,
            what,
        });
        if refused {
            break;
        }
    }
    outcomes
}

/// `/readyz` on `addr` every 50 ms from the SIGTERM on, as (seconds since it, status), until the
/// port stops answering.
async fn probe(addr: SocketAddr, sent: Instant) -> Vec<(f64, u16)> {
    let mut seen = Vec::new();
    loop {
        let at = sent.elapsed().as_secs_f64();
        match http(addr, "GET /readyz HTTP/1.0\r\n\r\n".into()).await {
            Ok((status, _)) if status != 0 => seen.push((at, status)),
            _ => return seen,
        }
        if at > 20.0 {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn recorded_ids(db: &Path) -> HashSet<String> {
    let db = rusqlite::Connection::open(db).unwrap();
    let mut query = db.prepare("SELECT request_id FROM usage_records").unwrap();
    let ids = query.query_map([], |row| row.get::<_, String>(0)).unwrap();
    ids.map(Result::unwrap).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_under_continuous_load_drains_refuses_nothing_and_records_every_answer() {
    let upstream = EndpointSpec::azure("up", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(Behavior {
            ttft_ms: 50,
            inter_token_ms: 25,
            reply_words: Some(16),
            ..Behavior::default()
        });
    let fleet = Fleet::start(vec![upstream]).await.unwrap();
    let dir = common::temp_dir("shutdown", "drain");
    let admin = free_addr();
    let config = write_config(&dir, &fleet.endpoint("up").unwrap().url(), admin);
    let mut gateway = Gateway::start(&config, "drain").await;
    let addr = gateway.addr;
    assert_eq!(
        http(admin, "GET /readyz HTTP/1.0\r\n\r\n".into())
            .await
            .unwrap()
            .0,
        200
    );

    let signal = Arc::new(tokio::sync::OnceCell::new());
    let until = DRAIN + Duration::from_secs(5);
    let clients: Vec<_> = (0..CLIENTS)
        .map(|i| tokio::spawn(client(i, addr, signal.clone(), until)))
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    gateway.signal("TERM");
    let sent = Instant::now();
    signal.set(sent).unwrap();
    let probes = tokio::spawn(probe(admin, sent));
    let client_port_probes = tokio::spawn(probe(addr, sent));

    let mut outcomes = Vec::new();
    for client in clients {
        outcomes.extend(client.await.unwrap());
    }
    let status = gateway.exit(Duration::from_secs(20)).await;
    let log = gateway.log();
    assert_eq!(status.code(), Some(0), "{log}");

    let drain = DRAIN.as_secs_f64();
    let safe = drain - RACE.as_secs_f64();
    let mut answered = HashSet::new();
    let (mut in_drain, mut fresh_in_drain, mut closing, mut straddling) = (0, 0, 0, 0);
    for o in &outcomes {
        match &o.what {
            What::Answered {
                status,
                whole,
                id,
                close,
            } => {
                assert_eq!(*status, 200, "{o:?}");
                assert!(*whole, "an answer was cut: {o:?}");
                assert!(answered.insert(id.clone()), "a request id twice: {o:?}");
                // The signal takes a moment to arrive.
                if o.began >= 0.5 {
                    assert!(*close, "an answer after SIGTERM kept its connection: {o:?}");
                    closing += 1;
                }
                if (0.0..drain).contains(&o.began) {
                    in_drain += 1;
                    fresh_in_drain += usize::from(o.fresh);
                }
                if o.began < drain && o.ended > drain && o.stream {
                    straddling += 1;
                }
            }
            What::Refused => assert!(
                o.began >= safe,
                "refused {:.3}s after SIGTERM, within the drain delay: {o:?}\n{log}",
                o.began
            ),
            What::Failed(why) => assert!(
                o.began >= safe,
                "{why} {:.3}s after SIGTERM, within the drain delay: {o:?}\n{log}",
                o.began
            ),
        }
    }
    let refused = outcomes
        .iter()
        .filter(|o| matches!(o.what, What::Refused))
        .count();
    let failed: Vec<_> = outcomes
        .iter()
        .filter(|o| matches!(o.what, What::Failed(_)))
        .collect();
    println!(
        "{} requests, {} answered ({in_drain} begun during the {drain}s drain, {fresh_in_drain} on new connections), {straddling} streams under way at the close, {refused} clients refused after it, {} cut off at the close: {failed:?}",
        outcomes.len(),
        answered.len(),
        failed.len()
    );
    assert!(in_drain >= CLIENTS, "too little traffic in the drain");
    assert!(
        fresh_in_drain >= CLIENTS / 2,
        "new connections were not served"
    );
    assert!(closing > 0 && straddling > 0, "{closing} {straddling}");
    assert_eq!(refused, CLIENTS, "every client ends at the closed listener");

    for (port, probes) in [("admin", probes), ("client", client_port_probes)] {
        let probes = probes.await.unwrap();
        assert!(
            probes.iter().any(|&(at, _)| at >= drain - 0.3),
            "{port} /readyz stopped answering early: {probes:?}"
        );
        for &(at, status) in &probes {
            if at >= 0.5 {
                assert_eq!(status, 503, "{port} /readyz at {at:.2}s: {probes:?}");
            }
        }
    }

    let recorded = recorded_ids(&dir.join("usage.db"));
    assert_eq!(recorded.len(), answered.len(), "{log}");
    assert!(recorded == answered, "records differ from the answers");
    fleet.shutdown().await;
}
