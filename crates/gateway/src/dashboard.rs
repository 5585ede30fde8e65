//! The operator dashboard on the admin port: pages (`GET /dashboard`, the overview, and
//! `GET /dashboard/keys`, runtime keys; their scripts, style and icon built into the binary) that
//! carry no data, and `GET /admin/dashboard`, everything the overview shows in one answer, behind
//! the admin token like the rest of the admin API (the keys page uses `/admin/keys`).

use bytes::Bytes;
use http::{header, HeaderValue, Method, Response};

use crate::body::{full, Body};
use crate::runtime::Runtime;

const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");
const STYLE: &str = include_str!("dashboard/dashboard.css");
const ICON: &str = include_str!("dashboard/icon.svg");
const KEYS_PAGE: &str = include_str!("dashboard/keys.html");
const KEYS_SCRIPT: &str = include_str!("dashboard/keys.js");

/// The page loads its own script, style and icon and talks to this port only; nothing inline,
/// nothing from elsewhere.
const POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The page or one of its files, for a `GET` of its path; `None` for every other request.
pub fn asset(method: &Method, path: &str) -> Option<Response<Body>> {
    if method != Method::GET {
        return None;
    }
    let (text, content_type) = match path {
        "/dashboard" | "/dashboard/" => (PAGE, "text/html; charset=utf-8"),
        "/dashboard/dashboard.js" => (SCRIPT, "text/javascript; charset=utf-8"),
        "/dashboard/dashboard.css" => (STYLE, "text/css; charset=utf-8"),
        "/dashboard/icon.svg" => (ICON, "image/svg+xml"),
        "/dashboard/keys" | "/dashboard/keys/" => (KEYS_PAGE, "text/html; charset=utf-8"),
        "/dashboard/keys.js" => (KEYS_SCRIPT, "text/javascript; charset=utf-8"),
        _ => return None,
    };
    let mut response = Response::new(full(Bytes::from_static(text.as_bytes())));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    Some(response)
}

/// `GET /admin/dashboard`: backends, tenants, the last hour's history and the recent errors.
pub async fn data(runtime: &Runtime) -> serde_json::Value {
    let now = onedoor_state::now_ms();
    let mut backends = crate::admin::backends(runtime).await;
    let tenants = crate::admission::usage_view(runtime).await;
    let activity = &runtime.metrics.activity;
    let mut points = activity.history();
    let totals = activity.now(now);
    let oldest = points.first();
    let errors = serde_json::json!({
        "since_ms": oldest.map_or(activity.started_ms(), |p| p.at_ms),
        "by_code": activity.errors_between(oldest, &totals),
        "recent": activity.recent_errors(),
    });
    // The samples of the hour and the totals now, cumulative since the gateway started.
    points.push(totals);
    serde_json::json!({
        "now_ms": now,
        "version": env!("CARGO_PKG_VERSION"),
        "backends": backends["backends"].take(),
        "tenants": tenants["tenants"],
        "state_store": tenants["state_store"],
        "history": {
            "every_ms": crate::activity::SAMPLE_EVERY.as_millis() as u64,
            "started_ms": activity.started_ms(),
            "points": points,
        },
        "errors": errors,
        "open_batches": crate::batch::open_batches(runtime).await,
    })
}
