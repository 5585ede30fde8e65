//! Listeners: accept loops serving HTTP/1.1 and h2 on the client and admin ports, with header
//! limits, and graceful shutdown: the listener closes at once, idle keep-alive connections close,
//! and requests under way (open streams included) finish within [`SHUTDOWN_GRACE`].

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

use crate::body::Body;
use crate::lanes::{Lanes, Serve};
use crate::park::{Answer, Parking, ParkingIo};

/// Request heads (request line and headers) larger than this get 431.
const MAX_HEAD_BYTES: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// How long shutdown waits for requests under way, streams included; connections still open
/// after it are closed. Not configurable: it bounds how long a stop may take, whatever routing says.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How connections are served: HTTP/1.1 directly when the first bytes rule h2 out, else by
/// reading the preface first. Serving HTTP/1.1 through the preface reader costs every connection
/// an 8 KiB read buffer: hyper gets the 24 preface bytes on a first read of their own and grows
/// its buffer to 16 KiB to read the rest after them.
struct Builders {
    http1: http1::Builder,
    auto: Builder<TokioExecutor>,
}

fn builders() -> Builders {
    let mut http1 = http1::Builder::new();
    http1
        .max_buf_size(MAX_HEAD_BYTES.max(8192))
        .max_headers(MAX_HEADERS)
        .keep_alive(true);
    let mut auto = Builder::new(TokioExecutor::new());
    auto.http1()
        .max_buf_size(MAX_HEAD_BYTES.max(8192))
        .max_headers(MAX_HEADERS)
        .keep_alive(true);
    auto.http2().max_header_list_size(MAX_HEAD_BYTES as u32);
    Builders { http1, auto }
}

/// Serves `listener` with `handler` until `shutdown` flips, then lets open connections finish.
/// With `lanes`, each connection is served on a lane (see [`crate::lanes`]); without, here.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    mut shutdown: watch::Receiver<bool>,
    lanes: Option<Arc<Lanes>>,
) where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let open = Open::new();
    let serve = serve_with(Arc::new(handler), &open, &shutdown);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.changed() => break,
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
                let stream = match &lanes {
                    Some(lanes) => match lanes.hand_over(stream, &serve) {
                        Ok(()) => continue,
                        Err(stream) => stream,
                    },
                    None => stream,
                };
                tokio::spawn(serve(stream));
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, open.drained())
        .await
        .is_err()
    {
        tracing::warn!("shutdown: connections still open after {SHUTDOWN_GRACE:?}, closing them");
    }
    open.abort();
}

/// How a socket of this listener is served, wherever it runs: as a counted connection that
/// ends early when [`Open::abort`] is called.
fn serve_with<H, F>(handler: Arc<H>, open: &Arc<Open>, shutdown: &watch::Receiver<bool>) -> Serve
where
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let builders = Arc::new(builders());
    let open = open.clone();
    let shutdown = shutdown.clone();
    Arc::new(move |stream| {
        let counted = open.enter();
        let mut aborted = open.aborted.subscribe();
        let served = connection(stream, builders.clone(), handler.clone(), shutdown.clone());
        Box::pin(async move {
            tokio::select! {
                () = served => {}
                _ = aborted.wait_for(|abort| *abort) => {}
            }
            drop(counted);
        })
    })
}

/// The connections of one listener still open, wherever they are served.
struct Open {
    count: AtomicUsize,
    closed: Notify,
    aborted: watch::Sender<bool>,
}

/// One open connection; see [`Open::enter`].
struct Counted(Arc<Open>);

impl Open {
    fn new() -> Arc<Open> {
        Arc::new(Open {
            count: AtomicUsize::new(0),
            closed: Notify::new(),
            aborted: watch::Sender::new(false),
        })
    }

    fn enter(self: &Arc<Self>) -> Counted {
        self.count.fetch_add(1, Ordering::AcqRel);
        Counted(self.clone())
    }

    /// Resolves once no connection is open.
    async fn drained(&self) {
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            closed.as_mut().enable();
            if self.count.load(Ordering::Acquire) == 0 {
                return;
            }
            closed.await;
        }
    }

    /// Ends every connection still open, at once.
    fn abort(&self) {
        self.aborted.send_replace(true);
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.closed.notify_waiters();
        }
    }
}

/// The h2 client preface; a connection whose first bytes may begin it is served as it comes
/// and never parks.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one accepted socket: a hyper connection once its first bytes are there, and again each
/// time it parks (see [`crate::park`]) and its next bytes arrive. Shutdown closes it while it
/// waits and ends a hyper connection gracefully.
async fn connection<H, F>(
    mut stream: TcpStream,
    builders: Arc<Builders>,
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
    let http1 = !H2_PREFACE.starts_with(&head[..seen]);
    let parking = Parking::new(http1);
    loop {
        // Boxed: the hyper connection lives in this future only while it serves; a parked
        // connection's task then holds a few hundred bytes, not the served state's kilobytes.
        Box::pin(serve_until_parked(
            stream,
            (&builders, http1),
            &handler,
            &parking,
            &mut shutdown,
        ))
        .await;
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
    (builders, http1): (&Builders, bool),
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
    if http1 {
        let connection = builders.http1.serve_connection(io, service).with_upgrades();
        until_ended(connection, |c| c.graceful_shutdown(), shutdown).await;
    } else {
        let connection = builders
            .auto
            .serve_connection_with_upgrades(io, service)
            .into_owned();
        until_ended(connection, |c| c.graceful_shutdown(), shutdown).await;
    }
}

/// Serves `connection` to its end; once shutdown begins, lets it finish gracefully.
async fn until_ended<C, E>(
    connection: C,
    graceful_shutdown: impl FnOnce(Pin<&mut C>),
    shutdown: &mut watch::Receiver<bool>,
) where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        _ = stopped(shutdown) => {
            graceful_shutdown(connection.as_mut());
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
