//! The seam between the request flow every endpoint shares and each provider's wire format.

use hyper::header::HeaderValue;
use hyper::{HeaderMap, Method, StatusCode};
use serde_json::Value;

use crate::quota::{Snapshot, Throttle};
use crate::reply::Reply;
use crate::request::Chat;
use crate::stream::Script;
use crate::{anthropic, azure, openai, Dialect};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Chat,
    Embeddings,
    Models,
    /// The OpenAI Responses API.
    Responses,
}

/// Where a request is going, as far as the URL says.
#[derive(Clone, Debug)]
pub struct Route {
    pub op: Op,
    /// The deployment named in the path (Azure classic URLs); otherwise the body's `model` says.
    pub deployment: Option<String>,
    pub api_version: Option<String>,
}

/// Every way a request can be refused, rendered by each dialect in its own error shape.
#[derive(Clone, Debug)]
pub enum Reject {
    /// Unknown path, or an Azure path without `api-version`.
    NoRoute,
    /// The key presented, if any.
    Unauthorized(Option<String>),
    /// A bearer token the endpoint does not take (its `entra_audience` expected).
    TokenRefused {
        audience: String,
    },
    UnknownDeployment(String),
    Missing(&'static str),
    Invalid(String),
    ContentFilter,
    ContextTooLong {
        limit: u64,
        tokens: u64,
    },
    /// `throttle` is absent when the 429 was injected rather than earned.
    RateLimited {
        throttle: Option<Throttle>,
        retry_after_s: u64,
    },
    /// An injected status, answered with the dialect's body for it.
    Status(u16),
    /// A Responses follow-up names a response this endpoint does not hold.
    UnknownResponse(String),
}

impl Reject {
    pub fn retry_after_s(&self) -> Option<u64> {
        match self {
            Reject::RateLimited { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        }
    }
}

/// What the dialects need to know about the request they answer.
pub struct Ctx {
    pub request_id: String,
    pub client_request_id: Option<HeaderValue>,
    pub region: String,
    /// "POST /v1/foo", for errors that quote the request.
    pub target: String,
    pub op: Option<Op>,
    pub api_version: Option<String>,
    /// The deployment or model name the request asked for.
    pub model: Option<String>,
}

/// A successful answer, before pacing is applied.
pub enum Payload {
    Json(Value),
    Stream(Script),
}

/// One provider's wire format.
pub trait Wire: Sync {
    fn route(&self, method: &Method, path: &str, query: Option<&str>) -> Result<Route, Reject>;

    /// Checks the credentials (when the endpoint has a key) and any required headers.
    fn check_headers(&self, headers: &HeaderMap, key: Option<&str>) -> Result<(), Reject>;

    fn parse_chat(&self, body: &Value) -> Result<Chat, Reject> {
        Chat::openai(body)
    }

    fn request_id(&self) -> String;

    fn reject(&self, reject: &Reject, ctx: &Ctx) -> (StatusCode, Value);

    /// Adds the headers this provider puts on every answer.
    fn decorate(
        &self,
        headers: &mut HeaderMap,
        ctx: &Ctx,
        quota: Option<&Snapshot>,
        retry_after_s: Option<u64>,
    );

    fn chat(&self, chat: &Chat, reply: &Reply, model: &str) -> Payload;
}

pub fn wire(dialect: Dialect) -> &'static dyn Wire {
    match dialect {
        Dialect::Azure => &azure::Azure,
        Dialect::OpenAi => &openai::OpenAi,
        Dialect::Anthropic => &anthropic::Anthropic,
    }
}

/// Passes when the endpoint has no key or the presented one matches it.
pub fn check_key(key: Option<&str>, presented: Option<&str>) -> Result<(), Reject> {
    match (key, presented) {
        (None, _) => Ok(()),
        (Some(k), Some(p)) if k == p => Ok(()),
        (Some(_), p) => Err(Reject::Unauthorized(p.map(str::to_owned))),
    }
}

/// The credential in `Authorization: Bearer …`.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get("authorization")?.to_str().ok()?;
    value.strip_prefix("Bearer ").map(str::trim)
}

/// The key a request presents, whichever header its dialect carries it in.
pub fn presented_key(headers: &HeaderMap) -> Option<&str> {
    bearer(headers).or_else(|| {
        ["api-key", "x-api-key"]
            .into_iter()
            .find_map(|name| headers.get(name)?.to_str().ok())
    })
}

/// An injected status as a status code; nonsense values become 500.
pub fn status_code(status: u16) -> StatusCode {
    StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
}

pub fn reason(status: StatusCode) -> &'static str {
    status.canonical_reason().unwrap_or("Error")
}
