//! Client connections over HTTP/1.1, served by the gateway itself: a request's head and body are
//! read whole (the body up to its limit, see [`BodyLimit`]) before its handler runs, an answer's head goes out with
//! its first bytes in one write (a stream: one write an event, the last chunk with the last
//! event), and between requests a connection holds its socket and nothing else. Keep-alive,
//! pipelining, `Expect: 100-continue`, chunked request bodies, HTTP/1.0 clients and upgrades
//! (the realtime WebSocket handshake) are served; a client that goes away cancels its request.

use std::future::Future;
use std::io::{self, IoSlice};
use std::ops::Range;
use std::pin::{pin, Pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body as _;
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{oneshot, watch};

use crate::body::{Body, RequestBody};
use crate::framing::{self, Chunked, Framed, Step, Wire};
use crate::idle_poll;
use crate::stamp::Stamp;

use super::Raised;

/// Request heads (request line and headers) larger than this get 431.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
pub const MAX_HEADERS: usize = 128;
/// A request head with up to this many fields is parsed without allocating their list.
const INLINE_FIELDS: usize = 16;
/// After an answer that ends a connection whose request was not read to its end, what the
/// client still sends is read and dropped for this long (or this much), so that closing does not
/// reset the connection under the answer before the client has read it.
const LINGER: Duration = Duration::from_millis(500);
const LINGER_BYTES: usize = 1024 * 1024;
/// How long a request the client has begun may wait for its next bytes (head or body) before
/// it is answered 408 and the connection closes: a client cannot hold a connection open by
/// sending a request slowly. Between requests a connection waits for as long as the client does.
#[cfg(not(test))]
const BEGUN_REQUEST_WAIT: Duration = Duration::from_secs(60);
#[cfg(test)]
const BEGUN_REQUEST_WAIT: Duration = Duration::from_millis(400);

/// How large the body of a request with these headers may be, asked only of a body that may be
/// larger than [`SMALL_BODY`] (a larger length, or chunked): the client port reads such a body
/// only for a caller whose key it knows, so a stranger cannot make it hold megabytes.
pub type BodyLimit = Arc<dyn Fn(&HeaderMap) -> u64 + Send + Sync>;

/// Bodies up to this size are read without asking their [`BodyLimit`].
pub const SMALL_BODY: u64 = 64 * 1024;

/// Serves requests on `stream` until the client closes it, an answer ends it, or shutdown
/// begins while it is idle (a request under way is answered first, with `connection: close`).
pub async fn serve<H, F>(
    stream: TcpStream,
    handler: &H,
    limit: &BodyLimit,
    shutdown: &mut watch::Receiver<bool>,
) where
    H: Fn(Request<RequestBody>) -> F,
    F: Future<Output = Response<Body>>,
{
    let mut connection = Connection {
        stream,
        buffer: BytesMut::new(),
        watching: true,
    };
    // Made once for the connection: it stays registered with the shutdown signal between
    // requests, where one made at each wait would register and unregister every request.
    let mut watcher = shutdown.clone();
    let stopped = pin!(super::stopped(&mut watcher));
    let mut shutdown = Raised::new(&*shutdown, stopped);
    loop {
        let head = match connection.read_head(&mut shutdown).await {
            Ok(Some(head)) => head,
            Ok(None) => return,
            Err(status) => return connection.refuse(status).await,
        };
        let limit = match head.framing {
            Framing::Length(length) if length <= SMALL_BODY => SMALL_BODY,
            _ => limit(&head.headers),
        };
        let body = match connection.read_body(&head, limit).await {
            Ok(body) => body,
            Err(error) if error.kind() == io::ErrorKind::TimedOut => {
                return connection.refuse(StatusCode::REQUEST_TIMEOUT).await
            }
            Err(_) => return connection.refuse(StatusCode::BAD_REQUEST).await,
        };
        let (request, exchange, upgrade) = head.into_request(body);
        idle_poll::worked();
        connection.watching = true;
        let Some(response) = connection.answer(handler(request)).await else {
            return;
        };
        let stopping = shutdown.raised();
        let after = connection.respond(response, &exchange, stopping).await;
        idle_poll::worked();
        match after {
            Ok(After::KeepAlive) => {}
            Ok(After::Close) => return connection.close(exchange.body_read).await,
            Ok(After::Upgrade) => return connection.upgrade(upgrade),
            Err(_) => return,
        }
    }
}

struct Connection {
    stream: TcpStream,
    /// Bytes read and not yet taken: part of a request, or the next ones a client pipelined.
    buffer: BytesMut,
    /// Whether the socket is watched for the client leaving while its request is served; off
    /// once the next request's first bytes arrived (they wait in the buffer).
    watching: bool,
}

/// What follows an answer on its connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum After {
    KeepAlive,
    Close,
    /// A 101: the socket belongs to the protocol it switched to.
    Upgrade,
}

/// What the connection keeps of a request while its answer is made and sent.
struct Exchange {
    version: Version,
    head_request: bool,
    /// The client asked to close (or spoke HTTP/1.0 without keep-alive).
    close: bool,
    /// The body was read to its end (not so for a body over the limit): the connection may go
    /// on to the next request.
    body_read: bool,
}

/// How a request's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
}

/// A parsed request head.
struct Head {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    framing: Framing,
    /// What the head's `connection`, `expect` and `upgrade` said, read as it was parsed.
    close: bool,
    expects_continue: bool,
    asks_upgrade: bool,
}

impl Head {
    fn into_request(
        self,
        body: RequestBody,
    ) -> (
        Request<RequestBody>,
        Exchange,
        Option<oneshot::Sender<Upgraded>>,
    ) {
        let exchange = Exchange {
            version: self.version,
            head_request: self.method == Method::HEAD,
            close: self.close,
            body_read: !matches!(body, RequestBody::TooLarge),
        };
        let upgrade = self.asks_upgrade;
        let mut request = Request::new(body);
        *request.method_mut() = self.method;
        *request.uri_mut() = self.uri;
        *request.version_mut() = self.version;
        *request.headers_mut() = self.headers;
        let sender = upgrade.then(|| {
            let (sender, receiver) = oneshot::channel();
            request
                .extensions_mut()
                .insert(Pending(Arc::new(Mutex::new(Some(receiver)))));
            sender
        });
        (request, exchange, sender)
    }
}

