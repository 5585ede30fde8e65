//! The access log: one JSON line per request on stderr (or the file `ONEDOOR_ACCESS_LOG`
//! names; `off` for none), written by a thread of its own every 20 ms, so the request path pays
//! for a serialisation and a copy, never for a write or a wake-up. Prompts,
//! completions and keys are never in it: only ids, names and numbers.

use std::io::Write;
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use onedoor_usage::UsageRecord;

/// Where the log goes: unset or `stderr`, `off`, or a file path lines are appended to.
pub const DESTINATION_VAR: &str = "ONEDOOR_ACCESS_LOG";

/// Text waiting for the writer; past this the log drops lines rather than slow requests.
const MAX_PENDING: usize = 8 << 20;
/// Pending text past this wakes the writer before its next round.
const WAKE_AT: usize = 256 << 10;
/// How often the writer writes out what is pending: a line is in the log at most this late.
const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// A line with every field filled and long names is about this long.
const LINE_BYTES: usize = 640;

/// One request's line: a JSON object of these fields, in this order.
#[cfg_attr(test, derive(serde::Serialize))]
pub struct Line<'a> {
    pub ts_ms: u64,
    pub request_id: &'a str,
    pub tenant: Option<&'a str>,
    pub key_id: Option<&'a str>,
    pub alias: Option<&'a str>,
    pub backend: Option<&'a str>,
    pub region: Option<&'a str>,
    pub attempts: &'a str,
    pub status: u16,
    pub error: Option<&'a str>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cached_tokens: u64,
    pub tokens_source: Option<&'a str>,
    pub cost_usd: f64,
    pub duration_ms: u64,
    pub ttft_ms: Option<u64>,
    pub stream: bool,
    pub stream_cut: bool,
}

impl<'a> Line<'a> {
    /// The line of a request refused before a caller was known (no usage record).
    pub fn refused(
        request_id: &'a str,
        ts_ms: u64,
        status: u16,
        error: Option<&'a str>,
    ) -> Line<'a> {
        Line {
            ts_ms,
            request_id,
            tenant: None,
            key_id: None,
            alias: None,
            backend: None,
            region: None,
            attempts: "",
            status,
            error,
            input_tokens: 0,
            output_tokens: 0,
            cached_tokens: 0,
            tokens_source: None,
            cost_usd: 0.0,
            duration_ms: 0,
            ttft_ms: None,
            stream: false,
            stream_cut: false,
        }
    }

    /// The line of a request that became a usage record.
    pub fn of(record: &'a UsageRecord, error: Option<&'a str>) -> Line<'a> {
        Line {
            ts_ms: record.at_ms,
            request_id: &record.request_id,
            tenant: Some(&record.tenant),
            key_id: Some(&record.key_id),
            alias: Some(&record.alias),
            backend: record.backend.as_deref(),
            region: record.region.as_deref(),
            attempts: &record.attempts,
            status: record.status,
            error,
            input_tokens: record.tokens.input,
            output_tokens: record.tokens.output,
            cached_tokens: record.tokens.cached,
            tokens_source: Some(record.tokens.source.as_str()),
            cost_usd: record.cost_usd,
            duration_ms: record.duration_ms,
            ttft_ms: record.ttft_ms,
            stream: record.stream,
            stream_cut: record.stream_cut,
        }
    }
}

/// Appends `line` to the pending text; a full buffer (the destination blocked) drops it.
pub fn write(line: &Line<'_>) {
    let Some(log) = log() else {
        return;
    };
    SCRATCH.with_borrow_mut(|text| {
        text.clear();
        if encode(line, text).is_err() {
            return;
        }
        text.push(b'\n');
        log.append(text);
    });
}

