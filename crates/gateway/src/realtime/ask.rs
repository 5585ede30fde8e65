//! The client's half of a realtime handshake, read before anything is decided: the alias its
//! URL names, the protocol it speaks (beta or GA), the subprotocols it offered (a browser's key
//! among them), and the WebSocket headers an upgrade needs.

use http::{header, HeaderMap, HeaderValue};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;

use crate::errors::GatewayError;
use crate::surface::{percent_decode, Encoded, RealtimePath};

/// The subprotocol browsers put their key in, since they cannot set headers.
const KEY_PROTOCOL: &str = "openai-insecure-api-key.";
/// The subprotocol the Realtime API speaks.
pub const REALTIME: &str = "realtime";

/// Which generation of the realtime event protocol the client speaks; the gateway never
/// translates events, so the upstream is asked for the same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Protocol {
    /// The beta protocol (`response.text.delta`): Azure's `/openai/realtime?api-version=...`, or an
    /// `OpenAI-Beta: realtime=v1` header (or `openai-beta.realtime-v1` subprotocol).
    Beta { api_version: Option<String> },
    /// The GA protocol (`response.output_text.delta`).
    Ga,
}

#[derive(Debug, Clone)]
pub struct Ask {
    pub alias: String,
    pub protocol: Protocol,
    /// The client offered the `realtime` subprotocol.
    pub offers_realtime: bool,
    /// The key of an `openai-insecure-api-key.KEY` subprotocol.
    pub subprotocol_key: Option<String>,
    /// `Sec-WebSocket-Key`.
    websocket_key: String,
}

impl Ask {
    pub fn read(path: RealtimePath, query: &str, headers: &HeaderMap) -> Result<Ask, GatewayError> {
        let websocket_key = upgrade_key(headers)?;
        let field = match path {
            RealtimePath::Azure => "deployment",
            RealtimePath::OpenAi | RealtimePath::AzureV1 => "model",
        };
        let alias = query_param(query, field)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| {
                GatewayError::InvalidRequest(format!(
                    "missing required query parameter `{field}` (the model alias)"
                ))
            })?;
        let offered = subprotocols(headers);
        let beta_asked = headers
            .get("openai-beta")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains("realtime=v1"))
            || offered.iter().any(|p| p == "openai-beta.realtime-v1");
        let protocol = match path {
            RealtimePath::Azure => Protocol::Beta {
                api_version: query_param(query, "api-version").filter(|v| !v.is_empty()),
            },
            _ if beta_asked => Protocol::Beta { api_version: None },
            _ => Protocol::Ga,
        };
        Ok(Ask {
            alias,
            protocol,
            offers_realtime: offered.iter().any(|p| p == REALTIME),
            subprotocol_key: offered
                .iter()
                .find_map(|p| p.strip_prefix(KEY_PROTOCOL))
                .map(str::to_owned),
            websocket_key,
        })
    }

    /// What the upstream is offered: `realtime` when the client offered it; never a key.
    pub fn forwarded_subprotocols(&self) -> Option<HeaderValue> {
        self.offers_realtime
            .then(|| HeaderValue::from_static(REALTIME))
    }

    /// `Sec-WebSocket-Accept` for the client's 101.
    pub fn accept_key(&self) -> String {
        derive_accept_key(self.websocket_key.as_bytes())
    }
}

/// The `Sec-WebSocket-Key` of a valid upgrade request (HTTP/1.1, `Upgrade: websocket`,
/// version 13), or why the request is not one.
fn upgrade_key(headers: &HeaderMap) -> Result<String, GatewayError> {
    let has = |name: header::HeaderName, token: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .any(|t| t.trim().eq_ignore_ascii_case(token))
    };
    let not_websocket = || {
        GatewayError::InvalidRequest(
            "this is a WebSocket endpoint: send an HTTP/1.1 GET with `Connection: Upgrade`, `Upgrade: websocket` and `Sec-WebSocket-Version: 13`".into(),
        )
    };
    if !has(header::UPGRADE, "websocket") || !has(header::CONNECTION, "upgrade") {
        return Err(not_websocket());
    }
    if !has(header::SEC_WEBSOCKET_VERSION, "13") {
        return Err(not_websocket());
    }
    headers
        .get(header::SEC_WEBSOCKET_KEY)
        .and_then(|v| v.to_str().ok())
        .map(|k| k.trim().to_owned())
        .filter(|k| !k.is_empty())
        .ok_or_else(not_websocket)
}

fn subprotocols(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_owned())
        .filter(|p| !p.is_empty())
        .collect()
}

/// A query parameter, percent-decoded (`+` is a space).
fn query_param(query: &str, key: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (k == key).then(|| percent_decode(v, Encoded::Query))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upgrade(extra: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("sec-websocket-version", "13"),
            ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ]
        .iter()
        .chain(extra)
        {
            headers.append(*name, HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn the_alias_and_protocol_come_from_where_each_client_puts_them() {
        let azure = Ask::read(
            RealtimePath::Azure,
            "api-version=2025-04-01-preview&deployment=voice%2Deu",
            &upgrade(&[]),
        )
        .unwrap();
        assert_eq!(azure.alias, "voice-eu");
        assert_eq!(
            azure.protocol,
            Protocol::Beta {
                api_version: Some("2025-04-01-preview".into())
            }
        );
        let ga = Ask::read(RealtimePath::OpenAi, "model=voice", &upgrade(&[])).unwrap();
        assert_eq!(ga.protocol, Protocol::Ga);
        let beta = Ask::read(
            RealtimePath::AzureV1,
            "model=voice",
            &upgrade(&[("openai-beta", "realtime=v1")]),
        )
        .unwrap();
        assert_eq!(beta.protocol, Protocol::Beta { api_version: None });
        assert_eq!(ga.accept_key(), "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=");
    }

    #[test]
    fn a_browser_key_is_read_from_its_subprotocol_and_never_forwarded() {
        let headers = upgrade(&[(
            "sec-websocket-protocol",
            "realtime, openai-insecure-api-key.k-123, openai-beta.realtime-v1",
        )]);
        let ask = Ask::read(RealtimePath::OpenAi, "model=voice", &headers).unwrap();
        assert_eq!(ask.subprotocol_key.as_deref(), Some("k-123"));
        assert_eq!(ask.protocol, Protocol::Beta { api_version: None });
        assert_eq!(ask.forwarded_subprotocols().unwrap(), "realtime");
    }

    #[test]
    fn requests_that_are_no_upgrade_or_name_no_alias_are_refused() {
        let plain = HeaderMap::new();
        assert!(Ask::read(RealtimePath::OpenAi, "model=x", &plain).is_err());
        let no_alias = Ask::read(RealtimePath::Azure, "api-version=1", &upgrade(&[]));
        assert!(
            matches!(no_alias, Err(GatewayError::InvalidRequest(m)) if m.contains("deployment"))
        );
    }
}
