//! Listeners: accept loops serving HTTP/1.1 and h2 on the client and admin ports, with header
//! limits, and graceful shutdown: the listener closes at once, idle keep-alive connections close,
//! and requests under way (open streams included) finish within [`SHUTDOWN_GRACE`].

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::body::Body;
use crate::park::{Answer, Parking, ParkingIo};

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
    let builder = Arc::new(builder());
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
                connections.spawn(connection(stream, builder.clone(), handler.clone(), shutdown.clone()));
            }
        }
    }
    drop(listener);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(SHUTDOWN_GRACE, drained).await.is_err() {
        tracing::warn!("shutdown: connections still open after {SHUTDOWN_GRACE:?}, closing them");
    }
    connections.shutdown().await;
}

/// The h2 client preface; a connection whose first bytes may begin it is served as it comes
/// and never parks.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one accepted socket: a hyper connection once its first bytes are there, and again each
/// time it parks (see [`crate::park`]) and its next bytes arrive. Shutdown closes it while it
/// waits and ends a hyper connection gracefully.
async fn connection<H, F>(
    mut stream: TcpStream,
    builder: Arc<Builder<TokioExecutor>>,
    handler: Arc<H>,
    mut shutdown: watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let mut head = [0u8; H2_PREFACE.len()];
    let seen = tokio::select! {
        biased;
        _ = stopped(&mut shutdown) => return,
        seen = stream.peek(&mut head) => match seen {
            Ok(0) | Err(_) => return,
            Ok(seen) => seen,
        },
    };
    let parking = Parking::new(!H2_PREFACE.starts_with(&head[..seen]));
    loop {
        serve_until_parked(stream, &builder, &handler, &parking, &mut shutdown).await;
        let Some(parked) = parking.take_parked() else {
            return;
        };
        stream = parked;
        tokio::select! {
            biased;
            _ = stopped(&mut shutdown) => return,
            ready = stream.readable() => if ready.is_err() { return },
        }
    }
}

async fn serve_until_parked<H, F>(
    stream: TcpStream,
    builder: &Builder<TokioExecutor>,
    handler: &Arc<H>,
    parking: &Arc<Parking>,
    shutdown: &mut watch::Receiver<bool>,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let handler = handler.clone();
    let service_parking = parking.clone();
    let service = service_fn(move |request| {
        let request_counted = service_parking.request();
        let parking = service_parking.clone();
        // Boxed: hyper keeps a slot of the service future's size for every
        // connection, idle or not, and moves the future into it per request.
        let future = Box::pin(handler(request));
        async move {
            let response = future.await;
            if response.status() == StatusCode::SWITCHING_PROTOCOLS {
                parking.forbid();
            }
            Ok::<_, Infallible>(response.map(|body| Answer::new(body, request_counted)))
        }
    });
    let io = TokioIo::new(ParkingIo::new(stream, parking.clone()));
    let connection = builder
        .serve_connection_with_upgrades(io, service)
        .into_owned();
    tokio::pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        _ = stopped(shutdown) => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = ended {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// Resolves once shutdown has begun (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}
