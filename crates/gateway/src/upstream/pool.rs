//! Upstream connections kept for reuse, one pool per backend and lane, all on hyper's client
//! connections: an HTTP/1.1 connection is lent to one request at a time and comes back the moment
//! its answer's last byte is read; an h2 connection (when TLS negotiates h2) is shared by every
//! request to its origin.
//!
//! A connection comes back when its body ends, before the caller has relayed that last byte, so the
//! caller's next request finds it here. A body dropped a few bytes short of its end, as a relay drops a
//! stream's after `data: [DONE]`, is read on briefly so its connection comes back too.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{header, HeaderValue, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::TokioExecutor;
use tower_service::Service;

use super::{describe, Failure};
use crate::body::BoxError;

type Http1 = http1::SendRequest<Whole>;
type Http2 = http2::SendRequest<Full<Bytes>>;

/// Connections idle longer than this are closed rather than reused (servers commonly close theirs
/// after 60-120 s; reusing one they are closing costs the request).
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Idle HTTP/1.1 connections kept per origin; more are closed when they come back.
const MAX_IDLE: usize = 1024;
/// A body dropped before its end (a relay stops at `data: [DONE]`, before the chunked body's
/// last bytes) is read on for this long and this much to save its connection; past that the
/// connection closes, which also tells the upstream to stop generating for a caller that left.
const SALVAGE_TIME: Duration = Duration::from_millis(100);
const SALVAGE_BYTES: usize = 64 * 1024;

/// The pooled connections to a backend's origins (usually one).
#[derive(Clone)]
pub struct Pool {
    shared: Arc<Shared>,
}

struct Shared {
    connector: HttpsConnector<HttpConnector>,
    origins: Mutex<Vec<Origin>>,
}

/// One scheme and authority with its idle HTTP/1.1 connections (oldest first) and its h2 one.
struct Origin {
    address: Address,
    idle: VecDeque<Parked>,
    http2: Option<Http2>,
}

struct Parked {
    connection: Http1,
    since: Instant,
}

/// Where a request goes, for finding its pooled connections.
#[derive(Clone)]
struct Address {
    scheme: Scheme,
    authority: Authority,
}

/// A connection to send on: lent whole (HTTP/1.1) or shared (h2).
enum Sender {
    Http1(Http1),
    Http2(Http2),
}

impl Pool {
    pub fn new(connect_timeout: Duration) -> Pool {
        Pool::with_connector(super::connector(connect_timeout, true))
    }

