//! The `identities` section: the Entra ID identities the gateway calls backends with, each
//! resolved against the environment variables Azure sets (`IDENTITY_ENDPOINT`,
//! `AZURE_FEDERATED_TOKEN_FILE`, `AZURE_AUTHORITY_HOST` ...) as the config is read, so the running
//! gateway never looks at its environment again and tests point everything at loopback.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::model::{Identity, IdentityId, ManagedEndpoint, Secret, TokenSource};
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::tree::Node;

/// The public cloud's authority, when neither `authority` nor `AZURE_AUTHORITY_HOST` says another.
const PUBLIC_AUTHORITY: &str = "https://login.microsoftonline.com";
/// The instance metadata service, when `AZURE_POD_IDENTITY_AUTHORITY_HOST` names no other host.
const IMDS_HOST: &str = "http://169.254.169.254";
const IMDS_PATH: &str = "/metadata/identity/oauth2/token";

const KEYS: &[&str] = &[
    "kind",
    "client_id",
    "tenant_id",
    "client_secret",
    "authority",
    "token_file",
    "endpoint",
];

/// Which keys each kind reads besides `kind` and `client_id`.
const KIND_KEYS: &[(&str, &[&str])] = &[
    ("managed_identity", &["endpoint"]),
    (
        "workload_identity",
        &["tenant_id", "authority", "token_file"],
    ),
    (
        "client_secret",
        &["tenant_id", "authority", "client_secret"],
    ),
];

pub(crate) struct Identities {
    pub list: Vec<Identity>,
    pub by_name: HashMap<String, IdentityId>,
}

impl Identities {
    /// Resolve an identity name written at `node`, reporting an unknown one with the names that exist.
    pub fn resolve(&self, node: &Node, p: &mut Problems) -> Option<IdentityId> {
        let name = read::name(node, p)?;
        if let Some(id) = self.by_name.get(name) {
            return Some(*id);
        }
        let mut known: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        known.sort_unstable();
        let known = match known.is_empty() {
            true => "none are defined".to_owned(),
            false => known.join(", "),
        };
        p.at(
            node.mark,
            format!("unknown identity {name:?} (known: {known})"),
        );
        None
    }
}

pub(crate) fn identities(
    node: Option<&Node>,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) -> Identities {
    let mut identities = Identities {
        list: Vec::new(),
        by_name: HashMap::new(),
    };
    let Some(node) = node else {
        return identities;
    };
    for (name, _, value) in read::named_entries(node, p) {
        let Some(source) = source(value, env, p) else {
            continue;
        };
        identities
            .by_name
            .insert(name.to_owned(), identities.list.len());
        identities.list.push(Identity {
            name: Arc::from(name),
            source,
        });
    }
    identities
}

