//! The admin API over HTTP, for the commands that drive it (`onedoor keys ...`): the URL from
//! `--admin-url`, the token from `ONEDOOR_ADMIN_TOKEN` (never a flag, so it stays out of
//! process listings and shell history).

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::Failure;

/// The environment variable the admin token is read from.
pub const TOKEN_ENV: &str = "ONEDOOR_ADMIN_TOKEN";

pub struct AdminClient {
    base: String,
    token: String,
    actor: String,
}

impl AdminClient {
    pub fn new(admin_url: &str) -> Result<AdminClient, Failure> {
        let token = std::env::var(TOKEN_ENV)
            .ok()
            .filter(|t| !t.trim().is_empty())
            .ok_or_else(|| {
                Failure::BadInput(format!("set {TOKEN_ENV} to the gateway's admin.token"))
            })?;
        let user = std::env::var("USER").unwrap_or_default();
        let actor = match user.is_empty() {
            true => "onedoor keys".to_owned(),
            false => format!("onedoor keys ({user})"),
        };
        Ok(AdminClient {
            base: admin_url.trim_end_matches('/').to_owned(),
            token: token.trim().to_owned(),
            actor,
        })
    }

    /// Sends one request; the answer's JSON when it is a success, else a failure with the
    /// gateway's own message (bad input for a 4xx, a runtime failure otherwise).
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, Failure> {
        let url = format!("{}{path}", self.base);
        let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
        let request = Request::builder()
            .method(method)
            .uri(&url)
            .header("authorization", format!("Bearer {}", self.token))
            .header("content-type", "application/json")
            .header("x-onedoor-actor", &self.actor)
            .body(Full::new(body))
            .map_err(|e| Failure::BadInput(format!("--admin-url {}: {e}", self.base)))?;
        let connector = hyper_rustls::HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .build();
        let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build(connector);
        let response = client.request(request).await.map_err(|e| {
            Failure::Runtime(format!("cannot reach the admin API at {}: {e}", self.base))
        })?;
        let status = response.status();
        let bytes = response
            .into_body()
            .collect()
            .await
            .map_err(|e| Failure::Runtime(format!("the admin API's answer broke off: {e}")))?
            .to_bytes();
        let answer: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
        if status.is_success() {
            return Ok(answer);
        }
        let message = answer["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| answer.to_string());
        let text = format!("{status}: {message}");
        match status.is_client_error() {
            true => Err(Failure::BadInput(text)),
            false => Err(Failure::Runtime(text)),
        }
    }
}
