//! HTTP/1.1 spoken byte by byte over a plain TCP socket: exact bytes out, the answers read back
//! as they came, every wait bounded, for tests of how a port reads requests and holds
//! connections.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

/// How long a test waits for an answer it expects before it fails.
pub const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// One answer as it came over the wire.
#[derive(Debug)]
pub struct RawAnswer {
    pub status: u16,
    /// The status line and header lines, without the blank line.
    pub head: String,
    /// The body, de-chunked.
    pub body: Vec<u8>,
}

impl RawAnswer {
    /// The first value of the header `name` (case-insensitive), or "".
    pub fn header(&self, name: &str) -> &str {
        self.head
            .split("\r\n")
            .skip(1)
            .filter_map(|line| line.split_once(':'))
            .find(|(n, _)| n.trim().eq_ignore_ascii_case(name))
            .map_or("", |(_, v)| v.trim())
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The `error.code` of a JSON error answer, or "".
    pub fn code(&self) -> String {
        serde_json::from_slice::<serde_json::Value>(&self.body)
            .ok()
            .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
            .unwrap_or_default()
    }
}

/// A client connection and what it has read but not yet taken as an answer.
pub struct Conn {
    stream: TcpStream,
    unread: Vec<u8>,
}

/// How a wait for the server to close ended.
#[derive(Debug)]
pub enum Ending {
    /// The server closed (or reset) the connection; what it sent before, as it came.
    Closed(Vec<u8>),
    /// Still open at the deadline; what it sent until then.
    Open(Vec<u8>),
}

impl Conn {
    pub async fn open(addr: SocketAddr) -> Conn {
        let stream = tokio::time::timeout(ANSWER_WITHIN, TcpStream::connect(addr))
            .await
            .expect("connects in time")
            .expect("connects");
        Conn {
            stream,
            unread: Vec::new(),
        }
    }

    /// A connection whose receive buffer is as small as the kernel allows, so an answer the
    /// test does not read soon fills it and the sender's writes wait.
    pub async fn open_with_small_window(addr: SocketAddr) -> Conn {
        let socket = TcpSocket::new_v4().expect("a socket");
        socket.set_recv_buffer_size(4096).expect("a small buffer");
        let stream = tokio::time::timeout(ANSWER_WITHIN, socket.connect(addr))
            .await
            .expect("connects in time")
            .expect("connects");
        Conn {
            stream,
            unread: Vec::new(),
        }
    }

    /// Writes `bytes` whole. An error means the server already closed, which some tests expect,
    /// so it is handed back rather than failing here.
    pub async fn send(&mut self, bytes: impl AsRef<[u8]>) -> std::io::Result<()> {
        match tokio::time::timeout(ANSWER_WITHIN, self.stream.write_all(bytes.as_ref())).await {
            Ok(result) => result,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the server does not take the request",
            )),
        }
    }

    /// The next whole answer, failing the test if none arrives within [`ANSWER_WITHIN`].
    pub async fn answer(&mut self) -> RawAnswer {
        let deadline = Instant::now() + ANSWER_WITHIN;
        loop {
            if let Some((answer, used)) = parse_answer(&self.unread, false) {
                self.unread.drain(..used);
                return answer;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let mut chunk = [0u8; 16 * 1024];
            let read = tokio::time::timeout(left, self.stream.read(&mut chunk)).await;
            match read {
                Ok(Ok(n)) if n > 0 => self.unread.extend_from_slice(&chunk[..n]),
                Ok(_) => {
                    if let Some((answer, used)) = parse_answer(&self.unread, true) {
                        self.unread.drain(..used);
                        return answer;
                    }
                    panic!(
                        "the connection closed before a whole answer: {:?}",
                        String::from_utf8_lossy(&self.unread)
                    );
                }
                Err(_) => panic!(
                    "no whole answer within {ANSWER_WITHIN:?}: {:?}",
                    String::from_utf8_lossy(&self.unread)
                ),
            }
        }
    }

    /// Reads until an answer's head (status line and headers) is in, and hands it back; what
    /// came after it stays unread.
    pub async fn head(&mut self) -> String {
        let deadline = Instant::now() + ANSWER_WITHIN;
        loop {
            if let Some(end) = find(&self.unread, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&self.unread[..end]).into_owned();
                self.unread.drain(..end + 4);
                return head;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            let mut chunk = [0u8; 1024];
            match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => self.unread.extend_from_slice(&chunk[..n]),
                other => panic!(
                    "no answer head ({other:?}): {:?}",
                    String::from_utf8_lossy(&self.unread)
                ),
            }
        }
    }

    /// Reads until the server closes the connection or `within` passes.
    pub async fn until_closed(&mut self, within: Duration) -> Ending {
        let deadline = Instant::now() + within;
        let mut got = std::mem::take(&mut self.unread);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut chunk = [0u8; 16 * 1024];
            match tokio::time::timeout(left, self.stream.read(&mut chunk)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return Ending::Closed(got),
                Ok(Ok(n)) => got.extend_from_slice(&chunk[..n]),
                Err(_) => return Ending::Open(got),
            }
        }
    }

    /// Every answer the server sends before it closes the connection, failing the test if it
    /// is still open after [`ANSWER_WITHIN`].
    pub async fn answers_then_close(&mut self) -> Vec<RawAnswer> {
        match self.until_closed(ANSWER_WITHIN).await {
            Ending::Closed(bytes) => answers(&bytes),
            Ending::Open(bytes) => panic!(
                "the connection is still open after {ANSWER_WITHIN:?}, having sent {:?}",
                String::from_utf8_lossy(&bytes)
            ),
        }
    }

    /// Waits `quiet` for a byte from the server: true if nothing came and it is still open.
    pub async fn stays_open_and_silent(&mut self, quiet: Duration) -> bool {
        matches!(self.until_closed(quiet).await, Ending::Open(bytes) if bytes.is_empty())
    }
}

