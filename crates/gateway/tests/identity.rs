//! Backends reached with the gateway's own Entra ID identity, through real HTTP against the
//! simulated Entra ID and Azure endpoints that take only its tokens: each kind of identity (the
//! instance metadata service, App Service, AKS workload identity, a client secret), one token
//! request however many requests wait at a cold start, refresh ahead of expiry under load, a
//! refused token replaced once, an identity endpoint outage failed over or answered 503
//! `upstream_auth_unavailable`, Claude on Azure AI Foundry and Azure's v1 API.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use common::*;
use onedoor_mock::{IdentityBehavior, IdentityServer, IdentitySpec};

const COGNITIVE: &str = "https://cognitiveservices.azure.com";
const FOUNDRY: &str = "https://ai.azure.com";
const AZURE_KEY: &str = "azure-key-0123456789";
const SECRET: &str = "client-secret-0123456789";

/// An Azure endpoint that takes only tokens (key authentication off).
fn entra_azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .entra(COGNITIVE)
}

fn keyed_azure(name: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "francecentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .api_key(AZURE_KEY)
}

async fn fleet(identity: IdentitySpec, specs: Vec<EndpointSpec>) -> Fleet {
    let identity = IdentityServer::start(identity).await.unwrap();
    Fleet::start(specs).await.unwrap().with_identity(identity)
}

fn identity(h: &Harness) -> &IdentityServer {
    h.fleet.identity().unwrap()
}

