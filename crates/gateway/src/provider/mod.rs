//! Provider adapters: each turns a client request for one target into that provider's wire
//! request. Dialects live here and nowhere else.

mod azure;
mod openai;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Uri};
use onedoor_config::{Backend, Provider};

use crate::request::{ClientRequest, Operation};

/// A request ready for the upstream client.
pub struct WireRequest {
    pub uri: Uri,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Why a target cannot be sent a request at all.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unsendable {
    #[error("the {0} provider does not serve this operation yet")]
    Unsupported(&'static str),
    #[error("the backend URL does not form a valid request URL")]
    BadUrl,
}

/// The backend's credential as a header, prepared once per snapshot and marked sensitive so it is
/// never printed.
pub fn credential(backend: &Backend) -> Option<(&'static str, HeaderValue)> {
    let key = backend.api_key.as_ref()?;
    let (name, value) = match backend.provider {
        Provider::Azure => ("api-key", key.expose().to_owned()),
        Provider::Anthropic => ("x-api-key", key.expose().to_owned()),
        Provider::OpenAi => ("authorization", format!("Bearer {}", key.expose())),
    };
    let mut value = HeaderValue::from_str(&value).ok()?;
    value.set_sensitive(true);
    Some((name, value))
}

/// Whether targets on this backend can take `operation` today.
pub fn supports(backend: &Backend, _operation: Operation) -> bool {
    !matches!(backend.provider, Provider::Anthropic)
}

pub fn build(
    backend: &Backend,
    credential: Option<&(&'static str, HeaderValue)>,
    deployment: &str,
    operation: Operation,
    request: &ClientRequest,
) -> Result<WireRequest, Unsendable> {
    let (uri, body) = match backend.provider {
        Provider::Azure => azure::wire(backend, deployment, operation, request)?,
        Provider::OpenAi => openai::wire(backend, deployment, operation, request)?,
        Provider::Anthropic => return Err(Unsendable::Unsupported("anthropic")),
    };
    let mut headers = HeaderMap::with_capacity(4);
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if request.stream {
        headers.insert(
            http::header::ACCEPT,
            HeaderValue::from_static("text/event-stream"),
        );
    }
    if let Some((name, value)) = credential {
        headers.insert(*name, value.clone());
    }
    Ok(WireRequest { uri, headers, body })
}
