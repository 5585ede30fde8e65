//! `GET /readyz` (client and admin ports): ready when the config is loaded and the state store
//! is reachable, or is not but `on_store_error: fail_open` keeps serving (the answer says so);
//! 503 `draining` from the moment a stop begins, so load balancers send no more.

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::{full, Body};
use crate::runtime::Runtime;

pub async fn answer(runtime: &Runtime) -> Response<Body> {
    let health = runtime.state.health().await;
    let draining = runtime.stopping.draining();
    let ready = health.ready && !draining;
    let status = match (draining, health.ready) {
        (true, _) => "draining",
        (false, true) => "ready",
        (false, false) => "not_ready",
    };
    let body = serde_json::json!({
        "status": status,
        "state": {
            "store": health.store,
            "reachable": health.reachable,
            "mode": health.mode,
            "errors": health.errors,
            "outages": health.outages,
            "problem": health.problem,
        },
    });
    let mut response = Response::new(full(Bytes::from(body.to_string())));
    if !ready {
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
