//! Reading a fleet description from YAML (the `onedoor mock --config` file).
//!
//! The YAML is turned into JSON and read with serde, so unknown keys are errors and the
//! behaviour block takes exactly the fields `PUT /_mock/behavior` does.

use std::net::SocketAddr;

use serde::Deserialize;
use serde_json::{Map, Value};
use yaml_rust2::{Yaml, YamlLoader};

use crate::{Behavior, DeploymentSpec, Dialect, EndpointSpec, Fleet, Issuer};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FleetFile {
    endpoints: Vec<EndpointEntry>,
    /// Simulated OIDC issuers (`oidc.rs`).
    #[serde(default)]
    issuers: Vec<IssuerEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IssuerEntry {
    name: String,
    listen: Option<SocketAddr>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EndpointEntry {
    name: String,
    dialect: Dialect,
    #[serde(default = "default_region")]
    region: String,
    listen: Option<SocketAddr>,
    api_key: Option<String>,
    #[serde(default)]
    deployments: Vec<DeploymentEntry>,
    #[serde(default)]
    behavior: Behavior,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DeploymentEntry {
    name: String,
    model: Option<String>,
    rpm: Option<u64>,
    tpm: Option<u64>,
    context_window: Option<u64>,
    #[serde(default)]
    ten_second_windows: bool,
}

fn default_region() -> String {
    "local".to_owned()
}

fn fleet_file(text: &str) -> Result<FleetFile, String> {
    let docs = YamlLoader::load_from_str(text).map_err(|e| format!("mock fleet YAML: {e}"))?;
    let doc = docs.first().ok_or("mock fleet YAML: empty document")?;
    serde_json::from_value(to_json(doc)?).map_err(|e| format!("mock fleet YAML: {e}"))
}

/// Starts the `issuers` of a fleet description, each with its name.
pub async fn issuers_from_yaml(text: &str) -> Result<Vec<(String, Issuer)>, String> {
    let mut issuers = Vec::new();
    for entry in fleet_file(text)?.issuers {
        let issuer = Issuer::start(entry.listen)
            .await
            .map_err(|e| format!("issuer {}: {e}", entry.name))?;
        issuers.push((entry.name, issuer));
    }
    Ok(issuers)
}

/// Parses a mock fleet description into endpoint specs.
pub fn specs_from_yaml(text: &str) -> Result<Vec<EndpointSpec>, String> {
    let file = fleet_file(text)?;
    Ok(file
        .endpoints
        .into_iter()
        .map(EndpointEntry::into_spec)
        .collect())
}

/// Parses a fleet description and starts it.
pub async fn run_from_yaml(text: &str) -> Result<Fleet, String> {
    let specs = specs_from_yaml(text)?;
    Fleet::start(specs).await.map_err(|e| e.to_string())
}

impl EndpointEntry {
    fn into_spec(self) -> EndpointSpec {
        EndpointSpec {
            name: self.name,
            dialect: self.dialect,
            region: self.region,
            api_key: self.api_key,
            deployments: self
                .deployments
                .into_iter()
                .map(DeploymentEntry::into_spec)
                .collect(),
            behavior: self.behavior,
            listen: self.listen,
        }
    }
}

impl DeploymentEntry {
    fn into_spec(self) -> DeploymentSpec {
        DeploymentSpec {
            model: self.model.unwrap_or_else(|| self.name.clone()),
            name: self.name,
            rpm: self.rpm,
            tpm: self.tpm,
            context_window: self.context_window,
            ten_second_windows: self.ten_second_windows,
        }
    }
}

fn to_json(y: &Yaml) -> Result<Value, String> {
    Ok(match y {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(s) => s
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| format!("mock fleet YAML: bad number {s}"))?,
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(items) => Value::Array(items.iter().map(to_json).collect::<Result<_, _>>()?),
        Yaml::Hash(map) => {
            let entries = map.iter().map(|(k, v)| Ok((key(k)?, to_json(v)?)));
            Value::Object(entries.collect::<Result<Map<_, _>, String>>()?)
        }
        Yaml::Alias(_) | Yaml::BadValue => {
            return Err("mock fleet YAML: aliases are not supported".to_owned())
        }
    })
}

fn key(k: &Yaml) -> Result<String, String> {
    match k {
        Yaml::String(s) => Ok(s.clone()),
        Yaml::Integer(i) => Ok(i.to_string()),
        other => Err(format!("mock fleet YAML: unsupported key {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
endpoints:
  - name: sub1-se
    dialect: azure            # azure | openai | anthropic
    region: swedencentral
    listen: 127.0.0.1:8101
    api_key: k1
    deployments:
      - { name: gpt-4o, model: gpt-4o-2024-11-20, rpm: 60, tpm: 100000, context_window: 128000 }
    behavior: { ttft_ms: 50, inter_token_ms: 20, error_rate: 0.5 }
  - name: claude
    dialect: anthropic
    deployments: [{ name: claude-sonnet-4-5 }]
"#;

    #[test]
    fn reads_the_documented_format() {
        let specs = specs_from_yaml(SAMPLE).unwrap();
        assert_eq!(specs.len(), 2);
        let azure = &specs[0];
        assert_eq!(azure.dialect, Dialect::Azure);
        assert_eq!(azure.listen, Some("127.0.0.1:8101".parse().unwrap()));
        assert_eq!(azure.api_key.as_deref(), Some("k1"));
        let d = &azure.deployments[0];
        assert_eq!(
            (d.model.as_str(), d.rpm, d.tpm, d.context_window),
            ("gpt-4o-2024-11-20", Some(60), Some(100_000), Some(128_000))
        );
        assert_eq!(
            (azure.behavior.ttft_ms, azure.behavior.error_rate),
            (50, 0.5)
        );
        assert_eq!(specs[1].deployments[0].model, "claude-sonnet-4-5");
        assert_eq!(specs[1].region, "local");
    }

    #[test]
    fn rejects_unknown_keys() {
        let err = specs_from_yaml("endpoints:\n  - { name: a, dialect: azure, colour: red }\n")
            .unwrap_err();
        assert!(err.contains("colour"), "{err}");
        assert!(specs_from_yaml("endpoints: [{ name: a, dialect: gemini }]").is_err());
    }

    #[tokio::test]
    async fn starts_the_issuers_it_lists() {
        let issuers = issuers_from_yaml("endpoints: []\nissuers: [{ name: entra }]\n")
            .await
            .unwrap();
        let (name, issuer) = &issuers[0];
        assert_eq!(name, "entra");
        assert!(issuer.url().starts_with("http://127.0.0.1:"));
        assert!(
            issuers_from_yaml("endpoints: []\nissuers: [{ name: e, colour: red }]\n")
                .await
                .is_err()
        );
    }
}
