//! HTTP/1.1 message framing of the gateway's own upstream client: reading a socket onto a
//! connection's buffer, the chunked transfer coding's decoding, bodies of a known length, and
//! when an answer ends its connection. (Client connections are hyper's: `server`.)

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use http::header::HeaderName;
use http::{header, HeaderMap, Version};
use tokio::io::{AsyncRead, ReadBuf};

/// The most one read takes.
const MAX_READ: usize = 64 * 1024;
/// A read's size when the thread's scratch space cannot be had (only while the thread exits).
const FALLBACK_READ: usize = 4096;

thread_local! {
    /// Where this thread's socket reads land before they are copied to their connection.
    static SCRATCH: std::cell::RefCell<Box<[u8]>> =
        std::cell::RefCell::new(vec![0; MAX_READ].into_boxed_slice());
}

/// Reads what `io` has onto `buffer`; `Ok(0)` is the connection's end. The read lands in the
/// thread's scratch space first and only what arrived is copied to the connection, so one read
/// takes up to 64 KiB and a connection waiting for its next bytes holds no read buffer of that
/// size.
pub fn poll_read_into(
    io: &mut (impl AsyncRead + Unpin),
    buffer: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    let mut through = |scratch: &mut [u8]| {
        let mut read = ReadBuf::new(scratch);
        ready!(Pin::new(&mut *io).poll_read(cx, &mut read))?;
        let filled = read.filled();
        // When nothing waits in the buffer, what arrived goes into a new one of its own size,
        // not into one of the size this connection's buffer once grew to: a stream holds its
        // last read's buffer between events (5,000 streams held 3 MB more, BENCHMARKS.md).
        match buffer.is_empty() {
            true => *buffer = BytesMut::from(filled),
            false => buffer.extend_from_slice(filled),
        }
        Poll::Ready(Ok(filled.len()))
    };
    let read = SCRATCH.try_with(|scratch| match scratch.try_borrow_mut() {
        Ok(mut scratch) => through(&mut scratch),
        Err(_) => through(&mut [0; FALLBACK_READ]),
    });
    read.unwrap_or_else(|_| through(&mut [0; FALLBACK_READ]))
}

/// Where the decoding of a chunked body stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunked {
    /// Before a chunk-size line.
    Size,
    /// Inside a chunk, this many bytes left.
    Data(u64),
    /// After a chunk's data, before its CRLF.
    DataEnd,
    /// After the last chunk: trailer lines until an empty one.
    Trailers,
}

/// What one decoding step gave.
#[derive(Debug)]
pub enum Step {
    Data(Bytes),
    /// The body has ended.
    End,
    /// The state moved on without data; step again.
    Continue,
    /// More bytes are needed.
    Read,
}

/// Chunk-size and trailer lines longer than this are refused.
const MAX_LINE: usize = 4096;

/// One step of chunked decoding on what `buffer` holds; `state` moves on.
pub fn chunked_step(buffer: &mut BytesMut, state: &mut Chunked) -> Result<Step, &'static str> {
    match *state {
        Chunked::Size => {
            let Some(line) = line_length(buffer)? else {
                return Ok(Step::Read);
            };
            let size = chunk_size(&buffer[..line.text]).ok_or("an invalid chunk size")?;
            buffer.advance(line.whole);
            *state = match size {
                0 => Chunked::Trailers,
                n => Chunked::Data(n),
            };
            Ok(Step::Continue)
        }
        Chunked::Data(left) => {
            let (bytes, left) = take(buffer, left);
            *state = match left {
                0 => Chunked::DataEnd,
                left => Chunked::Data(left),
            };
            Ok(bytes.map_or(Step::Read, Step::Data))
        }
        Chunked::DataEnd => match line_length(buffer)? {
            None => Ok(Step::Read),
            Some(line) if line.text == 0 => {
                buffer.advance(line.whole);
                *state = Chunked::Size;
                Ok(Step::Continue)
            }
            Some(_) => Err("a chunk that does not end where its size said"),
        },
        Chunked::Trailers => match line_length(buffer)? {
            None => Ok(Step::Read),
            Some(line) => {
                buffer.advance(line.whole);
                match line.text {
                    0 => Ok(Step::End),
                    _ => Ok(Step::Continue),
                }
            }
        },
    }
}

