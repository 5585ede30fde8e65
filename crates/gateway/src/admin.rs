//! The admin API on its own port, behind the admin bearer token: backends with their learned
//! state (not-served deployments, cooldowns, drained, health), tenants' usage against their
//! limits, drains, config reloads, the operator dashboard's data, and runtime client keys
//! (`client_keys::api`).

use std::sync::Arc;

use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use onedoor_state::{now_ms, MeterKey, State};
use sha2::{Digest, Sha256};

use crate::auth::presented_key;
use crate::body::{full, Body, RequestBody};
use crate::reload::{Live, ReloadError};
use crate::runtime::Runtime;

/// Admin requests carry no body worth more than this.
pub const MAX_BODY: u64 = 64 * 1024;

/// The admin port's connections: few, from operators and scrapers, held to the client port's
/// default deadlines.
pub const LIMITS: crate::server::Limits = crate::server::Limits {
    max_connections: 256,
    timeouts: onedoor_config::ClientTimeouts::DEFAULT,
};

pub async fn handle(live: Arc<Live>, request: Request<RequestBody>) -> Response<Body> {
    let runtime = live.current();
    let path = request.uri().path();
    if path == "/healthz" {
        return answer(StatusCode::OK, r#"{"status":"ok"}"#.into());
    }
    // The probes a platform points at the admin port, which answers until the client port is done.
    if path == "/readyz" {
        return Box::pin(crate::readiness::answer(&runtime)).await;
    }
    // The page carries no data: what it shows comes from `/admin/dashboard`, behind the token.
    if let Some(page) = crate::dashboard::asset(request.method(), path) {
        return page;
    }
    if path == "/admin/openapi.json" && request.method() == http::Method::GET {
        return crate::client_keys::api::openapi();
    }
    let public = path == "/metrics" && runtime.snapshot.admin.metrics_public;
    let admin = match public {
        true => Some("metrics_public".to_owned()),
        false => Box::pin(admin_of(&runtime, &request)).await,
    };
    let Some(admin) = admin else {
        return answer(
            StatusCode::UNAUTHORIZED,
            r#"{"error":{"message":"the admin API needs `Authorization: Bearer <admin.token>` (or a JWT with a role of admin.jwt_roles)","type":"authentication_error","param":null,"code":"invalid_api_key"}}"#.into(),
        );
    };
    if path.starts_with("/admin/keys") || path == "/admin/audit" {
        let actor = actor(admin, &request);
        let answer = crate::client_keys::api::handle(&runtime, request, actor).await;
        return answer.unwrap_or_else(|| not_found("no such admin endpoint".into()));
    }
    match (request.method().as_str(), path) {
        ("GET", "/admin/backends") => answer(StatusCode::OK, backends(&runtime).await.to_string()),
        ("GET", "/admin/dashboard") => answer(
            StatusCode::OK,
            crate::dashboard::data(&runtime).await.to_string(),
        ),
        ("GET", "/admin/tenants") => answer(
            StatusCode::OK,
            crate::admission::usage_view(&runtime).await.to_string(),
        ),
        ("GET", "/metrics") => metrics(&runtime).await,
        ("GET", p) if p.starts_with("/admin/traces/") => {
            let id = p.trim_start_matches("/admin/traces/");
            match crate::trace::find(&runtime, id).await {
                Some(trace) => answer(StatusCode::OK, trace),
                None => answer(
                    StatusCode::NOT_FOUND,
                    r#"{"error":{"message":"no such trace (unknown or expired)","type":"invalid_request_error","param":null,"code":"invalid_request"}}"#.into(),
                ),
            }
        }
        ("POST", "/admin/reload") => reload(&live).await,
        ("POST", p) if p.ends_with("/drain") || p.ends_with("/undrain") => drain(&runtime, p),
        _ => answer(
            StatusCode::NOT_FOUND,
            r#"{"error":{"message":"no such admin endpoint","type":"invalid_request_error","param":null,"code":"invalid_request"}}"#.into(),
        ),
    }
}

/// Who the request's credential makes an admin: `admin.token`, or the JWT caller whose role is
/// one of `admin.jwt_roles`; `None` for anyone else.
async fn admin_of(runtime: &Runtime, request: &Request<RequestBody>) -> Option<String> {
    if authorized(runtime, request) {
        return Some("admin.token".to_owned());
    }
    let credential = presented_key(request.headers())?;
    let roles_allowed = !runtime.snapshot.admin.jwt_roles.is_empty();
    if !roles_allowed || !crate::jwt::applies(&runtime.snapshot, credential) {
        return None;
    }
    match crate::jwt::admin(runtime, credential).await {
        Ok(who) => Some(who),
        Err(error) => {
            tracing::info!(%error, "an admin API call with a JWT was refused");
            None
        }
    }
}

/// Compares digests, so the time taken says nothing about how much of the token matched.
fn authorized(runtime: &Runtime, request: &Request<RequestBody>) -> bool {
    let Some(token) = runtime.snapshot.admin.token.as_ref() else {
        return false;
    };
    let Some(presented) = presented_key(request.headers()) else {
        return false;
    };
    Sha256::digest(presented.as_bytes()) == Sha256::digest(token.expose().as_bytes())
}

/// Who makes a change, for the audit: the admin (the token, or a JWT's subject), and the name an
/// `x-onedoor-actor` header gives (a person, a pipeline), when there is one.
fn actor(admin: String, request: &Request<RequestBody>) -> String {
    const MAX: usize = 100;
    let named = request
        .headers()
        .get("x-onedoor-actor")
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.trim()
                .chars()
                .filter(|c| !c.is_control())
                .take(MAX)
                .collect::<String>()
        })
        .filter(|v| !v.is_empty());
    match named {
        Some(name) => format!("{admin} ({name})"),
        None => admin,
    }
}

