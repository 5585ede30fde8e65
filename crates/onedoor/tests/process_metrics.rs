//! The standard `process_*` metrics of a real `onedoor serve`, scraped from its admin port and
//! held against what the kernel says about that process: CPU time, resident memory, open and
//! allowed file descriptors (which follow the connections clients hold), start time.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};
use tokio::net::TcpStream;

mod common;
use common::{free_addr, http, Gateway};

const ADMIN_TOKEN: &str = "process-metrics-admin-token";

fn config(admin: std::net::SocketAddr) -> String {
    format!(
        "listen: {}\nadmin: {{ listen: \"{admin}\", token: {ADMIN_TOKEN} }}\nbackends:\n  - {{ name: se, provider: azure, region: swedencentral, url: \"http://127.0.0.1:9\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: se, deployment: gpt-4o }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        hex::encode(Sha256::digest(b"process-metrics-client-key"))
    )
}

/// The `process_*` samples of one scrape, by name.
async fn scrape(admin: std::net::SocketAddr) -> Vec<(String, f64)> {
    let request = format!("GET /metrics HTTP/1.0\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\n\r\n");
    let (status, body) = http(admin, request).await.unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.ends_with("# EOF\n"), "{body}");
    assert_eq!(body.matches("# EOF").count(), 1, "{body}");
    assert!(
        body.contains("\nonedoor_not_served_entries "),
        "the gateway's own metrics: {body}"
    );
    body.lines()
        .filter(|l| l.starts_with("process_"))
        .map(|l| {
            let (name, value) = l.split_once(' ').unwrap();
            (name.to_owned(), value.parse().unwrap())
        })
        .collect()
}

fn sample(samples: &[(String, f64)], name: &str) -> f64 {
    samples
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no {name} in {samples:?}"))
        .1
}

/// The gateway's open descriptors once the count holds still between two scrapes: the
/// connections its start was checked over close as its lanes get to them, which on a loaded
/// machine can be after the first scrape.
async fn settled_open_fds(admin: std::net::SocketAddr) -> f64 {
    let mut last = sample(&scrape(admin).await, "process_open_fds");
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = sample(&scrape(admin).await, "process_open_fds");
        if now == last {
            break;
        }
        last = now;
    }
    last
}

fn proc_file(pid: u32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/{name}")).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn process_metrics_say_what_the_kernel_says_about_the_gateway() {
    let dir = common::temp_dir("process-metrics", "scrape");
    let path = dir.join("onedoor.yaml");
    let admin = free_addr();
    std::fs::write(&path, config(admin)).unwrap();
    let launched = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let gateway = Gateway::start(&path, "scrape").await;
    let pid = gateway.pid();

    let cpu_before = gateway.cpu_ticks() as f64 / 100.0;
    let first = scrape(admin).await;
    let cpu_after = gateway.cpu_ticks() as f64 / 100.0;
    let cpu = sample(&first, "process_cpu_seconds_total");
    assert!(
        cpu >= cpu_before && cpu <= cpu_after,
        "{cpu_before} <= {cpu} <= {cpu_after}"
    );

    let started = sample(&first, "process_start_time_seconds");
    assert!(
        (started - launched).abs() < 2.0,
        "started {started}, launched {launched}"
    );

    let status = proc_file(pid, "status");
    let rss_kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap();
    let resident = sample(&first, "process_resident_memory_bytes");
    assert!(
        (resident / 1024.0 - rss_kb).abs() < rss_kb / 4.0,
        "{resident} bytes resident against VmRSS {rss_kb} kB"
    );

    let limits = proc_file(pid, "limits");
    let soft: Option<f64> = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max open files"))
        .and_then(|l| l.split_whitespace().next()?.parse().ok());
    let max = first
        .iter()
        .find(|(n, _)| n == "process_max_fds")
        .map(|s| s.1);
    assert_eq!(max, soft, "the soft limit, absent when unlimited");

    let open = settled_open_fds(admin).await;
    let mut held = Vec::new();
    for _ in 0..40 {
        held.push(TcpStream::connect(gateway.addr).await.unwrap());
    }
    // Each connection is counted once the gateway has accepted it; on a loaded machine the
    // last ones may take longer than a fixed pause, so the count is looked at until it is there.
    let mut holding = open;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        holding = sample(&scrape(admin).await, "process_open_fds");
        if holding >= open + 40.0 {
            break;
        }
    }
    assert!(
        holding >= open + 40.0,
        "{open} open, then {holding} with 40 connections held"
    );
    drop(held);
    let mut closed = holding;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        closed = sample(&scrape(admin).await, "process_open_fds");
        if closed < open + 10.0 {
            break;
        }
    }
    assert!(
        closed < open + 10.0,
        "{open} open, {closed} after the 40 closed"
    );
}
