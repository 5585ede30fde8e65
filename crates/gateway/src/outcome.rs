//! What a failed attempt means for the rest of the request (contract section 2.1, rule 3).

use std::time::Duration;

use http::{HeaderMap, HeaderName, StatusCode};
use serde::Deserialize;

use crate::upstream::Failure;

/// The routing consequence of one failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Connect error, reset, 5xx: may be retried once on a target that was alone in its group.
    Transient,
    /// 429: the target cools down for its Retry-After (when it gave one).
    Throttled(Option<Duration>),
    /// 404 DeploymentNotFound / model_not_found: the (backend, deployment) goes into the not-served cache.
    NotServed,
    /// A connect or first-token timeout: never this target again in this request.
    TimedOut,
    /// The total time ran out.
    OutOfTime,
    /// 400 context_length_exceeded: only a target with a different deployment or model may help.
    ContextTooLong,
    /// 401 or 403: the backend's own credential is wrong.
    CredentialRejected,
    /// No token for the backend's identity: the next target, nothing learned about this one.
    AuthUnavailable,
    /// Any other 4xx: the caller's problem, returned as it came.
    ClientError,
}

#[derive(Deserialize)]
struct ErrorEnvelope {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct ErrorDetail {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default, rename = "type")]
    kind: Option<serde_json::Value>,
}

/// The `error.code` of an OpenAI or Azure error body (string or number), or its `error.type`.
fn error_code(body: &[u8]) -> Option<String> {
    let envelope: ErrorEnvelope = serde_json::from_slice(body).ok()?;
    let as_text = |v: serde_json::Value| match v {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    envelope
        .error
        .code
        .and_then(as_text)
        .or_else(|| envelope.error.kind.and_then(as_text))
}

pub fn verdict(failure: &Failure) -> Verdict {
    match failure {
        Failure::ConnectError(_) | Failure::Reset(_) => Verdict::Transient,
        Failure::ConnectTimeout | Failure::FirstTokenTimeout => Verdict::TimedOut,
        Failure::Timeout => Verdict::OutOfTime,
        Failure::AuthUnavailable(_) => Verdict::AuthUnavailable,
        Failure::Status {
            status,
            headers,
            body,
        } => status_verdict(*status, headers, body),
    }
}

fn status_verdict(status: StatusCode, headers: &HeaderMap, body: &[u8]) -> Verdict {
    match status.as_u16() {
        429 => Verdict::Throttled(retry_after(headers)),
        401 | 403 => Verdict::CredentialRejected,
        404 => match error_code(body).as_deref() {
            Some("DeploymentNotFound" | "model_not_found" | "DeploymentNotReady") => {
                Verdict::NotServed
            }
            _ => Verdict::ClientError,
        },
        400 => match error_code(body).as_deref() {
            Some("context_length_exceeded") => Verdict::ContextTooLong,
            _ => Verdict::ClientError,
        },
        500..=599 => Verdict::Transient,
        _ => Verdict::ClientError,
    }
}

/// How long a target that answered 429 without any Retry-After is left alone.
pub const DEFAULT_COOLDOWN: Duration = Duration::from_secs(1);

/// Azure's precise retry hint, in milliseconds.
pub const RETRY_AFTER_MS: HeaderName = HeaderName::from_static("retry-after-ms");

/// `retry-after-ms` when present (it is the precise one), else `retry-after` in seconds.
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let header = |name: HeaderName| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header(RETRY_AFTER_MS).and_then(|v| v.parse::<f64>().ok()) {
        if ms.is_finite() && ms >= 0.0 {
            return Some(Duration::from_millis(ms.ceil() as u64));
        }
    }
    header(http::header::RETRY_AFTER)
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use http::HeaderValue;

    fn status(code: u16, body: &str) -> Failure {
        Failure::Status {
            status: StatusCode::from_u16(code).unwrap(),
            headers: HeaderMap::new(),
            body: Bytes::from(body.to_owned()),
        }
    }

    #[test]
    fn each_upstream_answer_has_its_verdict() {
        let not_found = r#"{"error":{"code":"DeploymentNotFound","message":"The API deployment for this resource does not exist."}}"#;
        assert_eq!(verdict(&status(404, not_found)), Verdict::NotServed);
        assert_eq!(
            verdict(&status(
                404,
                r#"{"error":{"code":"404","message":"Resource not found"}}"#
            )),
            Verdict::ClientError
        );
        let too_long = r#"{"error":{"message":"too long","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#;
        assert_eq!(verdict(&status(400, too_long)), Verdict::ContextTooLong);
        assert_eq!(
            verdict(&status(400, r#"{"error":{"code":"content_filter"}}"#)),
            Verdict::ClientError
        );
        assert_eq!(verdict(&status(503, "")), Verdict::Transient);
        assert_eq!(verdict(&status(401, "")), Verdict::CredentialRejected);
        assert_eq!(verdict(&Failure::FirstTokenTimeout), Verdict::TimedOut);
    }

    #[test]
    fn retry_after_ms_is_preferred_over_seconds() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("6"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(6)));
        headers.insert("retry-after-ms", HeaderValue::from_static("5500"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(5500)));
    }
}
