//! OpenAI-compatible servers: `{url}/chat/completions` (`/embeddings`, `/responses`) with a
//! Bearer key; the body's `model` must name the server's model, so it is replaced.

use onedoor_config::Backend;

use crate::request::Operation;

/// The URL of `operation` on `backend`.
pub fn url(backend: &Backend, operation: Operation) -> String {
    format!("{}/{}", backend.url, operation.path())
}