/// Reads one identity; `env` fills what the config leaves out, as Azure's SDKs do.
fn source(
    node: &Node,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) -> Option<TokenSource> {
    let f = Fields::new(node, KEYS, p);
    let kinds: Vec<(&str, &str)> = KIND_KEYS.iter().map(|(k, _)| (*k, *k)).collect();
    let kind = f
        .required("kind", p)
        .and_then(|n| read::choice(n, &kinds, p))?;
    let (_, own) = KIND_KEYS.iter().find(|(k, _)| *k == kind)?;
    for key in [
        "tenant_id",
        "authority",
        "token_file",
        "endpoint",
        "client_secret",
    ] {
        if f.has(key) && !own.contains(&key) {
            p.at(
                f.key_mark(key),
                format!("{key} does not apply to kind {kind}"),
            );
        }
    }
    let text = |key: &str, p: &mut Problems| {
        f.get(key)
            .and_then(|n| read::name(n, p))
            .map(|s| s.trim().to_owned())
    };
    let client_id = text("client_id", p);
    match kind {
        "managed_identity" => {
            let endpoint = managed_endpoint(f.get("endpoint"), env, p)?;
            Some(TokenSource::ManagedIdentity {
                endpoint,
                client_id,
            })
        }
        _ => {
            let needed = |value: Option<String>, key: &str, var: &str, p: &mut Problems| {
                let value = value.or_else(|| env(var).filter(|v| !v.trim().is_empty()));
                if value.is_none() {
                    p.at(
                        f.mark,
                        format!("{kind} needs {key} (or {var} in the environment)"),
                    );
                }
                value
            };
            let client_id = needed(client_id, "client_id", "AZURE_CLIENT_ID", p);
            let tenant_id = needed(text("tenant_id", p), "tenant_id", "AZURE_TENANT_ID", p);
            let authority = authority(f.get("authority"), f.key_mark("authority"), env, p);
            let token_url = match (tenant_id, authority) {
                (Some(tenant), Some(authority)) => {
                    Some(format!("{authority}/{}/oauth2/v2.0/token", tenant.trim()))
                }
                _ => None,
            };
            if kind == "workload_identity" {
                let file = text("token_file", p);
                let file = needed(file, "token_file", "AZURE_FEDERATED_TOKEN_FILE", p)?;
                return Some(TokenSource::WorkloadIdentity {
                    token_url: token_url?,
                    client_id: client_id?,
                    token_file: PathBuf::from(file),
                });
            }
            let secret = match f.get("client_secret") {
                Some(n) => read::secret(n, "client_secret", p),
                None => needed(None, "client_secret", "AZURE_CLIENT_SECRET", p).map(Secret::new),
            };
            Some(TokenSource::ClientSecret {
                token_url: token_url?,
                client_id: client_id?,
                client_secret: secret?,
            })
        }
    }
}

/// `endpoint` when written (an instance-metadata-style token URL), else App Service's
/// `IDENTITY_ENDPOINT` with `IDENTITY_HEADER`, else the instance metadata service (at
/// `AZURE_POD_IDENTITY_AUTHORITY_HOST` when set).
fn managed_endpoint(
    node: Option<&Node>,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) -> Option<ManagedEndpoint> {
    if let Some(node) = node {
        let url = crate::backends::url(node, p)?;
        return Some(ManagedEndpoint::Imds { url });
    }
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    if let (Some(url), Some(header)) = (set("IDENTITY_ENDPOINT"), set("IDENTITY_HEADER")) {
        return Some(ManagedEndpoint::AppService {
            url: url.trim().to_owned(),
            header: Secret::new(header.trim()),
        });
    }
    let host = set("AZURE_POD_IDENTITY_AUTHORITY_HOST").unwrap_or_else(|| IMDS_HOST.to_owned());
    Some(ManagedEndpoint::Imds {
        url: format!("{}{IMDS_PATH}", host.trim().trim_end_matches('/')),
    })
}

/// The authority host: `authority`, else `AZURE_AUTHORITY_HOST`, else the public cloud. Plain
/// http only to a loopback address: a client secret or assertion goes there.
fn authority(
    node: Option<&Node>,
    mark: Mark,
    env: &dyn Fn(&str) -> Option<String>,
    p: &mut Problems,
) -> Option<String> {
    let (url, mark) = match node {
        Some(node) => (crate::backends::url(node, p)?, node.mark),
        None => match env("AZURE_AUTHORITY_HOST").filter(|v| !v.trim().is_empty()) {
            Some(host) => (host.trim().trim_end_matches('/').to_owned(), mark),
            None => (PUBLIC_AUTHORITY.to_owned(), mark),
        },
    };
    if url.starts_with("https://") || is_loopback_http(&url) {
        return Some(url);
    }
    p.at(
        mark,
        "the authority must be an https URL (plain http only on a loopback address)",
    );
    None
}

