//! The `/_mock/` control surface: stats, runtime behaviour changes and reset, over HTTP on the
//! endpoint's own port.

use std::sync::atomic::Ordering;

use hyper::http::request::Parts;
use hyper::{Method, Response, StatusCode};
use serde_json::{json, Value};

use crate::response::plain_json;
use crate::state::Shared;
use crate::stream::Body;
use crate::Behavior;

pub fn answer(shared: &Shared, parts: &Parts, body: &[u8]) -> Response<Body> {
    let path = parts.uri.path().trim_start_matches("/_mock/");
    match (&parts.method, path) {
        (&Method::GET, "stats") => plain_json(StatusCode::OK, &stats(shared)),
        (&Method::GET, "last_request") => plain_json(StatusCode::OK, &shared.last_request()),
        (&Method::PUT, "behavior") => with_behavior(body, |b| shared.set_behavior(b)),
        (&Method::POST, "reset") => {
            shared.reset_all();
            plain_json(StatusCode::OK, &stats(shared))
        }
        (&Method::PUT, p) => match deployment_of(p) {
            Some(d) => with_behavior(body, |b| shared.set_deployment_behavior(d, b)),
            None => not_found(),
        },
        _ => not_found(),
    }
}

fn stats(shared: &Shared) -> Value {
    json!({
        "endpoint": shared.spec.name,
        "total": shared.total(),
        "cancelled": shared.cancelled(),
        "connections": shared.counters.connections.load(Ordering::Relaxed),
        "deployments": shared.per_deployment(),
        "realtime": {
            "sessions": shared.realtime.sessions.load(Ordering::Relaxed),
            "open": shared.realtime.open.load(Ordering::Relaxed),
        },
    })
}

/// `deployments/{d}/behavior` → `{d}`.
fn deployment_of(path: &str) -> Option<&str> {
    let d = path
        .strip_prefix("deployments/")?
        .strip_suffix("/behavior")?;
    (!d.is_empty()).then_some(d)
}

/// Parses a behaviour and applies it, echoing it back.
fn with_behavior(body: &[u8], apply: impl FnOnce(Behavior)) -> Response<Body> {
    match serde_json::from_slice::<Behavior>(body) {
        Ok(b) => {
            let echo = json!(b);
            apply(b);
            plain_json(StatusCode::OK, &echo)
        }
        Err(e) => plain_json(StatusCode::BAD_REQUEST, &json!({"error": e.to_string()})),
    }
}

fn not_found() -> Response<Body> {
    let routes = "GET /_mock/stats, GET /_mock/last_request, PUT /_mock/behavior, PUT /_mock/deployments/{d}/behavior, POST /_mock/reset";
    plain_json(
        StatusCode::NOT_FOUND,
        &json!({"error": format!("unknown control route; try {routes}")}),
    )
}
