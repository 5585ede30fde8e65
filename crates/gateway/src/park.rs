//! Parking idle HTTP/1.1 keep-alive connections: a connection that has answered everything it was
//! sent and then stays quiet for [`PARK_AFTER`] ends its hyper connection (whose read and write
//! buffers cost some 24 KB) without closing the socket, and waits for its next bytes holding only
//! the socket; they start a new hyper connection on it. The client sees one keep-alive connection.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

use crate::body::{Body, BoxError};

/// How long an idle keep-alive connection keeps its hyper buffers before it parks.
const PARK_AFTER: Duration = Duration::from_secs(1);

/// What a connection's service and its socket wrapper share across its hyper connections.
pub struct Parking {
    /// Requests whose answer hyper has not finished sending.
    in_flight: AtomicUsize,
    /// Answers hyper has finished sending, ever.
    answered: AtomicUsize,
    /// False for a connection that may be h2 (it never parks) and after an upgrade.
    allowed: AtomicBool,
    /// The socket handed back by a hyper connection that parked.
    parked: Mutex<Option<TcpStream>>,
}

impl Parking {
    /// `allowed`: whether the connection may park at all (HTTP/1 only).
    pub fn new(allowed: bool) -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            answered: AtomicUsize::new(0),
            allowed: AtomicBool::new(allowed),
            parked: Mutex::new(None),
        })
    }

    /// Counts a request from the moment hyper hands it over until its answer's body is dropped.
    pub fn request(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(self.clone())
    }

    /// An upgraded connection belongs to its new protocol: it never parks again.
    pub fn forbid(&self) {
        self.allowed.store(false, Ordering::Release);
    }

    /// The socket, if the hyper connection that just ended parked rather than closed.
    pub fn take_parked(&self) -> Option<TcpStream> {
        self.parked.lock().ok().and_then(|mut slot| slot.take())
    }

    fn may_park(&self) -> bool {
        self.allowed.load(Ordering::Acquire) && self.in_flight.load(Ordering::Acquire) == 0
    }
}

/// One request under way; see [`Parking::request`].
pub struct InFlight(Arc<Parking>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.answered.fetch_add(1, Ordering::AcqRel);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request counted as under way while hyper sends it.
pub struct Answer {
    body: Body,
    _request: InFlight,
}

impl Answer {
    pub fn new(body: Body, request: InFlight) -> Self {
        Self {
            body,
            _request: request,
        }
    }
}

impl http_body::Body for Answer {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The socket as one hyper connection sees it. While the connection may park, everything written
/// has been flushed, every byte read was followed by a finished answer (hyper holds no part of a
/// request) and nothing arrives for [`PARK_AFTER`], a read ends with end-of-file: hyper, idle
/// between requests, ends the connection, and the socket goes back to [`Parking`] on drop.
pub struct ParkingIo {
    stream: Option<TcpStream>,
    parking: Arc<Parking>,
    flushed: bool,
    /// `answered` when bytes last came in; `None` before any did.
    answered_at_read: Option<usize>,
    quiet: Option<Pin<Box<Sleep>>>,
    armed: bool,
    parked: bool,
}

impl ParkingIo {
    pub fn new(stream: TcpStream, parking: Arc<Parking>) -> Self {
        Self {
            stream: Some(stream),
            parking,
            flushed: true,
            answered_at_read: None,
            quiet: None,
            armed: false,
            parked: false,
        }
    }

    fn idle(&self) -> bool {
        self.flushed
            && self.parking.may_park()
            && self
                .answered_at_read
                .is_none_or(|at| self.parking.answered.load(Ordering::Acquire) != at)
    }

    fn stream(&mut self) -> io::Result<&mut TcpStream> {
        self.stream
            .as_mut()
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotConnected))
    }

    /// Whether the quiet time has run out; arms the timer at the start of a quiet time.
    fn quiet_for_long(&mut self, cx: &mut Context<'_>) -> bool {
        let deadline = Instant::now() + PARK_AFTER;
        let armed = self.armed;
        let quiet = self
            .quiet
            .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
        if !armed {
            quiet.as_mut().reset(deadline);
            self.armed = true;
        }
        quiet.as_mut().poll(cx).is_ready()
    }
}

