//! The tokens one answer used: measured (the upstream's own usage block) or estimated (the
//! gateway counted, because the upstream reported nothing). Whole answers and streams fill the
//! same [`Usage`]; the request pipeline reads it from a [`UsageReport`] once the answer is
//! complete (at once for a whole answer, when the caller's stream ends for a stream).

use serde_json::{json, Value};
use tokio::sync::watch;

/// Where the numbers of a [`Usage`] come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageSource {
    /// The upstream's own usage block.
    Measured,
    /// Counted by the gateway (about four characters a token): the upstream reported nothing.
    Estimated,
}

impl UsageSource {
    /// The `x-onedoor-usage` word.
    pub fn as_str(self) -> &'static str {
        match self {
            UsageSource::Measured => "measured",
            UsageSource::Estimated => "estimated",
        }
    }
}

/// The tokens of one answer, in OpenAI's terms: `prompt_tokens` counts every input token, the
/// cached ones included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Input tokens read from a prompt cache (part of `prompt_tokens`).
    pub cached_tokens: u64,
    /// Input tokens written to a prompt cache (Anthropic's cache creation; part of `prompt_tokens`).
    pub cache_write_tokens: u64,
    pub source: UsageSource,
}

/// Characters a token is assumed to hold when the gateway has to count.
const CHARS_PER_TOKEN: usize = 4;

/// The gateway's own count of `chars` characters of text.
pub fn estimate_tokens(chars: usize) -> u64 {
    chars.div_ceil(CHARS_PER_TOKEN) as u64
}

impl Usage {
    pub fn estimated(prompt_tokens: u64, completion_tokens: u64) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            cached_tokens: 0,
            cache_write_tokens: 0,
            source: UsageSource::Estimated,
        }
    }

    pub fn total_tokens(&self) -> u64 {
        self.prompt_tokens + self.completion_tokens
    }

    /// An OpenAI usage object: Chat Completions and embeddings (`prompt_tokens`, ...) or the
    /// Responses API (`input_tokens`, ...). Anthropic cache fields, when a translation added
    /// them, say how much of the prompt was a cache write.
    pub fn from_openai(usage: &Value) -> Option<Usage> {
        let number = |v: &Value| v.as_u64();
        let prompt = number(&usage["prompt_tokens"]).or_else(|| number(&usage["input_tokens"]))?;
        let completion = number(&usage["completion_tokens"])
            .or_else(|| number(&usage["output_tokens"]))
            .unwrap_or(0);
        let cached = number(&usage["prompt_tokens_details"]["cached_tokens"])
            .or_else(|| number(&usage["input_tokens_details"]["cached_tokens"]))
            .unwrap_or(0);
        Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            cached_tokens: cached,
            cache_write_tokens: number(&usage["cache_creation_input_tokens"]).unwrap_or(0),
            source: UsageSource::Measured,
        })
    }

    /// The usage block of an OpenAI-shaped answer body, if it has one.
    pub fn of_body(body: &[u8]) -> Option<Usage> {
        let value: Value = serde_json::from_slice(body).ok()?;
        Usage::from_openai(value.get("usage")?)
    }

    /// An Anthropic usage object (`input_tokens` excludes both cache buckets).
    pub fn from_anthropic(usage: &Value) -> Option<Usage> {
        let number = |key: &str| usage[key].as_u64().unwrap_or(0);
        let input = usage["input_tokens"].as_u64()?;
        let (read, write) = (
            number("cache_read_input_tokens"),
            number("cache_creation_input_tokens"),
        );
        Some(Usage {
            prompt_tokens: input + read + write,
            completion_tokens: number("output_tokens"),
            cached_tokens: read,
            cache_write_tokens: write,
            source: UsageSource::Measured,
        })
    }

    /// Both answers together (a cut stream and its continuation): estimated if either is.
    pub fn plus(self, other: Usage) -> Usage {
        let source = match (self.source, other.source) {
            (UsageSource::Measured, UsageSource::Measured) => UsageSource::Measured,
            _ => UsageSource::Estimated,
        };
        Usage {
            prompt_tokens: self.prompt_tokens + other.prompt_tokens,
            completion_tokens: self.completion_tokens + other.completion_tokens,
            cached_tokens: self.cached_tokens + other.cached_tokens,
            cache_write_tokens: self.cache_write_tokens + other.cache_write_tokens,
            source,
        }
    }

    /// The Chat Completions usage object; cache writes ride along as Anthropic's field name.
    pub fn to_openai(&self) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens(),
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        });
        if self.cache_write_tokens > 0 {
            usage["cache_creation_input_tokens"] = json!(self.cache_write_tokens);
        }
        usage
    }

    /// The Anthropic usage object.
    pub fn to_anthropic(&self) -> Value {
        json!({
            "input_tokens": self
                .prompt_tokens
                .saturating_sub(self.cached_tokens + self.cache_write_tokens),
            "cache_creation_input_tokens": self.cache_write_tokens,
            "cache_read_input_tokens": self.cached_tokens,
            "output_tokens": self.completion_tokens,
        })
    }

    /// The SSE comment that ends a stream with its final usage, after the fact: the response
    /// head went out before the usage was known. Comments are ignored by SSE clients.
    pub fn sse_comment(&self) -> String {
        format!(
            ": x-onedoor-usage: {} prompt_tokens={} completion_tokens={} cached_tokens={} cache_write_tokens={}\n\n",
            self.source.as_str(),
            self.prompt_tokens,
            self.completion_tokens,
            self.cached_tokens,
            self.cache_write_tokens
        )
    }
}

