//! The compiled, read-only configuration (`Snapshot`) that the gateway runs on: every reference
//! resolved to an index, every duration parsed, every secret loaded.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// A secret value (upstream key, admin token). Its `Debug` and `Display` never show the value.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value itself, for the one place that must send it (an upstream header).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("***")
    }
}

/// Index of a backend in `Snapshot::backends`.
pub type BackendId = usize;
/// Index of an alias in `Snapshot::aliases`.
pub type AliasId = usize;
/// Index of a tenant in `Snapshot::tenants`.
pub type TenantId = usize;

#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The file this snapshot was read from (`<embedded>` for the demo).
    pub source: PathBuf,
    pub listen: SocketAddr,
    /// Bodies larger than this get 413 `request_too_large`.
    pub max_request_body: u64,
    /// Open client connections at most; past it a new one is answered 503 and closed.
    pub max_connections: usize,
    /// How long a client connection may take over each part of a request (read at start).
    pub client_timeouts: ClientTimeouts,
    pub admin: Admin,
    pub state: StateConfig,
    pub usage: UsageConfig,
    pub routing: Routing,
    /// Realtime WebSocket sessions: idle and maximum durations.
    pub realtime: Realtime,
    /// Region group name -> region names.
    pub regions: HashMap<String, Vec<String>>,
    pub backends: Vec<Backend>,
    pub backend_by_name: HashMap<String, BackendId>,
    pub circuit_breakers: HashMap<String, BreakerPolicy>,
    /// The identities backends authenticate with (Microsoft Entra ID), in file order.
    pub identities: Vec<Identity>,
    /// Every alias except `"*"`, in file order.
    pub aliases: Vec<Alias>,
    pub alias_by_name: Lookup<String, AliasId>,
    /// The `"*"` discovery alias, when configured.
    pub wildcard: Option<Alias>,
    pub tenants: Vec<Tenant>,
    /// sha256 digest of a client key -> (tenant, index into that tenant's `keys`).
    pub keys_by_hash: Lookup<[u8; 32], (TenantId, usize)>,
    /// JWT callers: the issuers trusted and which tenant's principal a token is.
    pub client_auth: ClientAuth,
    pub telemetry: Telemetry,
    /// How a stop drains: read when the signal comes, so a reload changes it.
    pub shutdown: Shutdown,
    /// The files and batches surface: how often open batches are polled, how large a file may be.
    pub batch: BatchSettings,
}

/// The `batch` section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSettings {
    /// How often the backends holding open batches are asked how they stand.
    pub poll_interval: Duration,
    /// An uploaded batch input file larger than this is refused (400).
    pub max_file_bytes: u64,
    /// A batch input file with more lines than this is refused (400).
    pub max_lines: u64,
}

/// The `shutdown` section: after SIGTERM the listeners go on accepting for `drain_delay` (with
/// `/readyz` answering 503), then close; requests, streams and realtime sessions under way get
/// `timeout` more before they are cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shutdown {
    pub drain_delay: Duration,
    pub timeout: Duration,
}

