//! The command line as a user runs it: `validate` on good and bad configs, `keys new`.

#![allow(clippy::unwrap_used)]

use std::process::Command;

fn onedoor() -> Command {
    Command::new(env!("CARGO_BIN_EXE_onedoor"))
}

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("onedoor-cli-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

const FIVE_MISTAKES: &str = r#"listen: 127.0.0.1:8080
routing:
  max_atempts: 4
  not_served_ttl: soon
backends:
  - { name: se, provider: azure, region: swedencentral, url: "https://se.example", api_key: "${NO_SUCH_SECRET_VAR}" }
  - { name: se, provider: azure, region: swedencentral, url: "https://se2.example" }
models:
  - name: chat
    targets:
      - { backend: fr, deployment: gpt-4o, weight: many }
"#;

#[test]
fn validate_prints_each_of_five_mistakes_at_its_location() {
    let path = temp_file("five", FIVE_MISTAKES);
    let output = onedoor()
        .args(["validate", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let file = path.display().to_string();
    let expected = [
        (3, "max_atempts"),
        (4, "duration"),
        (6, "NO_SUCH_SECRET_VAR"),
        (7, "duplicate backend name"),
        (11, "unknown backend \"fr\""),
        (11, "expected an integer, found \"many\""),
    ];
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, (number, words)) in lines.iter().zip(expected) {
        assert!(line.starts_with(&format!("{file}:{number}:")), "{line}");
        assert!(line.contains(words), "{line} lacks {words}");
    }
}

const BAD_BREAKER: &str = r#"circuit_breakers:
  default:
    rules:
      - name: errors
        failures: { count: 3, within: 30s, status: [5xx] }
        trip: 30s
        scope: endpoint
        backoff: { factor: 0, max: 5s }
backends:
  - { name: se, provider: azure, region: swedencentral, url: "https://se.example", circuit_breaker: default }
models:
  - { name: chat, targets: [{ backend: se, deployment: gpt-4o }] }
"#;

#[test]
fn validate_locates_a_breaker_rules_bad_scope_and_backoff() {
    let path = temp_file("breaker", BAD_BREAKER);
    let output = onedoor()
        .args(["validate", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = stdout.lines().collect();
    let file = path.display().to_string();
    let expected = [
        (7, "expected one of target, backend, found \"endpoint\""),
        (8, "a backoff factor must be at least 1"),
        (
            8,
            "the backoff max (5s) is shorter than the rule's trip (30s)",
        ),
    ];
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, (number, words)) in lines.iter().zip(expected) {
        assert!(line.starts_with(&format!("{file}:{number}:")), "{line}");
        assert!(line.contains(words), "{line} lacks {words}");
    }
}

const JWT_MISTAKES: &str = r#"client_auth:
  jwt:
    - { issuer: login.microsoftonline.com/t/v2.0, audience: api://onedoor }
    - { issuer: "http://idp.internal.example/", audience: api://onedoor }
tenants:
  - name: legal
    principals:
      - { id: app, claim: "roles[0]", equals: Ops }
      - { id: app, claim: azp, equals: "0000-1" }
"#;

#[test]
fn validate_locates_jwt_issuer_and_principal_mistakes() {
    let path = temp_file("jwt", JWT_MISTAKES);
    let output = onedoor()
        .args(["validate", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let file = path.display().to_string();
    let expected = [
        "3:17: issuer must be a URL starting with https://",
        "4:17: issuer \"http://idp.internal.example/\" is plain http on a host that is not loopback",
        "8:27: unknown claim form \"roles[0]\"",
        "9:15: duplicate key id \"app\"",
    ];
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, words) in lines.iter().zip(expected) {
        assert!(
            line.starts_with(&format!("{file}:{words}")),
            "{line} is not at {words}"
        );
    }
}

#[test]
fn validate_summarises_a_good_config_without_its_secrets() {
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/onedoor.yaml");
    let output = onedoor()
        .args(["validate", "--config", example])
        .env("ONEDOOR_ADMIN_TOKEN", "admin-secret-value")
        .env("AOAI_SUB1_SE_KEY", "se-secret-value")
        .env("AOAI_SUB1_FR_KEY", "fr-secret-value")
        .env("AOAI_SUB2_US_KEY", "us-secret-value")
        .env("OTLP_TOKEN", "otlp-secret-value")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(
        output.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("sub1-swedencentral-ptu"), "{stdout}");
    assert!(!stdout.contains("secret-value"), "{stdout}");
}

const IDENTITY_MISTAKES: &str = r#"identities:
  gateway: { kind: managed_identity }
  ci: { kind: certificate }
  sp: { kind: client_secret, tenant_id: t, client_id: c, client_secret: "sp-secret-value", authority: "http://login.example.com" }
backends:
  - { name: a, provider: azure, region: se, url: "https://a.example", identity: nobody }
  - { name: b, provider: azure, region: se, url: "https://b.example", api_key: "b-secret-value", identity: gateway }
"#;

#[test]
fn validate_locates_identity_mistakes_without_quoting_secrets() {
    let path = temp_file("identities", IDENTITY_MISTAKES);
    let output = onedoor()
        .args(["validate", "--config"])
        .arg(&path)
        .env_remove("AZURE_AUTHORITY_HOST")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let file = path.display().to_string();
    let expected = [
        format!("{file}:3:15: expected one of managed_identity, workload_identity, client_secret"),
        format!("{file}:4:103: the authority must be an https URL"),
        format!("{file}:6:81: unknown identity \"nobody\" (known: gateway)"),
        format!("{file}:7:98: a backend has api_key or identity, not both"),
    ];
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), expected.len(), "{stdout}");
    for (line, expected) in lines.iter().zip(&expected) {
        assert!(
            line.starts_with(expected.as_str()),
            "{line}\nexpected {expected}"
        );
    }
    assert!(!stdout.contains("secret-value"), "{stdout}");
}

const BAD_REDIS_URL: &str = r#"state:
  store: redis
  redis_url: "redis+sentinel://:hunter2@10.0.0.5:26379,10.0.0.6"
  on_store_error: fail_closed
backends:
  - { name: se, provider: azure, region: swedencentral, url: "https://se.example" }
models:
  - { name: chat, targets: [{ backend: se, deployment: gpt-4o }] }
"#;

#[test]
fn validate_locates_a_malformed_redis_url_without_quoting_its_password() {
    let path = temp_file("redis-url", BAD_REDIS_URL);
    let output = onedoor()
        .args(["validate", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let expected = format!(
        "{}:3:14: a redis+sentinel:// URL names the master after the sentinels",
        path.display()
    );
    assert!(stdout.starts_with(&expected), "{stdout}");
    assert!(!stdout.contains("hunter2"), "{stdout}");
}

#[test]
fn keys_new_prints_a_key_and_its_sha256() {
    let output = onedoor().args(["keys", "new"]).output().unwrap();
    assert!(output.status.success());
    let stdout = String::from_utf8_lossy(&output.stdout);
    let key = stdout
        .lines()
        .next()
        .unwrap()
        .trim_start_matches("key:")
        .trim();
    assert!(key.starts_with("od-") && key.len() == 43, "{stdout}");
    assert!(stdout.contains("sha256: "), "{stdout}");
}