/// Up to `left` bytes from the buffer, and how many are left after them.
pub fn take(buffer: &mut BytesMut, left: u64) -> (Option<Bytes>, u64) {
    if buffer.is_empty() {
        return (None, left);
    }
    let n = usize::try_from(left)
        .unwrap_or(usize::MAX)
        .min(buffer.len());
    let bytes = match n == buffer.len() {
        true => buffer.split(),
        false => buffer.split_to(n),
    };
    (Some(bytes.freeze()), left - n as u64)
}

/// The line at a buffer's start: its text's length, and its length with its end (CRLF or LF).
struct Line {
    text: usize,
    whole: usize,
}

/// The line a buffer begins with, read in place (the caller skips it once read); `None` until
/// its end arrived.
fn line_length(buffer: &BytesMut) -> Result<Option<Line>, &'static str> {
    let Some(end) = memchr::memchr(b'\n', buffer) else {
        if buffer.len() > MAX_LINE {
            return Err("a chunk line longer than 4 KiB");
        }
        return Ok(None);
    };
    let text = match end > 0 && buffer[end - 1] == b'\r' {
        true => end - 1,
        false => end,
    };
    Ok(Some(Line {
        text,
        whole: end + 1,
    }))
}

/// A chunk-size line's size: hexadecimal digits, blanks around them, and any chunk extensions
/// after a `;` ignored. `None` for anything else, or a size past `u64`.
fn chunk_size(line: &[u8]) -> Option<u64> {
    let digits = line.split(|b| *b == b';').next()?.trim_ascii();
    if digits.is_empty() {
        return None;
    }
    digits.iter().try_fold(0u64, |size, &digit| {
        let value = (digit as char).to_digit(16)?;
        size.checked_mul(16)?.checked_add(u64::from(value))
    })
}

/// Whether a message with these headers ends its connection after this exchange: [`Wire`]'s
/// rule, for a head already in a map.
pub fn wants_close(headers: &HeaderMap, version: Version) -> bool {
    let mut wire = Wire::default();
    for value in headers.get_all(header::CONNECTION) {
        wire.read(Framed::Connection, value.as_bytes());
    }
    wire.closes(version)
}

/// A header that frames a message or says whether its connection stays open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framed {
    Length,
    Coding,
    Connection,
}

impl Framed {
    pub const ALL: [Framed; 3] = [Framed::Length, Framed::Coding, Framed::Connection];

    pub fn name(self) -> HeaderName {
        match self {
            Framed::Length => header::CONTENT_LENGTH,
            Framed::Coding => header::TRANSFER_ENCODING,
            Framed::Connection => header::CONNECTION,
        }
    }
}

/// What a message's framing headers said, read as its head is parsed, so nothing looks them up
/// in a header map afterwards: the one `content-length` (repeats must agree), whether the last
/// transfer coding is `chunked`, and whether the connection ends.
#[derive(Debug)]
pub struct Wire {
    /// The one `content-length` (repeats must agree); `Err` when it cannot be used.
    pub length: Result<Option<u64>, &'static str>,
    /// A `transfer-encoding` was there.
    pub coded: bool,
    /// The last transfer coding of the last `transfer-encoding` is `chunked`.
    pub chunked: bool,
    /// A `connection` token `close`, or `keep-alive`.
    close: bool,
    keep_alive: bool,
}

impl Default for Wire {
    fn default() -> Wire {
        Wire {
            length: Ok(None),
            coded: false,
            chunked: false,
            close: false,
            keep_alive: false,
        }
    }
}

