//! OpenAI-compatible servers: `{url}/chat/completions` (`/embeddings`, `/responses`) with a
//! Bearer key; the body's `model` must name the server's model, so it is replaced.

use bytes::Bytes;
use http::Uri;
use onedoor_config::Backend;

use super::{openai_body, Unsendable};
use crate::request::{ClientRequest, Operation};

pub fn wire(
    backend: &Backend,
    model: &str,
    operation: Operation,
    request: &ClientRequest,
) -> Result<(Uri, Bytes), Unsendable> {
    let uri = format!("{}/{}", backend.url, operation.path());
    let uri = uri.parse().map_err(|_| Unsendable::BadUrl)?;
    Ok((uri, openai_body(request, Some(model), operation)))
}
