//! Listeners: accept loops serving the client and admin ports, HTTP/1.1 and h2 on hyper's
//! connections with header and body limits and the client port's deadlines, a cap on open
//! connections; and graceful shutdown in the phases of [`crate::stopping`]: while draining the
//! listener accepts, HTTP/1.1 answers carry `connection: close` and h2 connections get GOAWAY;
//! then the listener closes, idle keep-alive connections close, and requests under way (open
//! streams included) finish until the stop cuts them.

mod capacity;
mod framing;
mod guard;
pub mod http1;
mod intake;
mod upgrade;

use std::convert::Infallible;
use std::future::Future;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use onedoor_config::ClientTimeouts;
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};

use crate::body::{Body, RequestBody};
use crate::lanes::{Lanes, Serve};
use crate::stopping::{reached, Phase};
pub use capacity::{connection_cap, raise_descriptor_limit};
pub use framing::refusal as framing_refusal;
pub use intake::{AnswerBy, BodyLimit, Front, SMALL_BODY};
pub use upgrade::OnUpgrade;

/// How a listener's connections are held: its cap on open connections and the deadlines of each.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub timeouts: ClientTimeouts,
}

/// hyper's builder for h2 connections.
fn h2_builder() -> Builder<TokioExecutor> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http2()
        .max_header_list_size(http1::MAX_HEAD_BYTES as u32);
    builder
}

/// Serves `listener` with `handler` until `phase` reaches [`Phase::Closing`], then lets open
/// connections finish until it reaches [`Phase::Aborting`]. With `lanes`, each connection is
/// served on a lane (see [`crate::lanes`]); without, here. Past `limits.max_connections` open
/// connections, a new one is answered 503 and closed.
pub async fn serve<H, F>(
    listener: TcpListener,
    handler: H,
    limit: BodyLimit,
    limits: Limits,
    mut phase: watch::Receiver<Phase>,
    lanes: Option<Arc<Lanes>>,
) where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let open = Open::new();
    let front = Arc::new(Front {
        handler,
        limit,
        timeouts: limits.timeouts,
    });
    let serve = serve_with(front, &open, &phase);
    let mut failures = AcceptFailures::default();
    let take = |stream: TcpStream| {
        if open.count() >= limits.max_connections {
            tokio::spawn(capacity::refuse(stream, limits.max_connections));
            return;
        }
        let _ = stream.set_nodelay(true);
        let stream = match &lanes {
            Some(lanes) => match lanes.hand_over(stream, &serve) {
                Ok(()) => return,
                Err(stream) => stream,
            },
            None => stream,
        };
        tokio::spawn(serve(stream));
    };
    loop {
        tokio::select! {
            biased;
            () = reached(&mut phase, Phase::Closing) => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => take(stream),
                Err(error) => {
                    failures.log(&error);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            },
        }
    }
    // Connections the kernel has already completed are served, not reset with the listener.
    while let Some(Ok((stream, _))) = listener.accept().now_or_never() {
        take(stream);
    }
    drop(listener);
    tokio::select! {
        () = open.drained() => {}
        () = reached(&mut phase, Phase::Aborting) => {}
    }
    open.abort();
}

/// Accept errors (out of descriptors, most often), logged at most once a second with how many
/// there were since.
#[derive(Default)]
struct AcceptFailures {
    logged: Option<tokio::time::Instant>,
    since: u64,
}

impl AcceptFailures {
    fn log(&mut self, error: &std::io::Error) {
        self.since += 1;
        let now = tokio::time::Instant::now();
        if self
            .logged
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            return;
        }
        tracing::warn!(%error, failures = self.since, "accept failed");
        self.logged = Some(now);
        self.since = 0;
    }
}

