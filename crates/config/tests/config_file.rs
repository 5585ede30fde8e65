//! Whole config files through the public API: the CONTRACT.md example compiles, and a file with
//! several mistakes yields exactly one located problem per mistake.
#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "test helpers outside #[test] functions fail loudly too"
)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use onedoor_config::{parse, summary, FailureKind, FailureThreshold, Problem, Provider, Snapshot};

/// CONTRACT.md section 2, copied verbatim.
const CONTRACT_EXAMPLE: &str = include_str!("contract-example.yaml");

const ADMIN_TOKEN: &str = "admin-token-9f8e7d";
const SE_KEY: &str = "se-key-1a2b3c";
const FR_KEY: &str = "fr-key-from-a-file";
const ANTHROPIC_KEY: &str = "sk-ant-4d5e6f";

fn env(name: &str) -> Option<String> {
    match name {
        "ONEDOOR_ADMIN_TOKEN" => Some(ADMIN_TOKEN.to_owned()),
        "AOAI_SUB1_SE_KEY" => Some(SE_KEY.to_owned()),
        "ANTHROPIC_KEY" => Some(ANTHROPIC_KEY.to_owned()),
        _ => None,
    }
}

/// A new file under the temp dir, unique to this call; the caller removes it.
fn temp_file(name: &str, contents: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path =
        std::env::temp_dir().join(format!("onedoor-config-{}-{n}-{name}", std::process::id()));
    std::fs::write(&path, contents).unwrap();
    path
}

/// The contract example made valid (the `file:` secret points at a real file, the
/// `targets: [ ... ]` placeholder becomes a real target), compiled.
fn compile_contract() -> Snapshot {
    let secret = temp_file("aoai-sub1-fr", &format!("  {FR_KEY}\n\n"));
    let text = CONTRACT_EXAMPLE
        .replace(
            "file:/run/secrets/aoai-sub1-fr",
            &format!("file:{}", secret.display()),
        )
        .replace(
            "targets: [ ... ]",
            "targets: [{ backend: sub1-swedencentral-ptu, deployment: gpt-4o-assistants }]",
        );
    let snapshot = compile(&text);
    std::fs::remove_file(secret).unwrap();
    snapshot
}

fn compile(text: &str) -> Snapshot {
    match parse(text, Path::new("onedoor.yaml"), &env) {
        Ok(snapshot) => snapshot,
        Err(problems) => panic!("unexpected problems: {problems:#?}"),
    }
}

fn problems(text: &str) -> Vec<String> {
    match parse(text, Path::new("onedoor.yaml"), &env) {
        Ok(_) => panic!("expected problems"),
        Err(problems) => problems.iter().map(Problem::to_string).collect(),
    }
}

#[test]
fn the_contract_example_compiles() {
    let s = compile_contract();

    assert_eq!(s.listen, "0.0.0.0:8080".parse().unwrap());
    assert_eq!(s.max_request_body, 32 * 1024 * 1024);
    assert_eq!(s.admin.listen, "127.0.0.1:9090".parse().unwrap());
    assert_eq!(s.admin.token.as_ref().unwrap().expose(), ADMIN_TOKEN);
    assert_eq!(
        s.state.redis_url.as_deref(),
        Some("redis://127.0.0.1:6379/0")
    );
    assert_eq!(s.usage.store, "sqlite://onedoor-usage.db");
    assert_eq!(s.routing.not_served_ttl, Duration::from_secs(3600));

    let names: Vec<&str> = s.backends.iter().map(|b| &*b.name).collect();
    assert_eq!(
        names,
        [
            "sub1-swedencentral-ptu",
            "sub1-francecentral",
            "anthropic-eu",
            "vllm-onprem"
        ]
    );
    let se = &s.backends[s.backend_by_name["sub1-swedencentral-ptu"]];
    assert_eq!(se.provider, Provider::Azure);
    assert_eq!(se.api_key.as_ref().unwrap().expose(), SE_KEY);
    assert_eq!(se.limits.tpm, Some(450_000));
    assert_eq!(se.circuit_breaker.as_deref(), Some("default"));
    assert_eq!(se.timeouts.first_token, Duration::from_secs(20));
    assert_eq!(se.timeouts.total, Duration::from_secs(600));
    let fr = &s.backends[s.backend_by_name["sub1-francecentral"]];
    assert_eq!(
        fr.api_key.as_ref().unwrap().expose(),
        FR_KEY,
        "file: secrets are trimmed"
    );
    let vllm = &s.backends[s.backend_by_name["vllm-onprem"]];
    assert_eq!(vllm.url, "http://10.0.0.12:8000/v1");
    assert_eq!(
        vllm.health_check.as_ref().unwrap().interval,
        Duration::from_secs(10)
    );
    assert_eq!(s.backends[2].anthropic_version, "2023-06-01");

    let rules = &s.circuit_breakers["default"].rules;
    assert_eq!(rules.len(), 3);
    assert!(matches!(rules[0].threshold, FailureThreshold::Count(3)));
    assert_eq!(
        rules[0].status,
        [
            FailureKind::Status { from: 500, to: 599 },
            FailureKind::ConnectError,
            FailureKind::Timeout
        ]
    );
    assert!(matches!(
        rules[1].threshold,
        FailureThreshold::Percent { percent, min_requests: 20 } if percent == 50.0
    ));
    assert!(rules[2].accept_retry_after);
    assert_eq!(
        rules[2].status,
        [FailureKind::Status { from: 429, to: 429 }]
    );

    let aliases: Vec<&str> = s.aliases.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(aliases, ["chat-default", "embed-default", "assistants"]);
    let chat = &s.aliases[s.alias_by_name["chat-default"]];
    assert!(chat.continue_cut_streams);
    assert_eq!(chat.targets.len(), 3);
    assert_eq!(chat.targets[1].weight, 3);
    assert_eq!(
        chat.targets[2].deployment.as_deref(),
        Some("claude-sonnet-4-5")
    );
    assert!(chat.targets[2].accepts_prefill);
    assert_eq!(chat.price.unwrap().output_per_1m, 10.0);
    assert_eq!(chat.targets[0].price.unwrap().input_per_1m, 0.0);
    assert!(s.aliases[s.alias_by_name["assistants"]].session_affinity);

    let wildcard = s.wildcard.as_ref().unwrap();
    assert!(!s.alias_by_name.contains_key("*"));
    let backends: Vec<usize> = wildcard.targets.iter().map(|t| t.backend).collect();
    assert_eq!(
        backends,
        [
            s.backend_by_name["sub1-swedencentral-ptu"],
            s.backend_by_name["sub1-francecentral"]
        ]
    );
    assert!(wildcard
        .targets
        .iter()
        .all(|t| t.deployment.is_none() && t.priority == 1));

    let legal = &s.tenants[0];
    assert_eq!(
        legal.regions.as_deref().unwrap(),
        ["francecentral", "swedencentral", "norwayeast", "westeurope"]
    );
    assert!(legal.may_reach("swedencentral") && !legal.may_reach("europe"));
    assert!(legal.may_use("embed-default") && !legal.may_use("assistants"));
    assert_eq!(legal.limits.usd_per_month, Some(500.0));
    assert_eq!(legal.keys[0].trace_until, Some(1_796_119_200));
    let digest: [u8; 32] =
        hex::decode("5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8")
            .unwrap()
            .try_into()
            .unwrap();
    assert_eq!(s.keys_by_hash[&digest], (0, 0));
}

