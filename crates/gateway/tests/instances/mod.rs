//! More than one gateway instance in front of one simulated fleet, each with its own runtime (and
//! its own memory, unless their config shares a Redis), and the Redis those tests need.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::Method;
use onedoor_gateway::Running;
use tokio::net::TcpListener;

use crate::common::{render, Answer, Harness, ADMIN_TOKEN, KEY};

/// The machine's shared Redis; tests keep apart by key prefix.
pub const REDIS: &str = "127.0.0.1:6379";

/// Fails the test with how to start Redis when it does not answer.
pub fn require_redis() {
    if std::net::TcpStream::connect(REDIS).is_err() {
        panic!(
            "this test needs Redis at {REDIS}; start it with: redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no"
        );
    }
}

/// A key prefix no other test or run uses.
pub fn unique_prefix(test: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("test-{test}-{}-{nanos}", std::process::id())
}

/// A `state:` block for the shared Redis under its own prefix.
pub fn shared_state(test: &str) -> String {
    require_redis();
    format!(
        "state: {{ store: redis, redis_url: \"redis://{REDIS}/0\", key_prefix: {} }}\n",
        unique_prefix(test)
    )
}

/// Another gateway instance for `h`'s fleet with `config` (rendered as the harness renders it).
pub async fn another(h: &Harness, config: &str) -> Running {
    let yaml = render(&h.fleet, config);
    let snapshot = match onedoor_config::parse(&yaml, Path::new("test.yaml"), &|_| None) {
        Ok(snapshot) => snapshot,
        Err(problems) => panic!("test config invalid: {problems:#?}\n{yaml}"),
    };
    let client = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    onedoor_gateway::start_on(snapshot, client, admin)
}

/// POSTs a chat completion with the team's key to `gateway`.
pub async fn chat_on(h: &Harness, gateway: &Running, body: &serde_json::Value) -> Answer {
    chat_as(h, gateway, KEY, body).await
}

/// POSTs a chat completion with `key` to `gateway`.
pub async fn chat_as(
    h: &Harness,
    gateway: &Running,
    key: &str,
    body: &serde_json::Value,
) -> Answer {
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

pub async fn admin_get_on(h: &Harness, gateway: &Running, path: &str) -> Answer {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let url = format!("http://{}{path}", gateway.admin_addr());
    h.send(Method::GET, url, &[("authorization", &auth)], Bytes::new())
        .await
}

pub async fn get_on(h: &Harness, gateway: &Running, path: &str) -> Answer {
    let url = format!("http://{}{path}", gateway.addr());
    h.send(Method::GET, url, &[], Bytes::new()).await
}

/// Sends `count` copies of `body`, alternating between `gateways`, `concurrency` at a time;
/// the answers in the order they were sent.
pub async fn spread(
    h: &Arc<Harness>,
    gateways: &[Arc<Running>],
    body: serde_json::Value,
    count: usize,
    concurrency: usize,
) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(count);
    let mut next = 0;
    while next < count {
        let batch: Vec<_> = (next..count.min(next + concurrency))
            .map(|i| {
                let (h, gateway, body) = (
                    h.clone(),
                    gateways[i % gateways.len()].clone(),
                    body.clone(),
                );
                tokio::spawn(async move { chat_on(&h, &gateway, &body).await })
            })
            .collect();
        for task in batch {
            answers.push(task.await.unwrap());
        }
        next += concurrency;
    }
    answers
}

/// How many answers have each status.
pub fn tally(answers: &[Answer]) -> (usize, usize, usize) {
    let ok = answers.iter().filter(|a| a.status == 200).count();
    let limited = answers.iter().filter(|a| a.status == 429).count();
    (ok, limited, answers.len() - ok - limited)
}

/// Polls `check` every 20 ms for up to `within`.
pub async fn until<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < end {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    check().await
}
