//! HTTP/1.1 to upstreams, on the socket itself: the request is written and its answer read by
//! whoever awaits it, with no connection task and no channel between them. Reads land in the
//! thread's scratch space and only what arrived is kept, so a stream held open holds the socket,
//! the bytes not yet handed out and the body's framing state; a hyper client connection holds
//! two 8 KiB buffers, a request channel and a task per connection.
//!
//! Only what upstream answers need: a request with its whole body, answers framed by
//! `content-length`, `chunked` or the connection's end, 1xx answers skipped, keep-alive unless
//! either side says `close`.

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use hyper_rustls::MaybeHttpsStream;
use hyper_util::rt::TokioIo;
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::framing::{self, wants_close, Chunked, Framed, Step, Wire};
use crate::{headroom, outcome};

/// The connector's socket: plain TCP as it is, rustls over it boxed (a TLS session is some
/// kilobytes that a plain connection need not carry).
pub enum Io {
    Plain(TcpStream),
    Tls(Box<TokioIo<MaybeHttpsStream<TokioIo<TcpStream>>>>),
}

impl From<MaybeHttpsStream<TokioIo<TcpStream>>> for Io {
    fn from(stream: MaybeHttpsStream<TokioIo<TcpStream>>) -> Io {
        match stream {
            MaybeHttpsStream::Http(tcp) => Io::Plain(tcp.into_inner()),
            tls => Io::Tls(Box::new(TokioIo::new(tls))),
        }
    }
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        parts: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_write_vectored(cx, parts),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_write_vectored(cx, parts),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(tcp) => tcp.is_write_vectored(),
            Io::Tls(tls) => tls.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Io::Tls(tls) => Pin::new(&mut **tls).poll_shutdown(cx),
        }
    }
}

/// Response heads larger than this are refused.
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 128;
/// An answer's head with up to this many kept fields is parsed without allocating their list.
const INLINE_FIELDS: usize = 16;
/// A request body up to this size is copied behind its head, so both go out in one buffer; a
/// larger one goes out from where it is, head and body in one vectored write over plain TCP
/// (a TLS connection takes them together up to [`TLS_ONE_WRITE`], one record).
const INLINE_BODY: usize = 4 * 1024;
const TLS_ONE_WRITE: usize = 64 * 1024;

/// An open HTTP/1.1 connection and whatever it has read and not yet handed out.
pub struct Connection {
    io: Io,
    buffer: BytesMut,
}

/// Why a request produced no answer head.
pub enum SendError {
    /// Nothing was written: the request may go on another connection.
    Unsent(Box<Request<Bytes>>),
    /// The connection failed after (part of) the request went out, or the answer was not HTTP.
    Failed(String),
}

/// How the answer's body ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked(Chunked),
    /// Until the upstream closes the connection.
    Close,
    Done,
}

/// An answer's body being read off its connection.
pub struct Body {
    connection: Box<Connection>,
    framing: Framing,
    keep_alive: bool,
}

impl Connection {
    pub fn new(io: Io) -> Box<Connection> {
        Box::new(Connection {
            io,
            buffer: BytesMut::new(),
        })
    }