/// Every whole answer in `bytes`, the last one read to the end if it has no length.
pub fn answers(bytes: &[u8]) -> Vec<RawAnswer> {
    let mut out = Vec::new();
    let mut rest = bytes;
    while let Some((answer, used)) = parse_answer(rest, true) {
        out.push(answer);
        rest = &rest[used..];
    }
    out
}

/// The status codes of `answers`, in order.
pub fn statuses(answers: &[RawAnswer]) -> Vec<u16> {
    answers.iter().map(|a| a.status).collect()
}

/// One answer at the start of `bytes` and how many bytes it took, if it is all there. An answer
/// without a length ends at the connection's end, so it is whole only when `closed`.
fn parse_answer(bytes: &[u8], closed: bool) -> Option<(RawAnswer, usize)> {
    let head_end = find(bytes, b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&bytes[..head_end]).into_owned();
    let status = head.split(' ').nth(1)?.parse().ok()?;
    let mut answer = RawAnswer {
        status,
        head,
        body: Vec::new(),
    };
    let body_start = head_end + 4;
    if (100..200).contains(&status) || status == 204 || status == 304 {
        return Some((answer, body_start));
    }
    if answer
        .header("transfer-encoding")
        .eq_ignore_ascii_case("chunked")
    {
        let (body, used) = dechunk(&bytes[body_start..])?;
        answer.body = body;
        return Some((answer, body_start + used));
    }
    if let Ok(length) = answer.header("content-length").parse::<usize>() {
        let body = bytes.get(body_start..body_start + length)?;
        answer.body = body.to_vec();
        return Some((answer, body_start + length));
    }
    if !closed {
        return None;
    }
    answer.body = bytes[body_start..].to_vec();
    Some((answer, bytes.len()))
}

/// A chunked body at the start of `bytes`, de-chunked, and how many bytes it took.
fn dechunk(bytes: &[u8]) -> Option<(Vec<u8>, usize)> {
    let mut body = Vec::new();
    let mut at = 0;
    loop {
        let line_end = at + find(&bytes[at..], b"\r\n")?;
        let line = std::str::from_utf8(&bytes[at..line_end]).ok()?;
        let size_text = line.split(';').next()?.trim();
        let size = usize::from_str_radix(size_text, 16).ok()?;
        at = line_end + 2;
        if size == 0 {
            let trailer_end = at + find(&bytes[at..], b"\r\n")?;
            // Trailers are not expected; the last chunk ends at the next blank line.
            return Some((body, trailer_end + 2));
        }
        body.extend_from_slice(bytes.get(at..at + size)?);
        at += size + 2;
        if at > bytes.len() {
            return None;
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