#[test]
fn secrets_never_appear_in_debug_output_or_the_summary() {
    let s = compile_contract();
    for shown in [format!("{s:?}"), format!("{s:#?}"), summary(&s)] {
        for secret in [ADMIN_TOKEN, SE_KEY, FR_KEY, ANTHROPIC_KEY] {
            assert!(!shown.contains(secret), "{secret} leaked into {shown}");
        }
    }
}

#[test]
fn the_summary_names_backends_aliases_and_tenants() {
    let text = summary(&compile_contract());
    for expected in [
        "4 backends",
        "sub1-swedencentral-ptu (azure, swedencentral)",
        "anthropic-eu (anthropic, europe)",
        "3 aliases: chat-default, embed-default, assistants",
        "\"*\"",
        "1 tenant: legal-chatbot (1 key)",
    ] {
        assert!(text.contains(expected), "{expected:?} missing from {text}");
    }
}

#[test]
fn each_mistake_is_one_problem_at_its_place() {
    let text = "\
listen: 0.0.0.0:8080
admni:
  listen: 127.0.0.1:9090
routing:
  max_attempts: many
  max_retry_wait: soon
backends:
  - name: a
    provider: azure
    url: https://a.example.com
    region: westeurope
    api_key: ${MISSING_KEY}
  - name: a
    provider: openai
    url: https://b.example.com
    region: eastus
models:
  - name: chat
    targets:
      - { backend: b, deployment: gpt-4o }
";
    assert_eq!(
        problems(text),
        [
            "onedoor.yaml:2:1: unknown key \"admni\" (expected one of: listen, max_request_body, \
             max_connections, client_timeouts, admin, state, usage, routing, realtime, regions, identities, backends, circuit_breakers, models, client_auth, tenants, telemetry, shutdown, batch)",
            "onedoor.yaml:5:17: expected an integer, found \"many\"",
            "onedoor.yaml:6:19: expected a duration like \"30s\", found \"soon\"",
            "onedoor.yaml:12:14: environment variable MISSING_KEY is not set",
            "onedoor.yaml:13:11: duplicate backend name \"a\" (first defined at 8:11)",
            "onedoor.yaml:20:20: unknown backend \"b\" (known: a)",
        ]
    );
}

#[test]
fn secrets_never_appear_in_problems() {
    let text = "\
admin:
  token:
    - ${ONEDOOR_ADMIN_TOKEN}
routing:
  max_attempts: ${AOAI_SUB1_SE_KEY}
backends:
  - name: a
    provider: azure
    url: ftp://user:${ANTHROPIC_KEY}@host
    region: r
    api_key: { value: sk-literal-in-file }
    anthropic_version: ${ANTHROPIC_KEY}
";
    let problems = problems(text);
    assert_eq!(problems.len(), 5, "{problems:#?}");
    for problem in &problems {
        for secret in [ADMIN_TOKEN, SE_KEY, ANTHROPIC_KEY, "sk-literal-in-file"] {
            assert!(!problem.contains(secret), "{secret} leaked into {problem}");
        }
    }
    assert!(problems[1]
        .ends_with("expected an integer, found \"${AOAI_SUB1_SE_KEY}\" (its value is not shown)"));
}

#[test]
fn load_reads_a_file_and_locates_its_problems() {
    let path = temp_file("load.yaml", "listen: nowhere\n");
    let problems = onedoor_config::load(&path).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(problems.len(), 1);
    assert_eq!(problems[0].file, path.display().to_string());
    assert_eq!((problems[0].line, problems[0].col), (1, 9));

    let missing = onedoor_config::load(Path::new("/no/such/onedoor.yaml")).unwrap_err();
    assert_eq!(missing.len(), 1);
    assert!(missing[0]
        .message
        .starts_with("cannot read the config file"));
}