/// A gateway whose backend `az` is reached by identity `gw` (written by `identity_yaml`), with
/// `chat` on it and `chat-fallback` falling back to `keyed` when the fleet has it.
async fn gateway(
    fleet: Fleet,
    identity_yaml: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Harness {
    let has_keyed = fleet.endpoint("keyed").is_some();
    let mut config = format!(
        "identities:\n  gw: {identity_yaml}\nbackends:\n  - {{ name: az, provider: azure, region: swedencentral, url: \"{{url:az}}\", identity: gw }}\n"
    );
    if has_keyed {
        config.push_str(&format!("  - {{ name: keyed, provider: azure, region: francecentral, url: \"{{url:keyed}}\", api_key: {AZURE_KEY} }}\n"));
    }
    config
        .push_str("models:\n  - name: chat\n    targets: [{ backend: az, deployment: gpt-4o }]\n");
    if has_keyed {
        config.push_str("  - name: chat-fallback\n    targets:\n      - { backend: az, deployment: gpt-4o, priority: 1 }\n      - { backend: keyed, deployment: gpt-4o, priority: 2 }\n");
    }
    Harness::start_with(fleet, &config, env).await
}

async fn imds_gateway(identity_spec: IdentitySpec, specs: Vec<EndpointSpec>) -> Harness {
    let fleet = fleet(identity_spec, specs).await;
    let url = fleet.identity().unwrap().imds_url();
    let yaml = format!("{{ kind: managed_identity, endpoint: \"{url}\" }}");
    gateway(fleet, &yaml, &|_| None).await
}

async fn served(h: &Harness, model: &str) {
    let answer = h.chat(model).await;
    assert_eq!(answer.status, 200, "{} {}", answer.body, answer.attempts());
}

#[tokio::test]
async fn a_managed_identity_asks_the_instance_metadata_service_once() {
    let h = imds_gateway(IdentitySpec::default(), vec![entra_azure("az")]).await;
    for _ in 0..3 {
        served(&h, "chat").await;
    }
    assert_eq!(identity(&h).token_requests_by("imds"), 1);
    assert_eq!(h.endpoint("az").requests("gpt-4o"), 3);
}

#[tokio::test]
async fn a_managed_identity_on_app_service_follows_identity_endpoint_and_header() {
    let fleet = fleet(IdentitySpec::default(), vec![entra_azure("az")]).await;
    let url = fleet.identity().unwrap().app_service_url();
    let header = fleet.identity().unwrap().identity_header().to_owned();
    let env = move |name: &str| match name {
        "IDENTITY_ENDPOINT" => Some(url.clone()),
        "IDENTITY_HEADER" => Some(header.clone()),
        _ => None,
    };
    let h = gateway(
        fleet,
        "{ kind: managed_identity, client_id: user-assigned-1 }",
        &env,
    )
    .await;
    served(&h, "chat").await;
    assert_eq!(identity(&h).token_requests_by("app_service"), 1);
}

#[tokio::test]
async fn workload_identity_rereads_the_federated_token_file_at_every_refresh() {
    let fleet = fleet(
        IdentitySpec::default().lifetime_s(2),
        vec![entra_azure("az")],
    )
    .await;
    let file = temp_config_path().with_file_name("azure-identity-token");
    std::fs::write(&file, "federated-assertion-1\n").unwrap();
    let authority = fleet.identity().unwrap().authority();
    let path = file.display().to_string();
    let env = move |name: &str| match name {
        "AZURE_AUTHORITY_HOST" => Some(authority.clone()),
        "AZURE_TENANT_ID" => Some("tenant-1".to_owned()),
        "AZURE_CLIENT_ID" => Some("client-1".to_owned()),
        "AZURE_FEDERATED_TOKEN_FILE" => Some(path.clone()),
        _ => None,
    };
    let h = gateway(fleet, "{ kind: workload_identity }", &env).await;
    served(&h, "chat").await;
    assert_eq!(
        identity(&h).last_assertion().as_deref(),
        Some("federated-assertion-1")
    );
    // The kubelet rotates the file; the next refresh (ahead of the 2 s token's expiry) sends it.
    std::fs::write(&file, "federated-assertion-2\n").unwrap();
    assert!(
        eventually(|| identity(&h).last_assertion().as_deref() == Some("federated-assertion-2"))
            .await
    );
    served(&h, "chat").await;
    assert!(identity(&h).token_requests_by("client_assertion") >= 2);
}

#[tokio::test]
async fn a_client_secret_is_exchanged_and_a_wrong_one_is_a_503_that_quotes_nothing() {
    let fleet = fleet(
        IdentitySpec::default().client_secret(SECRET),
        vec![entra_azure("az")],
    )
    .await;
    let authority = fleet.identity().unwrap().authority();
    let yaml = format!("{{ kind: client_secret, tenant_id: t1, client_id: c1, client_secret: {SECRET}, authority: \"{authority}\" }}");
    let h = gateway(fleet, &yaml, &|_| None).await;
    served(&h, "chat").await;
    assert_eq!(identity(&h).token_requests_by("client_secret"), 1);

    let fleet = self::fleet(
        IdentitySpec::default().client_secret(SECRET),
        vec![entra_azure("az")],
    )
    .await;
    let authority = fleet.identity().unwrap().authority();
    let yaml = format!("{{ kind: client_secret, tenant_id: t1, client_id: c1, client_secret: wrong-secret-value, authority: \"{authority}\" }}");
    let h = gateway(fleet, &yaml, &|_| None).await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.code(), "upstream_auth_unavailable");
    assert_eq!(answer.attempts(), "az=auth_unavailable");
    assert!(
        !answer.body.contains("wrong-secret-value"),
        "{}",
        answer.body
    );
}

#[tokio::test]
async fn a_thousand_requests_at_a_cold_start_make_one_token_request() {
    let h = imds_gateway(IdentitySpec::default(), vec![entra_azure("az")]).await;
    let h = std::sync::Arc::new(h);
    let mut requests = tokio::task::JoinSet::new();
    for _ in 0..1000 {
        let h = h.clone();
        requests.spawn(async move { h.chat("chat").await.status });
    }
    let mut ok = 0;
    while let Some(status) = requests.join_next().await {
        ok += usize::from(status.unwrap() == 200);
    }
    assert_eq!(ok, 1000);
    assert_eq!(identity(&h).token_requests(), 1);
}

