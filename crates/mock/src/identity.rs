//! A simulated Microsoft Entra ID for the gateway's outbound identities: the instance metadata
//! service's token endpoint (`GET /metadata/identity/oauth2/token`, `Metadata: true`), App
//! Service's identity endpoint (`GET /msi/token`, `X-IDENTITY-HEADER`), and the tenant token
//! endpoint (`POST /{tenant}/oauth2/v2.0/token`, client credentials with a client secret or a
//! client assertion). Its tokens are short-lived JWT-shaped strings signed with a key every mock
//! endpoint knows, so an Azure or Anthropic endpoint with an `entra_audience` checks their
//! signature, audience and expiry without asking it. Its control surface counts token requests
//! (`GET /_mock/stats`), goes down or changes the lifetime (`PUT /_mock/behavior`) and resets
//! (`POST /_mock/reset`).

use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{HeaderMap, Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::dialect::{self, Reject, Wire};
use crate::state::{lock, Shared};

/// What every mock endpoint signs and checks tokens with.
const SIGNING_KEY: &[u8] = b"onedoor-mock-entra-signing-key";
/// The `X-IDENTITY-HEADER` App Service style requests must carry, unless the spec says another.
pub const DEFAULT_IDENTITY_HEADER: &str = "mock-identity-header";

/// The description of a simulated identity endpoint.
#[derive(Clone, Debug)]
pub struct IdentitySpec {
    /// How long issued tokens live, in seconds.
    pub lifetime_s: u64,
    /// When set, client secret grants must present it.
    pub client_secret: Option<String>,
    /// The value App Service style requests must send in `X-IDENTITY-HEADER`.
    pub identity_header: String,
    pub listen: Option<SocketAddr>,
}

impl Default for IdentitySpec {
    fn default() -> Self {
        IdentitySpec {
            lifetime_s: 3600,
            client_secret: None,
            identity_header: DEFAULT_IDENTITY_HEADER.to_owned(),
            listen: None,
        }
    }
}

impl IdentitySpec {
    pub fn lifetime_s(mut self, seconds: u64) -> Self {
        self.lifetime_s = seconds;
        self
    }

    pub fn client_secret(mut self, secret: &str) -> Self {
        self.client_secret = Some(secret.to_owned());
        self
    }
}

/// What the control surface may change at run time.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityBehavior {
    /// Answer every token request 503, as an unreachable or failing endpoint would.
    #[serde(default)]
    pub down: bool,
    /// Overrides the spec's token lifetime.
    #[serde(default)]
    pub lifetime_s: Option<u64>,
}

/// Token requests per flow, and the last client assertion seen.
#[derive(Default)]
struct Counts {
    total: AtomicU64,
    by_flow: Mutex<std::collections::BTreeMap<&'static str, u64>>,
    last_assertion: Mutex<Option<String>>,
}

struct State {
    spec: IdentitySpec,
    behavior: Mutex<IdentityBehavior>,
    counts: Counts,
}

