//! `GET /readyz`: ready when the config is loaded and the state store is reachable, or is not
//! but `on_store_error: fail_open` keeps serving (the answer says so).

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::{full, Body};
use crate::runtime::Runtime;

pub async fn answer(runtime: &Runtime) -> Response<Body> {
    let health = runtime.state.health().await;
    let body = serde_json::json!({
        "status": if health.ready { "ready" } else { "not_ready" },
        "state": {
            "store": health.store,
            "reachable": health.reachable,
            "mode": health.mode,
            "errors": health.errors,
            "outages": health.outages,
        },
    });
    let mut response = Response::new(full(Bytes::from(body.to_string())));
    if !health.ready {
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
    }
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}