#[tokio::test]
async fn tokens_are_refreshed_before_they_expire_under_load() {
    // Two-second tokens, refreshed half a second ahead: requests for five seconds never find
    // one expired and never wait for one.
    let h = imds_gateway(
        IdentitySpec::default().lifetime_s(2),
        vec![entra_azure("az")],
    )
    .await;
    served(&h, "chat").await;
    let h = std::sync::Arc::new(h);
    let until = tokio::time::Instant::now() + Duration::from_secs(5);
    let mut loops = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let h = h.clone();
        loops.spawn(async move {
            let mut statuses = Vec::new();
            while tokio::time::Instant::now() < until {
                let began = std::time::Instant::now();
                let answer = h.chat("chat").await;
                statuses.push((answer.status.as_u16(), began.elapsed()));
            }
            statuses
        });
    }
    let mut all = Vec::new();
    while let Some(statuses) = loops.join_next().await {
        all.extend(statuses.unwrap());
    }
    assert!(all.len() > 100, "{} requests", all.len());
    assert!(all.iter().all(|(status, _)| *status == 200));
    let token_requests = identity(&h).token_requests();
    assert!(
        (3..=6).contains(&token_requests),
        "{token_requests} token requests for {} requests",
        all.len()
    );
}

#[tokio::test]
async fn a_refused_token_is_replaced_once_and_the_request_sent_again() {
    let h = imds_gateway(IdentitySpec::default(), vec![entra_azure("az")]).await;
    served(&h, "chat").await;
    // The backend stops taking every token issued so far.
    let revoke = format!("{}/_mock/revoke-tokens", h.endpoint("az").url());
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let request = http::Request::post(revoke)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    assert_eq!(client.request(request).await.unwrap().status(), 200);
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "az=200");
    assert_eq!(identity(&h).token_requests(), 2);
    assert_eq!(h.endpoint("az").requests("gpt-4o"), 3);
}

#[tokio::test]
async fn a_second_401_is_the_backends_credential_failure_and_fails_over() {
    let h = imds_gateway(
        IdentitySpec::default(),
        vec![entra_azure("az"), keyed_azure("keyed")],
    )
    .await;
    h.endpoint("az").set_behavior(Behavior {
        status: Some(401),
        ..Behavior::default()
    });
    let answer = h.chat("chat-fallback").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "az=401,keyed=200");
    // The token was replaced once and the request sent once more.
    assert_eq!(h.endpoint("az").total_requests(), 2);
    assert_eq!(identity(&h).token_requests(), 2);
}

#[tokio::test]
async fn a_token_for_the_wrong_audience_is_refused_with_azures_401() {
    let fleet = fleet(IdentitySpec::default(), vec![entra_azure("az")]).await;
    let url = fleet.identity().unwrap().imds_url();
    let config = format!(
        "identities:\n  gw: {{ kind: managed_identity, endpoint: \"{url}\" }}\nbackends:\n  - {{ name: az, provider: azure, region: se, url: \"{{url:az}}\", identity: gw, scope: \"{FOUNDRY}/.default\" }}\nmodels:\n  - name: chat\n    targets: [{{ backend: az, deployment: gpt-4o }}]\n"
    );
    let h = Harness::start_with(fleet, &config, &|_| None).await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 502, "{}", answer.body);
    assert_eq!(answer.code(), "upstream_failed");
    assert_eq!(answer.attempts(), "az=401");
}

#[tokio::test]
async fn an_identity_endpoint_outage_fails_over_to_a_key_and_else_is_a_503() {
    let h = imds_gateway(
        IdentitySpec::default(),
        vec![entra_azure("az"), keyed_azure("keyed")],
    )
    .await;
    identity(&h).set_behavior(IdentityBehavior {
        down: true,
        ..IdentityBehavior::default()
    });
    let answer = h.chat("chat-fallback").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "az=auth_unavailable,keyed=200");
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert_eq!(answer.code(), "upstream_auth_unavailable");
    assert_eq!(
        answer.header("x-onedoor-error"),
        "upstream_auth_unavailable"
    );
    assert_eq!(h.endpoint("az").total_requests(), 0);
}