    fn with_connector(connector: HttpsConnector<HttpConnector>) -> Pool {
        Pool {
            shared: Arc::new(Shared {
                connector,
                origins: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Sends `request` (absolute URI) on a pooled connection, or a new one when none is idle, and
    /// returns the response head. An idle connection that turns out closed before the request was
    /// written is skipped; a request is never sent twice.
    pub async fn request(
        &self,
        mut request: Request<Bytes>,
    ) -> Result<Response<UpstreamBody>, Failure> {
        let address = Address::of(request.uri()).ok_or_else(|| {
            Failure::ConnectError(format!(
                "the upstream URL {} has no scheme or host",
                request.uri()
            ))
        })?;
        while let Some(pooled) = self.shared.checkout(&address) {
            let idle = match pooled {
                Sender::Http2(mut shared) => return send_http2(&mut shared, request).await,
                Sender::Http1(idle) => idle,
            };
            match self.send_http1(idle, address.clone(), request).await {
                Ok(response) => return Ok(response),
                Err(Unsent::Back(back)) => request = back,
                Err(Unsent::Failed(failure)) => return Err(failure),
            }
        }
        // Boxed: the connect and handshake futures are large, and only a new connection needs
        // them; inline they would make every request's future that much larger to move.
        match Box::pin(self.connect(request.uri().clone())).await? {
            Sender::Http2(mut shared) => {
                self.shared.keep_http2(&address, shared.clone());
                send_http2(&mut shared, request).await
            }
            Sender::Http1(connection) => {
                match self.send_http1(connection, address, request).await {
                    Ok(response) => Ok(response),
                    Err(Unsent::Back(_)) => Err(Failure::Reset(
                        "the new connection closed before the request was written".into(),
                    )),
                    Err(Unsent::Failed(failure)) => Err(failure),
                }
            }
        }
    }

    async fn send_http1(
        &self,
        mut connection: Http1,
        address: Address,
        request: Request<Bytes>,
    ) -> Result<Response<UpstreamBody>, Unsent> {
        if connection.ready().await.is_err() {
            return Err(Unsent::Back(request));
        }
        let request = in_origin_form(request, &address).map(|body| Whole(Some(body)));
        match connection.try_send_request(request).await {
            Ok(response) => Ok(response.map(|body| UpstreamBody {
                inner: Some(body),
                home: Some(Home {
                    shared: self.shared.clone(),
                    address,
                    connection,
                }),
            })),
            Err(mut error) => match error.take_message() {
                Some(back) => Err(Unsent::Back(back.map(Whole::into_bytes))),
                None => Err(Unsent::Failed(Failure::Reset(describe(error.error())))),
            },
        }
    }

    async fn connect(&self, uri: Uri) -> Result<Sender, Failure> {
        let mut connector = self.shared.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(|e| connect_failure(&*e))?;
        let io = connector
            .call(uri)
            .await
            .map_err(|e| connect_failure(&*e))?;
        let handshake_failed = |e: hyper::Error| Failure::ConnectError(describe(&e));
        if io.connected().is_negotiated_h2() {
            let (sender, connection) = http2::Builder::new(TokioExecutor::new())
                .handshake(io)
                .await
                .map_err(handshake_failed)?;
            tokio::spawn(drive(connection));
            return Ok(Sender::Http2(sender));
        }
        let (sender, connection) = http1::handshake(io).await.map_err(handshake_failed)?;
        tokio::spawn(drive(connection));
        Ok(Sender::Http1(sender))
    }
}

/// `request` as an HTTP/1.1 origin server takes it: the path alone in its target, the
/// authority in `host` (unless it set its own).
fn in_origin_form(mut request: Request<Bytes>, address: &Address) -> Request<Bytes> {
    let path = request
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *request.uri_mut() = Uri::from(path);
    if !request.headers().contains_key(header::HOST) {
        if let Ok(host) = HeaderValue::from_str(address.authority.as_str()) {
            request.headers_mut().insert(header::HOST, host);
        }
    }
    request
}

/// A request's body, whole, that a connection which closed before it was written hands back.
pub struct Whole(Option<Bytes>);

impl Whole {
    fn into_bytes(self) -> Bytes {
        self.0.unwrap_or_default()
    }
}

impl Body for Whole {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(
            self.0
                .take()
                .filter(|b| !b.is_empty())
                .map(|b| Ok(Frame::data(b))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_ref().is_none_or(Bytes::is_empty)
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.as_ref().map_or(0, |b| b.len() as u64))
    }
}

/// Why an HTTP/1.1 send did not produce a response head.
enum Unsent {
    /// The connection closed before the request was written: it may go elsewhere.
    Back(Request<Bytes>),
    Failed(Failure),
}

async fn send_http2(
    sender: &mut Http2,
    request: Request<Bytes>,
) -> Result<Response<UpstreamBody>, Failure> {
    let response = sender
        .send_request(request.map(Full::new))
        .await
        .map_err(|e| Failure::Reset(describe(&e)))?;
    Ok(response.map(|body| UpstreamBody {
        inner: Some(body),
        home: None,
    }))
}

/// Runs a connection until it closes; its errors reach the request that was using it.
async fn drive<F: std::future::Future<Output = hyper::Result<()>>>(connection: F) {
    if let Err(error) = connection.await {
        tracing::debug!(error = %describe(&error), "upstream connection ended");
    }
}

fn connect_failure(error: &(dyn std::error::Error + 'static)) -> Failure {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(current) = cause {
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return Failure::ConnectTimeout;
            }
        }
        cause = current.source();
    }
    Failure::ConnectError(describe(error))
}

impl Address {
    fn is(&self, other: &Address) -> bool {
        self.authority == other.authority && self.scheme == other.scheme
    }

    fn of(uri: &Uri) -> Option<Address> {
        Some(Address {
            scheme: uri.scheme()?.clone(),
            authority: uri.authority()?.clone(),
        })
    }
}

impl Shared {
    fn origins(&self) -> std::sync::MutexGuard<'_, Vec<Origin>> {
        self.origins.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn keep_http2(&self, address: &Address, sender: Http2) {
        let mut origins = self.origins();
        origin_entry(&mut origins, address).http2 = Some(sender);
    }

    /// The origin's live h2 connection, else its most recently parked open HTTP/1.1 one, in
    /// one look at the pool.
    fn checkout(&self, address: &Address) -> Option<Sender> {
        let mut origins = self.origins();
        let origin = find(&mut origins, address)?;
        if origin.http2.as_ref().is_some_and(Http2::is_closed) {
            origin.http2 = None;
        }
        if let Some(shared) = &origin.http2 {
            return Some(Sender::Http2(shared.clone()));
        }
        let now = Instant::now();
        while let Some(parked) = origin.idle.pop_back() {
            if now.duration_since(parked.since) < IDLE_TIMEOUT && !parked.connection.is_closed() {
                return Some(Sender::Http1(parked.connection));
            }
        }
        None
    }

    fn park(&self, address: &Address, connection: Http1) {
        let now = Instant::now();
        let mut origins = self.origins();
        let idle = &mut origin_entry(&mut origins, address).idle;
        while idle
            .front()
            .is_some_and(|oldest| now.duration_since(oldest.since) >= IDLE_TIMEOUT)
        {
            idle.pop_front();
        }
        if idle.len() < MAX_IDLE {
            idle.push_back(Parked {
                connection,
                since: now,
            });
        }
    }
}

fn find<'a>(origins: &'a mut [Origin], address: &Address) -> Option<&'a mut Origin> {
    origins.iter_mut().find(|origin| origin.address.is(address))
}