/// Writes `line` as one JSON object: the bytes serde_json's derived serialisation gives (a test
/// holds them equal), without its work per field for names and numbers that need no escaping.
fn encode(line: &Line<'_>, text: &mut Vec<u8>) -> serde_json::Result<()> {
    let mut json = Json(text);
    json.raw(b"{\"ts_ms\":");
    json.number(line.ts_ms);
    json.raw(b",\"request_id\":");
    json.string(line.request_id)?;
    let names = [
        (&b",\"tenant\":"[..], line.tenant),
        (b",\"key_id\":", line.key_id),
        (b",\"alias\":", line.alias),
        (b",\"backend\":", line.backend),
        (b",\"region\":", line.region),
    ];
    for (key, value) in names {
        json.raw(key);
        json.optional_string(value)?;
    }
    json.raw(b",\"attempts\":");
    json.string(line.attempts)?;
    json.raw(b",\"status\":");
    json.number(u64::from(line.status));
    json.raw(b",\"error\":");
    json.optional_string(line.error)?;
    let counts = [
        (&b",\"input_tokens\":"[..], line.input_tokens),
        (b",\"output_tokens\":", line.output_tokens),
        (b",\"cached_tokens\":", line.cached_tokens),
    ];
    for (key, value) in counts {
        json.raw(key);
        json.number(value);
    }
    json.raw(b",\"tokens_source\":");
    json.optional_string(line.tokens_source)?;
    json.raw(b",\"cost_usd\":");
    serde_json::to_writer(&mut *json.0, &line.cost_usd)?;
    json.raw(b",\"duration_ms\":");
    json.number(line.duration_ms);
    json.raw(b",\"ttft_ms\":");
    match line.ttft_ms {
        Some(ms) => json.number(ms),
        None => json.raw(b"null"),
    }
    json.raw(b",\"stream\":");
    json.boolean(line.stream);
    json.raw(b",\"stream_cut\":");
    json.boolean(line.stream_cut);
    json.raw(b"}");
    Ok(())
}

struct Json<'t>(&'t mut Vec<u8>);

impl Json<'_> {
    fn raw(&mut self, bytes: &[u8]) {
        self.0.extend_from_slice(bytes);
    }

    fn number(&mut self, number: u64) {
        self.raw(itoa::Buffer::new().format(number).as_bytes());
    }

    fn boolean(&mut self, value: bool) {
        self.raw(if value { b"true" } else { b"false" });
    }

    /// Ids and names are copied as they are; a string with a quote, a backslash or a control
    /// character is escaped by serde_json.
    fn string(&mut self, text: &str) -> serde_json::Result<()> {
        let plain = text.bytes().fold(true, |plain, b| {
            plain & (b >= 0x20 && b != b'"' && b != b'\\')
        });
        if !plain {
            return serde_json::to_writer(&mut *self.0, text);
        }
        self.raw(b"\"");
        self.raw(text.as_bytes());
        self.raw(b"\"");
        Ok(())
    }

    fn optional_string(&mut self, text: Option<&str>) -> serde_json::Result<()> {
        match text {
            Some(text) => self.string(text),
            None => {
                self.raw(b"null");
                Ok(())
            }
        }
    }
}

/// Writes out every line appended so far (shutdown); the writer thread goes on.
pub fn flush() {
    if let Some(log) = log() {
        log.write_out();
    }
}

thread_local! {
    /// Each thread serialises into its own reused buffer: no allocation per line.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = std::cell::RefCell::new(Vec::with_capacity(LINE_BYTES));
}

/// Lines wait in one shared buffer, appended under a lock held for a copy; a writer thread
/// takes the whole buffer every [`FLUSH_EVERY`] (or once it passes [`WAKE_AT`]), so a request
/// never wakes a thread nor makes a system call for its line.
struct Log {
    pending: Mutex<Vec<u8>>,
    out: Mutex<Output>,
    writer: OnceLock<std::thread::Thread>,
}

/// The destination, and the buffer that takes the pending one's place while it is written out:
/// the lines that come meanwhile land in room already there, not in a buffer that grows again.
struct Output {
    to: Box<dyn Write + Send>,
    spare: Vec<u8>,
}

impl Log {
    /// A log writing to `to`, with room for [`WAKE_AT`] bytes of lines in each of its buffers.
    fn new(to: Box<dyn Write + Send>) -> Log {
        Log {
            pending: Mutex::new(Vec::with_capacity(WAKE_AT)),
            out: Mutex::new(Output {
                to,
                spare: Vec::with_capacity(WAKE_AT),
            }),
            writer: OnceLock::new(),
        }
    }

    fn append(&self, line: &[u8]) {
        let size = {
            let mut pending = lock(&self.pending);
            if pending.len() + line.len() > MAX_PENDING {
                drop(pending);
                tracing::debug!("access log buffer full: a line was dropped");
                return;
            }
            pending.extend_from_slice(line);
            pending.len()
        };
        if size >= WAKE_AT && size - line.len() < WAKE_AT {
            if let Some(writer) = self.writer.get() {
                writer.unpark();
            }
        }
    }