#[tokio::test]
async fn a_failed_refresh_keeps_the_old_token_while_it_is_valid() {
    let h = imds_gateway(
        IdentitySpec::default().lifetime_s(4),
        vec![entra_azure("az")],
    )
    .await;
    served(&h, "chat").await;
    identity(&h).set_behavior(IdentityBehavior {
        down: true,
        ..IdentityBehavior::default()
    });
    // The refresh (a second ahead of expiry) fails; the token still serves until it expires.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    served(&h, "chat").await;
    identity(&h).set_behavior(IdentityBehavior::default());
    assert!(eventually(|| identity(&h).token_requests() >= 2).await);
    served(&h, "chat").await;
}

#[tokio::test]
async fn claude_on_azure_ai_foundry_takes_a_token_or_a_key_streaming_and_tools_included() {
    let foundry = |name: &str| {
        EndpointSpec::anthropic(name, "swedencentral")
            .deployment(DeploymentSpec::new("claude-sonnet-4-5"))
            .entra(FOUNDRY)
    };
    let fleet = fleet(
        IdentitySpec::default(),
        vec![
            foundry("foundry"),
            foundry("foundry-keyed").api_key(AZURE_KEY),
        ],
    )
    .await;
    let url = fleet.identity().unwrap().imds_url();
    let config = format!(
        "identities:\n  gw: {{ kind: managed_identity, endpoint: \"{url}\" }}
backends:
  - {{ name: foundry, provider: anthropic, region: se, url: \"{{url:foundry}}/anthropic\", identity: gw }}
  - {{ name: foundry-keyed, provider: anthropic, region: se, url: \"{{url:foundry-keyed}}/anthropic\", api_key: {AZURE_KEY} }}
models:
  - name: claude
    targets: [{{ backend: foundry, model: claude-sonnet-4-5 }}]
  - name: claude-keyed
    targets: [{{ backend: foundry-keyed, model: claude-sonnet-4-5 }}]
"
    );
    let h = Harness::start_with(fleet, &config, &|_| None).await;
    served(&h, "claude").await;
    served(&h, "claude-keyed").await;
    let stream = h
        .post("/v1/chat/completions", chat_body("claude", true))
        .await;
    assert_eq!(stream.status, 200, "{}", stream.body);
    assert!(
        stream.body.trim_end().ends_with("data: [DONE]"),
        "{}",
        stream.body
    );
    let tools = serde_json::json!({
        "model": "claude",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
    });
    let answer = h.post("/v1/chat/completions", tools).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    // The token was asked for Azure AI Foundry's scope, the Anthropic default.
    assert_eq!(identity(&h).token_requests(), 1);
    assert_eq!(h.endpoint("foundry").total_requests(), 3);
}

#[tokio::test]
async fn an_azure_v1_backend_names_the_deployment_in_the_body() {
    let fleet = fleet(IdentitySpec::default(), vec![entra_azure("az")]).await;
    let url = fleet.identity().unwrap().imds_url();
    let config = format!(
        "identities:\n  gw: {{ kind: managed_identity, endpoint: \"{url}\" }}\nbackends:\n  - {{ name: az, provider: azure, region: se, url: \"{{url:az}}\", identity: gw, azure_api: v1 }}\nmodels:\n  - name: chat\n    targets: [{{ backend: az, deployment: gpt-4o }}]\n  - name: embed\n    targets: [{{ backend: az, deployment: gpt-4o }}]\n"
    );
    let h = Harness::start_with(fleet, &config, &|_| None).await;
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let stream = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert_eq!(stream.status, 200, "{}", stream.body);
    // Found by the body's `model`: the v1 path names no deployment.
    assert_eq!(h.endpoint("az").requests("gpt-4o"), 2);
}

#[tokio::test]
async fn no_token_or_secret_reaches_a_log_line() {
    let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = Sink(logs.clone());
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || sink.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let fleet = fleet(
        IdentitySpec::default().client_secret(SECRET),
        vec![entra_azure("az"), keyed_azure("keyed")],
    )
    .await;
    let authority = fleet.identity().unwrap().authority();
    let yaml = format!("{{ kind: client_secret, tenant_id: t1, client_id: c1, client_secret: {SECRET}, authority: \"{authority}\" }}");
    let h = gateway(fleet, &yaml, &|_| None).await;
    served(&h, "chat").await;
    // A refused token, a second refusal, and an outage: every path that logs.
    h.endpoint("az").set_behavior(Behavior {
        status: Some(401),
        ..Behavior::default()
    });
    served(&h, "chat-fallback").await;
    identity(&h).set_behavior(IdentityBehavior {
        down: true,
        ..IdentityBehavior::default()
    });
    // Past the two seconds between replacements: the refusal asks the failing endpoint again.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let answer = h.chat("chat-fallback").await;
    assert_eq!(answer.attempts(), "az=401,keyed=200", "{}", answer.body);
    let text = String::from_utf8_lossy(&logs.lock().unwrap()).into_owned();
    assert!(text.contains("token request failed"), "{text}");
    assert!(!text.contains(SECRET), "{text}");
    // Every mock token starts with the base64 of `{"typ"`.
    assert!(!text.contains("eyJ0eXAi"), "{text}");
}

#[derive(Clone)]
struct Sink(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Sink {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn health_checks_carry_the_token_so_the_backend_stays_in_rotation() {
    let spec = EndpointSpec::openai("compat", "onprem")
        .deployment(DeploymentSpec::new("llama"))
        .entra(COGNITIVE);
    let fleet = fleet(IdentitySpec::default(), vec![spec]).await;
    let url = fleet.identity().unwrap().imds_url();
    let config = format!(
        "identities:\n  gw: {{ kind: managed_identity, endpoint: \"{url}\" }}\nbackends:\n  - {{ name: compat, provider: openai, region: onprem, url: \"{{url:compat}}\", identity: gw, health_check: {{ path: /models, interval: 100ms }} }}\nmodels:\n  - name: chat\n    targets: [{{ backend: compat, model: llama }}]\n"
    );
    let h = Harness::start_with(fleet, &config, &|_| None).await;
    // Probes without the token would be 401s: two of them take the backend out of rotation.
    assert!(eventually(|| h.endpoint("compat").total_requests() >= 4).await);
    served(&h, "chat").await;
    assert_eq!(identity(&h).token_requests(), 1);
}

#[tokio::test]
async fn a_realtime_session_to_a_keyless_backend_carries_the_token() {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let spec = EndpointSpec::azure("rt", "swedencentral")
        .deployment(DeploymentSpec::new("gpt-rt").model("gpt-4o-realtime-preview"))
        .entra(COGNITIVE);
    let fleet = fleet(IdentitySpec::default(), vec![spec]).await;
    let url = fleet.identity().unwrap().imds_url();
    let config = format!(
        "identities:\n  gw: {{ kind: managed_identity, endpoint: \"{url}\" }}\nbackends:\n  - {{ name: rt, provider: azure, region: se, url: \"{{url:rt}}\", identity: gw }}\nmodels:\n  - name: voice\n    targets: [{{ backend: rt, deployment: gpt-rt }}]\n"
    );
    let h = Harness::start_with(fleet, &config, &|_| None).await;
    let path = "/openai/realtime?api-version=2024-10-01-preview&deployment=voice";
    let mut request = format!("ws://{}{path}", h.gateway.addr())
        .into_client_request()
        .unwrap();
    request
        .headers_mut()
        .insert("api-key", http::HeaderValue::from_static(KEY));
    let stream = tokio::net::TcpStream::connect(h.gateway.addr())
        .await
        .unwrap();
    let (_socket, head) = tokio_tungstenite::client_async(request, stream)
        .await
        .expect("the gateway upgrades");
    assert_eq!(head.headers()["x-onedoor-attempts"], "rt=200");
    let seen = h.endpoint("rt").last_realtime_handshake().unwrap();
    assert_eq!(seen.credential_in, "bearer");
    assert_eq!(identity(&h).token_requests(), 1);
}
