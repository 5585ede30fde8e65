//! The upstream half of a realtime handshake: the URL each provider serves realtime at, the
//! backend's own credential in place of the client's, TCP (and TLS for `https` backends, rustls
//! on ring with the webpki roots, as the HTTP client does) under the backend's `connect` timeout,
//! and the WebSocket handshake under its `first_token` timeout. A refused handshake is a plain
//! HTTP answer, so it becomes the same [`Failure`] an HTTP attempt would, and the failover loop
//! treats it by the same rules.

use std::sync::{Arc, OnceLock};

use http::{HeaderMap, HeaderValue, StatusCode};
use onedoor_config::{Backend, Provider};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tokio_rustls::TlsConnector;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::protocol::WebSocketConfig;
use tokio_tungstenite::tungstenite::Error as WsError;
use tokio_tungstenite::WebSocketStream;

use super::ask::{Ask, Protocol};
use crate::provider::Header;
use crate::router::Candidate;
use crate::runtime::Runtime;
use crate::telemetry::Traceparent;
use crate::upstream::Failure;

/// The api-version asked for on Azure's beta realtime path when the client named none.
const AZURE_PREVIEW_VERSION: &str = "2024-10-01-preview";

/// A byte stream a WebSocket can run on: plain TCP or TLS over it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

pub type UpstreamSocket = WebSocketStream<Box<dyn Io>>;

/// Message and frame size limits of both hops: audio deltas are large base64 text frames.
pub fn config() -> WebSocketConfig {
    WebSocketConfig::default()
        .max_message_size(Some(64 << 20))
        .max_frame_size(Some(16 << 20))
}

/// Opens the upstream socket of `candidate` for the client's `ask`, its handshake stamped with
/// the `traceparent` of a traced session's attempt. Tungstenite checks the answer: a 101 whose
/// accept key or subprotocol does not match is a failed attempt.
pub async fn connect(
    runtime: &Runtime,
    candidate: &Candidate,
    ask: &Ask,
    deadline: Instant,
    traceparent: Option<&Traceparent>,
) -> Result<UpstreamSocket, Failure> {
    let unknown = || Failure::ConnectError("unknown backend".into());
    let backend = runtime
        .snapshot
        .backends
        .get(candidate.backend)
        .ok_or_else(unknown)?;
    let url = url(backend, &candidate.deployment, &ask.protocol)
        .ok_or_else(|| Failure::ConnectError("the backend URL is not http(s)".into()))?;
    let mut request = url
        .as_str()
        .into_client_request()
        .map_err(|e| Failure::ConnectError(format!("bad realtime URL: {e}")))?;
    let stamp = runtime
        .stamps
        .get(candidate.backend)
        .map_or(&[][..], Vec::as_slice);
    headers(request.headers_mut(), stamp, ask);
    if let Some(tokens) = runtime.credentials.of(candidate.backend) {
        let token = tokens.header(deadline).await?;
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, token);
    }
    if let Some(traceparent) = traceparent {
        traceparent.stamp(request.headers_mut());
    }
    let uri = request.uri().clone();
    let host = uri.host().unwrap_or_default().to_owned();
    let secure = uri.scheme_str() == Some("wss");
    let port = uri.port_u16().unwrap_or(if secure { 443 } else { 80 });
    let now = Instant::now();
    let connect_by = deadline.min(now + backend.timeouts.connect);
    let tcp = match tokio::time::timeout_at(connect_by, TcpStream::connect((host.as_str(), port)))
        .await
    {
        Err(_) => return Err(Failure::ConnectTimeout),
        Ok(Err(error)) => return Err(Failure::ConnectError(error.to_string())),
        Ok(Ok(tcp)) => tcp,
    };
    let _ = tcp.set_nodelay(true);
    let stream: Box<dyn Io> = match secure {
        false => Box::new(tcp),
        true => {
            let name = ServerName::try_from(host.clone())
                .map_err(|e| Failure::ConnectError(format!("bad TLS server name: {e}")))?;
            let connector =
                tls().ok_or_else(|| Failure::ConnectError("TLS is not available".into()))?;
            let tls = tokio::time::timeout_at(connect_by, connector.connect(name, tcp)).await;
            match tls {
                Err(_) => return Err(Failure::ConnectTimeout),
                Ok(Err(error)) => return Err(Failure::ConnectError(format!("TLS: {error}"))),
                Ok(Ok(tls)) => Box::new(tls),
            }
        }
    };
    let answer_by = deadline.min(Instant::now() + backend.timeouts.first_token);
    let shaken = tokio::time::timeout_at(
        answer_by,
        tokio_tungstenite::client_async_with_config(request, stream, Some(config())),
    )
    .await;
    match shaken {
        Err(_) if answer_by < deadline => Err(Failure::FirstTokenTimeout),
        Err(_) => Err(Failure::Timeout),
        Ok(Err(error)) => Err(failure(error)),
        Ok(Ok((socket, _))) => Ok(socket),
    }
}