fn answer(status: StatusCode, body: String) -> Response<Body> {
    let mut response = Response::new(full(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

async fn metrics(runtime: &Runtime) -> Response<Body> {
    let text = runtime.metrics.scrape(runtime).await;
    let mut response = Response::new(full(Bytes::from(text)));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(crate::metrics::CONTENT_TYPE),
    );
    response
}

/// `GET /admin/backends`, also part of the dashboard's data.
pub(crate) async fn backends(runtime: &Runtime) -> serde_json::Value {
    let now = now_ms();
    let not_served = runtime.state.not_served().await.unwrap_or_default();
    let cooldowns = runtime.state.cooldowns().await.unwrap_or_default();
    let entries = |list: &[onedoor_state::Entry], name: &str| -> Vec<serde_json::Value> {
        list.iter()
            .filter(|e| e.key.backend == name)
            .map(|e| serde_json::json!({"deployment": e.key.deployment, "expires_in_ms": e.remaining_ms}))
            .collect()
    };
    let backends = &runtime.snapshot.backends;
    let metered: Vec<usize> = (0..backends.len())
        .filter(|&i| runtime.load(i).is_some_and(|l| l.metered()))
        .collect();
    let keys: Vec<MeterKey> = metered
        .iter()
        .filter_map(|&i| backends.get(i))
        .map(|b| MeterKey::backend(&b.name))
        .collect();
    let usage = runtime.state.usage(&keys).await.unwrap_or_default();
    let shared = |i: usize| {
        metered
            .iter()
            .position(|&m| m == i)
            .and_then(|k| usage.get(k).copied())
    };
    let mut list = Vec::with_capacity(backends.len());
    for (i, b) in backends.iter().enumerate() {
        let breaker = breaker(runtime, i, now).await;
        list.push({
            let load = runtime.load(i).map(|l| l.view(&b.limits, shared(i), now));
            let flags = runtime.fleet.get(i);
            serde_json::json!({
                "name": b.name,
                "load": load,
                "provider": b.provider.as_str(),
                "region": b.region,
                "url": b.url,
                "not_served": entries(&not_served, &b.name),
                "cooling_down": entries(&cooldowns, &b.name),
                "drained": flags.is_some_and(|f| f.drained()),
                "healthy": flags.is_none_or(|f| f.healthy()),
                "last_check": flags.and_then(|f| f.last_check()).map(|c| c.view(now)),
                "breaker": breaker,
            })
        });
    }
    serde_json::json!({ "backends": list })
}

/// A backend's circuit breakers: its own (connection failures) and, in `targets`, each target's;
/// one without `circuit_breaker:` is always closed.
async fn breaker(runtime: &Runtime, backend: usize, now: u64) -> serde_json::Value {
    match runtime.breakers.view(backend, now).await {
        Some(view) => {
            let mut own = circuit(&view.own);
            own["policy"] = view.policy.into();
            own["targets"] = view.targets.iter().map(circuit).collect();
            own
        }
        None => {
            serde_json::json!({"state": "closed", "policy": null, "next_probe_in_ms": null, "trips": 0, "reopens": 0, "targets": []})
        }
    }
}

fn circuit(view: &crate::breaker::CircuitView) -> serde_json::Value {
    let mut out = serde_json::json!({
        "state": view.state.as_str(),
        "next_probe_in_ms": view.next_probe_in_ms,
        "trips": view.trips,
        "reopens": view.reopens,
    });
    if let Some(deployment) = &view.deployment {
        out["deployment"] = deployment.as_ref().into();
    }
    out
}

/// `POST /admin/backends/{name}/drain` or `/undrain`: in or out of rotation; requests already
/// under way finish.
fn drain(runtime: &Runtime, path: &str) -> Response<Body> {
    let target = path.strip_prefix("/admin/backends/").and_then(|rest| {
        rest.strip_suffix("/undrain")
            .map(|name| (name, false))
            .or_else(|| rest.strip_suffix("/drain").map(|name| (name, true)))
    });
    let Some((name, drained)) = target else {
        return not_found("no such admin endpoint".into());
    };
    let flags = runtime
        .snapshot
        .backend_by_name
        .get(name)
        .and_then(|&id| runtime.fleet.get(id));
    let Some(flags) = flags else {
        return not_found(format!(
            "no backend named `{name}`; GET /admin/backends lists them"
        ));
    };
    flags.set_drained(drained);
    tracing::info!(
        backend = name,
        drained,
        "drain changed through the admin API"
    );
    let body = serde_json::json!({"backend": name, "drained": drained});
    answer(StatusCode::OK, body.to_string())
}

fn not_found(message: String) -> Response<Body> {
    let body = serde_json::json!({"error": {"message": message, "type": "not_found_error", "param": null, "code": "not_found"}});
    answer(StatusCode::NOT_FOUND, body.to_string())
}

/// `POST /admin/reload`: 200 with what now runs, or 400 with every located problem.
async fn reload(live: &Live) -> Response<Body> {
    let (status, body) = match live.reload().await {
        Ok(summary) => (
            StatusCode::OK,
            serde_json::json!({
                "status": "reloaded",
                "summary": summary.text,
                "backends": summary.backends,
                "aliases": summary.aliases,
                "tenants": summary.tenants,
                "needs_restart": summary.needs_restart,
            }),
        ),
        Err(error) => {
            let problems: Vec<String> = match &error {
                ReloadError::Invalid(problems) => {
                    problems.iter().map(ToString::to_string).collect()
                }
                ReloadError::NoSource => Vec::new(),
            };
            let status = match error {
                ReloadError::Invalid(_) => StatusCode::BAD_REQUEST,
                ReloadError::NoSource => StatusCode::CONFLICT,
            };
            (
                status,
                serde_json::json!({"error": error.to_string(), "problems": problems}),
            )
        }
    };
    answer(status, body.to_string())
}
