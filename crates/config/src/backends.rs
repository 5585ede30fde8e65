//! The `backends` section: one upstream endpoint each (provider, URL, region, credential, quota,
//! breaker policy, timeouts, health check).

use std::collections::HashMap;
use std::time::Duration;

use crate::identities::Identities;
use crate::limits;
use crate::model::{
    AzureApi, Backend, BackendId, BackendIdentity, BreakerPolicy, HealthCheck, Provider, Timeouts,
};
use crate::problems::{Mark, Problems};
use crate::read::{self, Fields};
use crate::routing;
use crate::tree::Node;

pub(crate) const DEFAULT_API_VERSION: &str = "2024-10-21";
pub(crate) const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";
const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(10);
/// The scope of Azure OpenAI (and Azure AI services) tokens.
pub(crate) const COGNITIVE_SERVICES_SCOPE: &str = "https://cognitiveservices.azure.com/.default";
/// The scope of Azure AI Foundry tokens, which Claude on Foundry takes.
pub(crate) const AI_FOUNDRY_SCOPE: &str = "https://ai.azure.com/.default";

const KEYS: &[&str] = &[
    "name",
    "provider",
    "url",
    "region",
    "api_key",
    "identity",
    "scope",
    "azure_api",
    "api_version",
    "anthropic_version",
    "limits",
    "circuit_breaker",
    "timeouts",
    "health_check",
];

pub(crate) struct Backends {
    pub list: Vec<Backend>,
    pub by_name: HashMap<String, BackendId>,
}

impl Backends {
    /// Resolve a backend name written at `node`, reporting an unknown one with the names that exist.
    pub fn resolve(&self, node: &Node, p: &mut Problems) -> Option<BackendId> {
        let name = read::name(node, p)?;
        if let Some(id) = self.by_name.get(name) {
            return Some(*id);
        }
        let mut known: Vec<(BackendId, &str)> = self
            .by_name
            .iter()
            .map(|(n, id)| (*id, n.as_str()))
            .collect();
        known.sort_unstable();
        let known: Vec<&str> = known.into_iter().map(|(_, n)| n).collect();
        let known = if known.is_empty() {
            "none are defined".to_owned()
        } else {
            known.join(", ")
        };
        p.at(
            node.mark,
            format!("unknown backend {name:?} (known: {known})"),
        );
        None
    }
}

pub(crate) fn backends(
    node: Option<&Node>,
    identities: &Identities,
    breakers: &HashMap<String, BreakerPolicy>,
    timeouts: Timeouts,
    p: &mut Problems,
) -> Backends {
    let mut backends = Backends {
        list: Vec::new(),
        by_name: HashMap::new(),
    };
    let Some(items) = node.and_then(|n| read::list(n, p)) else {
        return backends;
    };
    let mut first_seen: HashMap<String, Mark> = HashMap::new();
    for item in items {
        let f = Fields::new(item, KEYS, p);
        let name_node = f.required("name", p);
        let name = name_node.and_then(|n| read::name(n, p));
        if let (Some(name), Some(n)) = (name, name_node) {
            match first_seen.get(name) {
                Some(first) => p.at(
                    n.mark,
                    format!("duplicate backend name {name:?} (first defined at {first})"),
                ),
                None => {
                    first_seen.insert(name.to_owned(), n.mark);
                    backends
                        .by_name
                        .insert(name.to_owned(), backends.list.len());
                }
            }
        }
        let backend = backend(&f, name.unwrap_or_default(), breakers, timeouts, p);
        let backend = Backend {
            identity: identity(&f, backend.provider, identities, p),
            ..backend
        };
        backends.list.push(backend);
    }
    backends
}