fn origin_entry<'a>(origins: &'a mut Vec<Origin>, address: &Address) -> &'a mut Origin {
    let at = match origins.iter().position(|origin| origin.address.is(address)) {
        Some(at) => at,
        None => {
            origins.push(Origin {
                address: address.clone(),
                idle: VecDeque::new(),
                http2: None,
            });
            origins.len() - 1
        }
    };
    &mut origins[at]
}

/// Where an HTTP/1.1 answer's connection goes back once its body has ended.
struct Home {
    shared: Arc<Shared>,
    address: Address,
    connection: Http1,
}

/// An upstream response body; reading it to its end returns its connection to the pool.
pub struct UpstreamBody {
    /// `None` once the body has ended or failed.
    inner: Option<Incoming>,
    /// Set while the HTTP/1.1 connection may still go back to its pool.
    home: Option<Home>,
}

impl UpstreamBody {
    /// The body has ended: its HTTP/1.1 connection goes back to the pool.
    fn finish(&mut self) {
        self.inner = None;
        if let Some(home) = self.home.take() {
            home.shared.park(&home.address, home.connection);
        }
    }

    /// Reads what has already arrived; `Some(true)` once the body has ended (its connection is
    /// back), `Some(false)` when it failed or ran past `budget` (the connection closes), `None`
    /// when more is on its way.
    fn read_arrived(&mut self, cx: &mut Context<'_>, budget: &mut usize) -> Option<bool> {
        loop {
            let (Some(_), Some(body)) = (&self.home, &mut self.inner) else {
                return Some(true);
            };
            let size = match Pin::new(&mut *body).poll_frame(cx) {
                Poll::Pending => return None,
                Poll::Ready(None) => {
                    self.finish();
                    return Some(true);
                }
                Poll::Ready(Some(Ok(frame))) => frame.data_ref().map_or(0, Bytes::len),
                Poll::Ready(Some(Err(_))) => usize::MAX,
            };
            let Some(left) = budget.checked_sub(size) else {
                self.home = None;
                return Some(false);
            };
            *budget = left;
            if body.is_end_stream() {
                self.finish();
                return Some(true);
            }
        }
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("pooled", &self.home.is_some())
            .finish()
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if self.home.is_none() {
            return;
        }
        let mut budget = SALVAGE_BYTES;
        let mut cx = Context::from_waker(std::task::Waker::noop());
        if self.read_arrived(&mut cx, &mut budget).is_some() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let mut rest = Salvaged(UpstreamBody {
            inner: self.inner.take(),
            home: self.home.take(),
        });
        runtime.spawn(async move {
            let salvage = std::future::poll_fn(|cx| match rest.0.read_arrived(cx, &mut budget) {
                Some(_) => Poll::Ready(()),
                None => Poll::Pending,
            });
            let _ = tokio::time::timeout(SALVAGE_TIME, salvage).await;
        });
    }
}

