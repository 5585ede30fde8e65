//! The token requests of each identity kind, on the wire as Azure's endpoints take them: the
//! instance metadata service and App Service's identity endpoint (GET, the resource in the query),
//! and the Entra ID token endpoint's client credentials grant with a client secret or a client
//! assertion (POST, a form). Nothing here logs or returns a token, a secret or an answer's body.

use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderValue, Method, Request};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use onedoor_config::{ManagedEndpoint, TokenSource};
use serde::Deserialize;

/// The longest a token request may take, connection included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// A token answer is a few kilobytes; more is not one.
const MAX_ANSWER: usize = 64 * 1024;
const CLIENT_ASSERTION_TYPE: &str = "urn:ietf:params:oauth:client-assertion-type:jwt-bearer";

pub type TokenClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// The client token requests go out on: the gateway's own hyper and rustls stack.
pub fn client() -> TokenClient {
    Client::builder(TokioExecutor::new()).build(crate::upstream::connector(CONNECT_TIMEOUT, false))
}

/// A token as an endpoint issued it.
pub struct Issued {
    pub access_token: String,
    pub lifetime: Duration,
}

/// Why no token came; never carries a token, a secret or a body.
#[derive(Debug, Clone, thiserror::Error)]
pub enum FetchError {
    #[error("cannot reach the identity endpoint: {0}")]
    Unreachable(String),
    #[error("the identity endpoint answered {status}{code}")]
    Refused { status: u16, code: String },
    #[error("the identity endpoint's answer is not a token: {0}")]
    Malformed(&'static str),
    #[error("cannot read the federated token file: {0}")]
    TokenFile(String),
}

/// Asks `source` for a token for `scope`.
pub async fn fetch(
    client: &TokenClient,
    source: &TokenSource,
    scope: &str,
) -> Result<Issued, FetchError> {
    let request = request(source, scope)?;
    let answer = tokio::time::timeout(REQUEST_TIMEOUT, send(client, request))
        .await
        .map_err(|_| FetchError::Unreachable("timed out".into()))??;
    parse(&answer)
}

async fn send(client: &TokenClient, request: Request<Full<Bytes>>) -> Result<Bytes, FetchError> {
    let response = client
        .request(request)
        .await
        .map_err(|e| FetchError::Unreachable(crate::upstream::describe(&e)))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), MAX_ANSWER)
        .collect()
        .await
        .map_err(|e| FetchError::Unreachable(e.to_string()))?
        .to_bytes();
    if !status.is_success() {
        return Err(FetchError::Refused {
            status: status.as_u16(),
            code: error_code(&body),
        });
    }
    Ok(body)
}

/// The request `source` takes for a token for `scope`.
fn request(source: &TokenSource, scope: &str) -> Result<Request<Full<Bytes>>, FetchError> {
    match source {
        TokenSource::ManagedIdentity {
            endpoint,
            client_id,
        } => managed(endpoint, client_id.as_deref(), scope),
        TokenSource::WorkloadIdentity {
            token_url,
            client_id,
            token_file,
        } => {
            // Re-read every time: the kubelet rotates the file. A few hundred bytes on a projected
            // (in-memory) volume, read by the cache's own task: not worth a blocking thread.
            let assertion = std::fs::read_to_string(token_file)
                .map_err(|e| FetchError::TokenFile(format!("{}: {e}", token_file.display())))?;
            let assertion = assertion.trim();
            if assertion.is_empty() {
                let file = token_file.display();
                return Err(FetchError::TokenFile(format!("{file} is empty")));
            }
            let form = [
                ("grant_type", "client_credentials"),
                ("client_id", client_id),
                ("scope", scope),
                ("client_assertion_type", CLIENT_ASSERTION_TYPE),
                ("client_assertion", assertion),
            ];
            form_post(token_url, &form)
        }
        TokenSource::ClientSecret {
            token_url,
            client_id,
            client_secret,
        } => {
            let form = [
                ("grant_type", "client_credentials"),
                ("client_id", client_id),
                ("scope", scope),
                ("client_secret", client_secret.expose()),
            ];
            form_post(token_url, &form)
        }
    }
}

fn managed(
    endpoint: &ManagedEndpoint,
    client_id: Option<&str>,
    scope: &str,
) -> Result<Request<Full<Bytes>>, FetchError> {
    // The managed identity endpoints take a resource, the scope without its `/.default`.
    let resource = scope.strip_suffix("/.default").unwrap_or(scope);
    let (url, version, name, value) = match endpoint {
        ManagedEndpoint::Imds { url } => (url, "2018-02-01", "metadata", "true"),
        ManagedEndpoint::AppService { url, header } => {
            (url, "2019-08-01", "x-identity-header", header.expose())
        }
    };
    let mut query = vec![("api-version", version), ("resource", resource)];
    query.extend(client_id.map(|id| ("client_id", id)));
    let separator = if url.contains('?') { '&' } else { '?' };
    let uri = format!("{url}{separator}{}", encode_pairs(&query));
    let mut value = HeaderValue::from_str(value).map_err(|_| bad_setting())?;
    value.set_sensitive(true);
    Request::builder()
        .method(Method::GET)
        .uri(uri)
        .header(name, value)
        .body(Full::new(Bytes::new()))
        .map_err(|_| bad_setting())
}

