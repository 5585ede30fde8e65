//! `onedoor serve` as a process on Azure: its identities come from the environment variables
//! Azure sets (App Service's `IDENTITY_ENDPOINT` and `IDENTITY_HEADER`, AKS workload identity's
//! `AZURE_*`, the instance metadata host), all pointed at the simulated Entra ID in the test
//! process, and the simulated Azure endpoints take only its tokens. No token or secret reaches
//! the gateway's log.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use onedoor_mock::{DeploymentSpec, EndpointSpec, Fleet, IdentityServer, IdentitySpec};
use sha2::{Digest, Sha256};

mod common;
use common::{free_addr, http, Gateway};

const KEY: &str = "identity-client-key";
const SECRET: &str = "process-client-secret-value";

fn keyless(name: &str, audience: &str) -> EndpointSpec {
    EndpointSpec::azure(name, "swedencentral")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .entra(audience)
}

async fn chat(gateway: &Gateway, model: &str) -> (u16, String) {
    let body = format!(r#"{{"model":"{model}","messages":[{{"role":"user","content":"Hello"}}]}}"#);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.0\r\nauthorization: Bearer {KEY}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    http(gateway.addr, request).await.unwrap()
}

fn write_config(
    dir: &Path,
    identities: &str,
    backends: &[(&str, &str, &str)],
) -> std::path::PathBuf {
    let mut text = format!(
        "listen: {}\nadmin: {{ listen: {} }}\nusage: {{ store: \"off\" }}\nidentities:\n{identities}backends:\n",
        free_addr(),
        free_addr()
    );
    for (name, url, identity) in backends {
        text.push_str(&format!(
            "  - {{ name: {name}, provider: azure, region: se, url: \"{url}\", identity: {identity} }}\n"
        ));
    }
    text.push_str("models:\n");
    for (name, ..) in backends {
        text.push_str(&format!(
            "  - name: {name}\n    targets: [{{ backend: {name}, deployment: gpt-4o }}]\n"
        ));
    }
    text.push_str(&format!(
        "tenants:\n  - name: team\n    keys: [{{ id: team-key, sha256: {} }}]\n",
        hex::encode(Sha256::digest(KEY.as_bytes()))
    ));
    let path = dir.join("onedoor.yaml");
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn app_service_workload_identity_and_client_secret_from_the_environment() {
    let entra = IdentityServer::start(IdentitySpec::default().client_secret(SECRET))
        .await
        .unwrap();
    let aoai = "https://cognitiveservices.azure.com";
    let fleet = Fleet::start(vec![
        keyless("app", aoai),
        keyless("aks", aoai),
        keyless("sp", aoai),
    ])
    .await
    .unwrap();
    let url = |name: &str| fleet.endpoint(name).unwrap().url();
    let dir = common::temp_dir("identity", "env");
    let token_file = dir.join("azure-identity-token");
    std::fs::write(&token_file, "projected-service-account-token").unwrap();
    let identities = "  app: { kind: managed_identity }\n  aks: { kind: workload_identity }\n  sp: { kind: client_secret, client_secret: \"${AZURE_CLIENT_SECRET}\" }\n";
    let config = write_config(
        &dir,
        identities,
        &[
            ("app", &url("app"), "app"),
            ("aks", &url("aks"), "aks"),
            ("sp", &url("sp"), "sp"),
        ],
    );
    let authority = entra.authority();
    let endpoint = entra.app_service_url();
    let file = token_file.display().to_string();
    let env = [
        ("IDENTITY_ENDPOINT", endpoint.as_str()),
        ("IDENTITY_HEADER", entra.identity_header()),
        ("AZURE_AUTHORITY_HOST", authority.as_str()),
        ("AZURE_TENANT_ID", "tenant-1"),
        ("AZURE_CLIENT_ID", "client-1"),
        ("AZURE_FEDERATED_TOKEN_FILE", file.as_str()),
        ("AZURE_CLIENT_SECRET", SECRET),
        ("ONEDOOR_LOG", "debug"),
    ];
    let gateway = Gateway::start_with(&config, "env", &env).await;
    for model in ["app", "aks", "sp"] {
        let (status, body) = chat(&gateway, model).await;
        assert_eq!(status, 200, "{model}: {body}\n{}", gateway.log());
    }
    assert_eq!(entra.token_requests_by("app_service"), 1);
    assert_eq!(entra.token_requests_by("client_assertion"), 1);
    assert_eq!(entra.token_requests_by("client_secret"), 1);
    assert_eq!(
        entra.last_assertion().as_deref(),
        Some("projected-service-account-token")
    );
    let log = gateway.log();
    assert!(!log.contains(SECRET), "{log}");
    assert!(!log.contains("eyJ0eXAi"), "{log}");
}

#[tokio::test]
async fn a_managed_identity_asks_the_instance_metadata_service_where_azure_points_it() {
    let entra = IdentityServer::start(IdentitySpec::default())
        .await
        .unwrap();
    let fleet = Fleet::start(vec![keyless("vm", "https://cognitiveservices.azure.com")])
        .await
        .unwrap();
    let dir = common::temp_dir("identity", "imds");
    let config = write_config(
        &dir,
        "  vm: { kind: managed_identity, client_id: user-assigned-1 }\n",
        &[("vm", &fleet.endpoint("vm").unwrap().url(), "vm")],
    );
    let host = entra.authority();
    let env = [("AZURE_POD_IDENTITY_AUTHORITY_HOST", host.as_str())];
    let gateway = Gateway::start_with(&config, "imds", &env).await;
    let (status, body) = chat(&gateway, "vm").await;
    assert_eq!(status, 200, "{body}\n{}", gateway.log());
    assert_eq!(entra.token_requests_by("imds"), 1);
}
