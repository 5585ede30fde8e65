//! How many connections the client port holds: the open-files limit raised to its hard limit at
//! start, a cap that leaves descriptors for the upstream connections and the admin port, and the
//! answer a connection past the cap gets.

use std::time::Duration;

use http::Response;
use http_body_util::BodyExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::body::Body;
use crate::errors::GatewayError;
use crate::surface::Dialect;

/// Descriptors kept for everything but client and upstream connections: listeners, the admin
/// port, the usage store, logs.
const RESERVED: u64 = 64;

/// How long a refused connection is read from after its answer, so the client reads the 503
/// rather than a reset.
const LINGER: Duration = Duration::from_millis(200);

/// Raises this process's soft open-files limit to its hard one, once, and says so.
pub fn raise_descriptor_limit() {
    static RAISED: std::sync::Once = std::sync::Once::new();
    RAISED.call_once(|| match rlimit::Resource::NOFILE.get() {
        Ok((soft, hard)) if soft < hard => match rlimit::Resource::NOFILE.set(hard, hard) {
            Ok(()) => tracing::info!(
                from = soft,
                to = hard,
                "raised the open files (descriptor) limit to its hard limit"
            ),
            Err(error) => tracing::warn!(%error, soft, hard, "cannot raise the open-files limit"),
        },
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot read the open-files limit"),
    });
}

/// The client connections this process can hold, at most `configured`: a quarter of the
/// descriptors stays for upstream connections (pooled, held only by requests under way) and
/// [`RESERVED`] for the rest.
pub fn connection_cap(configured: usize) -> usize {
    let Ok((soft, _)) = rlimit::Resource::NOFILE.get() else {
        return configured;
    };
    let clients = soft.saturating_sub(RESERVED).saturating_sub(soft / 4);
    let fits = usize::try_from(clients).unwrap_or(usize::MAX);
    if fits < configured {
        tracing::warn!(
            max_connections = configured,
            open_files = soft,
            cap = fits.max(1),
            "max_connections is more than the open-files limit allows; capping it"
        );
    }
    configured.min(fits).max(1)
}

/// The answer of a connection past the cap: 503 `gateway_overloaded`, written before anything
/// is read (nothing was: the path, and so the dialect, is not known), then the close.
pub async fn refuse(mut stream: TcpStream, cap: usize) {
    let refusal = GatewayError::Overloaded(format!(
        "the gateway holds {cap} connections, its max_connections; try again shortly"
    ));
    let answer = on_the_wire(refusal.into_response_in(Dialect::OpenAi)).await;
    if stream.write_all(&answer).await.is_err() || stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    let drain = async { while let Ok(1..) = stream.read(&mut sink).await {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
}

/// An answer as HTTP/1.1 bytes that end its connection.
async fn on_the_wire(response: Response<Body>) -> Vec<u8> {
    let (parts, body) = response.into_parts();
    let body = body
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let mut wire = format!("HTTP/1.1 {}\r\n", parts.status).into_bytes();
    for (name, value) in &parts.headers {
        wire.extend_from_slice(name.as_str().as_bytes());
        wire.extend_from_slice(b": ");
        wire.extend_from_slice(value.as_bytes());
        wire.extend_from_slice(b"\r\n");
    }
    let framing = format!(
        "connection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    wire.extend_from_slice(framing.as_bytes());
    wire.extend_from_slice(&body);
    wire
}