fn backend(
    f: &Fields,
    name: &str,
    breakers: &HashMap<String, BreakerPolicy>,
    timeouts: Timeouts,
    p: &mut Problems,
) -> Backend {
    let providers = [
        ("azure", Provider::Azure),
        ("openai", Provider::OpenAi),
        ("anthropic", Provider::Anthropic),
    ];
    let provider = f
        .required("provider", p)
        .and_then(|n| read::choice(n, &providers, p));
    let api_version = version(f, "api_version", provider, Provider::Azure, p);
    let anthropic_version = version(f, "anthropic_version", provider, Provider::Anthropic, p);
    Backend {
        name: name.into(),
        provider: provider.unwrap_or(Provider::OpenAi),
        url: f
            .required("url", p)
            .and_then(|n| url(n, p))
            .unwrap_or_default(),
        region: f
            .required("region", p)
            .and_then(|n| read::name(n, p))
            .unwrap_or_default()
            .into(),
        api_key: f.secret("api_key", p),
        identity: None,
        azure_api: azure_api(f, provider, p),
        api_version: api_version.unwrap_or_else(|| DEFAULT_API_VERSION.to_owned()),
        anthropic_version: anthropic_version
            .unwrap_or_else(|| DEFAULT_ANTHROPIC_VERSION.to_owned()),
        limits: limits::limits(f.get("limits"), limits::BACKEND, p),
        circuit_breaker: f
            .get("circuit_breaker")
            .and_then(|n| breaker(n, breakers, p)),
        timeouts: routing::timeouts(f.get("timeouts"), timeouts, p),
        health_check: f.get("health_check").and_then(|n| health_check(n, p)),
    }
}

/// `identity` and `scope`: a backend has an `api_key` or an `identity`, not both; its scope
/// defaults by provider (Azure AI Foundry's for Anthropic, Cognitive Services' otherwise).
fn identity(
    f: &Fields,
    provider: Provider,
    identities: &Identities,
    p: &mut Problems,
) -> Option<BackendIdentity> {
    let scope = f.get("scope").and_then(|n| read::name(n, p));
    let Some(node) = f.get("identity") else {
        if f.has("scope") {
            p.at(
                f.key_mark("scope"),
                "scope applies only to a backend with an identity",
            );
        }
        return None;
    };
    if f.has("api_key") {
        p.at(
            f.key_mark("identity"),
            "a backend has api_key or identity, not both",
        );
    }
    let identity = identities.resolve(node, p)?;
    let default = match provider {
        Provider::Anthropic => AI_FOUNDRY_SCOPE,
        Provider::Azure | Provider::OpenAi => COGNITIVE_SERVICES_SCOPE,
    };
    Some(BackendIdentity {
        identity,
        scope: scope.map_or(default, str::trim).to_owned(),
    })
}

/// `azure_api: deployments | v1`, on Azure backends only.
fn azure_api(f: &Fields, provider: Option<Provider>, p: &mut Problems) -> AzureApi {
    let Some(node) = f.get("azure_api") else {
        return AzureApi::Deployments;
    };
    if provider.is_some_and(|provider| provider != Provider::Azure) {
        p.at(node.mark, "azure_api applies only to azure backends");
        return AzureApi::Deployments;
    }
    let styles = [("deployments", AzureApi::Deployments), ("v1", AzureApi::V1)];
    read::choice(node, &styles, p).unwrap_or_default()
}

/// `api_version` or `anthropic_version`: only on the provider it belongs to.
fn version(
    f: &Fields,
    key: &str,
    provider: Option<Provider>,
    belongs_to: Provider,
    p: &mut Problems,
) -> Option<String> {
    let node = f.get(key)?;
    let version = read::name(node, p)?;
    match provider {
        Some(provider) if provider != belongs_to => {
            p.at(
                node.mark,
                format!("{key} applies only to {} backends", belongs_to.as_str()),
            );
            None
        }
        _ => Some(version.to_owned()),
    }
}

/// An http(s) base URL without its trailing slash. Never quoted back: it may carry credentials.
pub(crate) fn url(node: &Node, p: &mut Problems) -> Option<String> {
    let url = read::str(node, p)?.trim();
    let rest = url
        .strip_prefix("https://")
        .or_else(|| url.strip_prefix("http://"));
    match rest {
        Some(host) if !host.trim_end_matches('/').is_empty() => {
            Some(url.trim_end_matches('/').to_owned())
        }
        _ => {
            p.at(
                node.mark,
                "expected a URL starting with http:// or https://",
            );
            None
        }
    }
}