/// A running identity endpoint. Dropping it stops it.
pub struct IdentityServer {
    state: Arc<State>,
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl IdentityServer {
    pub async fn start(spec: IdentitySpec) -> std::io::Result<IdentityServer> {
        let bind = spec
            .listen
            .unwrap_or_else(|| SocketAddr::from((Ipv4Addr::LOCALHOST, 0)));
        let listener = TcpListener::bind(bind).await?;
        let mut addr = listener.local_addr()?;
        if addr.ip().is_unspecified() {
            addr.set_ip(Ipv4Addr::LOCALHOST.into());
        }
        let state = Arc::new(State {
            spec,
            behavior: Mutex::default(),
            counts: Counts::default(),
        });
        let task = tokio::spawn(accept(listener, state.clone()));
        Ok(IdentityServer { state, addr, task })
    }

    /// The authority host (`authority:` or `AZURE_AUTHORITY_HOST`).
    pub fn authority(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The instance-metadata-style token URL (a managed identity's `endpoint:`).
    pub fn imds_url(&self) -> String {
        format!("http://{}/metadata/identity/oauth2/token", self.addr)
    }

    /// App Service's `IDENTITY_ENDPOINT`.
    pub fn app_service_url(&self) -> String {
        format!("http://{}/msi/token", self.addr)
    }

    /// App Service's `IDENTITY_HEADER`.
    pub fn identity_header(&self) -> &str {
        &self.state.spec.identity_header
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Token requests answered with a token, in all.
    pub fn token_requests(&self) -> u64 {
        self.state.counts.total.load(Ordering::Relaxed)
    }

    /// Token requests answered with a token, by flow (`imds`, `app_service`, `client_secret`,
    /// `client_assertion`).
    pub fn token_requests_by(&self, flow: &str) -> u64 {
        lock(&self.state.counts.by_flow)
            .get(flow)
            .copied()
            .unwrap_or(0)
    }

    /// The client assertion of the last assertion grant.
    pub fn last_assertion(&self) -> Option<String> {
        lock(&self.state.counts.last_assertion).clone()
    }

    pub fn set_behavior(&self, behavior: IdentityBehavior) {
        *lock(&self.state.behavior) = behavior;
    }

    /// A token for `audience` as this endpoint would issue it (for tests of the token checks).
    pub fn mint(&self, audience: &str, lifetime_s: i64) -> String {
        mint(audience, "test", "minted", lifetime_s)
    }
}

impl Drop for IdentityServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn accept(listener: TcpListener, state: Arc<State>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                };
                let state = state.clone();
                connections.spawn(async move {
                    let service = service_fn(move |request| answer(state.clone(), request));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

type Answer = Response<Full<Bytes>>;

async fn answer(state: Arc<State>, request: Request<Incoming>) -> Result<Answer, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let path = parts.uri.path();
    let query = parts.uri.query().unwrap_or("");
    if let Some(control) = path.strip_prefix("/_mock/") {
        return Ok(control_answer(&state, &parts.method, control, &body));
    }
    if lock(&state.behavior).down {
        let body = json!({"error": "temporarily_unavailable", "error_description": "The identity endpoint is down."});
        return Ok(reply(StatusCode::SERVICE_UNAVAILABLE, &body));
    }
    let issued = match (&parts.method, path) {
        (&Method::GET, "/metadata/identity/oauth2/token") => imds(&state, &parts.headers, query),
        (&Method::GET, "/msi/token") => app_service(&state, &parts.headers, query),
        (&Method::POST, p) if p.ends_with("/oauth2/v2.0/token") => {
            let tenant = p.trim_start_matches('/').split('/').next().unwrap_or("");
            entra(&state, tenant, &body)
        }
        _ => Err(refusal(
            StatusCode::NOT_FOUND,
            "not_found",
            "No such endpoint.",
        )),
    };
    Ok(issued.unwrap_or_else(Refusal::answer))
}

/// The instance metadata service: `Metadata: true` or a 400, as Azure answers.
fn imds(state: &State, headers: &HeaderMap, query: &str) -> Result<Answer, Refusal> {
    if header(headers, "metadata") != Some("true") {
        return Err(refusal(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "Required metadata header not specified",
        ));
    }
    let resource = param(query, "resource").ok_or_else(missing_resource)?;
    let client = param(query, "client_id").unwrap_or_else(|| "system-assigned".into());
    Ok(managed_token(state, "imds", &resource, &client))
}

/// App Service and Container Apps: `X-IDENTITY-HEADER` must match.
fn app_service(state: &State, headers: &HeaderMap, query: &str) -> Result<Answer, Refusal> {
    if header(headers, "x-identity-header") != Some(state.spec.identity_header.as_str()) {
        return Err(refusal(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "The X-IDENTITY-HEADER is missing or wrong.",
        ));
    }
    let resource = param(query, "resource").ok_or_else(missing_resource)?;
    let client = param(query, "client_id").unwrap_or_else(|| "system-assigned".into());
    Ok(managed_token(state, "app_service", &resource, &client))
}

/// The managed identity endpoints' answer: every number a string, as they send it.
fn managed_token(state: &State, flow: &'static str, resource: &str, client: &str) -> Answer {
    let lifetime = lifetime(state);
    let token = mint(resource, client, flow, lifetime as i64);
    count(state, flow);
    let body = json!({
        "access_token": token,
        "expires_in": lifetime.to_string(),
        "expires_on": (unix_now() + lifetime).to_string(),
        "resource": resource,
        "token_type": "Bearer",
        "client_id": client,
    });
    reply(StatusCode::OK, &body)
}

/// The tenant token endpoint's client credentials grant.
fn entra(state: &State, tenant: &str, body: &[u8]) -> Result<Answer, Refusal> {
    let form = form(body);
    let get = |name: &str| {
        form.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    };
    if get("grant_type") != Some("client_credentials") {
        return Err(refusal(
            StatusCode::BAD_REQUEST,
            "unsupported_grant_type",
            "AADSTS70003: The app requested an unsupported grant type.",
        ));
    }
    let client = get("client_id").filter(|c| !c.is_empty()).ok_or_else(|| {
        refusal(
            StatusCode::BAD_REQUEST,
            "invalid_request",
            "AADSTS900144: The request body must contain the following parameter: 'client_id'.",
        )
    })?;
    let scope = get("scope").unwrap_or("");
    let Some(resource) = scope.strip_suffix("/.default") else {
        return Err(refusal(
            StatusCode::BAD_REQUEST,
            "invalid_scope",
            "AADSTS1002012: The provided value for scope is not valid. Client credential flows must have a scope value with /.default suffixed to the resource identifier.",
        ));
    };
    let flow = match (get("client_secret"), get("client_assertion")) {
        (Some(secret), _) => {
            let wanted = state.spec.client_secret.as_deref();
            if wanted.is_some_and(|w| w != secret) || secret.is_empty() {
                return Err(refusal(
                    StatusCode::UNAUTHORIZED,
                    "invalid_client",
                    "AADSTS7000215: Invalid client secret provided.",
                ));
            }
            "client_secret"
        }
        (None, Some(assertion))
            if get("client_assertion_type")
                == Some("urn:ietf:params:oauth:client-assertion-type:jwt-bearer")
                && !assertion.is_empty() =>
        {
            *lock(&state.counts.last_assertion) = Some(assertion.to_owned());
            "client_assertion"
        }
        _ => {
            return Err(refusal(
                StatusCode::UNAUTHORIZED,
                "invalid_client",
                "AADSTS7000218: The request body must contain the following parameter: 'client_assertion' or 'client_secret'.",
            ))
        }
    };
    let lifetime = lifetime(state);
    let token = mint(resource, client, flow, lifetime as i64);
    count(state, flow);
    tracing::debug!(tenant, flow, "mock identity issued a token");
    let body = json!({
        "token_type": "Bearer",
        "expires_in": lifetime,
        "ext_expires_in": lifetime,
        "access_token": token,
    });
    Ok(reply(StatusCode::OK, &body))
}

fn lifetime(state: &State) -> u64 {
    lock(&state.behavior)
        .lifetime_s
        .unwrap_or(state.spec.lifetime_s)
}

fn count(state: &State, flow: &'static str) {
    state.counts.total.fetch_add(1, Ordering::Relaxed);
    *lock(&state.counts.by_flow).entry(flow).or_insert(0) += 1;
}

fn control_answer(state: &State, method: &Method, path: &str, body: &[u8]) -> Answer {
    match (method, path) {
        (&Method::GET, "stats") => reply(StatusCode::OK, &stats(state)),
        (&Method::PUT, "behavior") => match serde_json::from_slice::<IdentityBehavior>(body) {
            Ok(behavior) => {
                let echo = json!(behavior);
                *lock(&state.behavior) = behavior;
                reply(StatusCode::OK, &echo)
            }
            Err(e) => reply(StatusCode::BAD_REQUEST, &json!({"error": e.to_string()})),
        },
        (&Method::POST, "reset") => {
            *lock(&state.behavior) = IdentityBehavior::default();
            state.counts.total.store(0, Ordering::Relaxed);
            lock(&state.counts.by_flow).clear();
            reply(StatusCode::OK, &stats(state))
        }
        _ => reply(
            StatusCode::NOT_FOUND,
            &json!({"error": "unknown control route; try GET /_mock/stats, PUT /_mock/behavior, POST /_mock/reset"}),
        ),
    }
}

fn stats(state: &State) -> Value {
    json!({
        "token_requests": state.counts.total.load(Ordering::Relaxed),
        "by_flow": *lock(&state.counts.by_flow),
        "behavior": *lock(&state.behavior),
    })
}

/// A token request refused, in Entra ID's error envelope.
struct Refusal {
    status: StatusCode,
    error: &'static str,
    description: &'static str,
}

impl Refusal {
    fn answer(self) -> Answer {
        let body =
            json!({"error": self.error, "error_description": self.description, "error_codes": []});
        reply(self.status, &body)
    }
}

fn refusal(status: StatusCode, error: &'static str, description: &'static str) -> Refusal {
    Refusal {
        status,
        error,
        description,
    }
}

fn missing_resource() -> Refusal {
    refusal(
        StatusCode::BAD_REQUEST,
        "invalid_request",
        "Required query variable 'resource' is missing",
    )
}

fn reply(status: StatusCode, body: &Value) -> Answer {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json; charset=utf-8"),
    );
    response
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name)?.to_str().ok()
}

fn param(query: &str, name: &str) -> Option<String> {
    form(query.as_bytes())
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v)
}

/// `a=1&b=2`, percent-decoded (`+` is a space).
fn form(body: &[u8]) -> Vec<(String, String)> {
    String::from_utf8_lossy(body)
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            (decode(name), decode(value))
        })
        .collect()
}

