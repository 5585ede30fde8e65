//! The deadlines a client's HTTP/1.1 connection is held to (`client_timeouts`), enforced where
//! its bytes move: a socket wrapper that knows, from the connection's [`Watch`], whether it waits
//! for a request, reads one's head, or answers one.
//!
//! - A new connection's first request and each request's head must come whole within `head`;
//!   one bytes keep trickling into is answered 408 and closed at that time all the same.
//! - A connection idle between requests closes after `idle`.
//! - An answer's bytes the client does not take end the connection after `write`, and at the
//!   request's own deadline (`routing.timeouts.total`) if that comes first, so a client that
//!   stops reading holds neither the upstream nor its in-flight slot.
//! - A connection that closes before its request's body was read drains what the client still
//!   sends for a moment first, so the answer is read rather than lost to a reset.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use futures_util::task::AtomicWaker;
use onedoor_config::ClientTimeouts;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};

/// After an answer that ends a connection whose request was not read to its end, what the
/// client still sends is read and dropped for this long (or this much).
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 1024 * 1024;

/// What a client connection is doing, as its socket's deadlines need to know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    /// Open, nothing read yet.
    Fresh = 0,
    /// Between requests.
    Idle = 1,
    /// A request's head has begun.
    Head = 2,
    /// A request is being read or answered.
    Busy = 3,
    /// The connection switched protocols (a WebSocket): its own protocol keeps time.
    Upgraded = 4,
}

/// One connection's phase, shared by its socket and the requests served on it.
pub struct Watch {
    phase: AtomicU8,
    /// When the phase began, in milliseconds since `opened`.
    since_ms: AtomicU64,
    /// The answer under way must be out by then (milliseconds since `opened`; 0: no deadline).
    answer_by_ms: AtomicU64,
    /// A request's body was left unread: drain before closing.
    linger: AtomicBool,
    /// The connection's task, woken when its read deadline moves (an answer done): a read that
    /// went pending while the request was served set no deadline.
    reader: AtomicWaker,
    opened: Instant,
}

impl Watch {
    pub fn new() -> Arc<Watch> {
        Arc::new(Watch {
            phase: AtomicU8::new(Phase::Fresh as u8),
            since_ms: AtomicU64::new(0),
            answer_by_ms: AtomicU64::new(0),
            linger: AtomicBool::new(false),
            reader: AtomicWaker::new(),
            opened: Instant::now(),
        })
    }

    /// A request is served from now until the returned guard is dropped (with its answer).
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.enter(Phase::Busy);
        Busy(self.clone())
    }

    /// The answer under way must be out by `by`.
    pub fn answer_by(&self, by: Instant) {
        let ms = self.ms(by).max(1);
        self.answer_by_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether nothing has been read on the connection yet.
    pub fn fresh(&self) -> bool {
        self.phase() == Phase::Fresh
    }

    /// The socket belongs to the protocol the connection switched to.
    pub fn upgraded(&self) {
        self.enter(Phase::Upgraded);
    }

    /// The request's body was not read to its end: the connection drains before it closes.
    pub fn linger(&self) {
        self.linger.store(true, Ordering::Relaxed);
    }

    fn enter(&self, phase: Phase) {
        self.since_ms
            .store(self.ms(Instant::now()), Ordering::Relaxed);
        self.phase.store(phase as u8, Ordering::Relaxed);
    }

    fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Fresh,
            1 => Phase::Idle,
            2 => Phase::Head,
            3 => Phase::Busy,
            _ => Phase::Upgraded,
        }
    }

    fn since(&self) -> Instant {
        self.at(self.since_ms.load(Ordering::Relaxed))
    }

    fn answer_deadline(&self) -> Option<Instant> {
        match self.answer_by_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.at(ms)),
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.opened).as_millis()).unwrap_or(u64::MAX)
    }

    fn at(&self, ms: u64) -> Instant {
        self.opened + Duration::from_millis(ms)
    }
}

/// A request under way on its connection; dropped with its answer, which leaves the connection
/// idle (unless it switched protocols).
pub struct Busy(Arc<Watch>);

impl Drop for Busy {
    fn drop(&mut self) {
        if self.0.phase() == Phase::Busy {
            self.0.answer_by_ms.store(0, Ordering::Relaxed);
            self.0.enter(Phase::Idle);
            self.0.reader.wake();
        }
    }
}

/// A client's socket held to its connection's deadlines.
pub struct Guarded {
    stream: TcpStream,
    watch: Arc<Watch>,
    timeouts: ClientTimeouts,
    reading: Timer,
    writing: Timer,
    /// Since when a write has waited for the client to take bytes.
    stalled: Option<Instant>,
    closing: Closing,
}

/// How far a connection's close has come.
#[derive(Clone, Copy)]
enum Closing {
    Open,
    /// The answer is out and the write side shut: what the client still sends is read and dropped.
    Draining {
        read: usize,
        until: Instant,
    },
    Closed,
}