impl Connection {
    /// The next request's head; `None` when the client closed, or shutdown began between
    /// requests.
    async fn read_head(
        &mut self,
        shutdown: &mut Raised<'_, impl Future<Output = ()>>,
    ) -> Result<Option<Head>, StatusCode> {
        loop {
            if !self.buffer.is_empty() {
                if let Some(head) = parse_head(&mut self.buffer)? {
                    return Ok(Some(head));
                }
                if self.buffer.len() > MAX_HEAD_BYTES {
                    return Err(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
                }
            }
            let read = match self.buffer.is_empty() {
                true => tokio::select! {
                    biased;
                    () = &mut *shutdown => return Ok(None),
                    read = self.read() => read,
                },
                false => match self.read_begun().await {
                    Err(error) if error.kind() == io::ErrorKind::TimedOut => {
                        return Err(StatusCode::REQUEST_TIMEOUT)
                    }
                    read => read,
                },
            };
            if !matches!(read, Ok(1..)) {
                return Ok(None);
            }
        }
    }

    /// The request's body, read to its end unless it is over `limit`.
    async fn read_body(&mut self, head: &Head, limit: u64) -> io::Result<RequestBody> {
        let declared = match head.framing {
            Framing::Length(0) => return Ok(RequestBody::Whole(Bytes::new())),
            Framing::Length(n) if n > limit => return Ok(RequestBody::TooLarge),
            Framing::Length(n) => Some(n as usize),
            Framing::Chunked => None,
        };
        if head.expects_continue && self.buffer.len() < declared.unwrap_or(1) {
            self.stream
                .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .await?;
        }
        match declared {
            Some(length) => self.read_length(length).await,
            None => self.read_chunked(limit).await,
        }
    }

    async fn read_length(&mut self, length: usize) -> io::Result<RequestBody> {
        while self.buffer.len() < length {
            self.read_more().await?;
        }
        let body = match self.buffer.len() == length {
            true => self.buffer.split(),
            false => self.buffer.split_to(length),
        };
        Ok(RequestBody::Whole(body.freeze()))
    }

    async fn read_chunked(&mut self, limit: u64) -> io::Result<RequestBody> {
        let mut body = BytesMut::new();
        let mut state = Chunked::Size;
        loop {
            match framing::chunked_step(&mut self.buffer, &mut state) {
                Ok(Step::Data(data)) if (body.len() + data.len()) as u64 > limit => {
                    return Ok(RequestBody::TooLarge)
                }
                Ok(Step::Data(data)) => body.extend_from_slice(&data),
                Ok(Step::Continue) => {}
                Ok(Step::End) => return Ok(RequestBody::Whole(body.freeze())),
                Ok(Step::Read) => self.read_more().await?,
                Err(why) => return Err(io::Error::new(io::ErrorKind::InvalidData, why)),
            }
        }
    }

    /// Reads more of a message the client has begun; its end before the message's is an error.
    async fn read_more(&mut self) -> io::Result<()> {
        match self.read_begun().await? {
            0 => Err(io::ErrorKind::UnexpectedEof.into()),
            _ => Ok(()),
        }
    }

    /// [`Connection::read`] for a request the client has begun: `TimedOut` when nothing came
    /// within [`BEGUN_REQUEST_WAIT`].
    async fn read_begun(&mut self) -> io::Result<usize> {
        tokio::time::timeout(BEGUN_REQUEST_WAIT, self.read())
            .await
            .unwrap_or_else(|_| Err(io::ErrorKind::TimedOut.into()))
    }

    /// Reads what the socket has onto the buffer; `Ok(0)` is the client's end.
    async fn read(&mut self) -> io::Result<usize> {
        std::future::poll_fn(|cx| framing::poll_read_into(&mut self.stream, &mut self.buffer, cx))
            .await
    }

    /// The handler's answer, or `None` when the client went away first (the handler is
    /// dropped, which cancels whatever it was waiting on upstream).
    async fn answer<F: Future<Output = Response<Body>>>(
        &mut self,
        answer: F,
    ) -> Option<Response<Body>> {
        let mut answer = pin!(answer);
        loop {
            tokio::select! {
                biased;
                response = &mut answer => return Some(response),
                left = self.left() => if left { return None },
            }
        }
    }

    /// Resolves `true` once the client has closed or broken the connection; bytes it sends
    /// meanwhile (a pipelined request) wait in the buffer, and after them this never resolves.
    async fn left(&mut self) -> bool {
        if !self.watching {
            return std::future::pending().await;
        }
        match self.read().await {
            Ok(0) | Err(_) => true,
            Ok(_) => {
                self.watching = false;
                false
            }
        }
    }

    /// Writes the answer; what follows it on this connection.
    async fn respond(
        &mut self,
        response: Response<Body>,
        exchange: &Exchange,
        stopping: bool,
    ) -> io::Result<After> {
        let (parts, mut body) = response.into_parts();
        let status = parts.status;
        let stamp = Stamp::lines_in(&parts.extensions);
        if status == StatusCode::SWITCHING_PROTOCOLS {
            let head = encode_head(status, &parts.headers, stamp, BodyFraming::None, &[]);
            self.stream.write_all(&head).await?;
            return Ok(After::Upgrade);
        }
        let no_body = status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED;
        let bodiless = exchange.head_request || no_body;
        let length = body.size_hint().exact();
        let delimited_by_close =
            !bodiless && length.is_none() && exchange.version < Version::HTTP_11;
        let after = match exchange.close || stopping || !exchange.body_read || delimited_by_close {
            true => After::Close,
            false => After::KeepAlive,
        };
        let framing = match (bodiless, length) {
            (true, _) => BodyFraming::None,
            (false, Some(length)) => BodyFraming::Length(length),
            (false, None) if delimited_by_close => BodyFraming::Close,
            (false, None) => BodyFraming::Chunked,
        };
        let connection = match (after, exchange.version) {
            (After::Close, _) => &b"connection: close\r\n"[..],
            (_, Version::HTTP_10) => b"connection: keep-alive\r\n",
            _ => b"",
        };
        // A HEAD answer says the length the body would have had, when it is known.
        let declared = match (no_body, exchange.head_request, length) {
            (true, _, _) | (false, true, None) => BodyFraming::None,
            (false, true, Some(length)) => BodyFraming::Length(length),
            (false, false, _) => framing,
        };
        let head = encode_head(status, &parts.headers, stamp, declared, connection);
        if bodiless {
            self.stream.write_all(&head).await?;
            return Ok(after);
        }
        self.send_body(head, &mut body, framing).await?;
        Ok(after)
    }

    /// Sends the head with the body's first bytes, then the rest as it comes; a body that
    /// fails midway ends the connection without its last chunk, so the client sees it cut.
    /// Data that is already behind a frame that came at once goes out with it, in one chunk.
    /// Behind a frame that was waited for, nothing is looked for: the body has just said it
    /// waits, and asking again would cost a poll an event of a paced stream.
    async fn send_body(
        &mut self,
        head: Vec<u8>,
        body: &mut Body,
        framing: BodyFraming,
    ) -> io::Result<()> {
        let mut head = Some(head);
        loop {
            let (frame, at_once) = match head.is_some() {
                // The head waits for the body's first bytes only if they are there already.
                true => match std::future::poll_fn(|cx| Poll::Ready(poll_now(body, cx))).await {
                    Some(frame) => (frame, true),
                    None => {
                        let written = head.take().unwrap_or_default();
                        self.stream.write_all(&written).await?;
                        continue;
                    }
                },
                false => self.next_frame(body).await?,
            };
            let mut batch = match frame {
                None => Batch::ended(),
                Some(Ok(data)) if data.is_empty() => continue,
                Some(Ok(data)) => Batch::of(data, body),
                Some(Err(())) => return Err(io::ErrorKind::BrokenPipe.into()),
            };
            if at_once {
                std::future::poll_fn(|cx| {
                    batch.gather(body, cx);
                    Poll::Ready(())
                })
                .await;
            }
            let (size, size_length) = chunk_size_line(batch.length);
            let mut parts = [IoSlice::new(&[]); GATHER + 3];
            parts[0] = IoSlice::new(head.as_deref().unwrap_or_default());
            if framing == BodyFraming::Chunked && batch.length > 0 {
                parts[1] = IoSlice::new(&size[..size_length]);
            }
            let taken = 2 + batch.fill(&mut parts[2..GATHER + 2]);
            parts[taken] = IoSlice::new(match (framing, batch.length, batch.end) {
                (BodyFraming::Chunked, 1.., true) => b"\r\n0\r\n\r\n",
                (BodyFraming::Chunked, 1.., false) => b"\r\n",
                (BodyFraming::Chunked, 0, _) => b"0\r\n\r\n",
                _ => b"",
            });
            write_all_vectored(&mut self.stream, &mut parts[..taken + 1]).await?;
            head = None;
            if batch.failed {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            if batch.end {
                return Ok(());
            }
        }
    }

    /// The body's next data, watching for the client leaving meanwhile (a stream waits here
    /// between events); `Some(Err)` when the body failed. With it, whether it was there at the
    /// first look.
    async fn next_frame(&mut self, body: &mut Body) -> io::Result<(Next, bool)> {
        let mut looks = 0;
        loop {
            let look = |cx: &mut Context<'_>| {
                looks += 1;
                Pin::new(&mut *body).poll_frame(cx)
            };
            tokio::select! {
                biased;
                frame = std::future::poll_fn(look) => {
                    let next = match frame {
                        None => None,
                        Some(Ok(frame)) => match frame.into_data() {
                            Ok(data) => Some(Ok(data)),
                            Err(_) => continue,
                        },
                        Some(Err(error)) => {
                            tracing::debug!(%error, "an answer's body failed midway");
                            Some(Err(()))
                        }
                    };
                    return Ok((next, looks == 1));
                }
                left = self.left() => if left {
                    return Err(io::ErrorKind::ConnectionAborted.into());
                },
            }
        }
    }

    /// Answers a request that cannot be read (malformed, or its head too large) and closes.
    async fn refuse(mut self, status: StatusCode) {
        let head = encode_head(
            status,
            &HeaderMap::new(),
            &[],
            BodyFraming::Length(0),
            b"connection: close\r\n",
        );
        if self.stream.write_all(&head).await.is_ok() {
            self.close(false).await;
        }
    }

    /// Ends the connection after its last answer: the client reads to its end before the
    /// socket closes, also when it was still sending a request nobody read.
    async fn close(mut self, read_to_end: bool) {
        if self.stream.shutdown().await.is_err() || read_to_end {
            return;
        }
        // On the heap: a buffer here would be part of every connection's state, idle or not.
        let mut sink = vec![0u8; 4096];
        let mut drained = 0;
        let drain = async {
            while let Ok(1..) = self.stream.read(&mut sink).await {
                drained += sink.len();
                if drained > LINGER_BYTES {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }

    /// Hands the socket, with whatever the client sent after the handshake, to the upgrade.
    fn upgrade(self, to: Option<oneshot::Sender<Upgraded>>) {
        if let Some(to) = to {
            let _ = to.send(Upgraded {
                stream: self.stream,
                read: self.buffer.freeze(),
            });
        }
    }
}

/// How an answer's body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyFraming {
    None,
    Length(u64),
    Chunked,
    /// An HTTP/1.0 client's answer of unknown length: until the connection closes.
    Close,
}

/// An answer body's next data: `None` at its end, `Some(Err)` when it failed.
type Next = Option<Result<Bytes, ()>>;

/// The body's next data if it is there now.
fn poll_now(body: &mut Body, cx: &mut Context<'_>) -> Option<Next> {
    loop {
        return match Pin::new(&mut *body).poll_frame(cx) {
            Poll::Pending => None,
            Poll::Ready(None) => Some(None),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Some(Some(Ok(data))),
                Err(_) => continue,
            },
            Poll::Ready(Some(Err(error))) => {
                tracing::debug!(%error, "an answer's body failed");
                Some(Some(Err(())))
            }
        };
    }
}

/// How many of a body's frames one write takes at most.
const GATHER: usize = 8;

/// The body's data that one write sends: the frame that was awaited and the frames that were
/// there already behind it (an upstream that sends several events at once, as Azure's content
/// filter does, costs one write, not one an event).
#[derive(Default)]
struct Batch {
    first: Bytes,
    /// Frames behind the first: allocated only when there are any.
    more: Vec<Bytes>,
    length: usize,
    /// The body ended with this data (the last chunk follows it).
    end: bool,
    /// The body failed after this data: it is written, then the connection ends unfinished.
    failed: bool,
}

impl Batch {
    /// The batch of a body that ended: no data, the last chunk.
    fn ended() -> Batch {
        Batch {
            end: true,
            ..Batch::default()
        }
    }

    fn of(first: Bytes, body: &Body) -> Batch {
        Batch {
            length: first.len(),
            first,
            end: body.is_end_stream(),
            ..Batch::default()
        }
    }

    /// Takes the frames that are there now, until the batch is full or the body waits or ends.
    fn gather(&mut self, body: &mut Body, cx: &mut Context<'_>) {
        while !self.end && !self.failed && self.more.len() + 1 < GATHER {
            match poll_now(body, cx) {
                None => return,
                Some(None) => self.end = true,
                Some(Some(Ok(data))) if data.is_empty() => {}
                Some(Some(Ok(data))) => {
                    self.length += data.len();
                    self.more.push(data);
                    self.end = body.is_end_stream();
                }
                Some(Some(Err(()))) => self.failed = true,
            }
        }
    }

    /// The batch's data in `parts`, from the first; how many it took.
    fn fill<'a>(&'a self, parts: &mut [IoSlice<'a>]) -> usize {
        let data = std::iter::once(&self.first).chain(&self.more);
        parts
            .iter_mut()
            .zip(data)
            .map(|(part, data)| *part = IoSlice::new(data))
            .count()
    }
}

/// A chunk's size line: the length in hex and CRLF, and how many bytes of the array it takes.
fn chunk_size_line(length: usize) -> ([u8; 18], usize) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut line = [0u8; 18];
    let digits = (usize::BITS - length.leading_zeros()).div_ceil(4).max(1) as usize;
    for (i, digit) in line[..digits].iter_mut().enumerate() {
        *digit = HEX[(length >> (4 * (digits - 1 - i))) & 0xf];
    }
    line[digits..digits + 2].copy_from_slice(b"\r\n");
    (line, digits + 2)
}

async fn write_all_vectored(stream: &mut TcpStream, parts: &mut [IoSlice<'_>]) -> io::Result<()> {
    let mut parts = &mut parts[..];
    IoSlice::advance_slices(&mut parts, 0);
    while !parts.is_empty() {
        match stream.write_vectored(parts).await? {
            0 => return Err(io::ErrorKind::WriteZero.into()),
            n => IoSlice::advance_slices(&mut parts, n),
        }
    }
    Ok(())
}

/// Parses a request head at the buffer's start and takes it; `None` until it is whole. Header
/// values and the target stay in the bytes read (no copies).
fn parse_head(buffer: &mut BytesMut) -> Result<Option<Head>, StatusCode> {
    let bad = StatusCode::BAD_REQUEST;
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Request::new(&mut []);
    let length = match parsed.parse_with_uninit_headers(buffer, &mut slots) {
        Ok(httparse::Status::Complete(length)) if length <= MAX_HEAD_BYTES => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Ok(httparse::Status::Complete(_)) | Err(httparse::Error::TooManyHeaders) => {
            return Err(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        }
        Err(_) => return Err(bad),
    };
    let start = buffer.as_ptr() as usize;
    let within = |part: &[u8]| {
        let at = part.as_ptr() as usize - start;
        at..at + part.len()
    };
    let method =
        Method::from_bytes(parsed.method.unwrap_or_default().as_bytes()).map_err(|_| bad)?;
    let target = within(parsed.path.unwrap_or_default().as_bytes());
    let version = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let mut fields: SmallVec<[(HeaderName, Range<usize>); INLINE_FIELDS]> = SmallVec::new();
    let mut wire = Wire::default();
    // `expect` as its first value says it, as a map lookup reads it.
    let (mut expect, mut asks_upgrade) = (None, false);
    for field in parsed.headers.iter() {
        let name = crate::framing::header_name(field.name.as_bytes()).map_err(|_| bad)?;
        if let Some(framed) = Framed::of(&name) {
            wire.read(framed, field.value);
        } else if name == header::EXPECT {
            expect.get_or_insert(field.value.eq_ignore_ascii_case(b"100-continue"));
        } else if name == header::UPGRADE {
            asks_upgrade = true;
        }
        fields.push((name, within(field.value)));
    }
    let head = buffer.split_to(length).freeze();
    let uri = Uri::from_maybe_shared(head.slice(target)).map_err(|_| bad)?;
    let mut headers = HeaderMap::with_capacity(fields.len());
    // Drained where they lie: iterating the list by value would copy it whole first.
    for (name, value) in fields.drain(..) {
        let value = HeaderValue::from_maybe_shared(head.slice(value)).map_err(|_| bad)?;
        headers.append(name, value);
    }
    let framing = body_framing(&wire).ok_or(bad)?;
    Ok(Some(Head {
        method,
        uri,
        version,
        headers,
        framing,
        close: wire.closes(version),
        expects_continue: expect == Some(true) && version == Version::HTTP_11,
        asks_upgrade,
    }))
}

/// How the request's body is framed; `None` when that cannot be told safely (both a length and
/// a transfer coding, a coding other than chunked last, lengths that differ).
fn body_framing(wire: &Wire) -> Option<Framing> {
    let length = wire.length.ok()?;
    match (wire.coded, length) {
        (true, Some(_)) => None,
        (true, None) => wire.chunked.then_some(Framing::Chunked),
        (false, length) => Some(Framing::Length(length.unwrap_or(0))),
    }
}

/// An answer's head: the status line, the answer's headers (the connection's own framing in
/// place of any it set), `date`, the body's framing and `connection`.
fn encode_head(
    status: StatusCode,
    headers: &HeaderMap,
    stamp: &[u8],
    framing: BodyFraming,
    connection: &[u8],
) -> Vec<u8> {
    let mut head = Vec::with_capacity(160 + headers.len() * 48 + stamp.len());
    head.extend_from_slice(b"HTTP/1.1 ");
    head.extend_from_slice(status.as_str().as_bytes());
    head.push(b' ');
    head.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    head.extend_from_slice(b"\r\n");
    let upgrade = status == StatusCode::SWITCHING_PROTOCOLS;
    for (name, value) in headers {
        let framing_header = name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || (name == header::CONNECTION && !upgrade);
        if framing_header || name == header::DATE {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(stamp);
    date::write(&mut head);
    match framing {
        BodyFraming::Length(length) => {
            head.extend_from_slice(b"content-length: ");
            head.extend_from_slice(itoa::Buffer::new().format(length).as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        BodyFraming::Chunked => head.extend_from_slice(b"transfer-encoding: chunked\r\n"),
        BodyFraming::None | BodyFraming::Close => {}
    }
    head.extend_from_slice(connection);
    head.extend_from_slice(b"\r\n");
    head
}

/// The `date` header, formatted once a second per thread.
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    thread_local! {
        static NOW: RefCell<(u64, String)> = const { RefCell::new((0, String::new())) };
    }

    pub fn write(head: &mut Vec<u8>) {
        let now = SystemTime::now();
        let second = now
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_secs());
        let written = NOW.try_with(|cached| {
            let Ok(mut cached) = cached.try_borrow_mut() else {
                return false;
            };
            if cached.0 != second || cached.1.is_empty() {
                *cached = (second, httpdate::fmt_http_date(now));
            }
            line(head, &cached.1);
            true
        });
        if !matches!(written, Ok(true)) {
            line(head, &httpdate::fmt_http_date(now));
        }
    }

    fn line(head: &mut Vec<u8>, date: &str) {
        head.extend_from_slice(b"date: ");
        head.extend_from_slice(date.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
}

/// The upgrade of a request whose answer is a 101: its connection, once that answer is out.
/// Handlers take it from the request with [`OnUpgrade::take`].
pub struct OnUpgrade(Option<oneshot::Receiver<Upgraded>>);

/// The upgrade a request carries until its handler takes it (request extensions are `Clone`).
#[derive(Clone)]
struct Pending(Arc<Mutex<Option<oneshot::Receiver<Upgraded>>>>);

/// Why an upgrade did not happen.
#[derive(Debug)]
pub struct UpgradeFailed;

impl std::fmt::Display for UpgradeFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the connection was not upgraded")
    }
}

impl std::error::Error for UpgradeFailed {}

impl OnUpgrade {
    /// The request's upgrade; one that never happens when the request did not ask for one on
    /// an HTTP/1.1 connection.
    pub fn take<B>(request: &mut Request<B>) -> OnUpgrade {
        let pending = request.extensions_mut().remove::<Pending>();
        OnUpgrade(pending.and_then(|p| p.0.lock().ok()?.take()))
    }
}

impl Future for OnUpgrade {
    type Output = Result<Upgraded, UpgradeFailed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.0.as_mut() {
            None => Poll::Ready(Err(UpgradeFailed)),
            Some(receiver) => Pin::new(receiver).poll(cx).map_err(|_| UpgradeFailed),
        }
    }
}

/// An upgraded connection: the bytes the client sent after its handshake, then the socket.
pub struct Upgraded {
    stream: TcpStream,
    read: Bytes,
}

impl AsyncRead for Upgraded {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if !self.read.is_empty() {
            let n = self.read.len().min(buf.remaining());
            let read = self.read.split_to(n);
            buf.put_slice(&read);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Upgraded {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, Ordering};

    use http_body_util::{BodyExt, StreamBody};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    use super::*;
    use crate::body::{full, BoxError};

    /// A gateway listener serving `handler`; a body larger than [`SMALL_BODY`] is read up to 1 MiB
    /// for a request with `x-known: yes`, not at all for others.
    async fn listen<H, F>(handler: H) -> (SocketAddr, watch::Sender<bool>)
    where
        H: Fn(Request<RequestBody>) -> F + Send + Sync + 'static,
        F: Future<Output = Response<Body>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let (stop, shutdown) = watch::channel(false);
        tokio::spawn(crate::server::serve(
            listener,
            handler,
            Arc::new(
                |headers: &HeaderMap| match headers.contains_key("x-known") {
                    true => 1 << 20,
                    false => SMALL_BODY,
                },
            ),
            shutdown,
            None,
        ));
        (address, stop)
    }

    /// Answers with the method, target and body it got (`413` for a body over the limit).
    async fn echo(request: Request<RequestBody>) -> Response<Body> {
        let said = format!("{} {} ", request.method(), request.uri());
        match request.into_body() {
            RequestBody::Whole(body) => {
                let mut answer = said.into_bytes();
                answer.extend_from_slice(&body);
                Response::new(full(answer))
            }
            _ => {
                let mut answer = Response::new(full("too large"));
                *answer.status_mut() = StatusCode::PAYLOAD_TOO_LARGE;
                answer
            }
        }
    }

    async fn connect(address: SocketAddr) -> TcpStream {
        TcpStream::connect(address).await.unwrap()
    }

    /// A client that has asked for `/`.
    async fn get(address: SocketAddr) -> TcpStream {
        let mut client = connect(address).await;
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        client
    }

    /// What the client reads until `needle` has come (or the connection's end).
    async fn read_until(client: &mut TcpStream, needle: &str) -> String {
        let mut seen = Vec::new();
        let reading = async {
            let mut chunk = [0u8; 4096];
            while !String::from_utf8_lossy(&seen).contains(needle) {
                match client.read(&mut chunk).await.unwrap() {
                    0 => break,
                    n => seen.extend_from_slice(&chunk[..n]),
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(5), reading)
            .await
            .expect("the answer came in time");
        String::from_utf8(seen).unwrap()
    }

    /// Whether the server closes the connection within a second.
    async fn closes(client: &mut TcpStream) -> bool {
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest));
        matches!(read.await, Ok(Ok(_)))
    }

    const PING: &[u8] = b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nping";

    #[tokio::test]
    async fn keep_alive_connections_answer_request_after_request_also_after_a_pause() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for _ in 0..2 {
            client.write_all(PING).await.unwrap();
            let answer = read_until(&mut client, "ping").await;
            assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
            assert!(answer.contains("content-length: 15\r\n"), "{answer}");
            assert!(answer.contains("date: "), "{answer}");
            assert!(answer.ends_with("\r\n\r\nPOST /echo ping"), "{answer}");
            tokio::time::sleep(Duration::from_millis(1300)).await;
        }
    }

    #[tokio::test]
    async fn a_request_that_arrives_in_pieces_is_read_whole() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for piece in [&PING[..10], &PING[10..40], &PING[40..50], &PING[50..]] {
            client.write_all(piece).await.unwrap();
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        let answer = read_until(&mut client, "ping").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn a_request_whose_first_byte_comes_alone_is_served_as_http1() {
        // `P` alone could begin `POST` or h2's `PRI * HTTP/2.0` preface.
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        client.write_all(&PING[..1]).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&PING[1..]).await.unwrap();
        let answer = read_until(&mut client, "ping").await;
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
        assert!(answer.ends_with("POST /echo ping"), "{answer}");
    }

    #[tokio::test]
    async fn a_client_that_ends_after_a_lone_first_byte_is_closed_at_once() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        client.write_all(b"P").await.unwrap();
        client.shutdown().await.unwrap();
        // Closed with the `P` unread, so the end may come as a reset.
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest));
        assert!(ended.await.is_ok(), "the connection was left open");
        assert!(rest.is_empty());
    }