/// The realtime URL of `deployment` on `backend`, in the protocol the client speaks: Azure's
/// beta path (`/openai/realtime?api-version&deployment`) or its v1 path (`/openai/v1/realtime?model`),
/// and `{url}/realtime?model` for OpenAI-compatible servers (their URL ends in `/v1`).
pub fn url(backend: &Backend, deployment: &str, protocol: &Protocol) -> Option<String> {
    let base = backend.url.trim_end_matches('/');
    let ws = match base.split_once("://") {
        Some(("https", rest)) => format!("wss://{rest}"),
        Some(("http", rest)) => format!("ws://{rest}"),
        _ => return None,
    };
    let deployment = encode(deployment);
    Some(match (backend.provider, protocol) {
        (Provider::Azure, Protocol::Beta { api_version }) => format!(
            "{ws}/openai/realtime?api-version={}&deployment={deployment}",
            encode(api_version.as_deref().unwrap_or(AZURE_PREVIEW_VERSION))
        ),
        (Provider::Azure, Protocol::Ga) => format!("{ws}/openai/v1/realtime?model={deployment}"),
        (Provider::OpenAi | Provider::Anthropic, _) => format!("{ws}/realtime?model={deployment}"),
    })
}

/// The handshake headers: the backend's credential (never the client's), the subprotocols the
/// client offered minus any that carry a key, and the beta header of a beta-protocol client.
fn headers(headers: &mut HeaderMap, stamp: &[Header], ask: &Ask) {
    for (name, value) in stamp {
        headers.insert(name.clone(), value.clone());
    }
    if let Some(offered) = ask.forwarded_subprotocols() {
        headers.insert("sec-websocket-protocol", offered);
    }
    if matches!(ask.protocol, Protocol::Beta { .. }) {
        headers.insert("openai-beta", HeaderValue::from_static("realtime=v1"));
    }
}

/// A failed handshake as the failover loop reads attempts: a refusal with its status and body,
/// a connection that broke, or one that never opened.
fn failure(error: WsError) -> Failure {
    match error {
        WsError::Http(response) => {
            let (parts, body) = (*response).into_parts();
            Failure::Status {
                status: parts.status,
                headers: parts.headers,
                body: body.unwrap_or_default().into(),
            }
        }
        WsError::Io(error) => Failure::Reset(error.to_string()),
        WsError::Tls(error) => Failure::ConnectError(format!("TLS: {error}")),
        WsError::Protocol(error) => Failure::Status {
            status: StatusCode::BAD_GATEWAY,
            headers: HeaderMap::new(),
            body: format!(
                "the upstream's handshake answer is not a valid WebSocket upgrade: {error}"
            )
            .into(),
        },
        other => Failure::Reset(other.to_string()),
    }
}

/// One TLS client for every upstream socket: rustls on ring, the webpki roots. `None` only if
/// ring offered no protocol version, which a build with ring never does.
fn tls() -> Option<TlsConnector> {
    static CONFIG: OnceLock<Option<Arc<ClientConfig>>> = OnceLock::new();
    let config = CONFIG.get_or_init(|| {
        let roots = RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let config = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .ok()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Some(Arc::new(config))
    });
    config.clone().map(TlsConnector::from)
}

/// Percent-encodes a query value: everything but unreserved characters.
fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for byte in value.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backend(provider: Provider, url: &str) -> Backend {
        let yaml = format!(
            "backends:\n  - {{ name: b, provider: {}, url: \"{url}\", region: r }}\n",
            provider.as_str()
        );
        let snapshot =
            onedoor_config::parse(&yaml, std::path::Path::new("t.yaml"), &|_| None).unwrap();
        snapshot.backends[0].clone()
    }

    #[test]
    fn each_provider_is_asked_at_its_own_realtime_url() {
        let azure = backend(Provider::Azure, "https://sub1.openai.azure.com/");
        let beta = Protocol::Beta { api_version: None };
        assert_eq!(
            url(&azure, "gpt rt", &beta).unwrap(),
            "wss://sub1.openai.azure.com/openai/realtime?api-version=2024-10-01-preview&deployment=gpt%20rt"
        );
        assert_eq!(
            url(&azure, "rt", &Protocol::Ga).unwrap(),
            "wss://sub1.openai.azure.com/openai/v1/realtime?model=rt"
        );
        let openai = backend(Provider::OpenAi, "http://10.0.0.12:8000/v1");
        assert_eq!(
            url(&openai, "gpt-realtime", &Protocol::Ga).unwrap(),
            "ws://10.0.0.12:8000/v1/realtime?model=gpt-realtime"
        );
    }
}
