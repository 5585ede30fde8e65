//! The admin API on its own port, behind the admin bearer token: backends with their learned
//! state (not-served deployments, cooldowns).

use std::sync::Arc;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::{header, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use onedoor_state::now_ms;
use sha2::{Digest, Sha256};

use crate::auth::presented_key;
use crate::body::{full, Body};
use crate::runtime::Runtime;

pub async fn handle(runtime: Arc<ArcSwap<Runtime>>, request: Request<Incoming>) -> Response<Body> {
    let runtime = runtime.load_full();
    let path = request.uri().path();
    if path == "/healthz" {
        return answer(StatusCode::OK, r#"{"status":"ok"}"#.into());
    }
    if !authorized(&runtime, &request) {
        return answer(
            StatusCode::UNAUTHORIZED,
            r#"{"error":{"message":"the admin API needs `Authorization: Bearer <admin.token>`","type":"authentication_error","param":null,"code":"invalid_api_key"}}"#.into(),
        );
    }
    match (request.method().as_str(), path) {
        ("GET", "/admin/backends") => answer(StatusCode::OK, backends(&runtime).to_string()),
        _ => answer(
            StatusCode::NOT_FOUND,
            r#"{"error":{"message":"no such admin endpoint","type":"invalid_request_error","param":null,"code":"invalid_request"}}"#.into(),
        ),
    }
}

/// Compares digests, so the time taken says nothing about how much of the token matched.
fn authorized(runtime: &Runtime, request: &Request<Incoming>) -> bool {
    let Some(token) = runtime.snapshot.admin.token.as_ref() else {
        return false;
    };
    let Some(presented) = presented_key(request.headers()) else {
        return false;
    };
    Sha256::digest(presented.as_bytes()) == Sha256::digest(token.expose().as_bytes())
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

fn backends(runtime: &Runtime) -> serde_json::Value {
    let now = now_ms();
    let not_served = runtime.state.not_served(now);
    let cooldowns = runtime.state.cooldowns(now);
    let entries = |list: &[onedoor_state::Entry], name: &str| -> Vec<serde_json::Value> {
        list.iter()
            .filter(|e| e.key.backend == name)
            .map(|e| serde_json::json!({"deployment": e.key.deployment, "expires_in_ms": e.until_ms.saturating_sub(now)}))
            .collect()
    };
    let list: Vec<serde_json::Value> = runtime
        .snapshot
        .backends
        .iter()
        .map(|b| {
            serde_json::json!({
                "name": b.name,
                "provider": b.provider.as_str(),
                "region": b.region,
                "url": b.url,
                "not_served": entries(&not_served, &b.name),
                "cooling_down": entries(&cooldowns, &b.name),
            })
        })
        .collect();
    serde_json::json!({ "backends": list })
}