fn breaker(
    node: &Node,
    breakers: &HashMap<String, BreakerPolicy>,
    p: &mut Problems,
) -> Option<String> {
    let name = read::name(node, p)?;
    if breakers.contains_key(name) {
        return Some(name.to_owned());
    }
    let mut known: Vec<&str> = breakers.keys().map(String::as_str).collect();
    known.sort_unstable();
    let known = if known.is_empty() {
        "none are defined".to_owned()
    } else {
        known.join(", ")
    };
    p.at(
        node.mark,
        format!("unknown circuit breaker {name:?} (known: {known})"),
    );
    None
}

fn health_check(node: &Node, p: &mut Problems) -> Option<HealthCheck> {
    let f = Fields::new(node, &["path", "interval"], p);
    let interval = f
        .get("interval")
        .and_then(|n| read::positive_duration(n, p));
    let path_node = f.required("path", p)?;
    let path = read::str(path_node, p)?;
    if !path.starts_with('/') {
        p.at(path_node.mark, "a health check path starts with /");
    }
    Some(HealthCheck {
        path: path.to_owned(),
        interval: interval.unwrap_or(DEFAULT_HEALTH_INTERVAL),
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::model::Provider;
    use crate::testing::{compile, problems};

    #[test]
    fn env_references_work_inside_longer_strings_and_trailing_slashes_go() {
        let s = compile(
            "backends:\n  - { name: a, provider: azure, url: \"https://${HOST}/\", region: r, api_key: \"${KEY}\" }\n",
        );
        let a = &s.backends[0];
        assert_eq!(a.url, "https://aoai.example.com");
        assert_eq!(a.api_key.as_ref().unwrap().expose(), "secret-key-value");
        assert_eq!(a.api_version, "2024-10-21");
    }

    #[test]
    fn file_secrets_are_trimmed_and_relative_to_the_config_file() {
        let dir =
            std::env::temp_dir().join(format!("onedoor-config-{}-backends", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("key"), "\n  from-a-file \n").unwrap();
        let config = dir.join("onedoor.yaml");
        std::fs::write(
            &config,
            "backends:\n  - { name: a, provider: openai, url: http://h, region: r, api_key: file:key }\n",
        )
        .unwrap();
        let s = crate::load(&config).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            s.backends[0].api_key.as_ref().unwrap().expose(),
            "from-a-file"
        );
    }

    #[test]
    fn a_backend_overrides_only_the_timeouts_it_names() {
        let s = compile(
            "routing: { timeouts: { connect: 1s } }
backends:
  - name: a
    provider: anthropic
    url: https://api.anthropic.com
    region: eu
    timeouts: { first_token: 20s }
    health_check: { path: /health }
",
        );
        let a = &s.backends[0];
        assert_eq!(a.provider, Provider::Anthropic);
        assert_eq!(a.timeouts.connect, Duration::from_secs(1));
        assert_eq!(a.timeouts.first_token, Duration::from_secs(20));
        assert_eq!(a.timeouts.total, Duration::from_secs(600));
        assert_eq!(
            a.health_check.as_ref().unwrap().interval,
            Duration::from_secs(10)
        );
    }

    #[test]
    fn backend_mistakes_are_located() {
        let found = problems(
            "circuit_breakers: { strict: { rules: [{ name: r, failures: { count: 1, within: 1s, status: [500] }, trip: 1s }] } }
backends:
  - name: a
    provider: openai
    url: a.example.com
    region: r
    api_version: 2024-10-21
    circuit_breaker: lenient
    limits: { rpm: 0, max_sessions: 3 }
  - provider: bedrock
    api_key: \"\"
",
        );
        assert_eq!(
            found,
            [
                "5:10: expected a URL starting with http:// or https://",
                "7:18: api_version applies only to azure backends",
                "8:22: unknown circuit breaker \"lenient\" (known: strict)",
                "9:20: must be at least 1",
                "9:23: unknown key \"max_sessions\" (expected one of: rpm, tpm, max_in_flight)",
                "10:5: missing required key \"name\"",
                "10:5: missing required key \"url\"",
                "10:5: missing required key \"region\"",
                "10:15: expected one of azure, openai, anthropic, found \"bedrock\"",
                "11:14: api_key is empty",
            ]
        );
    }
}
