//! Azure OpenAI: the deployment is in the path, the version in the query, the key in `api-key`.
//! The body's `model` is ignored by Azure, so the client's body goes out as it came (a chat
//! stream asks for its usage). The Responses API is only on the v1 surface
//! (`/openai/v1/responses`), where the body's `model` names the deployment; a backend with
//! `azure_api: v1` takes every operation there.

use bytes::Bytes;
use onedoor_config::{AzureApi, Backend};

use super::openai_body;
use crate::request::{ClientRequest, Operation};

/// The body an Azure deployment gets for `request`: on the Responses API the deployment is the
/// body's `model`; elsewhere the deployment is in the URL ([`url`]).
pub fn body(
    backend: &Backend,
    deployment: &str,
    operation: Operation,
    request: &ClientRequest,
) -> Bytes {
    match on_v1(backend, operation) {
        true => openai_body(request, Some(deployment), operation),
        false => openai_body(request, None, operation),
    }
}

/// Whether `operation` goes to the v1 surface, where the body names the deployment.
fn on_v1(backend: &Backend, operation: Operation) -> bool {
    operation == Operation::Responses || backend.azure_api == AzureApi::V1
}

/// The URL of `operation` on `deployment`.
pub fn url(backend: &Backend, deployment: &str, operation: Operation) -> String {
    if on_v1(backend, operation) {
        return format!("{}/openai/v1/{}", backend.url, operation.path());
    }
    format!(
        "{}/openai/deployments/{}/{}?api-version={}",
        backend.url,
        encode_segment(deployment),
        operation.path(),
        backend.api_version
    )
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
