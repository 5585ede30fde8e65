//! The upstream client: pooled keep-alive connections per backend and lane (HTTP/1.1 and h2,
//! rustls for https), and one attempt's transport outcome with its timeouts.

mod pool;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper_rustls::builderstates::WantsSchemes;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use onedoor_config::Backend;
use tokio::time::Instant;

use crate::provider::WireRequest;

pub use pool::{Pool, UpstreamBody};

/// The TCP and rustls connector every upstream connection goes through: `http` or `https` URLs,
/// the webpki roots, h2 offered by ALPN when `http2` is set.
pub fn connector(connect_timeout: Duration, http2: bool) -> HttpsConnector<HttpConnector> {
    let tls = HttpsConnectorBuilder::new().with_webpki_roots();
    connector_with(tls, connect_timeout, http2)
}

/// [`connector`] with its TLS settings given (tests trust their own certificate).
fn connector_with(
    tls: HttpsConnectorBuilder<WantsSchemes>,
    connect_timeout: Duration,
    http2: bool,
) -> HttpsConnector<HttpConnector> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    let builder = tls.https_or_http().enable_http1();
    match http2 {
        true => builder.enable_http2().wrap_connector(http),
        false => builder.wrap_connector(http),
    }
}

/// Error bodies are read to classify them (not-served, context length); more than this is not an
/// error body anyone needs.
const MAX_ERROR_BODY: usize = 1 << 20;

/// One pool per lane, and one for work off the lanes (health probes): a request borrows pooled
/// connections that its own lane drives.
#[derive(Clone)]
pub struct LaneClients {
    off: Pool,
    lanes: Vec<Pool>,
}

impl LaneClients {
    pub fn new(backend: &Backend) -> LaneClients {
        let pool = || Pool::new(backend.timeouts.connect);
        LaneClients {
            off: pool(),
            lanes: (0..crate::lanes::count()).map(|_| pool()).collect(),
        }
    }

    /// The pool of the lane this thread runs.
    pub fn here(&self) -> &Pool {
        crate::lanes::current()
            .checked_sub(1)
            .and_then(|lane| self.lanes.get(lane))
            .unwrap_or(&self.off)
    }
}

/// Whether pools built for `before` serve `after` as well (all they read), so a reload can keep
/// them.
pub fn client_fits(before: &Backend, after: &Backend) -> bool {
    before.timeouts.connect == after.timeouts.connect
}

/// How an attempt failed before it produced a usable answer.
#[derive(Debug)]
pub enum Failure {
    ConnectError(String),
    /// The connection closed or reset before a whole response arrived.
    Reset(String),
    ConnectTimeout,
    FirstTokenTimeout,
    /// The request's total time ran out.
    Timeout,
    /// No credential could be had for the backend: its identity's token endpoint is failing.
    /// Nothing was sent.
    AuthUnavailable(String),
    /// The upstream answered with a non-success status; its body has been read.
    Status {
        status: StatusCode,
        headers: HeaderMap,
        body: Bytes,
    },
}

impl Failure {
    /// What went wrong at the transport level, for logs (never a body, which may echo a prompt).
    pub fn detail(&self) -> &str {
        match self {
            Failure::ConnectError(detail)
            | Failure::Reset(detail)
            | Failure::AuthUnavailable(detail) => detail,
            Failure::ConnectTimeout => "connect timeout",
            Failure::FirstTokenTimeout => "first token timeout",
            Failure::Timeout => "total timeout",
            Failure::Status { .. } => "error status",
        }
    }

    /// The outcome word of `x-onedoor-attempts`.
    pub fn label(&self) -> Outcome {
        match self {
            Failure::ConnectError(_) => "connect_error".into(),
            Failure::Reset(_) => "reset".into(),
            Failure::ConnectTimeout | Failure::Timeout => "timeout".into(),
            Failure::FirstTokenTimeout => "first_token_timeout".into(),
            Failure::AuthUnavailable(_) => "auth_unavailable".into(),
            Failure::Status { status, .. } => status.as_u16().to_string().into(),
        }
    }
}

/// An attempt's outcome word: a status code or a failure kind, borrowed when it is a constant.
pub type Outcome = std::borrow::Cow<'static, str>;

/// Sends one request and waits for its response headers, at most until `first_token_by`.
/// A non-success answer is read whole so it can be classified.
pub async fn send(
    pool: &Pool,
    wire: WireRequest,
    first_token_by: Instant,
    deadline: Instant,
) -> Result<Response<UpstreamBody>, Failure> {
    let mut request = Request::post(wire.uri);
    if let Some(headers) = request.headers_mut() {
        *headers = wire.headers;
    }
    let request = request
        .body(wire.body)
        .map_err(|e| Failure::ConnectError(e.to_string()))?;
    // Boxed, as hyper-util's client does: the pool's future is large, and inline it would grow
    // every future that awaits an attempt, each moved (copied) as it is built.
    let asked = Box::pin(pool.request(request));
    let response = match tokio::time::timeout_at(first_token_by.min(deadline), asked).await {
        Err(_) if first_token_by < deadline => return Err(Failure::FirstTokenTimeout),
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(failure)) => return Err(failure),
        Ok(Ok(response)) => response,
    };
    if response.status().is_success() {
        return Ok(response);
    }
    let (parts, body) = response.into_parts();
    let body = match tokio::time::timeout_at(deadline, Limited::new(body, MAX_ERROR_BODY).collect())
        .await
    {
        Err(_) => return Err(Failure::Timeout),
        Ok(Err(error)) => return Err(Failure::Reset(error.to_string())),
        Ok(Ok(collected)) => collected.to_bytes(),
    };
    Err(Failure::Status {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// The error and its causes in one line, for logs.
pub(crate) fn describe(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
