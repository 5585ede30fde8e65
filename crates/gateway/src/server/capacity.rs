//! How many connections the client port holds: the open-files limit raised to its hard limit at
//! start, a cap that leaves descriptors for the upstream connections and the admin port, and the
//! answer a connection past the cap gets.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

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

/// The answer of a connection past the cap: 503 `gateway_overloaded`, then the close.
pub async fn refuse(mut stream: TcpStream, cap: usize) {
    let body = format!(
        r#"{{"error":{{"message":"the gateway holds {cap} connections, its max_connections; try again shortly","type":"server_error","param":null,"code":"gateway_overloaded"}}}}"#
    );
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nx-onedoor-error: gateway_overloaded\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let answer = [head.as_bytes(), body.as_bytes()].concat();
    if stream.write_all(&answer).await.is_err() || stream.shutdown().await.is_err() {
        return;
    }
    let mut sink = [0u8; 1024];
    let drain = async { while let Ok(1..) = stream.read(&mut sink).await {} };
    let _ = tokio::time::timeout(LINGER, drain).await;
}