fn form_post(url: &str, form: &[(&str, &str)]) -> Result<Request<Full<Bytes>>, FetchError> {
    Request::builder()
        .method(Method::POST)
        .uri(url)
        .header(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        )
        .body(Full::new(Bytes::from(encode_pairs(form))))
        .map_err(|_| bad_setting())
}

fn bad_setting() -> FetchError {
    FetchError::Unreachable("the identity's URL or header does not form a request".into())
}

/// `a=1&b=2`, each name and value percent-encoded (RFC 3986's unreserved characters kept).
fn encode_pairs(pairs: &[(&str, &str)]) -> String {
    let mut out = String::new();
    for (i, (name, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push('&');
        }
        encode(name, &mut out);
        out.push('=');
        encode(value, &mut out);
    }
    out
}

fn encode(text: &str, out: &mut String) {
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
}

#[derive(Deserialize)]
struct TokenAnswer {
    access_token: Option<String>,
    /// Seconds; Entra ID sends a number, the managed identity endpoints a string.
    expires_in: Option<serde_json::Value>,
    /// Unix seconds, likewise either.
    expires_on: Option<serde_json::Value>,
}

fn parse(body: &[u8]) -> Result<Issued, FetchError> {
    let answer: TokenAnswer =
        serde_json::from_slice(body).map_err(|_| FetchError::Malformed("not JSON"))?;
    let access_token = answer
        .access_token
        .filter(|t| !t.is_empty())
        .ok_or(FetchError::Malformed("no access_token"))?;
    if HeaderValue::from_str(&format!("Bearer {access_token}")).is_err() {
        return Err(FetchError::Malformed("the token is not a header value"));
    }
    let lifetime = match (seconds(answer.expires_in), seconds(answer.expires_on)) {
        (Some(s), _) => Duration::from_secs(s),
        (None, Some(on)) => Duration::from_secs(on.saturating_sub(unix_now())),
        (None, None) => return Err(FetchError::Malformed("no expires_in or expires_on")),
    };
    Ok(Issued {
        access_token,
        lifetime,
    })
}

fn seconds(value: Option<serde_json::Value>) -> Option<u64> {
    match value? {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Entra ID's `error` (`invalid_client`), or the managed identity endpoint's; never the
/// description, which may quote what was sent.
fn error_code(body: &[u8]) -> String {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
        return String::new();
    };
    let code = value["error"]
        .as_str()
        .or_else(|| value["error"]["code"].as_str());
    match code {
        Some(code) if code.len() <= 64 && code.bytes().all(|b| b.is_ascii_graphic()) => {
            format!(" ({code})")
        }
        _ => String::new(),
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn both_spellings_of_a_lifetime_are_read() {
        let entra = parse(br#"{"token_type":"Bearer","expires_in":3599,"access_token":"a"}"#);
        assert_eq!(entra.unwrap().lifetime, Duration::from_secs(3599));
        let imds = parse(br#"{"access_token":"b","expires_in":"86399","expires_on":"1"}"#);
        assert_eq!(imds.unwrap().lifetime, Duration::from_secs(86399));
        let on = format!(
            r#"{{"access_token":"c","expires_on":"{}"}}"#,
            unix_now() + 600
        );
        let lifetime = parse(on.as_bytes()).unwrap().lifetime.as_secs();
        assert!((598..=600).contains(&lifetime), "{lifetime}");
        assert!(parse(br#"{"access_token":"d"}"#).is_err());
        assert!(parse(b"{\"access_token\":\"e\nf\",\"expires_in\":1}").is_err());
    }

    #[test]
    fn a_refusal_names_the_error_code_and_nothing_else() {
        let body = br#"{"error":"invalid_client","error_description":"AADSTS7000215: Invalid client secret provided: s3cr3t"}"#;
        assert_eq!(error_code(body), " (invalid_client)");
        assert_eq!(error_code(b"<html>"), "");
    }

    #[test]
    fn form_values_are_percent_encoded() {
        let form = encode_pairs(&[("scope", "https://ai.azure.com/.default"), ("a b", "+&=")]);
        assert_eq!(
            form,
            "scope=https%3A%2F%2Fai.azure.com%2F.default&a%20b=%2B%26%3D"
        );
    }
}