impl Wire {
    /// Takes in one framing header's value, in the order the head gives them.
    pub fn read(&mut self, framed: Framed, value: &[u8]) {
        // As `HeaderValue::to_str` reads values: visible ASCII only.
        let text = std::str::from_utf8(value).ok().filter(|t| t.is_ascii());
        match framed {
            Framed::Length => self.length = self.length.and_then(|known| length(text, known)),
            Framed::Coding => {
                self.coded = true;
                self.chunked = text
                    .and_then(|t| t.rsplit(',').next())
                    .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
            }
            Framed::Connection => {
                for token in text.into_iter().flat_map(|t| t.split(',')).map(str::trim) {
                    self.close |= token.eq_ignore_ascii_case("close");
                    self.keep_alive |= token.eq_ignore_ascii_case("keep-alive");
                }
            }
        }
    }

    /// Whether the message ends its connection: HTTP/1.0 unless `keep-alive`, later versions
    /// when `close`.
    pub fn closes(&self, version: Version) -> bool {
        match version {
            Version::HTTP_10 => !self.keep_alive,
            _ => self.close,
        }
    }
}

/// A `content-length` value after `known` (the one read before, if any).
fn length(text: Option<&str>, known: Option<u64>) -> Result<Option<u64>, &'static str> {
    // Digits only: `parse` would take a sign (`+62`), which no HTTP peer may send.
    let length = text
        .map(str::trim)
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse::<u64>().ok())
        .ok_or("an invalid content-length")?;
    match known {
        Some(before) if before != length => Err("differing content-length headers"),
        _ => Ok(Some(length)),
    }
}