impl Guarded {
    pub fn new(stream: TcpStream, watch: Arc<Watch>, timeouts: ClientTimeouts) -> Guarded {
        Guarded {
            stream,
            watch,
            timeouts,
            reading: Timer::default(),
            writing: Timer::default(),
            stalled: None,
            closing: Closing::Open,
        }
    }

    /// When the read under way must have brought what it waits for, and whether it is a
    /// request's head (answered 408) rather than a quiet connection (closed).
    fn read_deadline(&self) -> Option<(Instant, bool)> {
        let since = self.watch.since();
        match self.watch.phase() {
            Phase::Fresh | Phase::Head => Some((since + self.timeouts.head, true)),
            Phase::Idle => Some((since + self.timeouts.idle, false)),
            Phase::Busy | Phase::Upgraded => None,
        }
    }

    /// A write that must wait: the connection ends once the client has taken nothing for
    /// `write`, or at the answer's deadline.
    fn stall<T>(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<T>> {
        if self.watch.phase() == Phase::Upgraded {
            return Poll::Pending;
        }
        let since = *self.stalled.get_or_insert_with(Instant::now);
        let mut deadline = since + self.timeouts.write;
        if let Some(by) = self.watch.answer_deadline() {
            deadline = deadline.min(by);
        }
        match self.writing.expired(deadline, cx) {
            true => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no bytes of its answer in time",
            ))),
            false => Poll::Pending,
        }
    }

    fn wrote<T>(
        &mut self,
        written: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<T>> {
        match written {
            Poll::Pending => self.stall(cx),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }

    /// Reads and drops what the client still sends, until it ends or the linger is over.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut sink = [0u8; 4096];
        while let Closing::Draining { read, until } = self.closing {
            if read > LINGER_BYTES || self.reading.expired(until, cx) {
                self.closing = Closing::Closed;
                break;
            }
            let mut buf = ReadBuf::new(&mut sink);
            match Pin::new(&mut self.stream).poll_read(cx, &mut buf) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                    let read = read + buf.filled().len();
                    self.closing = Closing::Draining { read, until };
                }
                Poll::Ready(_) => self.closing = Closing::Closed,
            }
        }
        Poll::Ready(())
    }
}

impl AsyncRead for Guarded {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let quiet = matches!(this.watch.phase(), Phase::Fresh | Phase::Idle);
                if quiet && buf.filled().len() > before {
                    this.watch.enter(Phase::Head);
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => {
                let Some((deadline, head)) = this.read_deadline() else {
                    this.watch.reader.register(cx.waker());
                    return Poll::Pending;
                };
                if !this.reading.expired(deadline, cx) {
                    return Poll::Pending;
                }
                match head && this.watch.phase() == Phase::Head {
                    // A head under way is told why it ends; a quiet connection just ends.
                    true => {
                        let _ = this.stream.try_write(REQUEST_TIMEOUT);
                        Poll::Ready(Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the request head did not come whole in time",
                        )))
                    }
                    false => Poll::Ready(Ok(())),
                }
            }
        }
    }
}

/// The answer to a head that did not come in time.
const REQUEST_TIMEOUT: &[u8] =
    b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n";

impl AsyncWrite for Guarded {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.wrote(written, cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.wrote(written, cx)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let flushed = Pin::new(&mut this.stream).poll_flush(cx);
        this.wrote(flushed, cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Closing::Open = this.closing {
            ready!(Pin::new(&mut this.stream).poll_shutdown(cx))?;
            this.closing = match this.watch.linger.load(Ordering::Relaxed) {
                true => Closing::Draining {
                    read: 0,
                    until: Instant::now() + LINGER,
                },
                false => Closing::Closed,
            };
        }
        ready!(this.poll_drain(cx));
        Poll::Ready(Ok(()))
    }
}

/// A deadline's sleep, made when first needed and moved rather than made again.
#[derive(Default)]
struct Timer {
    sleep: Option<Pin<Box<Sleep>>>,
    set_for: Option<Instant>,
}

impl Timer {
    /// Whether `deadline` has passed; if not, the task is woken when it does. Deadlines move
    /// later as requests come (the idle one with each answer): a sleep set earlier is left to
    /// fire and then moved, so a busy connection does not reset its timer at every request.
    fn expired(&mut self, deadline: Instant, cx: &mut Context<'_>) -> bool {
        if Instant::now() >= deadline {
            return true;
        }
        let sleep = match &mut self.sleep {
            Some(sleep) => sleep,
            None => self
                .sleep
                .insert(Box::pin(tokio::time::sleep_until(deadline))),
        };
        let keeps = self
            .set_for
            .is_some_and(|at| at <= deadline && !sleep.is_elapsed());
        if !keeps {
            sleep.as_mut().reset(deadline);
            self.set_for = Some(deadline);
        }
        if sleep.as_mut().poll(cx).is_pending() {
            return false;
        }
        // An earlier sleep fired before this deadline: wait on for the deadline itself.
        sleep.as_mut().reset(deadline);
        self.set_for = Some(deadline);
        sleep.as_mut().poll(cx).is_ready()
    }
}