fn decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => match text.get(i + 1..i + 3).map(|h| u8::from_str_radix(h, 16)) {
                Some(Ok(byte)) => {
                    out.push(byte);
                    i += 2;
                }
                _ => out.push(b'%'),
            },
            byte => out.push(byte),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The claims of a mock token.
#[derive(Debug, Serialize, Deserialize)]
pub struct Claims {
    pub aud: String,
    pub iss: String,
    pub appid: String,
    /// How it was obtained: `imds`, `app_service`, `client_secret`, `client_assertion`.
    pub flow: String,
    pub iat: i64,
    /// Milliseconds, so a revocation can fall between two tokens of one second.
    pub iat_ms: u64,
    pub exp: i64,
}

/// A JWT-shaped token: `header.claims.signature`, the signature a SHA-256 over the key and the
/// first two parts.
fn mint(audience: &str, client: &str, flow: &str, lifetime_s: i64) -> String {
    let now_ms = unix_now_ms();
    let claims = Claims {
        aud: audience.trim_end_matches('/').to_owned(),
        iss: "https://sts.windows.net/mock-tenant/".to_owned(),
        appid: client.to_owned(),
        flow: flow.to_owned(),
        iat: (now_ms / 1000) as i64,
        iat_ms: now_ms,
        // Rounded up: a token lives at least as long as its expires_in says.
        exp: (now_ms as i64 + lifetime_s * 1000 + 999) / 1000,
    };
    let head = URL_SAFE_NO_PAD.encode(br#"{"typ":"JWT","alg":"MOCK256"}"#);
    let body = URL_SAFE_NO_PAD.encode(json!(claims).to_string());
    let signed = format!("{head}.{body}");
    format!("{signed}.{}", signature(&signed))
}

fn signature(signed: &str) -> String {
    let mut hasher = Sha256::new();
    hasher.update(SIGNING_KEY);
    hasher.update(signed.as_bytes());
    URL_SAFE_NO_PAD.encode(hasher.finalize())
}

/// Why a token is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenProblem {
    Malformed,
    BadSignature,
    WrongAudience,
    Expired,
    Revoked,
}

