//! Azure OpenAI: the deployment is in the path, the version in the query, the key in `api-key`.
//! The body's `model` is ignored by Azure, so the client's body goes out as it came (a chat
//! stream asks for its usage). The Responses API is only on the v1 surface
//! (`/openai/v1/responses`), where the body's `model` names the deployment.

use bytes::Bytes;
use http::Uri;
use onedoor_config::Backend;

use super::{openai_body, Unsendable};
use crate::request::{ClientRequest, Operation};

pub fn wire(
    backend: &Backend,
    deployment: &str,
    operation: Operation,
    request: &ClientRequest,
) -> Result<(Uri, Bytes), Unsendable> {
    if operation == Operation::Responses {
        let uri = format!("{}/openai/v1/{}", backend.url, operation.path());
        let uri = uri.parse().map_err(|_| Unsendable::BadUrl)?;
        return Ok((uri, openai_body(request, Some(deployment), operation)));
    }
    let uri = format!(
        "{}/openai/deployments/{}/{}?api-version={}",
        backend.url,
        encode_segment(deployment),
        operation.path(),
        backend.api_version
    );
    let uri = uri.parse().map_err(|_| Unsendable::BadUrl)?;
    Ok((uri, openai_body(request, None, operation)))
}

/// Deployment names are letters, digits, `-`, `_` and `.`; anything else is percent-encoded so a
/// requested name can never change the path.
fn encode_segment(segment: &str) -> String {
    if segment.bytes().all(|b| b == b'.') {
        return segment.replace('.', "%2E");
    }
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::encode_segment;

    #[test]
    fn a_deployment_name_cannot_escape_its_path_segment() {
        assert_eq!(encode_segment("gpt-4o_mini.v2"), "gpt-4o_mini.v2");
        assert_eq!(encode_segment("../x?y"), "..%2Fx%3Fy");
        assert_eq!(encode_segment(".."), "%2E%2E");
    }
}