/// The writing end: a stream reports once, when it ends.
pub struct UsageSink(watch::Sender<Option<Usage>>);

/// The reading end, for the request pipeline (the usage store records what it says).
#[derive(Clone)]
pub struct UsageReport(Reported);

#[derive(Clone)]
enum Reported {
    /// A whole answer's usage, known when the report was made: no channel to set up or notify.
    Known(Usage),
    /// A stream's, once its relay reports it.
    Awaited(watch::Receiver<Option<Usage>>),
}

pub fn channel() -> (UsageSink, UsageReport) {
    let (tx, rx) = watch::channel(None);
    (UsageSink(tx), UsageReport(Reported::Awaited(rx)))
}

/// A report that already holds the usage of a whole answer.
pub fn reported(usage: Usage) -> UsageReport {
    UsageReport(Reported::Known(usage))
}

impl UsageSink {
    pub fn report(self, usage: Usage) {
        self.0.send_replace(Some(usage));
    }
}

impl UsageReport {
    /// The usage, once known.
    pub fn get(&self) -> Option<Usage> {
        match &self.0 {
            Reported::Known(usage) => Some(*usage),
            Reported::Awaited(report) => *report.borrow(),
        }
    }

    /// Waits until the answer is complete: the usage, or `None` when the answer was dropped
    /// before it ended (the caller went away).
    pub async fn finished(self) -> Option<Usage> {
        match self.0 {
            Reported::Known(usage) => Some(usage),
            Reported::Awaited(mut report) => match report.wait_for(Option::is_some).await {
                Ok(usage) => *usage,
                Err(_) => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_cache_buckets_are_part_of_the_prompt() {
        let usage = Usage::from_anthropic(&json!({
            "input_tokens": 10, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 5, "output_tokens": 7
        }))
        .unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.cached_tokens,
                usage.cache_write_tokens
            ),
            (115, 100, 5)
        );
        assert_eq!(usage.to_anthropic()["input_tokens"], 10);
        assert_eq!(Usage::from_openai(&usage.to_openai()), Some(usage));
    }

    #[test]
    fn responses_and_embeddings_usage_are_read() {
        let responses = json!({"input_tokens": 5, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 3, "total_tokens": 8});
        let usage = Usage::from_openai(&responses).unwrap();
        assert_eq!(
            (
                usage.prompt_tokens,
                usage.completion_tokens,
                usage.cached_tokens
            ),
            (5, 3, 2)
        );
        let embeddings =
            Usage::from_openai(&json!({"prompt_tokens": 8, "total_tokens": 8})).unwrap();
        assert_eq!(embeddings.total_tokens(), 8);
    }

    #[tokio::test]
    async fn a_report_is_read_when_the_answer_ends() {
        let (sink, report) = channel();
        assert_eq!(report.get(), None);
        let waiting = tokio::spawn(report.clone().finished());
        sink.report(Usage::estimated(3, 4));
        assert_eq!(waiting.await.unwrap().map(|u| u.total_tokens()), Some(7));
        let (sink, report) = channel();
        drop(sink);
        assert_eq!(report.finished().await, None);
        let whole = reported(Usage::estimated(1, 2));
        assert_eq!(whole.get().map(|u| u.total_tokens()), Some(3));
        assert_eq!(whole.finished().await.map(|u| u.total_tokens()), Some(3));
    }
}
