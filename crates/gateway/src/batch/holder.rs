//! The backend that holds a batch and its files, and the calls the gateway makes to it: an upload
//! (multipart, `purpose: batch`), a batch's creation, reading and cancel, and a file's content.
//! OpenAI-compatible backends take them under their URL (`{url}/files`); Azure ones under
//! `/openai/` with their `api-version` (or `/openai/v1/` on the v1 surface).

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use onedoor_config::{AzureApi, Backend, BackendId, Provider};
use serde_json::Value;

use crate::runtime::Runtime;
use crate::upstream::{Failure, LaneClients};

/// A batch's output file is read whole, up to this.
const MAX_CONTENT: usize = 512 << 20;

pub struct Holder<'r> {
    runtime: &'r Runtime,
    pub id: BackendId,
    pub backend: &'r Backend,
}

impl<'r> Holder<'r> {
    pub fn new(runtime: &'r Runtime, id: BackendId) -> Option<Holder<'r>> {
        let backend = runtime.snapshot.backends.get(id)?;
        Some(Holder {
            runtime,
            id,
            backend,
        })
    }

    /// The backend of this name in the running config.
    pub fn named(runtime: &'r Runtime, name: &str) -> Option<Holder<'r>> {
        let id = *runtime.snapshot.backend_by_name.get(name)?;
        Holder::new(runtime, id)
    }

    pub fn name(&self) -> &str {
        &self.backend.name
    }

    /// Whether this backend has a batch API at all (Anthropic's is another shape).
    pub fn takes_batches(backend: &Backend) -> bool {
        backend.provider != Provider::Anthropic
    }

    fn url(&self, path: &str) -> String {
        let backend = self.backend;
        match (backend.provider, backend.azure_api) {
            (Provider::Azure, AzureApi::V1) => format!("{}/openai/v1/{path}", backend.url),
            (Provider::Azure, _) => format!(
                "{}/openai/{path}?api-version={}",
                backend.url, backend.api_version
            ),
            _ => format!("{}/{path}", backend.url),
        }
    }

    /// Uploads `content` as a batch input file; the backend's file object.
    pub async fn upload(&self, filename: &str, content: Bytes) -> Result<Value, Failure> {
        let boundary = format!("onedoor{:032x}", rand::random::<u128>());
        let mut body = Vec::with_capacity(content.len() + 512);
        let safe_name: String = filename
            .chars()
            .filter(|c| *c != '"' && !c.is_control())
            .collect();
        body.extend_from_slice(
            format!(
                "--{boundary}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(format!("--{boundary}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"{safe_name}\"\r\ncontent-type: application/jsonl\r\n\r\n").as_bytes());
        body.extend_from_slice(&content);
        body.extend_from_slice(format!("\r\n--{boundary}--\r\n").as_bytes());
        let form = format!("multipart/form-data; boundary={boundary}");
        let answer = self
            .send(Method::POST, "files", Some(&form), Bytes::from(body))
            .await?;
        Ok(object(&answer))
    }

    pub async fn create(&self, request: &Value) -> Result<Value, Failure> {
        let body = Bytes::from(request.to_string());
        let answer = self
            .send(Method::POST, "batches", Some("application/json"), body)
            .await?;
        Ok(object(&answer))
    }

    pub async fn batch(&self, id: &str) -> Result<Value, Failure> {
        let path = format!("batches/{}", segment(id));
        Ok(object(
            &self.send(Method::GET, &path, None, Bytes::new()).await?,
        ))
    }

    pub async fn cancel(&self, id: &str) -> Result<Value, Failure> {
        let path = format!("batches/{}/cancel", segment(id));
        Ok(object(
            &self.send(Method::POST, &path, None, Bytes::new()).await?,
        ))
    }

    pub async fn content(&self, file: &str) -> Result<Bytes, Failure> {
        let path = format!("files/{}/content", segment(file));
        self.send(Method::GET, &path, None, Bytes::new()).await
    }

    /// Removes an uploaded file the backend no longer needs; a failure leaves it to the
    /// backend's own retention.
    pub async fn delete_file(&self, file: &str) {
        let path = format!("files/{}", segment(file));
        if let Err(failure) = self.send(Method::DELETE, &path, None, Bytes::new()).await {
            tracing::debug!(
                backend = self.name(),
                detail = failure.detail(),
                "an uploaded batch file was not deleted"
            );
        }
    }

    /// One call: the answer's whole body on success, else how it failed.
    async fn send(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Bytes,
    ) -> Result<Bytes, Failure> {
        let unknown = || Failure::ConnectError("unknown backend".into());
        let pool = self
            .runtime
            .clients
            .get(self.id)
            .map(LaneClients::here)
            .ok_or_else(unknown)?;
        let mut request = Request::builder().method(method).uri(self.url(path));
        if let Some(headers) = request.headers_mut() {
            for (name, value) in self.runtime.stamps.get(self.id).into_iter().flatten() {
                headers.insert(name.clone(), value.clone());
            }
            if let Some(kind) = content_type.and_then(|v| HeaderValue::from_str(v).ok()) {
                headers.insert(header::CONTENT_TYPE, kind);
            }
        }
        let total = self.backend.timeouts.total;
        let deadline = tokio::time::Instant::now() + total;
        if let Some(tokens) = self.runtime.credentials.of(self.id) {
            let token = tokens.header(deadline).await?;
            if let Some(headers) = request.headers_mut() {
                headers.insert(header::AUTHORIZATION, token);
            }
        }
        let request = request
            .body(body)
            .map_err(|e| Failure::ConnectError(e.to_string()))?;
        let answered = tokio::time::timeout(total, Box::pin(pool.request(request))).await;
        let response = answered.map_err(|_| Failure::Timeout)??;
        let (parts, body) = response.into_parts();
        let read = tokio::time::timeout(
            remaining(deadline),
            Limited::new(body, MAX_CONTENT).collect(),
        );
        let body = match read.await {
            Err(_) => return Err(Failure::Timeout),
            Ok(Err(error)) => return Err(Failure::Reset(error.to_string())),
            Ok(Ok(collected)) => collected.to_bytes(),
        };
        match parts.status.is_success() {
            true => Ok(body),
            false => Err(Failure::Status {
                status: parts.status,
                headers: parts.headers,
                body,
            }),
        }
    }
}

fn remaining(deadline: tokio::time::Instant) -> Duration {
    deadline.saturating_duration_since(tokio::time::Instant::now())
}

/// A JSON object answer; anything else reads as an empty object.
fn object(body: &[u8]) -> Value {
    serde_json::from_slice(body).unwrap_or(Value::Null)
}

/// A backend's id as one path segment.
fn segment(id: &str) -> String {
    let mut out = String::with_capacity(id.len());
    for byte in id.bytes() {
        match byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.') {
            true => out.push(byte as char),
            false => out.push_str(&format!("%{byte:02X}")),
        }
    }
    out
}

/// Whether a failed call may go to another backend: it was refused for capacity or health
/// (429, 5xx, an enqueued-token limit, a wrong credential, no connection), not for its content.
pub fn moves_elsewhere(failure: &Failure) -> bool {
    match failure {
        Failure::Status { status, body, .. } => {
            *status == StatusCode::TOO_MANY_REQUESTS
                || status.is_server_error()
                || matches!(status.as_u16(), 401 | 403)
                || token_limit(body)
        }
        _ => true,
    }
}

/// Azure's refusal of a batch over its deployment's enqueued-token quota, in an error body or in
/// a batch object's `errors`.
pub fn token_limit(text: &[u8]) -> bool {
    memchr::memmem::find(text, b"token_limit_exceeded").is_some()
}

/// Whether a batch object the backend just made has already failed for its enqueued-token quota.
pub fn refused_at_creation(batch: &Value) -> bool {
    batch["status"] == "failed" && token_limit(batch["errors"].to_string().as_bytes())
}
