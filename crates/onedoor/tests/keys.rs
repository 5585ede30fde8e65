//! `onedoor keys` against a real `onedoor serve`: a pipeline creates a runtime key, uses it,
//! rotates, disables and lists it, and reads the audit, all without curl; bad input exits 1
//! with the gateway's own message.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Output};

use onedoor_mock::{DeploymentSpec, EndpointSpec, Fleet};
use serde_json::Value;

mod common;
use common::{free_addr, http, temp_dir, Gateway};

const TOKEN: &str = "cli-admin-token";

fn write_config(dir: &Path, url: &str, admin: SocketAddr) -> std::path::PathBuf {
    let path = dir.join("onedoor.yaml");
    let text = format!(
        "listen: {}\nadmin: {{ listen: \"{admin}\", token: {TOKEN} }}\nusage: {{ store: \"sqlite://{}/usage.db\" }}\nbackends:\n  - {{ name: up, provider: azure, region: swedencentral, url: \"{url}\" }}\nmodels:\n  - {{ name: chat, targets: [{{ backend: up, deployment: gpt-4o }}] }}\ntenants:\n  - name: team\n    limits: {{ rpm: 100 }}\n",
        free_addr(),
        dir.display(),
    );
    std::fs::write(&path, text).unwrap();
    path
}

fn keys(admin: SocketAddr, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_onedoor"))
        .arg("keys")
        .args(args)
        .args(["--admin-url", &format!("http://{admin}")])
        .env("ONEDOOR_ADMIN_TOKEN", TOKEN)
        .output()
        .unwrap()
}

fn json_of(output: &Output) -> Value {
    assert_eq!(
        output.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap()
}

async fn chat(addr: SocketAddr, key: &str) -> u16 {
    let body = r#"{"model":"chat","messages":[{"role":"user","content":"Hi"}]}"#;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nauthorization: Bearer {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    http(addr, request).await.unwrap().0
}

#[tokio::test]
async fn a_pipeline_creates_uses_rotates_and_disables_a_key_with_the_cli() {
    let fleet = Fleet::start(vec![
        EndpointSpec::azure("up", "swedencentral").deployment(DeploymentSpec::new("gpt-4o"))
    ])
    .await
    .unwrap();
    let dir = temp_dir("keys", "cli");
    let admin = free_addr();
    let config = write_config(&dir, &fleet.endpoint("up").unwrap().url(), admin);
    let gateway = Gateway::start(&config, "cli").await;

    let made = json_of(&keys(
        admin,
        &["create", "--tenant", "team", "--name", "etl", "--rpm", "10"],
    ));
    let id = made["id"].as_str().unwrap().to_owned();
    let secret = made["key"].as_str().unwrap().to_owned();
    assert_eq!(made["limits"]["rpm"], 10);
    assert_eq!(chat(gateway.addr, &secret).await, 200);

    let rotated = json_of(&keys(admin, &["rotate", &id, "--grace", "10m"]));
    let fresh = rotated["key"].as_str().unwrap().to_owned();
    assert_eq!(
        chat(gateway.addr, &secret).await,
        200,
        "the old secret works in its grace"
    );
    assert_eq!(chat(gateway.addr, &fresh).await, 200);

    let changed = json_of(&keys(admin, &["update", &id, "--tpm", "5000", "--disable"]));
    assert_eq!(changed["state"], "disabled");
    assert_eq!(
        changed["limits"],
        serde_json::json!({"rpm": 10, "tpm": 5000})
    );
    assert_eq!(chat(gateway.addr, &fresh).await, 401);

    let listed = keys(admin, &["list"]);
    let text = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert_eq!(json_of(&listed)["keys"][0]["id"], id.as_str());
    assert!(!text.contains(&secret) && !text.contains(&fresh));

    let audit = json_of(&keys(admin, &["audit"]));
    let actions: Vec<&str> = audit["audit"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["update", "rotate", "create"]);
    assert!(audit["audit"][0]["actor"]
        .as_str()
        .unwrap()
        .starts_with("admin.token (onedoor keys"));

    // Bad input: exit 1 with the gateway's message.
    let refused = keys(admin, &["create", "--tenant", "nobody"]);
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
    assert!(
        stderr.contains("unknown tenant `nobody` (known: team)"),
        "{stderr}"
    );
    let looser = keys(admin, &["create", "--tenant", "team", "--rpm", "1000"]);
    assert_eq!(looser.status.code(), Some(1));
    // Without the token in the environment: exit 1, saying where it comes from.
    let tokenless = Command::new(env!("CARGO_BIN_EXE_onedoor"))
        .args(["keys", "list", "--admin-url", &format!("http://{admin}")])
        .env_remove("ONEDOOR_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert_eq!(tokenless.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&tokenless.stderr).contains("ONEDOOR_ADMIN_TOKEN"));

    let deleted = json_of(&keys(admin, &["delete", &id]));
    assert_eq!(deleted["deleted"], true);
    assert_eq!(gateway.terminate().await.code(), Some(0));
    fleet.shutdown().await;
}