/// A map the gateway reads on every request (an alias by its name, a caller by its key's
/// digest): foldhash, seeded per map, instead of the standard SipHash, which costs several times
/// as much for keys this short.
pub type Lookup<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The `telemetry` section: where the gateway sends its traces, if anywhere.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Telemetry {
    /// OpenTelemetry traces over OTLP/HTTP; `None` (the default) builds no spans at all.
    pub otlp: Option<Otlp>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Otlp {
    /// The collector's traces URL (`.../v1/traces`); `None`: the exporter reads
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`, else localhost:4318.
    pub endpoint: Option<String>,
    /// `service.name` of every span. Default `onedoor`.
    pub service_name: String,
    /// Sent with every export, names in lowercase; the values are secrets (collector tokens).
    pub headers: Vec<(String, Secret)>,
    /// The share of traces this gateway starts that are sampled (0 to 1); a request whose
    /// `traceparent` says sampled or not follows its caller.
    pub sample_ratio: f64,
    /// The longest a finished span waits before it is sent.
    pub export_interval: Duration,
    /// How long one export may take, retries included.
    pub timeout: Duration,
    /// Finished spans waiting for export; more are dropped (and counted), never waited for.
    pub max_queue: usize,
}

/// The deadlines a client connection is held to (`client_timeouts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientTimeouts {
    /// The whole request head, from a new connection's start or a request's first byte.
    pub head: Duration,
    /// A keep-alive connection between requests.
    pub idle: Duration,
    /// The request body, from the end of its head.
    pub body: Duration,
    /// An answer's bytes the client does not take.
    pub write: Duration,
}

impl ClientTimeouts {
    /// What a connection is held to when the config says nothing.
    pub const DEFAULT: ClientTimeouts = ClientTimeouts {
        head: Duration::from_secs(20),
        idle: Duration::from_secs(75),
        body: Duration::from_secs(60),
        write: Duration::from_secs(60),
    };
}

#[derive(Debug, Clone)]
pub struct Admin {
    pub listen: SocketAddr,
    /// Bearer token for `/admin/*`. `None` means the admin API answers 401 to everything.
    pub token: Option<Secret>,
    pub metrics_public: bool,
    /// App roles whose holders may use the admin API with a JWT of a `client_auth.jwt` issuer
    /// (its `roles` claim holding one of them) instead of the token. Empty: the token only.
    pub jwt_roles: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreKind {
    Memory,
    Redis,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnStoreError {
    FailOpen,
    FailClosed,
}

#[derive(Debug, Clone)]
pub struct StateConfig {
    pub store: StoreKind,
    /// As written; its form is checked ([`crate::RedisAddress`]).
    pub redis_url: Option<String>,
    /// PEM file of the CA(s) that signed the Redis servers' certificates, for `rediss` URLs;
    /// `None`: the system's roots.
    pub redis_ca_file: Option<PathBuf>,
    pub on_store_error: OnStoreError,
    /// Every Redis key starts with `{<key_prefix>:`, so gateways (or test runs) that share one
    /// Redis but not their limits stay apart. Default `onedoor`.
    pub key_prefix: String,
}

#[derive(Debug, Clone)]
pub struct UsageConfig {
    /// `sqlite://PATH`, `postgres://...`, or `off`, as written.
    pub store: String,
    /// Where records spill while the store cannot take them; `None`: next to an SQLite file,
    /// or the working directory for Postgres.
    pub journal_dir: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct Routing {
    /// Completion tokens reserved against token limits for a request that sets no `max_tokens`.
    pub default_max_tokens: u64,
    pub max_attempts: u32,
    pub same_target_retries: u32,
    pub max_retry_wait: Duration,
    pub not_served_ttl: Duration,
    pub timeouts: Timeouts,
}

/// The `realtime` section: a session with no text or binary frame either way for `idle` is
/// closed, and every session ends after `max_session`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Realtime {
    pub idle: Duration,
    pub max_session: Duration,
}

/// Fully resolved timeouts (a backend's own values override `routing.timeouts`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    pub connect: Duration,
    pub first_token: Duration,
    pub idle: Duration,
    pub total: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(2),
            first_token: Duration::from_secs(60),
            idle: Duration::from_secs(30),
            total: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Provider {
    Azure,
    OpenAi,
    Anthropic,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Azure => "azure",
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Limits {
    pub rpm: Option<u64>,
    pub tpm: Option<u64>,
    pub max_in_flight: Option<u64>,
    pub max_sessions: Option<u64>,
    pub tokens_per_day: Option<u64>,
    pub usd_per_month: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct HealthCheck {
    pub path: String,
    pub interval: Duration,
}

#[derive(Debug, Clone)]
pub struct Backend {
    pub name: Arc<str>,
    pub provider: Provider,
    /// Base URL without a trailing slash.
    pub url: String,
    pub region: Arc<str>,
    pub api_key: Option<Secret>,
    /// An Entra ID token instead of `api_key`: which identity, for which scope.
    pub identity: Option<BackendIdentity>,
    /// Azure only: deployment paths (the default) or the v1 API.
    pub azure_api: AzureApi,
    /// Azure only; defaults to `2024-10-21`.
    pub api_version: String,
    /// Anthropic only; defaults to `2023-06-01`.
    pub anthropic_version: String,
    pub limits: Limits,
    pub circuit_breaker: Option<String>,
    pub timeouts: Timeouts,
    pub health_check: Option<HealthCheck>,
}

/// Index of an identity in `Snapshot::identities`.
pub type IdentityId = usize;

/// Which of Azure OpenAI's URL styles a backend is called on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AzureApi {
    /// `/openai/deployments/{deployment}/...?api-version=...`.
    #[default]
    Deployments,
    /// `/openai/v1/...`, the deployment in the body's `model`, no `api-version`.
    V1,
}

/// A backend reached with an identity's token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendIdentity {
    pub identity: IdentityId,
    /// The OAuth scope the token is asked for (`https://cognitiveservices.azure.com/.default`).
    pub scope: String,
}

/// An identity the gateway gets Entra ID tokens for, every setting resolved (the environment
/// variables Azure sets included) when the config is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub name: Arc<str>,
    pub source: TokenSource,
}

/// Where an identity's tokens come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// The instance metadata service (VM, VMSS, AKS node), or App Service / Container Apps /
    /// Functions (`IDENTITY_ENDPOINT` with `IDENTITY_HEADER`).
    ManagedIdentity {
        endpoint: ManagedEndpoint,
        /// A user-assigned identity; `None`: the system-assigned one.
        client_id: Option<String>,
    },
    /// AKS workload identity: the federated token in `token_file` (re-read at every refresh)
    /// exchanged for an Entra ID token at `token_url`.
    WorkloadIdentity {
        token_url: String,
        client_id: String,
        token_file: PathBuf,
    },
    /// A service principal's client secret, exchanged at `token_url`.
    ClientSecret {
        token_url: String,
        client_id: String,
        client_secret: Secret,
    },
}

/// The managed identity endpoint a process on Azure asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManagedEndpoint {
    /// `GET {url}?api-version=2018-02-01&resource=...` with `Metadata: true`.
    Imds { url: String },
    /// `GET {url}?api-version=2019-08-01&resource=...` with `X-IDENTITY-HEADER`.
    AppService { url: String, header: Secret },
}

impl TokenSource {
    /// The kind as the config writes it.
    pub fn kind(&self) -> &'static str {
        match self {
            TokenSource::ManagedIdentity { .. } => "managed_identity",
            TokenSource::WorkloadIdentity { .. } => "workload_identity",
            TokenSource::ClientSecret { .. } => "client_secret",
        }
    }
}