/// Test support for the HTTP/1.1 readers of both ports: `bytes` damaged one to three times, by a
/// cut, an overwritten byte, random noise, or a piece that breaks framing (a size too large,
/// negative or not hexadecimal, an early blank line, a second length) put in at random.
#[cfg(test)]
pub(crate) fn damage(rng: &mut impl rand::Rng, bytes: &mut Vec<u8>) {
    const BAD: [&[u8]; 5] = [
        b"ffffffffffffffffffff\r\n",
        b"-1\r\n",
        b"zz\r\n",
        b"\r\n\r\n",
        b"content-length: 9\r\n",
    ];
    for _ in 0..rng.random_range(1..=3) {
        let at = rng.random_range(0..=bytes.len());
        match rng.random_range(0..4) {
            0 => bytes.truncate(at),
            1 if at < bytes.len() => bytes[at] = rng.random(),
            2 => {
                let noise: Vec<u8> = (0..rng.random_range(1..40)).map(|_| rng.random()).collect();
                bytes.splice(at..at, noise);
            }
            _ => {
                let bad = BAD[rng.random_range(0..BAD.len())];
                bytes.splice(at..at, bad.iter().copied());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use http::HeaderValue;

    use super::*;

    fn decode(wire: &[u8]) -> Result<Vec<u8>, &'static str> {
        let mut buffer = BytesMut::from(wire);
        let mut state = Chunked::Size;
        let mut out = Vec::new();
        loop {
            match chunked_step(&mut buffer, &mut state)? {
                Step::Data(bytes) => out.extend_from_slice(&bytes),
                Step::Continue => {}
                Step::End => return Ok(out),
                Step::Read => return Err("incomplete"),
            }
        }
    }

    #[test]
    fn chunked_bodies_decode_with_extensions_and_trailers() {
        let wire = b"5;name=x\r\nhello\r\n7\r\n, world\r\n0\r\ntrailer: yes\r\n\r\n";
        assert_eq!(decode(wire).unwrap(), b"hello, world");
    }

    #[test]
    fn a_chunk_longer_than_its_size_is_an_error() {
        assert!(decode(b"3\r\nhello\r\n0\r\n\r\n").is_err());
        assert!(decode(b"zz\r\n").is_err());
        assert!(decode(&[b'1'; 5000]).is_err());
    }

    #[test]
    fn chunk_sizes_are_hexadecimal_with_blanks_and_extensions_allowed() {
        assert_eq!(chunk_size(b"1A"), Some(26));
        assert_eq!(chunk_size(b" ff ;ext=1"), Some(255));
        assert_eq!(chunk_size(b"0"), Some(0));
        assert_eq!(chunk_size(b"ffffffffffffffff"), Some(u64::MAX));
        for bad in [
            &b""[..],
            b";x",
            b"+5",
            b"-1",
            b"g",
            b"1 2",
            b"10000000000000000",
        ] {
            assert_eq!(chunk_size(bad), None, "{:?}", String::from_utf8_lossy(bad));
        }
        // A chunk-size line that ends in a bare LF reads as one that ends in CRLF.
        assert_eq!(decode(b"5\nhello\n0\n\n").unwrap(), b"hello");
    }

    #[test]
    fn a_length_body_stops_at_its_length() {
        let mut buffer = BytesMut::from(&b"abcdef"[..]);
        let (bytes, left) = take(&mut buffer, 3);
        assert_eq!(&bytes.unwrap()[..], b"abc");
        assert_eq!(left, 0);
        assert_eq!(&buffer[..], b"def");
    }

    #[test]
    fn close_is_read_from_either_version_s_rules() {
        let mut headers = HeaderMap::new();
        assert!(!wants_close(&headers, Version::HTTP_11));
        assert!(wants_close(&headers, Version::HTTP_10));
        headers.insert(
            header::CONNECTION,
            HeaderValue::from_static("Keep-Alive, Close"),
        );
        assert!(wants_close(&headers, Version::HTTP_11));
        headers.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        assert!(!wants_close(&headers, Version::HTTP_10));
    }

    /// A head's framing headers, in order, read into a [`Wire`].
    fn wire(fields: &[(&str, &str)]) -> Wire {
        let mut wire = Wire::default();
        for (name, value) in fields {
            let name = HeaderName::from_bytes(name.as_bytes()).unwrap();
            let framed = Framed::ALL.into_iter().find(|f| f.name() == name);
            wire.read(framed.unwrap(), value.as_bytes());
        }
        wire
    }

    #[test]
    fn lengths_must_agree_and_the_last_coding_says_chunked() {
        assert_eq!(wire(&[]).length, Ok(None));
        let agreeing = wire(&[("content-length", "12"), ("Content-Length", " 12")]);
        assert_eq!(agreeing.length, Ok(Some(12)));
        let differing = wire(&[("content-length", "12"), ("content-length", "13")]);
        assert!(differing.length.is_err());
        assert!(wire(&[("content-length", "-1")]).length.is_err());
        assert!(wire(&[("content-length", "1\u{e9}")]).length.is_err());
        let gzip_chunked = wire(&[("transfer-encoding", "gzip, chunked")]);
        assert!(gzip_chunked.coded && gzip_chunked.chunked);
        let chunked_gzip = wire(&[("transfer-encoding", "chunked, gzip")]);
        assert!(chunked_gzip.coded && !chunked_gzip.chunked);
        let last_decides = wire(&[
            ("transfer-encoding", "chunked"),
            ("transfer-encoding", "gzip"),
        ]);
        assert!(!last_decides.chunked);
        assert!(!wire(&[]).coded);
    }

    #[test]
    fn a_wire_closes_by_its_version_s_rule() {
        for (connection, version, closes) in [
            (None, Version::HTTP_11, false),
            (None, Version::HTTP_10, true),
            (Some("Keep-Alive, Close"), Version::HTTP_11, true),
            (Some("keep-alive"), Version::HTTP_10, false),
            (Some("upgrade"), Version::HTTP_10, true),
            (Some(" close "), Version::HTTP_11, true),
        ] {
            let mut read = Wire::default();
            if let Some(value) = connection {
                read.read(Framed::Connection, value.as_bytes());
            }
            assert_eq!(read.closes(version), closes, "{connection:?} {version:?}");
        }
    }
}