fn is_loopback_http(url: &str) -> bool {
    let Some(rest) = url.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split(['/', '?']).next().unwrap_or("");
    let host = match host.rsplit_once(':') {
        Some((h, port)) if !port.contains(']') => h,
        _ => host,
    };
    matches!(host, "localhost" | "[::1]") || host.starts_with("127.")
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::model::{ManagedEndpoint, TokenSource};
    use crate::testing::{compile, problems};

    fn with_env(text: &str, vars: &[(&str, &str)]) -> crate::Snapshot {
        let env = |name: &str| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        };
        crate::parse(text, Path::new("t.yaml"), &env).unwrap()
    }

    #[test]
    fn a_managed_identity_asks_the_metadata_service_unless_app_service_says_otherwise() {
        let text = "identities: { gw: { kind: managed_identity, client_id: abc } }\n";
        let imds = compile(text);
        assert_eq!(
            imds.identities[0].source,
            TokenSource::ManagedIdentity {
                endpoint: ManagedEndpoint::Imds {
                    url: "http://169.254.169.254/metadata/identity/oauth2/token".into()
                },
                client_id: Some("abc".into()),
            }
        );
        let app = with_env(
            text,
            &[
                ("IDENTITY_ENDPOINT", "http://127.0.0.1:41/msi/token"),
                ("IDENTITY_HEADER", "h"),
            ],
        );
        match &app.identities[0].source {
            TokenSource::ManagedIdentity {
                endpoint: ManagedEndpoint::AppService { url, header },
                ..
            } => assert_eq!(
                (url.as_str(), header.expose()),
                ("http://127.0.0.1:41/msi/token", "h")
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn workload_identity_comes_from_the_variables_aks_sets() {
        let s = with_env(
            "identities: { wi: { kind: workload_identity } }\n",
            &[
                ("AZURE_AUTHORITY_HOST", "https://login.microsoftonline.us/"),
                ("AZURE_TENANT_ID", "t1"),
                ("AZURE_CLIENT_ID", "c1"),
                ("AZURE_FEDERATED_TOKEN_FILE", "/var/run/token"),
            ],
        );
        assert_eq!(
            s.identities[0].source,
            TokenSource::WorkloadIdentity {
                token_url: "https://login.microsoftonline.us/t1/oauth2/v2.0/token".into(),
                client_id: "c1".into(),
                token_file: "/var/run/token".into(),
            }
        );
    }

    #[test]
    fn the_summary_names_the_identity_and_never_its_secret() {
        let s = compile(
            "identities: { ci: { kind: client_secret, tenant_id: t, client_id: c, client_secret: s3cr3t-value } }
backends:
  - { name: a, provider: azure, url: https://a.example.com, region: r, identity: ci }
",
        );
        assert_eq!(
            s.backends[0].identity.as_ref().unwrap().scope,
            "https://cognitiveservices.azure.com/.default"
        );
        let summary = crate::summary(&s);
        assert!(
            summary.contains("a (azure, r, by identity ci)"),
            "{summary}"
        );
        assert!(!summary.contains("s3cr3t") && !format!("{s:?}").contains("s3cr3t"));
    }

    #[test]
    fn identity_mistakes_are_located() {
        let found = problems(
            "identities:
  a: { kind: password }
  b: { kind: client_secret, tenant_id: t, client_id: c, token_file: /x }
  c: { kind: managed_identity, client_secret: s }
  d: { kind: client_secret, tenant_id: t, client_id: c, client_secret: s, authority: http://login.example.com }
backends:
  - { name: x, provider: azure, url: https://x.example.com, region: r, identity: nobody }
  - { name: y, provider: azure, url: https://y.example.com, region: r, api_key: k, identity: c }
  - { name: z, provider: azure, url: https://z.example.com, region: r, scope: https://ai.azure.com/.default }
  - { name: w, provider: openai, url: https://w.example.com, region: r, azure_api: v1 }
",
        );
        assert_eq!(
            found,
            [
                "2:14: expected one of managed_identity, workload_identity, client_secret, found \"password\"",
                "3:6: client_secret needs client_secret (or AZURE_CLIENT_SECRET in the environment)",
                "3:57: token_file does not apply to kind client_secret",
                "4:32: client_secret does not apply to kind managed_identity",
                "5:86: the authority must be an https URL (plain http only on a loopback address)",
                "7:82: unknown identity \"nobody\" (known: c)",
                "8:84: a backend has api_key or identity, not both",
                "9:72: scope applies only to a backend with an identity",
                "10:84: azure_api applies only to azure backends",
            ]
        );
    }
}
