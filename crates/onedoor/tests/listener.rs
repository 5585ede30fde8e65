//! What the real `onedoor serve` asks of the kernel for its client port: a listen backlog deep
//! enough for a burst of new connections, and as many open descriptors as the hard limit allows.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::Command;

use sha2::{Digest, Sha256};

mod common;
use common::{free_addr, Gateway};

fn config() -> String {
    format!(
        "listen: {}\nadmin: {{ listen: \"{}\", token: listener-admin-token }}\nbackends:\n  - {{ name: se, provider: azure, region: swedencentral, url: \"http://127.0.0.1:9\" }}\nmodels:\n  - name: chat\n    targets:\n      - {{ backend: se, deployment: gpt-4o }}\ntenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        free_addr(),
        free_addr(),
        hex::encode(Sha256::digest(b"listener-client-key"))
    )
}

/// The backlog of the socket listening on `port`: `ss -ltn` shows it as a LISTEN socket's
/// Send-Q.
fn backlog(port: u16) -> u32 {
    let output = Command::new("ss").arg("-ltn").output().unwrap();
    assert!(output.status.success(), "ss -ltn failed");
    let table = String::from_utf8_lossy(&output.stdout).into_owned();
    table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|f| f.len() >= 4 && f[0] == "LISTEN" && f[3].ends_with(&format!(":{port}")))
        .unwrap_or_else(|| panic!("nothing listens on {port}:\n{table}"))[2]
        .parse()
        .unwrap()
}

/// The soft and hard open-files limits of process `pid`.
fn open_files_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_else(|| panic!("no open-files limit in\n{limits}"));
    let fields: Vec<&str> = line
        .trim_start_matches("Max open files")
        .split_whitespace()
        .collect();
    (fields[0].to_owned(), fields[1].to_owned())
}

#[tokio::test]
async fn the_client_port_listens_with_a_backlog_of_at_least_1024() {
    let dir = common::temp_dir("listener", "backlog");
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, config()).unwrap();
    let gateway = Gateway::start(&path, "backlog").await;
    let depth = backlog(gateway.addr.port());
    assert!(depth >= 1024, "the client port's backlog is {depth}");
}

#[tokio::test]
async fn the_soft_descriptor_limit_is_raised_to_the_hard_one_at_start_and_the_log_says_so() {
    let dir = common::temp_dir("listener", "nofile");
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, config()).unwrap();
    let gateway = Gateway::start_after(&path, "nofile", "ulimit -Sn 256").await;
    let (soft, hard) = open_files_limits(gateway.pid());
    assert_ne!(hard, "256", "the shell lowered the hard limit too");
    assert_eq!(soft, hard, "the soft open-files limit was left at {soft}");
    let log = gateway.log();
    assert!(
        log.lines().any(|l| l.contains(&hard)
            && ["descriptor", "open files", "nofile"]
                .iter()
                .any(|w| l.to_lowercase().contains(w))),
        "no log line tells the raised limit {hard}:\n{log}"
    );
}
