//! Every answer the gateway itself gives instead of an upstream's: one error type, one place that
//! turns it into an HTTP response in the caller's dialect.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Response, StatusCode};

use crate::body::{full, Body};

/// An error the gateway answers with; each variant is one code of the contract's error table.
#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("a valid API key is required: send it as `Authorization: Bearer KEY`, `api-key: KEY` or `x-api-key: KEY`")]
    MissingKey,
    #[error("the API key is not valid")]
    UnknownKey,
    #[error("this key may not use the model `{0}`")]
    ModelNotAllowed(String),
    #[error("the model `{0}` does not exist; GET /v1/models lists the ones this key may use")]
    ModelNotFound(String),
    #[error("the request body is larger than the limit of {limit} bytes")]
    RequestTooLarge { limit: u64 },
    #[error("every backend that serves `{alias}` is rate limited; retry after {retry_after:?}")]
    UpstreamRateLimited {
        alias: String,
        retry_after: Duration,
    },
    #[error("every attempt to reach a backend for `{0}` failed; x-onedoor-attempts says how")]
    UpstreamFailed(String),
    #[error("every backend that serves `{alias}` is behind an open circuit breaker; retry after {retry_after:?}")]
    CircuitOpen {
        alias: String,
        retry_after: Duration,
    },
    #[error("{0}")]
    NoBackendAvailable(String),
    #[error("attempts for `{0}` ran out of time; x-onedoor-attempts says how")]
    UpstreamTimeout(String),
}

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            GatewayError::NotFound(_) | GatewayError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            GatewayError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::MissingKey | GatewayError::UnknownKey => StatusCode::UNAUTHORIZED,
            GatewayError::ModelNotAllowed(_) => StatusCode::FORBIDDEN,
            GatewayError::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::UpstreamRateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::UpstreamFailed(_) => StatusCode::BAD_GATEWAY,
            GatewayError::CircuitOpen { .. } | GatewayError::NoBackendAvailable(_) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            GatewayError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
        }
    }

    /// The contract's error code, also sent as `x-onedoor-error`.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_) => "invalid_request",
            GatewayError::MissingKey | GatewayError::UnknownKey => "invalid_api_key",
            GatewayError::ModelNotAllowed(_) => "model_not_allowed",
            GatewayError::ModelNotFound(_) => "model_not_found",
            GatewayError::RequestTooLarge { .. } => "request_too_large",
            GatewayError::UpstreamRateLimited { .. } => "upstream_rate_limited",
            GatewayError::UpstreamFailed(_) => "upstream_failed",
            GatewayError::CircuitOpen { .. } => "circuit_open",
            GatewayError::NoBackendAvailable(_) => "no_backend_available",
            GatewayError::UpstreamTimeout(_) => "upstream_timeout",
        }
    }

    /// The OpenAI `error.type` that SDKs branch on.
    fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            400..=499 => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            GatewayError::UpstreamRateLimited { retry_after, .. }
            | GatewayError::CircuitOpen { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// The error as an OpenAI-shaped JSON response (OpenAI and Azure paths).
    pub fn into_response(self) -> Response<Body> {
        let body = serde_json::json!({
            "error": {
                "message": self.to_string(),
                "type": self.openai_type(),
                "param": null,
                "code": self.code(),
            }
        });
        let mut response = Response::new(full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert("x-onedoor-error", HeaderValue::from_static(self.code()));
        if let Some(wait) = self.retry_after() {
            insert_retry_after(headers, wait);
        }
        response
    }
}

/// `retry-after` in whole seconds (rounded up, at least 1) and `retry-after-ms` exactly.
pub fn insert_retry_after(headers: &mut http::HeaderMap, wait: Duration) {
    let ms = wait.as_millis().max(1) as u64;
    let secs = ms.div_ceil(1000).max(1);
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    headers.insert("retry-after-ms", HeaderValue::from(ms));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_limit_answer_carries_both_retry_headers() {
        let err = GatewayError::UpstreamRateLimited {
            alias: "chat".into(),
            retry_after: Duration::from_millis(1500),
        };
        let response = err.into_response();
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()["retry-after"], "2");
        assert_eq!(response.headers()["retry-after-ms"], "1500");
        assert_eq!(
            response.headers()["x-onedoor-error"],
            "upstream_rate_limited"
        );
    }
}