/// An endpoint's credential check: its key, or on an endpoint with an `entra_audience` a bearer
/// token from the mock identity endpoint (which must be valid: signed, for the audience,
/// unexpired, not revoked); without an `api_key` too, nothing but such a token passes.
pub fn check(shared: &Shared, wire: &dyn Wire, headers: &HeaderMap) -> Result<(), Reject> {
    let spec = &shared.spec;
    let Some(audience) = &spec.entra_audience else {
        return wire.check_headers(headers, spec.api_key.as_deref());
    };
    let refused = || Reject::TokenRefused {
        audience: audience.clone(),
    };
    let Some(token) = dialect::bearer(headers) else {
        return match spec.api_key {
            Some(_) => wire.check_headers(headers, spec.api_key.as_deref()),
            None => Err(refused()),
        };
    };
    let not_before = shared.tokens_not_before_ms.load(Ordering::Relaxed);
    verify(token, audience, not_before).map_err(|problem| {
        tracing::debug!(endpoint = %spec.name, ?problem, "mock endpoint refused a bearer token");
        refused()
    })?;
    // The dialect's other required headers (anthropic-version), without a key to check.
    wire.check_headers(headers, None)
}

/// Checks a bearer token for `audience`: signed by the mock, for that audience, not expired and
/// not issued before `not_before_ms`.
pub fn verify(token: &str, audience: &str, not_before_ms: u64) -> Result<Claims, TokenProblem> {
    let (signed, sig) = token.rsplit_once('.').ok_or(TokenProblem::Malformed)?;
    if signature(signed) != sig {
        return Err(TokenProblem::BadSignature);
    }
    let body = signed.split('.').nth(1).ok_or(TokenProblem::Malformed)?;
    let body = URL_SAFE_NO_PAD
        .decode(body)
        .map_err(|_| TokenProblem::Malformed)?;
    let claims: Claims = serde_json::from_slice(&body).map_err(|_| TokenProblem::Malformed)?;
    if claims.aud != audience.trim_end_matches('/') {
        return Err(TokenProblem::WrongAudience);
    }
    if claims.exp <= (unix_now_ms() / 1000) as i64 {
        return Err(TokenProblem::Expired);
    }
    if claims.iat_ms < not_before_ms {
        return Err(TokenProblem::Revoked);
    }
    Ok(claims)
}