/// How a socket of this listener is served, wherever it runs: as a counted connection that
/// ends early when [`Open::abort`] is called.
fn serve_with<H, F>(front: Arc<Front<H>>, open: &Arc<Open>, phase: &watch::Receiver<Phase>) -> Serve
where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let open = open.clone();
    let phase = phase.clone();
    Arc::new(move |stream| {
        let counted = open.enter();
        let mut aborted = open.aborted.subscribe();
        let served = connection(stream, front.clone(), phase.clone());
        Box::pin(async move {
            let signal = aborted.clone();
            let wait = pin!(stopped(&mut aborted));
            tokio::select! {
                () = served => {}
                () = Raised::new(&signal, wait) => {}
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

    fn count(&self) -> usize {
        self.count.load(Ordering::Acquire)
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

/// The h2 client preface; a connection whose first bytes may begin it is served by hyper.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Serves one accepted socket once its first bytes are there: HTTP/1.1 or h2, both on hyper.
/// The listener's close closes it while it waits.
async fn connection<H, F>(
    stream: TcpStream,
    front: Arc<Front<H>>,
    mut phase: watch::Receiver<Phase>,
) where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let first = tokio::time::timeout(front.timeouts.head, speaks_h2(&stream, &mut phase));
    match first.await.ok().flatten() {
        None => {}
        Some(false) => http1::serve(stream, front, &mut phase).await,
        // Boxed: hyper's h2 connection is kilobytes that HTTP/1.1 connections need not carry.
        Some(true) => Box::pin(h2(stream, front, &mut phase)).await,
    }
}

/// How long a client whose first bytes could begin either protocol (a `P` alone: `POST` or
/// the h2 preface's `PRI`) may take to send enough to tell them apart.
const PREFACE_WAIT: Duration = Duration::from_secs(10);

/// How long a connection accepted before the listener closed may still take to send its first
/// bytes once it has: they may be on their way.
pub(super) const FIRST_BYTES_AFTER_CLOSE: Duration = Duration::from_secs(1);

/// Whether the client's first bytes are the h2 preface; `None` when it closed, sent nothing
/// within [`FIRST_BYTES_AFTER_CLOSE`] of the listener's close, or sent too little to tell within
/// [`PREFACE_WAIT`]. Read with `peek`, so the bytes stay for whichever protocol serves them.
async fn speaks_h2(stream: &TcpStream, phase: &mut watch::Receiver<Phase>) -> Option<bool> {
    let give_up = tokio::time::Instant::now() + PREFACE_WAIT;
    let mut head = [0u8; H2_PREFACE.len()];
    let late = async {
        reached(phase, Phase::Closing).await;
        tokio::time::sleep(FIRST_BYTES_AFTER_CLOSE).await;
    };
    tokio::pin!(late);
    loop {
        let seen = tokio::select! {
            biased;
            () = &mut late => return None,
            seen = stream.peek(&mut head) => match seen {
                Ok(0) | Err(_) => return None,
                Ok(seen) => seen,
            },
        };
        if !H2_PREFACE.starts_with(&head[..seen]) {
            return Some(false);
        }
        if seen == H2_PREFACE.len() {
            return Some(true);
        }
        // A client that has ended its sending will never tell.
        let ready = stream.ready(Interest::READABLE).await.ok()?;
        if ready.is_read_closed() || tokio::time::Instant::now() >= give_up {
            return None;
        }
        // A peek answers at once while the bytes it saw wait: look again a little later.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Serves an h2 connection with hyper; a drain sends GOAWAY, so the client opens its next
/// streams on a new connection (to this gateway while it still accepts, or another).
async fn h2<H, F>(stream: TcpStream, front: Arc<Front<H>>, phase: &mut watch::Receiver<Phase>)
where
    H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
    F: Future<Output = Response<Body>> + Send + 'static,
{
    let service = service_fn(move |request: Request<Incoming>| {
        let answer = front.clone().answer(request, None);
        async move { Ok::<_, Infallible>(answer.await) }
    });
    let connection = h2_builder()
        .serve_connection_with_upgrades(TokioIo::new(stream), service)
        .into_owned();
    let now = || Duration::ZERO;
    until_ended(
        connection,
        |c| c.graceful_shutdown(),
        phase,
        Phase::Draining,
        now,
    )
    .await;
}

/// Serves `connection` to its end; once `phase` reaches `at`, and `delay` (asked then) has
/// passed, lets it finish gracefully.
async fn until_ended<C, E>(
    connection: C,
    graceful_shutdown: impl FnOnce(Pin<&mut C>),
    phase: &mut watch::Receiver<Phase>,
    at: Phase,
    delay: impl FnOnce() -> Duration,
) where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    tokio::pin!(connection);
    let signal = phase.clone();
    let wait = pin!(reached(phase, at));
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        () = Raised::new(&signal, wait) => {
            let delay = delay();
            tokio::select! {
                ended = connection.as_mut() => ended,
                () = tokio::time::sleep(delay) => {
                    graceful_shutdown(connection.as_mut());
                    connection.await
                }
            }
        }
    };
    if let Err(error) = ended {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// A wait for a watch signal to be raised (a flag set once, or a stop moving to its next phase)
/// that takes the signal's lock only once it moved. A registered wait for a watch takes its lock
/// at every poll, and a connection's task is polled a few times a request, with the same signal
/// for every connection of both lanes; so `wait` is polled first to register, and later only
/// once `signal`'s version (an atomic load) moved.
struct Raised<'a, T, F> {
    /// A receiver of the signal `wait` waits on, which has seen its value as `wait` first did.
    signal: &'a watch::Receiver<T>,
    wait: Pin<&'a mut F>,
    registered: bool,
}

impl<'a, T, F: Future<Output = ()>> Raised<'a, T, F> {
    fn new(signal: &'a watch::Receiver<T>, wait: Pin<&'a mut F>) -> Self {
        Raised {
            signal,
            wait,
            registered: false,
        }
    }

    /// Whether the signal changed since `signal` last looked, or its sender is gone.
    fn changed(&self) -> bool {
        self.signal.has_changed().unwrap_or(true)
    }
}

impl<T, F: Future<Output = ()>> Future for Raised<'_, T, F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.registered && !self.changed() {
            return Poll::Pending;
        }
        self.registered = true;
        self.wait.as_mut().poll(cx)
    }
}

/// Resolves once the signal is raised, an abort (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::net::SocketAddr;

    use bytes::Bytes;
    use http::HeaderName;
    use http_body_util::{BodyExt, Empty};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::stamp::Stamp;

    /// Whether `raised` ends within `millis` milliseconds.
    async fn ends_within(
        raised: &mut Raised<'_, bool, impl Future<Output = ()>>,
        millis: u64,
    ) -> bool {
        tokio::time::timeout(Duration::from_millis(millis), raised)
            .await
            .is_ok()
    }

    #[tokio::test]
    async fn a_raised_signal_ends_a_registered_wait_and_a_change_back_does_not() {
        let (raise, mut receiver) = watch::channel(false);
        let signal = receiver.clone();
        let wait = pin!(stopped(&mut receiver));
        let mut raised = Raised::new(&signal, wait);
        // Registered at its first poll; later polls see no change.
        assert!(!ends_within(&mut raised, 50).await);
        assert!(!ends_within(&mut raised, 50).await);
        raise.send(false).unwrap();
        assert!(!ends_within(&mut raised, 50).await);
        raise.send(true).unwrap();
        assert!(ends_within(&mut raised, 1000).await);
    }

    #[tokio::test]
    async fn a_signal_whose_sender_is_gone_ends_a_registered_wait() {
        let (raise, mut receiver) = watch::channel(false);
        let signal = receiver.clone();
        let wait = pin!(stopped(&mut receiver));
        let mut raised = Raised::new(&signal, wait);
        assert!(!ends_within(&mut raised, 50).await);
        drop(raise);
        assert!(ends_within(&mut raised, 1000).await);
    }

    /// The path asked for, with a stamp that says it too.
    async fn path_of(request: Request<RequestBody>) -> Response<Body> {
        let path = request.uri().path().to_owned();
        let mut stamp = Stamp::default();
        stamp.add(&HeaderName::from_static("x-onedoor-path"), path.as_bytes());
        let mut response = Response::new(crate::body::full(path));
        stamp.put(&mut response);
        response
    }

    /// A server of [`path_of`], and the sender that stops it.
    async fn listening() -> (SocketAddr, watch::Sender<Phase>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(Phase::Serving);
        let limit: BodyLimit = Arc::new(|_: &http::HeaderMap| 1024);
        let limits = Limits {
            max_connections: 64,
            timeouts: ClientTimeouts::DEFAULT,
        };
        tokio::spawn(serve(listener, path_of, limit, limits, shutdown, None));
        (addr, stop)
    }

    #[tokio::test]
    async fn an_h2_client_with_prior_knowledge_is_answered_by_the_handler_until_shutdown() {
        let (addr, stop) = listening().await;
        let stream = TcpStream::connect(addr).await.unwrap();
        let (mut sender, connection) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap();
        let connection = tokio::spawn(connection);
        for _ in 0..2 {
            let request = Request::get(format!("http://{addr}/over/h2"))
                .body(Empty::<Bytes>::new())
                .unwrap();
            let response = sender.send_request(request).await.unwrap();
            assert_eq!(response.version(), http::Version::HTTP_2);
            assert_eq!(response.headers()["x-onedoor-path"], "/over/h2");
            let body = response.into_body().collect().await.unwrap().to_bytes();
            assert_eq!(&body[..], b"/over/h2");
        }
        // Shutdown ends the idle connection gracefully: the client's side of it ends too.
        stop.send(Phase::Closing).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(2), connection).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
    }

    #[tokio::test]
    async fn a_drain_sends_h2_connections_goaway_while_new_ones_are_still_served() {
        let (addr, stop) = listening().await;
        let handshake = || async {
            let stream = TcpStream::connect(addr).await.unwrap();
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .unwrap()
        };
        let (_first, connection) = handshake().await;
        let connection = tokio::spawn(connection);
        tokio::time::sleep(Duration::from_millis(50)).await;
        stop.send(Phase::Draining).unwrap();
        let ended = tokio::time::timeout(Duration::from_secs(2), connection).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "{ended:?}");
        let (mut sender, connection) = handshake().await;
        tokio::spawn(connection);
        let request = Request::get(format!("http://{addr}/while/draining"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        let response = sender.send_request(request).await.unwrap();
        assert_eq!(response.headers()["x-onedoor-path"], "/while/draining");
    }

    #[tokio::test]
    async fn an_http1_answer_carries_its_stamp_s_lines_in_its_head() {
        let (addr, _stop) = listening().await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /over/http1 HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert!(
            head.contains("\r\nx-onedoor-path: /over/http1\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\ncontent-length: 11\r\n"), "{head}");
        assert_eq!(body, "/over/http1");
    }
}