    /// Whether an idle connection can carry a request: nothing arrived while it waited (an
    /// idle connection that reads anything, its end included, was closed or broken).
    pub fn is_usable(&mut self) -> bool {
        if !self.buffer.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 1];
        let mut read = ReadBuf::new(&mut probe);
        matches!(
            Pin::new(&mut self.io).poll_read(&mut cx, &mut read),
            Poll::Pending
        )
    }

    /// Sends `request` (origin-form URI, `host` set) and reads the answer's head.
    pub async fn send(
        mut self: Box<Self>,
        request: Request<Bytes>,
    ) -> Result<Response<Body>, SendError> {
        let head_request = request.method() == Method::HEAD;
        let inline = match self.io {
            Io::Plain(_) => INLINE_BODY,
            Io::Tls(_) => TLS_ONE_WRITE,
        };
        let (bytes, body) = encode(&request, inline);
        if let Err(error) = self.write_request(&bytes, &body).await {
            return Err(match error {
                Written::Nothing => SendError::Unsent(Box::new(request)),
                Written::Part(e) => SendError::Failed(e.to_string()),
            });
        }
        let close_asked = wants_close(request.headers(), Version::HTTP_11);
        let (head, framing) = loop {
            let head = self.read_head().await.map_err(SendError::Failed)?;
            if !head.status.is_informational() || head.status == StatusCode::SWITCHING_PROTOCOLS {
                let framing = framing(&head, head_request).map_err(SendError::Failed)?;
                break (head, framing);
            }
        };
        // After a 101 the connection speaks another protocol: it never goes back to a pool.
        let keep_alive = !close_asked
            && framing != Framing::Close
            && head.status != StatusCode::SWITCHING_PROTOCOLS
            && !head.wire.closes(head.version);
        let mut response = Response::new(Body {
            connection: self,
            framing,
            keep_alive,
        });
        *response.status_mut() = head.status;
        *response.version_mut() = head.version;
        *response.headers_mut() = head.headers;
        Ok(response)
    }

    /// Writes the head and the body behind it, in one system call when the socket takes all.
    async fn write_request(&mut self, head: &[u8], body: &Bytes) -> Result<(), Written> {
        let mut written = 0;
        while written < head.len() + body.len() {
            let (head_left, body_left) = match head.get(written..) {
                Some(rest) => (rest, &body[..]),
                None => (
                    &[][..],
                    body.get(written - head.len()..).unwrap_or_default(),
                ),
            };
            let parts = [IoSlice::new(head_left), IoSlice::new(body_left)];
            match self.io.write_vectored(&parts).await {
                Ok(0) => return Err(Written::at(written, closed_error())),
                Ok(n) => written += n,
                Err(e) => return Err(Written::at(written, e)),
            }
        }
        self.io.flush().await.map_err(Written::Part)
    }

    /// The next answer head, consumed from the buffer.
    async fn read_head(&mut self) -> Result<Head, String> {
        loop {
            if let Some(head) = parse_head(&mut self.buffer)? {
                return Ok(head);
            }
            if self.buffer.len() >= MAX_HEAD {
                return Err(format!("the answer's head is larger than {MAX_HEAD} bytes"));
            }
            let read = std::future::poll_fn(|cx| self.poll_read(cx)).await;
            match read {
                Ok(0) => return Err("the connection closed before an answer arrived".into()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// Reads what the socket has into the buffer ([`framing::poll_read_into`]).
    fn poll_read(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<usize>> {
        framing::poll_read_into(&mut self.io, &mut self.buffer, cx)
    }
}

/// How much of a request went out before its connection failed.
enum Written {
    Nothing,
    Part(std::io::Error),
}

impl Written {
    fn at(written: usize, error: std::io::Error) -> Written {
        match written {
            0 => Written::Nothing,
            _ => Written::Part(error),
        }
    }
}

fn closed_error() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::WriteZero, "the connection closed")
}

/// The request as it goes out: its head with the body copied behind it when the body is at
/// most `inline` bytes (the body left to write is then empty), else the head and the body apart
/// (the body not copied).
fn encode(request: &Request<Bytes>, inline: usize) -> (Vec<u8>, Bytes) {
    let body = request.body();
    let copied = body.len() <= inline;
    let room = if copied { body.len() } else { 0 };
    let mut head = Vec::with_capacity(256 + request.headers().len() * 48 + room);
    head.extend_from_slice(request.method().as_str().as_bytes());
    head.push(b' ');
    let target = request.uri().path_and_query().map_or("/", |p| p.as_str());
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = host_of(request) {
        head.extend_from_slice(b"host: ");
        head.extend_from_slice(host.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    for (name, value) in request.headers() {
        if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
            continue;
        }
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    if !body.is_empty() || request.method() == Method::POST || request.method() == Method::PUT {
        head.extend_from_slice(b"content-length: ");
        head.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    head.extend_from_slice(b"\r\n");
    if copied {
        head.extend_from_slice(body);
        return (head, Bytes::new());
    }
    (head, body.clone())
}

/// The `host` line a request needs when it has no `host` header: its URI's authority, without
/// the scheme's default port. The request line carries the path alone (origin form).
fn host_of(request: &Request<Bytes>) -> Option<&str> {
    if request.headers().contains_key(header::HOST) {
        return None;
    }
    let authority = request.uri().authority()?;
    let default_port = match request.uri().scheme_str() {
        Some("https") => 443,
        _ => 80,
    };
    Some(match authority.port_u16() {
        Some(port) if port == default_port => authority.host(),
        _ => authority.as_str(),
    })
}

/// The answer headers the gateway reads: the content type, the retry hints
/// ([`outcome::retry_after`]) and the backend's remaining quota ([`headroom::Load::observe`]).
/// The others are left out of the head as it is read: an Azure answer carries a dozen more
/// (request ids, region, content-filter flags), each hashed and stored for nobody. The framing
/// headers ([`Framed`]) are read as the head is parsed, into its [`Wire`].
static READ: [HeaderName; 7] = [
    header::CONTENT_TYPE,
    header::RETRY_AFTER,
    outcome::RETRY_AFTER_MS,
    headroom::REMAINING_REQUESTS,
    headroom::REMAINING_TOKENS,
    headroom::RESET_REQUESTS,
    headroom::RESET_TOKENS,
];

/// Where a header read off the wire, in any case, goes.
enum Field {
    /// Into the head's map, under this name.
    Kept(HeaderName),
    /// Into the head's [`Wire`].
    Framing(Framed),
    Skipped,
}

fn field(name: &[u8]) -> Field {
    let same = |known: &HeaderName| known.as_str().as_bytes().eq_ignore_ascii_case(name);
    if let Some(framed) = Framed::ALL.into_iter().find(|framed| same(&framed.name())) {
        return Field::Framing(framed);
    }
    READ.iter()
        .find(|known| same(known))
        .map_or(Field::Skipped, |known| Field::Kept(known.clone()))
}

struct Head {
    status: StatusCode,
    version: Version,
    headers: HeaderMap,
    wire: Wire,
}

/// Parses an answer head at the buffer's start and consumes it; `None` until it is whole.
fn parse_head(buffer: &mut BytesMut) -> Result<Option<Head>, String> {
    if buffer.is_empty() {
        return Ok(None);
    }
    let mut slots = [const { std::mem::MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let parse = httparse::ParserConfig::default();
    let length = match parse.parse_response_with_uninit_headers(&mut parsed, buffer, &mut slots) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(format!("the answer is not HTTP/1.1: {e}")),
    };
    let status = parsed
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or("the answer has no valid status")?;
    let version = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    // Header values stay in the bytes read: their ranges now, their slices once the head is taken.
    let start = buffer.as_ptr() as usize;
    let mut fields: SmallVec<[_; INLINE_FIELDS]> = SmallVec::new();
    let mut wire = Wire::default();
    for header in parsed.headers.iter() {
        match field(header.name.as_bytes()) {
            Field::Kept(name) => {
                let at = header.value.as_ptr() as usize - start;
                fields.push((name, at..at + header.value.len()));
            }
            Field::Framing(framed) => wire.read(framed, header.value),
            Field::Skipped => {}
        }
    }
    let head = buffer.split_to(length).freeze();
    let mut headers = HeaderMap::with_capacity(fields.len());
    // Drained where they lie: iterating the list by value would copy it whole first.
    for (name, value) in fields.drain(..) {
        let value = HeaderValue::from_maybe_shared(head.slice(value))
            .map_err(|_| format!("the answer's {name} header has an invalid value"))?;
        headers.append(name, value);
    }
    Ok(Some(Head {
        status,
        version,
        headers,
        wire,
    }))
}

/// How the body of an answer with this head ends.
fn framing(head: &Head, head_request: bool) -> Result<Framing, String> {
    let status = head.status;
    if head_request
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Done);
    }
    if head.wire.chunked {
        return Ok(Framing::Chunked(Chunked::Size));
    }
    if head.wire.coded {
        return Ok(Framing::Close);
    }
    let length = head
        .wire
        .length
        .map_err(|e| format!("the answer has {e}"))?;
    Ok(match length {
        None => Framing::Close,
        Some(0) => Framing::Done,
        Some(n) => Framing::Length(n),
    })
}

/// A body's read failure.
#[derive(Debug)]
pub struct BodyError(String);

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BodyError {}

impl Body {
    /// Whether the connection can go back to a pool once this body has ended.
    pub fn may_return(&self) -> bool {
        self.keep_alive
    }

    pub fn is_end(&self) -> bool {
        self.framing == Framing::Done
    }

    /// The exact length left, when the answer said it.
    pub fn exact_length(&self) -> Option<u64> {
        match self.framing {
            Framing::Length(left) => Some(left),
            Framing::Done => Some(0),
            _ => None,
        }
    }

    /// The connection, once the body has ended and the connection may carry another request.
    pub fn into_reusable(self) -> Option<Box<Connection>> {
        (self.framing == Framing::Done && self.keep_alive && self.connection.buffer.is_empty())
            .then_some(self.connection)
    }

    /// The body's next bytes; `None` at its end.
    pub fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            match self.step() {
                Ok(Step::Data(bytes)) => return Poll::Ready(Some(Ok(bytes))),
                Ok(Step::End) => return Poll::Ready(None),
                Ok(Step::Continue) => continue,
                Ok(Step::Read) => {}
                Err(error) => {
                    self.keep_alive = false;
                    return Poll::Ready(Some(Err(error)));
                }
            }
            let read = ready!(self.connection.poll_read(cx));
            match read {
                Ok(0) if self.framing == Framing::Close => {
                    self.framing = Framing::Done;
                    self.keep_alive = false;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return Poll::Ready(Some(Err(
                        self.fail("the connection closed before the answer's end")
                    )))
                }
                Ok(_) => {}
                Err(e) => return Poll::Ready(Some(Err(self.fail(&e.to_string())))),
            }
        }
    }

    fn fail(&mut self, why: &str) -> BodyError {
        self.keep_alive = false;
        BodyError(why.to_string())
    }

    /// One step on what the buffer holds.
    fn step(&mut self) -> Result<Step, BodyError> {
        let buffer = &mut self.connection.buffer;
        match self.framing {
            Framing::Done => Ok(Step::End),
            Framing::Close if buffer.is_empty() => Ok(Step::Read),
            Framing::Close => Ok(Step::Data(buffer.split().freeze())),
            Framing::Length(left) => {
                let (bytes, left) = framing::take(buffer, left);
                self.framing = match left {
                    0 => Framing::Done,
                    left => Framing::Length(left),
                };
                Ok(bytes.map_or(Step::Read, Step::Data))
            }
            Framing::Chunked(mut state) => {
                let step = framing::chunked_step(buffer, &mut state)
                    .map_err(|e| BodyError(format!("the answer has {e}")))?;
                self.framing = match step {
                    Step::End => Framing::Done,
                    _ => Framing::Chunked(state),
                };
                Ok(step)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn head(wire: &[u8]) -> Head {
        parse_head(&mut BytesMut::from(wire)).unwrap().unwrap()
    }

    #[test]
    fn heads_parse_and_say_how_their_body_ends() {
        let ok = head(b"HTTP/1.1 200 OK\r\ncontent-length: 12\r\nretry-after: 1\r\nretry-after: 2\r\n\r\nbody");
        assert_eq!(ok.status, StatusCode::OK);
        assert_eq!(ok.headers.get_all("retry-after").iter().count(), 2);
        assert_eq!(framing(&ok, false).unwrap(), Framing::Length(12));
        assert_eq!(framing(&ok, true).unwrap(), Framing::Done);
        let chunked = head(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n");
        assert_eq!(
            framing(&chunked, false).unwrap(),
            Framing::Chunked(Chunked::Size)
        );
        let open = head(b"HTTP/1.0 200 OK\r\n\r\n");
        assert_eq!(framing(&open, false).unwrap(), Framing::Close);
        assert!(open.wire.closes(open.version));
        let twice = head(b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n");
        assert!(framing(&twice, false).is_err());
        let agreeing = head(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\ncontent-length:  3 \r\n\r\n");
        assert_eq!(framing(&agreeing, false).unwrap(), Framing::Length(3));
        let invalid = head(b"HTTP/1.1 200 OK\r\ncontent-length: 3x\r\n\r\n");
        assert!(framing(&invalid, false).is_err());
        // The last coding of the last transfer-encoding decides; any other ends with the connection.
        let gzip = head(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: gzip\r\n\r\n",
        );
        assert_eq!(framing(&gzip, false).unwrap(), Framing::Close);
        let kept = head(b"HTTP/1.0 200 OK\r\nConnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n");
        assert!(!kept.wire.closes(kept.version));
        let closing = head(b"HTTP/1.1 200 OK\r\nconnection: upgrade, Close\r\n\r\n");
        assert!(closing.wire.closes(closing.version));
        assert!(!ok.wire.closes(ok.version));
        assert!(
            closing.headers.is_empty(),
            "framing headers stay out of the map"
        );
        let none = head(b"HTTP/1.1 204 No Content\r\n\r\n");
        assert_eq!(framing(&none, false).unwrap(), Framing::Done);
        assert!(
            parse_head(&mut BytesMut::from(&b"HTTP/1.1 200 OK\r\ncontent-"[..]))
                .unwrap()
                .is_none()
        );
        assert!(parse_head(&mut BytesMut::from(&b"SSH-2.0-OpenSSH\r\n\r\n"[..])).is_err());
    }

    #[test]
    fn a_head_keeps_the_headers_the_gateway_reads_and_leaves_out_the_rest() {
        let azure = head(
            b"HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\n\
              apim-request-id: 4e52\r\nx-ms-region: Sweden Central\r\nRetry-After-Ms: 1500\r\n\
              x-ratelimit-remaining-requests: 0\r\nx-ratelimit-remaining-tokens: 12\r\n\
              x-ms-client-request-id: 4e52\r\ncontent-length: 2\r\n\r\n{}",
        );
        let mut kept: Vec<&str> = azure.headers.keys().map(|name| name.as_str()).collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            [
                "content-type",
                "retry-after-ms",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-remaining-tokens"
            ]
        );
        assert_eq!(
            outcome::retry_after(&azure.headers),
            Some(std::time::Duration::from_millis(1500))
        );
    }

    #[test]
    fn requests_carry_their_length_and_no_framing_of_their_own() {
        let request = Request::post("/v1/chat?x=1")
            .header("host", "upstream")
            .header("content-length", "999")
            .body(Bytes::from_static(b"{}"))
            .unwrap();
        let (head, body) = encode(&request, INLINE_BODY);
        assert_eq!(
            String::from_utf8(head).unwrap(),
            "POST /v1/chat?x=1 HTTP/1.1\r\nhost: upstream\r\ncontent-length: 2\r\n\r\n{}"
        );
        assert!(body.is_empty());
        let large = Request::post("/")
            .body(Bytes::from(vec![b'x'; INLINE_BODY + 1]))
            .unwrap();
        let (head, body) = encode(&large, INLINE_BODY);
        assert!(head.ends_with(b"content-length: 4097\r\n\r\n"));
        assert_eq!(body.len(), INLINE_BODY + 1);
        let (head, body) = encode(&large, TLS_ONE_WRITE);
        assert!(head.ends_with(&[b'x'; INLINE_BODY + 1]));
        assert!(body.is_empty());
    }

    #[test]
    fn a_request_to_a_full_url_goes_out_in_origin_form_with_its_host() {
        let line = |uri: &str| {
            let request = Request::get(uri).body(Bytes::new()).unwrap();
            let head = String::from_utf8(encode(&request, INLINE_BODY).0).unwrap();
            head.lines().take(2).collect::<Vec<_>>().join("|")
        };
        assert_eq!(
            line("https://a.example:443/x?q=1"),
            "GET /x?q=1 HTTP/1.1|host: a.example"
        );
        assert_eq!(
            line("http://a.example:8080/x"),
            "GET /x HTTP/1.1|host: a.example:8080"
        );
        assert_eq!(line("http://a.example"), "GET / HTTP/1.1|host: a.example");
        let named = Request::get("http://a.example/x")
            .header("host", "b.example")
            .body(Bytes::new())
            .unwrap();
        let head = String::from_utf8(encode(&named, INLINE_BODY).0).unwrap();
        assert_eq!(head, "GET /x HTTP/1.1\r\nhost: b.example\r\n\r\n");
    }

    /// A raw upstream that takes one request at a time in small, slow reads, so the gateway's
    /// writes end partway, and answers each with the bytes it got.
    async fn slow_echo() -> std::net::SocketAddr {
        use std::time::Duration;
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpSocket::new_v4().unwrap();
        listener.set_recv_buffer_size(8 * 1024).unwrap();
        listener.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = listener.listen(1).unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            loop {
                let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
                    let mut chunk = [0u8; 1024];
                    match socket.read(&mut chunk).await.unwrap() {
                        0 => return,
                        n => got.extend_from_slice(&chunk[..n]),
                    }
                    continue;
                };
                let head = String::from_utf8_lossy(&got[..end]).to_string();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length: "))
                    .map_or(0, |n| n.parse().unwrap());
                while got.len() < end + 4 + length {
                    let mut chunk = [0u8; 16 * 1024];
                    let n = socket.read(&mut chunk).await.unwrap();
                    assert!(n > 0, "the request ended early");
                    got.extend_from_slice(&chunk[..n]);
                    tokio::time::sleep(Duration::from_micros(200)).await;
                }
                let request: Vec<u8> = got.drain(..end + 4 + length).collect();
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n",
                    request.len()
                );
                socket.write_all(answer.as_bytes()).await.unwrap();
                socket.write_all(&request).await.unwrap();
            }
        });
        address
    }

    #[tokio::test]
    async fn request_bodies_of_every_size_arrive_whole_behind_their_head() {
        use std::time::Duration;
        let address = slow_echo().await;
        // Small socket buffers on both ends: the larger bodies take many writes.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(8 * 1024).unwrap();
        let socket = socket.connect(address).await.unwrap();
        let mut connection = Connection::new(Io::Plain(socket));
        let sizes = [0, 100, INLINE_BODY, INLINE_BODY + 1, 70_000, 1_000_000];
        for (round, size) in sizes.into_iter().enumerate() {
            let body: Vec<u8> = (0..size).map(|i| (i * 7 + round) as u8).collect();
            let request = Request::post("/echo")
                .header("host", "upstream")
                .body(Bytes::from(body.clone()))
                .unwrap();
            let (expected_head, _) = encode(&request, 0);
            let response = tokio::time::timeout(Duration::from_secs(10), connection.send(request))
                .await
                .expect("answered in time")
                .unwrap_or_else(|_| panic!("the request of {size} bytes was sent"));
            let mut body_read = response.into_body();
            let mut echoed = Vec::new();
            while let Some(data) = std::future::poll_fn(|cx| body_read.poll_data(cx)).await {
                echoed.extend_from_slice(&data.unwrap());
            }
            assert_eq!(echoed.len(), expected_head.len() + size, "{size} bytes");
            assert_eq!(
                &echoed[..expected_head.len()],
                &expected_head[..],
                "{size} bytes"
            );
            assert!(
                echoed[expected_head.len()..] == body[..],
                "the body of {size} bytes"
            );
            connection = body_read
                .into_reusable()
                .expect("the connection is reusable");
        }
    }
}
