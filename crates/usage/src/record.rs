//! One finished request as the usage store keeps it: who asked, what answered, the tokens and
//! whether the upstream measured them or the gateway estimated them, the cost, and the timings.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Where a record's token numbers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The upstream's own usage block.
    Measured,
    /// The gateway counted: the upstream sent no usage (or the request never reached one).
    Estimated,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Measured => "measured",
            Source::Estimated => "estimated",
        }
    }
}

/// The tokens of one request. `cached` is the part of `input` the upstream served from its
/// prompt cache, `cache_write` the part it wrote to it (Anthropic's cache creation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    pub input: u64,
    pub output: u64,
    pub cached: u64,
    /// Absent from records journaled before it was counted: none.
    #[serde(default)]
    pub cache_write: u64,
    pub source: Source,
}

impl Tokens {
    pub fn total(&self) -> u64 {
        self.input.saturating_add(self.output)
    }
}

/// One request, start to end. The request id is the primary key in every store, so writing a
/// record twice (a journal replayed after a batch whose commit was not confirmed) keeps one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRecord {
    /// The `x-onedoor-request-id` of the answer.
    pub request_id: String,
    /// When the request arrived, in milliseconds since the Unix epoch.
    pub at_ms: u64,
    pub tenant: Arc<str>,
    pub key_id: Arc<str>,
    /// The model name the client asked for.
    pub alias: Arc<str>,
    /// The backend that produced the answer; `None` when none did.
    pub backend: Option<Arc<str>>,
    /// The deployment (Azure) or model (OpenAI, Anthropic) name sent upstream.
    pub model: Option<Arc<str>>,
    pub region: Option<Arc<str>>,
    /// The HTTP status the caller got.
    pub status: u16,
    pub tokens: Tokens,
    /// What the gateway estimated before sending (prompt plus completion budget), kept next to
    /// the measured numbers so reports can show how far estimates drift.
    pub estimated_tokens: u64,
    pub cost_usd: f64,
    /// Arrival to the last byte sent (for a stream, to its end).
    pub duration_ms: u64,
    /// Arrival to the first content byte sent; `None` when nothing was streamed.
    pub ttft_ms: Option<u64>,
    /// `backend=outcome,...` as `x-onedoor-attempts` carried it.
    pub attempts: String,
    pub stream: bool,
    /// The stream ended with an error event instead of its answer.
    pub stream_cut: bool,
    /// The error code the request ended with, whatever its status line said: a cut stream's is
    /// what cut it. `None` when it was answered.
    #[serde(default)]
    pub error: Option<String>,
    /// The requests a batch's record stands for (the lines of its input file); `None` for a
    /// record of one request.
    #[serde(default)]
    pub lines: Option<u64>,
}

impl UsageRecord {
    /// How many upstream attempts the request made.
    pub fn attempt_count(&self) -> u32 {
        if self.attempts.is_empty() {
            return 0;
        }
        // One more than its commas: a byte count, where `split` searched for each.
        let commas = self.attempts.bytes().filter(|&b| b == b',').count();
        u32::try_from(commas + 1).unwrap_or(u32::MAX)
    }

    /// The UTC day of `at_ms`, `YYYY-MM-DD`.
    pub fn day(&self) -> String {
        utc_day(self.at_ms)
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
}

/// The UTC day (`YYYY-MM-DD`) of a Unix time in milliseconds. The writer asks it of every record,
/// nearly always for the day before, which each thread keeps.
pub fn utc_day(at_ms: u64) -> String {
    const DAY_MS: u64 = 86_400_000;
    thread_local! {
        static LAST: std::cell::RefCell<(u64, String)> =
            const { std::cell::RefCell::new((u64::MAX, String::new())) };
    }
    let day = at_ms / DAY_MS;
    let kept = LAST.try_with(|last| {
        let mut last = last.try_borrow_mut().ok()?;
        if last.0 != day {
            *last = (day, format_day(at_ms));
        }
        Some(last.1.clone())
    });
    kept.ok().flatten().unwrap_or_else(|| format_day(at_ms))
}

fn format_day(at_ms: u64) -> String {
    let time = UNIX_EPOCH + Duration::from_millis(at_ms);
    let mut text = humantime::format_rfc3339_seconds(time).to_string();
    text.truncate(10);
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_utc_dates() {
        assert_eq!(utc_day(0), "1970-01-01");
        // 2026-12-01T23:59:59.999Z and one millisecond later.
        assert_eq!(utc_day(1_796_169_599_999), "2026-12-01");
        assert_eq!(utc_day(1_796_169_600_000), "2026-12-02");
        // The day kept from the last call is not another day's.
        assert_eq!(utc_day(1_796_169_600_001), "2026-12-02");
        assert_eq!(utc_day(1_796_169_599_999), "2026-12-01");
        assert_eq!(utc_day(0), "1970-01-01");
    }

    #[test]
    fn attempts_are_counted_from_the_trail() {
        let mut record = crate::testing_record("r1");
        record.attempts = "a=429,b=200".into();
        assert_eq!(record.attempt_count(), 2);
        record.attempts = "a=200".into();
        assert_eq!(record.attempt_count(), 1);
        record.attempts = "a=timeout,b=503,c=200".into();
        assert_eq!(record.attempt_count(), 3);
        record.attempts = String::new();
        assert_eq!(record.attempt_count(), 0);
    }
}