impl Drop for ParkingIo {
    fn drop(&mut self) {
        if self.parked {
            if let Ok(mut slot) = self.parking.parked.lock() {
                *slot = self.stream.take();
            }
        }
    }
}

impl AsyncRead for ParkingIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.parked {
            return Poll::Ready(Ok(()));
        }
        let before = buf.filled().len();
        match Pin::new(this.stream()?).poll_read(cx, buf) {
            Poll::Pending => {}
            ready => {
                this.armed = false;
                if buf.filled().len() > before {
                    this.answered_at_read = Some(this.parking.answered.load(Ordering::Acquire));
                }
                return ready;
            }
        }
        if !this.idle() {
            this.armed = false;
            return Poll::Pending;
        }
        if !this.quiet_for_long(cx) {
            return Poll::Pending;
        }
        this.parked = true;
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for ParkingIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.flushed = false;
        Pin::new(this.stream()?).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.flushed = false;
        Pin::new(this.stream()?).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.as_ref().is_some_and(|s| s.is_write_vectored())
    }

    /// hyper flushes the socket only once its own buffer is empty. The last answer's last flush
    /// starts the quiet time: hyper's pending read of the next request waits on the socket alone.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(this.stream()?).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            this.flushed = true;
            if !this.armed && this.idle() && this.quiet_for_long(cx) {
                cx.waker().wake_by_ref();
            }
        }
        flushed
    }

    /// A parked connection keeps its socket open.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.parked {
            return Poll::Ready(Ok(()));
        }
        Pin::new(this.stream()?).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::watch;

    use super::PARK_AFTER;
    use crate::body;

    const REQUEST: &[u8] = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nping";

    async fn gateway() -> (TcpStream, watch::Sender<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(false);
        tokio::spawn(crate::server::serve(
            listener,
            |_request| async { http::Response::new(body::full("pong")) },
            shutdown,
            Some(std::sync::Arc::new(crate::lanes::Lanes::start())),
        ));
        (TcpStream::connect(address).await.unwrap(), stop)
    }

    async fn answer(client: &mut TcpStream) -> String {
        let mut answer = vec![0u8; 4096];
        let read = client.read(&mut answer).await.unwrap();
        String::from_utf8_lossy(&answer[..read]).into_owned()
    }

    #[tokio::test]
    async fn a_connection_idle_past_the_quiet_time_answers_its_next_request() {
        let (mut client, _stop) = gateway().await;
        for _ in 0..2 {
            client.write_all(REQUEST).await.unwrap();
            let answer = answer(&mut client).await;
            assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
            assert!(answer.ends_with("pong"), "{answer}");
            tokio::time::sleep(PARK_AFTER + Duration::from_millis(300)).await;
        }
    }

    #[tokio::test]
    async fn a_request_head_that_pauses_past_the_quiet_time_is_still_read_whole() {
        let (mut client, _stop) = gateway().await;
        client.write_all(REQUEST).await.unwrap();
        assert!(answer(&mut client).await.starts_with("HTTP/1.1 200"));
        client.write_all(&REQUEST[..20]).await.unwrap();
        tokio::time::sleep(PARK_AFTER + Duration::from_millis(300)).await;
        client.write_all(&REQUEST[20..]).await.unwrap();
        let answer = answer(&mut client).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn shutdown_closes_a_parked_connection() {
        let (mut client, stop) = gateway().await;
        client.write_all(REQUEST).await.unwrap();
        assert!(answer(&mut client).await.starts_with("HTTP/1.1 200"));
        tokio::time::sleep(PARK_AFTER + Duration::from_millis(300)).await;
        stop.send(true).unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut rest));
        assert_eq!(closed.await.unwrap().unwrap(), 0);
    }
}