/// One status class a breaker rule counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailureKind {
    Status { from: u16, to: u16 },
    ConnectError,
    Timeout,
}

#[derive(Debug, Clone, PartialEq)]
pub enum FailureThreshold {
    Count(u32),
    Percent { percent: f64, min_requests: u32 },
}

/// What a counted failure is held against: one target (backend and deployment or model), or the
/// whole backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerScope {
    Target,
    Backend,
}

/// How a failed probe re-opens: the rule's `trip` times `factor` for each consecutive failed
/// probe, at most `max` (and never less than `trip`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerBackoff {
    pub factor: f64,
    pub max: Duration,
}

impl BreakerBackoff {
    /// `backoff: { factor: 2, max: 30s }`: a target that recovers is probed again, and back,
    /// within 30 s (or its `trip`, when longer).
    pub const DEFAULT: BreakerBackoff = BreakerBackoff {
        factor: 2.0,
        max: Duration::from_secs(30),
    };
}

#[derive(Debug, Clone, PartialEq)]
pub struct BreakerRule {
    pub name: String,
    pub threshold: FailureThreshold,
    pub within: Duration,
    pub status: Vec<FailureKind>,
    pub trip: Duration,
    pub accept_retry_after: bool,
    /// `None`: by the failure, HTTP statuses and response timeouts against the target,
    /// connection failures and connect timeouts against the backend.
    pub scope: Option<BreakerScope>,
    pub backoff: BreakerBackoff,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BreakerPolicy {
    pub name: String,
    pub rules: Vec<BreakerRule>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Price {
    pub input_per_1m: f64,
    pub output_per_1m: f64,
    /// What the same tokens cost through the batch API; half the normal price unless written.
    pub batch_input_per_1m: f64,
    pub batch_output_per_1m: f64,
}

impl Price {
    /// The synchronous price of a target, with batch prices at half of it.
    pub fn new(input_per_1m: f64, output_per_1m: f64) -> Price {
        Price {
            input_per_1m,
            output_per_1m,
            batch_input_per_1m: input_per_1m / 2.0,
            batch_output_per_1m: output_per_1m / 2.0,
        }
    }

    /// The batch prices as a price of their own, for the code that prices batch usage.
    pub fn for_batches(&self) -> Price {
        Price {
            input_per_1m: self.batch_input_per_1m,
            output_per_1m: self.batch_output_per_1m,
            ..*self
        }
    }
}

/// One (backend, deployment or model) entry of an alias.
#[derive(Debug, Clone)]
pub struct Target {
    pub backend: BackendId,
    /// The deployment (Azure) or model (OpenAI, Anthropic) name sent upstream. `None` only on
    /// `"*"` targets: the requested name is used.
    pub deployment: Option<Arc<str>>,
    /// Lower is preferred; default 1.
    pub priority: u32,
    /// Default 1; zero is rejected by validation.
    pub weight: u32,
    pub price: Option<Price>,
    pub accepts_prefill: bool,
    /// A batch deployment (Azure global batch): it takes batches only, never synchronous calls.
    pub batch: bool,
}

#[derive(Debug, Clone)]
pub struct Alias {
    pub name: String,
    pub targets: Vec<Target>,
    pub continue_cut_streams: bool,
    pub session_affinity: bool,
    pub price: Option<Price>,
}

/// Who a caller is inside its tenant: a client key, or a JWT principal (which counts exactly as a
/// key does: its id is the `key_id` of usage records, limits and traces).
#[derive(Debug, Clone)]
pub struct Key {
    pub id: Arc<str>,
    /// Unix seconds until which this key may ask for decision traces.
    pub trace_until: Option<i64>,
    pub limits: Limits,
    /// Aliases this key may use, within its tenant's; `None`: the tenant's. Keys made through
    /// the admin API may narrow them; the config's keys never do.
    pub models: Option<Vec<String>>,
    /// A monthly budget in dollars (admin API keys only); `limits.usd_per_month` already holds
    /// it, this says that a refusal at it is a spent budget rather than a quota.
    pub usd_budget: Option<f64>,
    pub origin: KeyOrigin,
}

/// Where a key was made: written in the config, or through the admin API (whose keys are
/// always metered, so their spend is known).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyOrigin {
    Config,
    Runtime,
}

impl Key {
    /// Whether this key (its own list; the tenant's is checked apart) may call `alias`.
    pub fn may_use(&self, alias: &str) -> bool {
        match &self.models {
            None => true,
            Some(list) => list.iter().any(|m| m == alias),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Tenant {
    pub name: Arc<str>,
    pub keys: Vec<Key>,
    /// Callers that present a JWT with a matching claim, besides (or instead of) keys.
    pub principals: Vec<Principal>,
    /// Aliases this tenant may use; `None` means every alias (and `"*"`).
    pub models: Option<Vec<String>>,
    /// Region names (groups already expanded) this tenant's requests may go to; `None` means any.
    pub regions: Option<Vec<String>>,
    pub limits: Limits,
}

impl Tenant {
    /// Every caller identity of this tenant: its keys, then its principals.
    pub fn callers(&self) -> impl Iterator<Item = &Key> {
        self.keys
            .iter()
            .chain(self.principals.iter().map(|p| &p.key))
    }

    /// Whether this tenant may call `alias`; requests through the `"*"` discovery alias ask for `"*"`.
    pub fn may_use(&self, alias: &str) -> bool {
        match &self.models {
            None => true,
            Some(list) => list.iter().any(|m| m == alias),
        }
    }

    pub fn may_reach(&self, region: &str) -> bool {
        match &self.regions {
            None => true,
            Some(list) => list.iter().any(|r| r == region),
        }
    }
}

/// The `client_auth` section, compiled.
#[derive(Debug, Clone, Default)]
pub struct ClientAuth {
    /// Issuers whose tokens are checked; empty: every credential is a client key.
    pub jwt: Vec<JwtIssuer>,
    /// For each claim some principal names (in the order first named): the claim's value ->
    /// the principals it picks, as (tenant, index into that tenant's `principals`), in file order.
    pub principals: Vec<(Arc<str>, ClaimValues)>,
}

/// One claim's values -> the principals each picks, as (tenant, index into its `principals`).
pub type ClaimValues = Lookup<String, Vec<(TenantId, usize)>>;

/// One trusted OIDC issuer (`client_auth.jwt[]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtIssuer {
    /// The `iss` a token must carry, exactly as written.
    pub issuer: String,
    /// A token's `aud` must name one of these.
    pub audiences: Vec<String>,
    /// Where the signing keys are; `None`: the `jwks_uri` of the issuer's
    /// `/.well-known/openid-configuration`.
    pub jwks_url: Option<String>,
    /// A token with a `kid` the cached keys lack refetches them at most this often (so forged
    /// `kid`s cannot make the gateway hammer the issuer). Default 1m.
    pub refetch_interval: Duration,
}

/// A tenant's JWT caller (`tenants[].principals[]`): a token whose `claim` is (or, for a list
/// claim such as `roles`, holds) `equals`.
#[derive(Debug, Clone)]
pub struct Principal {
    pub key: Key,
    pub claim: Arc<str>,
    pub equals: String,
    /// Index into `ClientAuth::jwt` of the one issuer whose tokens may be this principal;
    /// `None`: any configured issuer's.
    pub issuer: Option<usize>,
}
