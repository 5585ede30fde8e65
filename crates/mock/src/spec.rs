//! The description of a simulated endpoint and its deployments, as tests and the YAML file write it.

use std::net::SocketAddr;

use crate::Behavior;

/// Which provider's wire format an endpoint speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dialect {
    Azure,
    #[serde(rename = "openai")]
    OpenAi,
    Anthropic,
}

/// One deployment (Azure) or model (OpenAI, Anthropic) served by an endpoint, with its quota.
#[derive(Clone, Debug)]
pub struct DeploymentSpec {
    /// Azure deployment name, or the model name clients send to OpenAI/Anthropic endpoints.
    pub name: String,
    /// The model reported in responses.
    pub model: String,
    /// Requests per rolling minute; more gets a 429.
    pub rpm: Option<u64>,
    /// Tokens per rolling minute, charged at admission as prompt estimate plus max tokens (like Azure).
    pub tpm: Option<u64>,
    /// Prompt tokens above this get a 400 context_length_exceeded.
    pub context_window: Option<u64>,
    /// Also enforce a sixth of `rpm` and `tpm` in any ten seconds, as Azure does.
    pub ten_second_windows: bool,
}

impl DeploymentSpec {
    pub fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            model: name.to_owned(),
            rpm: None,
            tpm: None,
            context_window: None,
            ten_second_windows: false,
        }
    }

    pub fn model(mut self, model: &str) -> Self {
        self.model = model.to_owned();
        self
    }

    pub fn rpm(mut self, n: u64) -> Self {
        self.rpm = Some(n);
        self
    }

    pub fn tpm(mut self, n: u64) -> Self {
        self.tpm = Some(n);
        self
    }

    pub fn context_window(mut self, n: u64) -> Self {
        self.context_window = Some(n);
        self
    }

    /// Enforces Azure's short periods: a sixth of `rpm` and `tpm` in any ten seconds.
    pub fn ten_second_windows(mut self) -> Self {
        self.ten_second_windows = true;
        self
    }
}

/// One simulated upstream: a listening port speaking one dialect.
#[derive(Clone, Debug)]
pub struct EndpointSpec {
    pub name: String,
    pub dialect: Dialect,
    /// Reported in `x-ms-region` by Azure endpoints.
    pub region: String,
    /// When set, requests must carry this key (in the dialect's header) or get a 401.
    pub api_key: Option<String>,
    /// When set, `Authorization: Bearer` tokens from the mock identity endpoint for this
    /// audience (`https://cognitiveservices.azure.com`) are taken, and checked; without an
    /// `api_key` too, nothing else is (key authentication off, as enterprise policy has it).
    pub entra_audience: Option<String>,
    pub deployments: Vec<DeploymentSpec>,
    /// The behaviour the endpoint starts with, and returns to on `POST /_mock/reset`.
    pub behavior: Behavior,
    /// Where to listen; 127.0.0.1 on an ephemeral port when unset.
    pub listen: Option<SocketAddr>,
}

impl EndpointSpec {
    fn new(name: &str, dialect: Dialect, region: &str) -> Self {
        Self {
            name: name.to_owned(),
            dialect,
            region: region.to_owned(),
            api_key: None,
            entra_audience: None,
            deployments: Vec::new(),
            behavior: Behavior::default(),
            listen: None,
        }
    }

    pub fn azure(name: &str, region: &str) -> Self {
        Self::new(name, Dialect::Azure, region)
    }

    pub fn openai(name: &str, region: &str) -> Self {
        Self::new(name, Dialect::OpenAi, region)
    }

    pub fn anthropic(name: &str, region: &str) -> Self {
        Self::new(name, Dialect::Anthropic, region)
    }

    pub fn deployment(mut self, d: DeploymentSpec) -> Self {
        self.deployments.push(d);
        self
    }

    pub fn api_key(mut self, key: &str) -> Self {
        self.api_key = Some(key.to_owned());
        self
    }

    /// Takes Entra ID tokens for `audience` (see [`EndpointSpec::entra_audience`]).
    pub fn entra(mut self, audience: &str) -> Self {
        self.entra_audience = Some(audience.to_owned());
        self
    }

    pub fn behavior(mut self, b: Behavior) -> Self {
        self.behavior = b;
        self
    }

    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.listen = Some(addr);
        self
    }
}