    #[tokio::test]
    async fn a_request_left_unfinished_gets_408_and_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let heads_and_bodies: [&[u8]; 2] = [
            b"POST /echo HTTP/1.1\r\nhost: x\r\n",
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc",
        ];
        for begun in heads_and_bodies {
            let mut client = connect(address).await;
            client.write_all(begun).await.unwrap();
            let started = std::time::Instant::now();
            let answer = read_until(&mut client, "\r\n\r\n").await;
            assert!(started.elapsed() >= BEGUN_REQUEST_WAIT, "{answer}");
            assert!(
                answer.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
        }
    }

    #[tokio::test]
    async fn pipelined_requests_are_answered_in_order() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let get = b"GET /second HTTP/1.1\r\nhost: x\r\n\r\n";
        client.write_all(&[PING, &get[..]].concat()).await.unwrap();
        let answers = read_until(&mut client, "GET /second ").await;
        let first = answers.find("POST /echo ping").unwrap();
        assert!(first < answers.find("GET /second ").unwrap(), "{answers}");
        assert_eq!(answers.matches("HTTP/1.1 200 OK").count(), 2, "{answers}");
    }

    #[tokio::test]
    async fn chunked_request_bodies_reach_the_handler_whole() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let request = b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n\
                        4;ext=1\r\nhell\r\n3\r\no, \r\n5\r\nworld\r\n0\r\nx-trailer: 1\r\n\r\n";
        client.write_all(request).await.unwrap();
        let answer = read_until(&mut client, "world").await;
        assert!(answer.ends_with("POST /c hello, world"), "{answer}");
    }

    #[tokio::test]
    async fn expect_100_continue_gets_its_interim_answer_before_the_body_is_sent() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        let head =
            b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 4\r\n\r\n";
        client.write_all(head).await.unwrap();
        let interim = read_until(&mut client, "\r\n\r\n").await;
        assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n");
        client.write_all(b"pong").await.unwrap();
        let answer = read_until(&mut client, "pong").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn unreadable_requests_get_400_or_431_and_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let long = format!("GET / HTTP/1.1\r\nx-long: {}\r\n\r\n", "a".repeat(70_000));
        let many = format!("GET / HTTP/1.1\r\n{}\r\n", "x-h: 1\r\n".repeat(130));
        let cases = [
            (long.into_bytes(), "431 Request Header Fields Too Large"),
            (many.into_bytes(), "431 Request Header Fields Too Large"),
            (b"HELLO THERE\r\n\r\n".to_vec(), "400 Bad Request"),
            (
                b"POST / HTTP/1.1\r\ncontent-length: 4\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n"
                    .to_vec(),
                "400 Bad Request",
            ),
            (
                b"POST / HTTP/1.1\r\ncontent-length: 4\r\ncontent-length: 5\r\n\r\nabcde".to_vec(),
                "400 Bad Request",
            ),
            (
                b"POST / HTTP/1.1\r\ntransfer-encoding: gzip\r\n\r\nxx".to_vec(),
                "400 Bad Request",
            ),
            (
                b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
                "400 Bad Request",
            ),
        ];
        for (request, status) in cases {
            let mut client = connect(address).await;
            let _ = client.write_all(&request).await;
            let answer = read_until(&mut client, "\r\n\r\n").await;
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status}\r\n")),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
        }
    }

    #[tokio::test]
    async fn a_large_body_is_read_only_when_its_limit_allows_and_else_the_connection_closes() {
        let (address, _stop) = listen(echo).await;
        let large = "x".repeat(70_000);
        let chunked = format!("{:X}\r\n{large}\r\n0\r\n\r\n", large.len());
        for (framing, body) in [
            (format!("content-length: {}", large.len()), &large),
            ("transfer-encoding: chunked".to_owned(), &chunked),
        ] {
            let stranger = format!("POST /big HTTP/1.1\r\n{framing}\r\n\r\n{body}");
            let mut client = connect(address).await;
            let _ = client.write_all(stranger.as_bytes()).await;
            let answer = read_until(&mut client, "too large").await;
            assert!(
                answer.starts_with("HTTP/1.1 413 Payload Too Large"),
                "{answer}"
            );
            assert!(answer.contains("connection: close\r\n"), "{answer}");
            assert!(closes(&mut client).await);
            let known = format!("POST /big HTTP/1.1\r\nx-known: yes\r\n{framing}\r\n\r\n{body}");
            let mut client = connect(address).await;
            client.write_all(known.as_bytes()).await.unwrap();
            let answer = read_until(&mut client, &large[..1000]).await;
            assert!(answer.starts_with("HTTP/1.1 200 OK"), "{}", &answer[..200]);
            assert!(
                answer.contains("content-length: 70010\r\n"),
                "{}",
                &answer[..200]
            );
        }
    }

    /// A handler's answer of unknown length: the events sent on `events`; `dropped` once the
    /// connection let go of it.
    struct Stream {
        events: mpsc::UnboundedSender<Bytes>,
        dropped: Arc<AtomicBool>,
    }

    fn streaming() -> (
        impl Fn(Request<RequestBody>) -> std::future::Ready<Response<Body>> + Send + Sync,
        Stream,
    ) {
        let (events, receiver) = mpsc::unbounded_channel::<Bytes>();
        let receiver = Arc::new(Mutex::new(Some(receiver)));
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let handler = move |_request| {
            let receiver = receiver.lock().unwrap().take().unwrap();
            let guard = Guard(flag.clone());
            let frames = futures_util::stream::unfold((receiver, guard), |(mut r, g)| async move {
                let event = r.recv().await?;
                Some((Ok::<_, BoxError>(http_body::Frame::data(event)), (r, g)))
            });
            std::future::ready(Response::new(StreamBody::new(frames).boxed_unsync()))
        };
        (handler, Stream { events, dropped })
    }

    /// Sets its flag when dropped.
    struct Guard(Arc<AtomicBool>);

    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn answers_of_unknown_length_are_chunked_an_event_a_chunk_and_end_with_the_last_chunk() {
        let (handler, Stream { events, .. }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = get(address).await;
        let head = read_until(&mut client, "\r\n\r\n").await;
        assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
        events.send(Bytes::from_static(b"data: 1\n\n")).unwrap();
        assert_eq!(
            read_until(&mut client, "\n\n\r\n").await,
            "9\r\ndata: 1\n\n\r\n"
        );
        events.send(Bytes::from(vec![b'x'; 300])).unwrap();
        let chunk = read_until(&mut client, "x\r\n").await;
        assert!(chunk.starts_with("12C\r\nxxx"), "{chunk}");
        drop(events);
        assert_eq!(read_until(&mut client, "0\r\n\r\n").await, "0\r\n\r\n");
    }

    #[tokio::test]
    async fn events_already_there_behind_one_go_out_in_one_chunk() {
        let (handler, Stream { events, .. }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = get(address).await;
        read_until(&mut client, "\r\n\r\n").await;
        for event in ["data: 1\n\n", "data: 2\n\n", "data: 3\n\n"] {
            events.send(Bytes::from_static(event.as_bytes())).unwrap();
        }
        // The first was waited for and goes alone; the two behind it were there at once.
        assert_eq!(
            read_until(&mut client, "data: 3\n\n\r\n").await,
            "9\r\ndata: 1\n\n\r\n12\r\ndata: 2\n\ndata: 3\n\n\r\n"
        );
        drop(events);
        assert_eq!(read_until(&mut client, "0\r\n\r\n").await, "0\r\n\r\n");
    }

    #[tokio::test]
    async fn data_ahead_of_a_body_failure_is_written_and_the_answer_is_left_cut() {
        let handler = |_request| {
            let frames = futures_util::stream::iter([
                Ok(http_body::Frame::data(Bytes::from_static(b"data: 1\n\n"))),
                Ok(http_body::Frame::data(Bytes::from_static(b"data: 2\n\n"))),
                Err::<_, BoxError>("the upstream reset".into()),
            ]);
            std::future::ready(Response::new(StreamBody::new(frames).boxed_unsync()))
        };
        let (address, _stop) = listen(handler).await;
        let mut client = get(address).await;
        let answer = read_until(&mut client, "never").await;
        assert!(
            answer.ends_with("\r\n\r\n12\r\ndata: 1\n\ndata: 2\n\n\r\n"),
            "{answer}"
        );
    }

    #[tokio::test]
    async fn http_1_0_clients_get_answers_of_unknown_length_until_the_connection_closes() {
        let (handler, Stream { events, .. }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = connect(address).await;
        client.write_all(b"GET / HTTP/1.0\r\n\r\n").await.unwrap();
        events.send(Bytes::from_static(b"first ")).unwrap();
        events.send(Bytes::from_static(b"second")).unwrap();
        drop(events);
        let answer = read_until(&mut client, "never").await;
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(!answer.contains("transfer-encoding"), "{answer}");
        assert!(answer.ends_with("\r\n\r\nfirst second"), "{answer}");
    }

    #[tokio::test]
    async fn http_1_0_keep_alive_is_kept_for_answers_of_known_length() {
        let (address, _stop) = listen(echo).await;
        let mut client = connect(address).await;
        for _ in 0..2 {
            client
                .write_all(b"GET /ka HTTP/1.0\r\nconnection: keep-alive\r\n\r\n")
                .await
                .unwrap();
            let answer = read_until(&mut client, "GET /ka ").await;
            assert!(answer.contains("connection: keep-alive\r\n"), "{answer}");
        }
        client
            .write_all(b"GET /last HTTP/1.0\r\n\r\n")
            .await
            .unwrap();
        let answer = read_until(&mut client, "GET /last ").await;
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn head_requests_and_204_answers_carry_no_body() {
        let (address, _stop) = listen(|request: Request<RequestBody>| async move {
            let mut answer = Response::new(full("twelve bytes"));
            if request.uri() == "/none" {
                *answer.status_mut() = StatusCode::NO_CONTENT;
            }
            answer
        })
        .await;
        let mut client = connect(address).await;
        client
            .write_all(b"HEAD / HTTP/1.1\r\n\r\nGET /none HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let answers = read_until(&mut client, "twelve bytes").await;
        let parts: Vec<&str> = answers.split("HTTP/1.1 ").collect();
        assert_eq!(parts.len(), 4, "{answers}");
        assert!(parts[1].starts_with("200 OK") && parts[1].contains("content-length: 12\r\n"));
        assert!(parts[1].ends_with("\r\n\r\n"), "{answers}");
        assert!(parts[2].starts_with("204 No Content") && !parts[2].contains("content-length"));
        assert!(parts[3].ends_with("\r\n\r\ntwelve bytes"), "{answers}");
    }

    #[tokio::test]
    async fn a_client_that_leaves_cancels_its_request() {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = dropped.clone();
        let (address, _stop) = listen(move |_request| {
            let guard = Guard(flag.clone());
            async move {
                std::future::pending::<()>().await;
                drop(guard);
                Response::new(full(""))
            }
        })
        .await;
        let mut client = connect(address).await;
        client.write_all(PING).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!dropped.load(Ordering::SeqCst));
        drop(client);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(dropped.load(Ordering::SeqCst), "the handler was dropped");
    }

    #[tokio::test]
    async fn a_client_that_leaves_mid_stream_ends_the_stream_at_once() {
        let (handler, Stream { events, dropped }) = streaming();
        let (address, _stop) = listen(handler).await;
        let mut client = connect(address).await;
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        events.send(Bytes::from_static(b"data: 1\n\n")).unwrap();
        read_until(&mut client, "data: 1").await;
        drop(client);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(dropped.load(Ordering::SeqCst), "the body was dropped");
    }

    /// A server whose handler answers "finished" once `release` (the third) is raised; the
    /// second stops it.
    async fn answering_once_released() -> (SocketAddr, watch::Sender<bool>, watch::Sender<bool>) {
        let (release, released) = watch::channel(false);
        let (address, stop) = listen(move |_request| {
            let mut released = released.clone();
            async move {
                let _ = released.wait_for(|r| *r).await;
                Response::new(full("finished"))
            }
        })
        .await;
        (address, stop, release)
    }

    #[tokio::test]
    async fn shutdown_closes_idle_connections_and_answers_requests_under_way_first() {
        let (address, stop, release) = answering_once_released().await;
        let mut idle = connect(address).await;
        let mut busy = connect(address).await;
        busy.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(true).unwrap();
        assert!(closes(&mut idle).await);
        release.send(true).unwrap();
        let answer = read_until(&mut busy, "finished").await;
        assert!(answer.contains("connection: close\r\n"), "{answer}");
        assert!(closes(&mut busy).await);
    }

    #[tokio::test]
    async fn a_connection_idle_after_its_requests_closes_when_shutdown_begins() {
        let (address, stop) = listen(|_request| async { Response::new(full("done")) }).await;
        let mut client = connect(address).await;
        // Its wait for the shutdown signal was polled at every request since the first.
        for _ in 0..3 {
            client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
            let answer = read_until(&mut client, "done").await;
            assert!(!answer.contains("connection: close"), "{answer}");
        }
        stop.send(true).unwrap();
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn a_request_under_way_when_shutdown_begins_is_answered_with_connection_close() {
        let (address, stop, release) = answering_once_released().await;
        let mut client = connect(address).await;
        // An earlier request first: the connection's wait is registered before shutdown.
        release.send(true).unwrap();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        let first = read_until(&mut client, "finished").await;
        assert!(!first.contains("connection: close"), "{first}");
        release.send(false).unwrap();
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        stop.send(true).unwrap();
        release.send(true).unwrap();
        let second = read_until(&mut client, "finished").await;
        assert!(second.contains("connection: close\r\n"), "{second}");
        assert!(closes(&mut client).await);
    }

    #[tokio::test]
    async fn an_upgrade_hands_over_the_socket_with_what_the_client_sent_after_its_handshake() {
        let (address, _stop) = listen(|mut request: Request<RequestBody>| async move {
            let upgrade = OnUpgrade::take(&mut request);
            tokio::spawn(async move {
                let mut upgraded = upgrade.await.unwrap();
                let mut got = [0u8; 5];
                upgraded.read_exact(&mut got).await.unwrap();
                upgraded.write_all(&got).await.unwrap();
            });
            let mut answer = Response::new(full(""));
            *answer.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
            answer
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            answer
                .headers_mut()
                .insert(header::UPGRADE, HeaderValue::from_static("echo"));
            answer
        })
        .await;
        let mut client = connect(address).await;
        client
            .write_all(b"GET / HTTP/1.1\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\nhel")
            .await
            .unwrap();
        let head = read_until(&mut client, "\r\n\r\n").await;
        assert!(
            head.starts_with("HTTP/1.1 101 Switching Protocols\r\n"),
            "{head}"
        );
        assert!(
            head.contains("connection: upgrade\r\nupgrade: echo\r\n"),
            "{head}"
        );
        assert!(!head.contains("content-length"), "{head}");
        client.write_all(b"lo").await.unwrap();
        assert_eq!(read_until(&mut client, "hello").await, "hello");
    }

    #[tokio::test]
    async fn a_connection_s_own_state_holds_no_buffer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = connect(listener.local_addr().unwrap()).await;
        let (_stop, mut shutdown) = watch::channel(false);
        let limit: BodyLimit = Arc::new(|_: &HeaderMap| 1024);
        let handler = |request| Box::pin(echo(request));
        let connection = serve(stream, &handler, &limit, &mut shutdown);
        // 10,000 idle connections hold 10,000 of these: a buffer kept across an await in it
        // (a read buffer, a drain's sink) costs as much again.
        let size = std::mem::size_of_val(&connection);
        assert!(size < 2048, "a connection's future is {size} bytes");
    }

    #[test]
    fn chunk_size_lines_are_hex() {
        for (length, line) in [
            (0, "0\r\n"),
            (9, "9\r\n"),
            (300, "12C\r\n"),
            (65536, "10000\r\n"),
        ] {
            let (bytes, used) = chunk_size_line(length);
            assert_eq!(&bytes[..used], line.as_bytes());
        }
    }

    /// A valid request to `/r` carrying `body`, framed by `content-length` or `chunked` (random
    /// chunks, an extension or a trailer now and then); a body-less GET when `body` is empty.
    fn request(rng: &mut impl rand::Rng, body: &[u8]) -> Vec<u8> {
        if body.is_empty() {
            return b"GET /r HTTP/1.1\r\nhost: x\r\n\r\n".to_vec();
        }
        let mut request = b"POST /r HTTP/1.1\r\nhost: x\r\n".to_vec();
        if rng.random_bool(0.5) {
            request.extend_from_slice(format!("content-length: {}\r\n\r\n", body.len()).as_bytes());
            request.extend_from_slice(body);
            return request;
        }
        request.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
        for piece in body.chunks(rng.random_range(1..=body.len())) {
            let ext = if rng.random_bool(0.2) { ";a=b" } else { "" };
            request.extend_from_slice(format!("{:x}{ext}\r\n", piece.len()).as_bytes());
            request.extend_from_slice(piece);
            request.extend_from_slice(b"\r\n");
        }
        let trailer = if rng.random_bool(0.2) {
            "x-t: 1\r\n"
        } else {
            ""
        };
        request.extend_from_slice(format!("0\r\n{trailer}\r\n").as_bytes());
        request
    }

    /// What [`echo`] answers to a request [`request`] made of `body`.
    fn echoed(body: &[u8]) -> String {
        match body.is_empty() {
            true => "GET /r ".to_owned(),
            false => format!("POST /r {}", String::from_utf8_lossy(body)),
        }
    }

    #[tokio::test]
    async fn random_and_damaged_requests_get_their_answers_or_a_close_in_time() {
        use rand::{Rng, SeedableRng};
        static PANICS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let earlier = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            earlier(info);
        }));
        let (address, _stop) = listen(echo).await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for round in 0..300 {
            let bodies: Vec<Vec<u8>> = (0..rng.random_range(1..=3))
                .map(|_| {
                    (0..rng.random_range(0..2000))
                        .map(|_| rng.random_range(b'a'..=b'z'))
                        .collect()
                })
                .collect();
            let mut sent: Vec<u8> = bodies
                .iter()
                .flat_map(|body| request(&mut rng, body))
                .collect();
            let intact = rng.random_bool(0.4);
            if !intact {
                framing::damage(&mut rng, &mut sent);
            }
            let mut client = connect(address).await;
            let talk = async {
                let mut from = 0;
                for _ in 0..rng.random_range(1..4) {
                    let to = rng.random_range(from..=sent.len());
                    if client.write_all(&sent[from..to]).await.is_err() {
                        break;
                    }
                    from = to;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                let _ = client.write_all(&sent[from..]).await;
                // Intact requests are answered while the client still listens; a damaged one may
                // leave the server waiting for more, and the end of the sending says none comes.
                // (A client that sends its end leaves, as far as the server can tell.)
                if !intact {
                    let _ = client.shutdown().await;
                }
                let last = echoed(bodies.last().map_or(&[][..], Vec::as_slice));
                let mut answers = Vec::new();
                let mut chunk = [0u8; 4096];
                while !(intact && answers.ends_with(last.as_bytes())) {
                    match client.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => answers.extend_from_slice(&chunk[..n]),
                    }
                }
                answers
            };
            let answers = tokio::time::timeout(Duration::from_secs(5), talk)
                .await
                .unwrap_or_else(|_| panic!("round {round}: no end within 5 s"));
            let answers = String::from_utf8_lossy(&answers);
            assert!(
                answers.is_empty() || answers.starts_with("HTTP/1.1 "),
                "round {round}: {answers}"
            );
            if intact {
                assert_eq!(
                    answers.matches("HTTP/1.1 200 OK\r\n").count(),
                    bodies.len(),
                    "round {round}: sent {:?}, answered {answers:?}",
                    String::from_utf8_lossy(&sent)
                );
                let mut rest = &answers[..];
                for body in &bodies {
                    let echoed = echoed(body);
                    let at = rest
                        .find(&echoed)
                        .unwrap_or_else(|| panic!("round {round}: {echoed} missing"));
                    rest = &rest[at + echoed.len()..];
                }
            }
        }
        assert_eq!(PANICS.load(Ordering::SeqCst), 0);
    }
}