/// A body read on after its caller dropped it. However its salvage ends (in time, too late, or
/// cancelled with its runtime), a connection it did not bring home closes without another
/// salvage: one from here would be spawned again for ever on a runtime that is shutting down.
struct Salvaged(UpstreamBody);

impl Drop for Salvaged {
    fn drop(&mut self) {
        self.0.home = None;
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(body) = &mut this.inner else {
            return Poll::Ready(None);
        };
        match std::task::ready!(Pin::new(&mut *body).poll_frame(cx)) {
            Some(Ok(frame)) => {
                if body.is_end_stream() {
                    this.finish();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            None => {
                this.finish();
                Poll::Ready(None)
            }
            Some(Err(error)) => {
                this.inner = None;
                this.home = None;
                Poll::Ready(Some(Err(Box::new(error))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    use super::*;
    use http::{header, HeaderValue};

    /// A server on an ephemeral port that hands each accepted socket to `serve` and counts them;
    /// its `/v1/chat` URI.
    async fn counting(
        serve: impl Fn(TokioIo<tokio::net::TcpStream>) + Send + 'static,
    ) -> (Uri, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = accepted.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                serve(TokioIo::new(socket));
            }
        });
        let uri = format!("http://{address}/v1/chat").parse().unwrap();
        (uri, accepted)
    }

    /// An HTTP/1.1 upstream that answers every request with `answer` bytes, closing the
    /// connection after each answer when `close` is set.
    async fn upstream(answer: usize, close: bool) -> (Uri, Arc<AtomicUsize>) {
        counting(move |io| {
            let service = service_fn(move |_request| async move {
                let mut response = Response::new(Full::new(Bytes::from(vec![b'x'; answer])));
                if close {
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                Ok::<_, Infallible>(response)
            });
            tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, service));
        })
        .await
    }

    fn post(uri: &Uri) -> Request<Bytes> {
        Request::post(uri.clone())
            .body(Bytes::from_static(b"{}"))
            .unwrap()
    }

    async fn read(pool: &Pool, uri: &Uri) -> usize {
        text(pool, uri).await.len()
    }

    #[tokio::test]
    async fn an_answer_read_to_its_end_lends_its_connection_to_the_next_request() {
        let (uri, accepted) = upstream(100, false).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..5 {
            assert_eq!(read(&pool, &uri).await, 100);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn concurrent_requests_open_one_connection_each_and_then_reuse_them() {
        let (uri, accepted) = upstream(10, false).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..3 {
            let answers = futures_util::future::join_all((0..8).map(|_| read(&pool, &uri))).await;
            assert_eq!(answers, vec![10; 8]);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 8);
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_is_not_reused() {
        let (uri, accepted) = upstream(100_000, false).await;
        let pool = Pool::new(Duration::from_secs(1));
        let response = pool.request(post(&uri)).await.unwrap();
        drop(response);
        assert_eq!(read(&pool, &uri).await, 100_000);
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_body_dropped_just_before_its_last_bytes_keeps_its_connection() {
        let (uri, accepted) = upstream(100, false).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..3 {
            drop(pool.request(post(&uri)).await.unwrap());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(read(&pool, &uri).await, 100);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_salvage_under_way_when_its_runtime_shuts_down_closes_its_connection() {
        use futures_util::StreamExt;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let (uri, _) = counting(|io| {
                let service = service_fn(|_request| async {
                    // The body's first bytes, then nothing: its end never comes.
                    let first = Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"x")));
                    let body =
                        futures_util::stream::iter([first]).chain(futures_util::stream::pending());
                    Ok::<_, Infallible>(Response::new(http_body_util::StreamBody::new(body)))
                });
                tokio::spawn(
                    hyper::server::conn::http1::Builder::new().serve_connection(io, service),
                );
            })
            .await;
            let pool = Pool::new(Duration::from_secs(1));
            // Dropped before its end: a task of its own reads on to save the connection.
            drop(pool.request(post(&uri)).await.unwrap());
        });
        // Cancelled, the salvage closes the connection; it is not salvaged again.
        drop(runtime);
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closes_is_not_lent_again() {
        let (uri, accepted) = upstream(10, true).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..3 {
            assert_eq!(read(&pool, &uri).await, 10);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_h2_connection_carries_concurrent_requests_to_its_origin() {
        let (uri, accepted) = counting(|io| {
            let service = service_fn(|request: Request<Incoming>| async move {
                // h2 carries the scheme and authority as pseudo-headers: the URI stays whole.
                let seen = format!(
                    "{} {}",
                    request.version() == http::Version::HTTP_2,
                    request.uri()
                );
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(seen))))
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(io, service),
            );
        })
        .await;
        let address = uri.authority().unwrap().as_str().to_owned();
        let pool = Pool::new(Duration::from_secs(1));
        // What a TLS connection that negotiated h2 leaves in the pool.
        let socket = tokio::net::TcpStream::connect(address).await.unwrap();
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .handshake(TokioIo::new(socket))
            .await
            .unwrap();
        tokio::spawn(drive(connection));
        pool.shared.keep_http2(&Address::of(&uri).unwrap(), sender);
        let answers = futures_util::future::join_all((0..4).map(|_| async {
            let response = pool.request(post(&uri)).await.unwrap();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            String::from_utf8(body.to_vec()).unwrap()
        }))
        .await;
        assert_eq!(answers, vec![format!("true {uri}"); 4]);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let uri: Uri = format!("http://{}/", listener.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(listener);
        let pool = Pool::new(Duration::from_secs(1));
        let failure = pool.request(post(&uri)).await.unwrap_err();
        assert!(matches!(failure, Failure::ConnectError(_)), "{failure:?}");
    }

    /// Reads one request [`post`] sent (its head, then a two-byte body); `false` when the
    /// connection ended first.
    async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
        use tokio::io::AsyncReadExt;
        let mut request = Vec::new();
        while request
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .is_none_or(|at| request.len() < at + 6)
        {
            let mut chunk = [0u8; 1024];
            match socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => request.extend_from_slice(&chunk[..n]),
            }
        }
        true
    }

    /// A raw upstream: on each connection, reads one request after another and answers each with
    /// the next of `answers`, every answer written in the pieces given (a pause between them);
    /// closes the connection after `per_connection` answers.
    async fn scripted<P: AsRef<[u8]> + Send + Sync + 'static>(
        answers: Vec<Vec<P>>,
        per_connection: usize,
    ) -> (Uri, Arc<AtomicUsize>) {
        use tokio::io::AsyncWriteExt;
        let answers = Arc::new(answers);
        let next = Arc::new(AtomicUsize::new(0));
        counting(move |io| {
            let (answers, next) = (answers.clone(), next.clone());
            let mut socket = io.into_inner();
            tokio::spawn(async move {
                for _ in 0..per_connection {
                    if !read_request(&mut socket).await {
                        return;
                    }
                    let answer = &answers[next.fetch_add(1, Ordering::SeqCst) % answers.len()];
                    for piece in answer {
                        if socket.write_all(piece.as_ref()).await.is_err() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                }
            });
        })
        .await
    }

    async fn text(pool: &Pool, uri: &Uri) -> String {
        let response = pool.request(post(uri)).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(body.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn chunked_answers_in_pieces_decode_whole_and_keep_their_connection() {
        let answer: Vec<&'static [u8]> = vec![
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-",
            b"encoding: chunked\r\n\r\n5\r\nhel",
            b"lo\r\n7;ext=1\r\n, world\r\n",
            b"0\r\n\r\n",
        ];
        let (uri, accepted) = scripted(vec![answer], 10).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..3 {
            assert_eq!(text(&pool, &uri).await, "hello, world");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn an_answer_without_a_length_ends_with_its_connection() {
        let answer: Vec<&'static [u8]> = vec![b"HTTP/1.0 200 OK\r\n\r\nall of ", b"it"];
        let (uri, accepted) = scripted(vec![answer], 1).await;
        let pool = Pool::new(Duration::from_secs(1));
        assert_eq!(text(&pool, &uri).await, "all of it");
        assert_eq!(text(&pool, &uri).await, "all of it");
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn an_idle_connection_the_upstream_closed_quietly_is_not_used() {
        // Keep-alive by its headers, then closed by the upstream while idle in the pool.
        let answer: Vec<&'static [u8]> = vec![b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"];
        let (uri, accepted) = scripted(vec![answer], 1).await;
        let pool = Pool::new(Duration::from_secs(1));
        for _ in 0..3 {
            assert_eq!(text(&pool, &uri).await, "ok");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn an_answer_cut_before_its_length_is_an_error_and_not_reused() {
        let cut: Vec<&'static [u8]> = vec![b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort"];
        let (uri, _) = scripted(vec![cut], 1).await;
        let pool = Pool::new(Duration::from_secs(1));
        let response = pool.request(post(&uri)).await.unwrap();
        let error = response.into_body().collect().await.unwrap_err();
        assert!(
            error.to_string().contains("error reading a body"),
            "{error}"
        );
        let garbage: Vec<&'static [u8]> = vec![b"SSH-2.0-OpenSSH_9\r\n\r\n"];
        let (uri, _) = scripted(vec![garbage], 1).await;
        let failure = pool.request(post(&uri)).await.unwrap_err();
        assert!(matches!(failure, Failure::Reset(_)), "{failure:?}");
    }

    /// A valid answer carrying `body`: framed by `content-length`, `chunked` (in random chunks,
    /// with extensions and trailers now and then) or the connection's end, sometimes after a
    /// `100 Continue`.
    fn framed(rng: &mut impl rand::Rng, body: &[u8]) -> Vec<u8> {
        let mut answer = Vec::new();
        if rng.random_bool(0.2) {
            answer.extend_from_slice(b"HTTP/1.1 100 Continue\r\n\r\n");
        }
        match rng.random_range(0..3) {
            0 => {
                answer.extend_from_slice(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n");
                answer.extend_from_slice(
                    format!("content-length: {}\r\n\r\n", body.len()).as_bytes(),
                );
                answer.extend_from_slice(body);
            }
            1 => {
                answer.extend_from_slice(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
                let mut rest = body;
                while !rest.is_empty() {
                    let n = rng.random_range(1..=rest.len().min(700));
                    let size = match rng.random_bool(0.5) {
                        true => format!("{n:x}"),
                        false => format!("{n:X};ext=1"),
                    };
                    answer.extend_from_slice(format!("{size}\r\n").as_bytes());
                    answer.extend_from_slice(&rest[..n]);
                    answer.extend_from_slice(b"\r\n");
                    rest = &rest[n..];
                }
                answer.extend_from_slice(b"0\r\n");
                if rng.random_bool(0.2) {
                    answer.extend_from_slice(b"x-trailer: 1\r\n");
                }
                answer.extend_from_slice(b"\r\n");
            }
            _ => {
                answer.extend_from_slice(b"HTTP/1.0 200 OK\r\n\r\n");
                answer.extend_from_slice(body);
            }
        }
        answer
    }

    #[tokio::test]
    async fn random_and_damaged_answers_end_in_their_body_or_an_error_in_time() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let (mut whole, mut failed) = (0, 0);
        for round in 0..400 {
            let body: Vec<u8> = (0..rng.random_range(0..3000))
                .map(|_| rng.random_range(b' '..=b'~'))
                .collect();
            let mut answer = framed(&mut rng, &body);
            let intact = rng.random_bool(0.4);
            if !intact {
                crate::wire_damage::damage(&mut rng, &mut answer);
            }
            let mut cuts: Vec<usize> = (0..rng.random_range(0..4))
                .map(|_| rng.random_range(0..=answer.len()))
                .collect();
            cuts.sort_unstable();
            let pieces: Vec<Vec<u8>> = [0]
                .into_iter()
                .chain(cuts.iter().copied())
                .zip(cuts.iter().copied().chain([answer.len()]))
                .map(|(from, to)| answer[from..to].to_vec())
                .collect();
            let (uri, _) = scripted(vec![pieces], 1).await;
            let pool = Pool::new(Duration::from_secs(1));
            let read = async {
                let response = pool
                    .request(post(&uri))
                    .await
                    .map_err(|f| f.detail().to_owned())?;
                let body = response
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(body.to_bytes())
            };
            let outcome = tokio::time::timeout(Duration::from_secs(5), read)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no end within 5 s"));
            match (intact, outcome) {
                (true, outcome) => assert_eq!(outcome.as_deref(), Ok(&body[..]), "round {round}"),
                (false, Ok(_)) => whole += 1,
                (false, Err(_)) => failed += 1,
            }
        }
        // Damage inside a body, or a cut in an answer framed by the connection's end, still
        // reads; about half of it does, so both ways out are taken many times.
        assert!(failed >= 50 && whole >= 50, "{failed} failed, {whole} read");
    }

    /// A TLS upstream for `localhost` offering `alpn`, answering `answer` bytes over HTTP/1.1
    /// or h2 (whichever was negotiated), and a pool that trusts its certificate.
    async fn tls_upstream(alpn: &[&[u8]], answer: usize) -> (Uri, Arc<AtomicUsize>, Pool) {
        use tokio_rustls::rustls;
        let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let cert = certified.cert.der().clone();
        let key =
            rustls::pki_types::PrivateKeyDer::Pkcs8(certified.key_pair.serialize_der().into());
        let mut server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)
            .unwrap();
        server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        let (plain, accepted) = counting(move |io| {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let tls = acceptor.accept(io.into_inner()).await.unwrap();
                let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                let service = service_fn(move |request: Request<Incoming>| async move {
                    let version = format!("{:?}", request.version());
                    let mut body = version.into_bytes();
                    body.resize(answer.max(body.len()), b'x');
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
                });
                let io = TokioIo::new(tls);
                if h2 {
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, service)
                        .await;
                } else {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(io, service)
                        .await;
                }
            });
        })
        .await;
        let uri: Uri = format!("https://localhost:{}/v1/chat", plain.port_u16().unwrap())
            .parse()
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).unwrap();
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tls = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(client);
        let pool = Pool::with_connector(super::super::connector_with(
            tls,
            Duration::from_secs(1),
            true,
        ));
        (uri, accepted, pool)
    }

    #[tokio::test]
    async fn tls_upstreams_that_negotiate_http1_keep_their_connection() {
        let (uri, accepted, pool) = tls_upstream(&[b"http/1.1"], 100_000).await;
        for _ in 0..3 {
            let answer = text(&pool, &uri).await;
            assert!(answer.starts_with("HTTP/1.1"), "{}", &answer[..20]);
            assert_eq!(answer.len(), 100_000);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn tls_upstreams_that_offer_h2_carry_concurrent_requests_on_one_connection() {
        let (uri, accepted, pool) = tls_upstream(&[b"h2", b"http/1.1"], 0).await;
        // The first request opens the connection; the next ones share it.
        assert_eq!(text(&pool, &uri).await, "HTTP/2.0");
        let answers = futures_util::future::join_all((0..4).map(|_| text(&pool, &uri))).await;
        assert_eq!(answers, vec!["HTTP/2.0"; 4]);
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }
}