fn unix_now() -> u64 {
    unix_now_ms() / 1000
}

pub fn unix_now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_checked_for_signature_audience_and_expiry() {
        let aud = "https://cognitiveservices.azure.com";
        let token = mint(aud, "c", "imds", 60);
        assert_eq!(verify(&token, aud, 0).unwrap().appid, "c");
        assert_eq!(
            verify(&token, "https://ai.azure.com", 0).unwrap_err(),
            TokenProblem::WrongAudience
        );
        let expired = mint(aud, "c", "imds", -5);
        assert_eq!(verify(&expired, aud, 0).unwrap_err(), TokenProblem::Expired);
        let forged = format!("{}x", &token[..token.len() - 1]);
        assert_eq!(
            verify(&forged, aud, 0).unwrap_err(),
            TokenProblem::BadSignature
        );
        assert_eq!(
            verify(&token, aud, u64::MAX).unwrap_err(),
            TokenProblem::Revoked
        );
    }

    #[test]
    fn forms_are_percent_decoded() {
        let pairs = form(b"scope=https%3A%2F%2Fai.azure.com%2F.default&a+b=%2B%26");
        assert_eq!(pairs[0].1, "https://ai.azure.com/.default");
        assert_eq!(pairs[1], ("a b".to_owned(), "+&".to_owned()));
    }
}
