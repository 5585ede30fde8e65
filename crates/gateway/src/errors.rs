//! Every answer the gateway itself gives instead of an upstream's: one error type, one place that
//! turns it into an HTTP response in the caller's dialect.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Response, StatusCode};

use crate::body::{full, Body};
use crate::messages;
use crate::surface::Dialect;

/// An error the gateway answers with; each variant is one code of the contract's error table.
/// `x-onedoor-error`: the error code of an answer the gateway refused or could not complete.
pub const ERROR_HEADER: HeaderName = HeaderName::from_static("x-onedoor-error");

#[derive(Debug, Clone, thiserror::Error)]
pub enum GatewayError {
    #[error("{0}")]
    InvalidRequest(String),
    #[error("{0}")]
    NotFound(String),
    /// A file or batch id the caller's tenant does not hold (another tenant's looks the same).
    #[error("{0}")]
    NoSuchObject(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("a valid API key is required: send it as `Authorization: Bearer KEY`, `api-key: KEY` or `x-api-key: KEY`")]
    MissingKey,
    #[error("the API key is not valid")]
    UnknownKey,
    /// A runtime key that exists but may not be used now (disabled, expired).
    #[error("{0}")]
    KeyRefused(String),
    /// A JWT that failed a check; the message says which (never the token).
    #[error("the bearer token is not accepted: {0}")]
    InvalidToken(String),
    #[error("this key may not use the model `{0}`")]
    ModelNotAllowed(String),
    #[error("the model `{0}` does not exist; GET /v1/models lists the ones this key may use")]
    ModelNotFound(String),
    #[error(
        "no reachable backend serves the model `{0}`: each one asked answered that it lacks it"
    )]
    ServedNowhere(String),
    #[error("the request body is larger than the limit of {limit} bytes")]
    RequestTooLarge { limit: u64 },
    #[error("every backend that serves `{alias}` is rate limited; retry after {retry_after:?}")]
    UpstreamRateLimited {
        alias: String,
        retry_after: Duration,
    },
    #[error("every attempt to reach a backend for `{0}` failed; x-onedoor-attempts says how")]
    UpstreamFailed(String),
    /// Like `UpstreamFailed`, for a key held to some regions: the targets outside them were not
    /// asked, and the message says so.
    #[error("every attempt to reach a backend for `{alias}` failed; x-onedoor-attempts says how. {outside} target(s) outside the regions this key may use were not asked")]
    UpstreamFailedInRegions { alias: String, outside: usize },
    #[error("every backend that serves `{alias}` is behind an open circuit breaker; retry after {retry_after:?}")]
    CircuitOpen {
        alias: String,
        retry_after: Duration,
    },
    #[error("{0}")]
    NoBackendAvailable(String),
    /// Every backend that could serve needs a token from an identity endpoint that is failing.
    #[error("no backend for `{0}` could be authenticated to: the identity endpoint its backends need is failing, and no backend without one could serve")]
    UpstreamAuthUnavailable(String),
    #[error("attempts for `{0}` ran out of time; x-onedoor-attempts says how")]
    UpstreamTimeout(String),
    /// The caller's own rpm, tpm or max_in_flight.
    #[error("{message}")]
    RateLimited {
        message: String,
        retry_after: Duration,
    },
    /// A runtime key's `usd_budget` is spent; the message says how much.
    #[error("{message}")]
    BudgetExceeded {
        message: String,
        period_ends_in: Duration,
    },
    /// The caller's tokens_per_day or usd_per_month; `period_ends_in` says when it renews.
    #[error("{message}")]
    QuotaExceeded {
        message: String,
        period_ends_in: Duration,
    },
    #[error(
        "the shared state store is unreachable and on_store_error is fail_closed; retry shortly"
    )]
    StateUnavailable,
    /// A request that did not come whole in time (`client_timeouts`).
    #[error("{0}")]
    RequestTimeout(String),
    /// A request framed in a way the gateway does not decode (a transfer coding but chunked).
    #[error("{0}")]
    NotImplemented(String),
    /// The gateway's own limits, such as `max_connections`: not a backend's.
    #[error("{0}")]
    Overloaded(String),
}

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        match self {
            GatewayError::InvalidRequest(_) => StatusCode::BAD_REQUEST,
            GatewayError::NotFound(_)
            | GatewayError::NoSuchObject(_)
            | GatewayError::ModelNotFound(_)
            | GatewayError::ServedNowhere(_) => StatusCode::NOT_FOUND,
            GatewayError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            GatewayError::MissingKey
            | GatewayError::UnknownKey
            | GatewayError::KeyRefused(_)
            | GatewayError::InvalidToken(_) => StatusCode::UNAUTHORIZED,
            GatewayError::ModelNotAllowed(_) | GatewayError::QuotaExceeded { .. } => {
                StatusCode::FORBIDDEN
            }
            GatewayError::RequestTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            GatewayError::UpstreamRateLimited { .. }
            | GatewayError::RateLimited { .. }
            | GatewayError::BudgetExceeded { .. } => StatusCode::TOO_MANY_REQUESTS,
            GatewayError::UpstreamFailed(_) | GatewayError::UpstreamFailedInRegions { .. } => {
                StatusCode::BAD_GATEWAY
            }
            GatewayError::CircuitOpen { .. }
            | GatewayError::NoBackendAvailable(_)
            | GatewayError::UpstreamAuthUnavailable(_)
            | GatewayError::StateUnavailable
            | GatewayError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            GatewayError::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            GatewayError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            GatewayError::NotImplemented(_) => StatusCode::NOT_IMPLEMENTED,
        }
    }

    /// The contract's error code, also sent as `x-onedoor-error`.
    pub fn code(&self) -> &'static str {
        match self {
            GatewayError::InvalidRequest(_)
            | GatewayError::NotFound(_)
            | GatewayError::MethodNotAllowed(_)
            | GatewayError::NotImplemented(_) => "invalid_request",
            GatewayError::NoSuchObject(_) => "object_not_found",
            GatewayError::MissingKey | GatewayError::UnknownKey | GatewayError::KeyRefused(_) => {
                "invalid_api_key"
            }
            GatewayError::InvalidToken(_) => "invalid_token",
            GatewayError::ModelNotAllowed(_) => "model_not_allowed",
            GatewayError::ModelNotFound(_) | GatewayError::ServedNowhere(_) => "model_not_found",
            GatewayError::RequestTooLarge { .. } => "request_too_large",
            GatewayError::UpstreamRateLimited { .. } => "upstream_rate_limited",
            GatewayError::UpstreamFailed(_) | GatewayError::UpstreamFailedInRegions { .. } => {
                "upstream_failed"
            }
            GatewayError::CircuitOpen { .. } => "circuit_open",
            GatewayError::NoBackendAvailable(_) => "no_backend_available",
            GatewayError::UpstreamAuthUnavailable(_) => "upstream_auth_unavailable",
            GatewayError::UpstreamTimeout(_) => "upstream_timeout",
            GatewayError::RateLimited { .. } => "rate_limited",
            GatewayError::QuotaExceeded { .. } => "quota_exceeded",
            GatewayError::BudgetExceeded { .. } => "budget_exceeded",
            GatewayError::StateUnavailable => "state_unavailable",
            GatewayError::RequestTimeout(_) => "request_timeout",
            GatewayError::Overloaded(_) => "gateway_overloaded",
        }
    }

    /// The OpenAI `error.type` that SDKs branch on.
    fn openai_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            // A coding the gateway does not decode is the request's to change.
            400..=499 | 501 => "invalid_request_error",
            _ => "server_error",
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            GatewayError::UpstreamRateLimited { retry_after, .. }
            | GatewayError::CircuitOpen { retry_after, .. }
            | GatewayError::RateLimited { retry_after, .. } => Some(*retry_after),
            // Not a retry that cures it soon: when the quota's period renews.
            GatewayError::QuotaExceeded { period_ends_in, .. }
            | GatewayError::BudgetExceeded { period_ends_in, .. } => Some(*period_ends_in),
            GatewayError::StateUnavailable | GatewayError::Overloaded(_) => {
                Some(Duration::from_secs(1))
            }
            _ => None,
        }
    }

    /// The error as a JSON response in the caller's dialect: OpenAI's envelope on OpenAI and
    /// Azure paths, Anthropic's `{"type":"error","error":{...}}` on `/v1/messages`.
    pub fn into_response_in(self, dialect: Dialect) -> Response<Body> {
        let body = match dialect {
            Dialect::Anthropic => messages::error_body(self.status(), &self.to_string()),
            Dialect::OpenAi | Dialect::Azure => serde_json::json!({
                "error": {
                    "message": self.to_string(),
                    "type": self.openai_type(),
                    "param": null,
                    "code": self.code(),
                }
            }),
        };
        let mut response = Response::new(full(Bytes::from(body.to_string())));
        *response.status_mut() = self.status();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(ERROR_HEADER, HeaderValue::from_static(self.code()));
        if let Some(wait) = self.retry_after() {
            insert_retry_after(headers, wait);
        }
        if let GatewayError::InvalidToken(_) = self {
            // RFC 6750: what a bearer-token client reads to know its token, not its request, failed.
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer error=\"invalid_token\""),
            );
        }
        response
    }

    /// The error as a realtime `error` event answering the client event `event_id`, for a
    /// refusal inside an open session (which stays open): the code and type of the HTTP answer.
    pub fn realtime_event(&self, event_id: Option<&str>) -> String {
        serde_json::json!({
            "type": "error",
            "event_id": format!("event_{:016x}", rand::random::<u64>()),
            "error": {
                "type": self.openai_type(),
                "code": self.code(),
                "message": self.to_string(),
                "param": null,
                "event_id": event_id,
            }
        })
        .to_string()
    }
}

/// `retry-after` in whole seconds (rounded up, at least 1) and `retry-after-ms` exactly.
pub fn insert_retry_after(headers: &mut http::HeaderMap, wait: Duration) {
    let ms = wait.as_millis().max(1) as u64;
    let secs = ms.div_ceil(1000).max(1);
    headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
    headers.insert(crate::outcome::RETRY_AFTER_MS, HeaderValue::from(ms));
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
        let response = err.into_response_in(Dialect::OpenAi);
        assert_eq!(response.status(), 429);
        assert_eq!(response.headers()["retry-after"], "2");
        assert_eq!(response.headers()["retry-after-ms"], "1500");
        assert_eq!(
            response.headers()["x-onedoor-error"],
            "upstream_rate_limited"
        );
    }

    #[tokio::test]
    async fn an_anthropic_caller_gets_anthropic_shaped_errors() {
        use http_body_util::BodyExt;
        let response = GatewayError::UnknownKey.into_response_in(Dialect::Anthropic);
        assert_eq!(response.status(), 401);
        assert_eq!(response.headers()["x-onedoor-error"], "invalid_api_key");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"type": "error", "error": {"type": "authentication_error", "message": "the API key is not valid"}})
        );
    }
}