    /// Takes what is pending, the spare buffer in its place, and writes it to the destination.
    fn write_out(&self) {
        let mut out = lock(&self.out);
        let mut text = {
            let mut pending = lock(&self.pending);
            if pending.is_empty() {
                return;
            }
            std::mem::replace(&mut *pending, std::mem::take(&mut out.spare))
        };
        let _ = out.to.write_all(&text);
        let _ = out.to.flush();
        // Kept as the next spare, unless a stalled destination let it grow far beyond the usual.
        if text.capacity() <= 2 * WAKE_AT {
            text.clear();
            out.spare = text;
        }
    }
}

fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn log() -> Option<&'static Log> {
    static LOG: OnceLock<Option<&'static Log>> = OnceLock::new();
    *LOG.get_or_init(|| {
        let log: &'static Log = Box::leak(Box::new(Log::new(destination()?)));
        let writer = std::thread::Builder::new()
            .name("onedoor-access-log".into())
            .spawn(move || loop {
                std::thread::park_timeout(FLUSH_EVERY);
                log.write_out();
            })
            .ok()?;
        let _ = log.writer.set(writer.thread().clone());
        Some(log)
    })
}

fn destination() -> Option<Box<dyn Write + Send>> {
    match std::env::var(DESTINATION_VAR).ok().as_deref() {
        None | Some("" | "stderr") => Some(Box::new(std::io::stderr())),
        Some("off") => None,
        Some(path) => match std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            Ok(file) => Some(Box::new(file)),
            Err(error) => {
                tracing::error!(%error, path, "the access log file cannot be opened; logging to stderr");
                Some(Box::new(std::io::stderr()))
            }
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn line<'a>(text: &'a str, cost_usd: f64, filled: bool) -> Line<'a> {
        let some = |s: &'a str| filled.then_some(s);
        Line {
            ts_ms: 1_796_253_718_123,
            request_id: "019ae1f0c2b37a5d9e4f1a2b3c4d5e6f",
            tenant: some(text),
            key_id: some("key-1"),
            alias: some(text),
            backend: some("sweden"),
            region: some("swedencentral"),
            attempts: text,
            status: 429,
            error: some(text),
            input_tokens: 12,
            output_tokens: u64::MAX,
            cached_tokens: 0,
            tokens_source: some("measured"),
            cost_usd,
            duration_ms: 7,
            ttft_ms: filled.then_some(3),
            stream: filled,
            stream_cut: !filled,
        }
    }

    #[test]
    fn a_line_is_the_json_serde_would_write() {
        let texts = [
            "",
            "plain-name_1",
            "quote \" and backslash \\",
            "newline\n tab\t bell\u{7} escape\u{1b} nul\u{0}",
            "delete \u{7f}, accents é, cjk 漢字, emoji 🚪",
            "sweden=429 (retry-after 3s); france=ok",
        ];
        let costs = [0.0, 0.1, 1e-7, 123_456.789, f64::NAN, f64::INFINITY];
        for (text, cost) in texts.iter().zip(costs.iter().cycle()) {
            for filled in [true, false] {
                let line = line(text, *cost, filled);
                let mut ours = Vec::new();
                encode(&line, &mut ours).unwrap();
                let theirs = serde_json::to_vec(&line).unwrap();
                assert_eq!(
                    String::from_utf8(ours).unwrap(),
                    String::from_utf8(theirs).unwrap()
                );
            }
        }
    }

    /// A destination the test reads back.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            lock(&self.0).extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn lines_appended_while_the_writer_writes_are_all_written_in_order_into_reused_buffers() {
        let written = Shared::default();
        let log = Log::new(Box::new(written.clone()));
        let lines = 20_000;
        std::thread::scope(|scope| {
            let appending = scope.spawn(|| {
                for n in 0..lines {
                    log.append(format!("line {n}\n").as_bytes());
                }
            });
            while !appending.is_finished() {
                log.write_out();
            }
        });
        log.write_out();
        let text = String::from_utf8(lock(&written.0).clone()).unwrap();
        let expected: String = (0..lines).map(|n| format!("line {n}\n")).collect();
        assert!(text == expected, "lines lost or out of order");
        // Both buffers keep their room: the next lines grow nothing.
        assert!(lock(&log.pending).capacity() >= WAKE_AT);
        assert!(lock(&log.out).spare.capacity() >= WAKE_AT);
    }
}
