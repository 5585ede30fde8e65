//! The access log: one JSON line per request on stderr (or the file `ONEDOOR_ACCESS_LOG`
//! names; `off` for none), written by a thread of its own through a buffered writer, so the
//! request path pays for a serialisation and a channel send, never for a write. Prompts,
//! completions and keys are never in it: only ids, names and numbers.

use std::io::Write;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::OnceLock;

use onedoor_usage::UsageRecord;
use serde::Serialize;

/// Where the log goes: unset or `stderr`, `off`, or a file path lines are appended to.
pub const DESTINATION_VAR: &str = "ONEDOOR_ACCESS_LOG";

/// Lines waiting for the writer; past this the log drops lines rather than slow requests.
const QUEUE: usize = 16_384;
/// A line with every field filled and long names is about this long.
const LINE_BYTES: usize = 640;

/// One request's line.
#[derive(Serialize)]
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

/// Queues `line` for the writer; a full queue (stderr blocked) drops it.
pub fn write(line: &Line<'_>) {
    let Some(sender) = writer() else {
        return;
    };
    // Sized for a whole line, so writing it never grows the buffer.
    let mut text = Vec::with_capacity(LINE_BYTES);
    if serde_json::to_writer(&mut text, line).is_err() {
        return;
    }
    text.push(b'\n');
    if let Err(TrySendError::Full(_)) = sender.try_send(text) {
        tracing::debug!("access log queue full: a line was dropped");
    }
}

fn writer() -> Option<&'static SyncSender<Vec<u8>>> {
    static WRITER: OnceLock<Option<SyncSender<Vec<u8>>>> = OnceLock::new();
    WRITER
        .get_or_init(|| {
            let out = destination()?;
            let (sender, inbox) = sync_channel(QUEUE);
            std::thread::Builder::new()
                .name("onedoor-access-log".into())
                .spawn(move || drain(inbox, out))
                .ok()
                .map(|_| sender)
        })
        .as_ref()
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

/// Writes lines as they come, flushing whenever the queue is empty.
fn drain(inbox: Receiver<Vec<u8>>, out: Box<dyn Write + Send>) {
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, out);
    while let Ok(line) = inbox.recv() {
        let _ = out.write_all(&line);
        while let Ok(line) = inbox.try_recv() {
            let _ = out.write_all(&line);
        }
        let _ = out.flush();
    }
}
