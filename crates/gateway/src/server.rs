//! Listeners: accept loops serving HTTP/1.1 and h2 on the client and admin ports, with header
//! limits, and graceful shutdown: the listener closes at once, idle keep-alive connections close,
//! and requests under way (open streams included) finish within [`SHUTDOWN_GRACE`].

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::body::Body;

/// Request heads (request line and headers) larger than this get 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// How long shutdown waits for requests under way, streams included; connections still open
/// after it are closed. Not configurable: it bounds how long a stop may take, whatever routing says.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

fn builder() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .max_buf_size(MAX_HEAD_BYTES.max(8192))
        .max_headers(MAX_HEADERS)
        .keep_alive(true);
    builder.http2().max_header_list_size(MAX_HEAD_BYTES as u32);
    builder
}

/// Serves `listener` with `handler` until `shutdown` flips, then lets open connections finish.
pub async fn serve<H, F>(listener: TcpListener, handler: H, mut shutdown: watch::Receiver<bool>)
where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = Arc::new(handler);
    let builder = builder();
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let service = service_fn(move |request| {
                    // Boxed: hyper keeps a slot of the service future's size for every
                    // connection, idle or not, and moves the future into it per request.
                    let future = Box::pin(handler(request));
                    async move { Ok::<_, Infallible>(future.await) }
                });
                let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let connection = graceful.watch(connection);
                connections.spawn(async move {
                    if let Err(error) = connection.await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                });
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("shutdown: connections still open after {SHUTDOWN_GRACE:?}, closing them");
    }
    connections.shutdown().await;
}
