//! The faults and pacing an endpoint or deployment is told to show, changeable at runtime.

use serde::{Deserialize, Serialize};

/// How an endpoint (or one deployment, overriding its endpoint) answers.
/// The default is a healthy, instant upstream.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Behavior {
    /// Answer every request with this status and the dialect's matching error body.
    pub status: Option<u16>,
    /// Fraction (0..1) of requests answered 500, spread evenly so tests are deterministic.
    pub error_rate: f64,
    /// Accept the request and never answer, keeping the connection open.
    pub hang: bool,
    /// Send 200 headers, then never a body byte.
    pub headers_then_hang: bool,
    /// Close the TCP connection (with a reset) without any response.
    pub reset: bool,
    /// Streaming: drop the connection after this many content chunks.
    pub cut_after: Option<u32>,
    /// With `cut_after`: only the first this many requests (of the deployment) are cut; later
    /// ones play whole, as a replica of the same model would.
    pub cut_first: Option<u64>,
    /// Delay before the first byte of the answer: headers for plain answers, first content chunk for streams.
    pub ttft_ms: u64,
    /// Gap between stream chunks.
    pub inter_token_ms: u64,
    /// Streaming: play the content chunks over and over and never finish, for a client that
    /// stops reading (the stream outlasts every buffer between the two).
    pub endless: bool,
    /// Retry-After carried by 429s, overriding the real time until the quota frees.
    pub retry_after_s: Option<u64>,
    /// Reported in `x-ratelimit-remaining-tokens` on every answer, whatever the quota says (a
    /// PTU that answers 429 with no tokens left).
    pub remaining_tokens: Option<u64>,
    /// Length of the reply in words (default 8).
    pub reply_words: Option<u32>,
    /// Answer like a lax OpenAI-compatible server (OpenAI dialect): no usage at all (not even
    /// when a stream asks for it), every streamed tool call at index 0, arguments as a JSON
    /// object instead of a string, and `finish_reason: "stop"` after tool calls.
    pub compat_quirks: bool,
    /// Refuse every request with a 400 (the dialect's invalid-request error) that quotes the
    /// key it presented, as some providers do, in its message and its headers: an
    /// `x-echoed-api-key` header and a parameter of its content type.
    pub echo_key_error: bool,
    /// Streaming: end the stream after its content with an error event (OpenAI framing) that
    /// quotes the key the request presented, instead of its finish.
    pub echo_key_in_stream: bool,
    /// Batches: how long one runs from creation to completed (default 2 s), on the simulated
    /// clock that walks it through validating, in_progress and finalizing.
    pub batch_ms: Option<u64>,
    /// Batches: a batch whose lines' tokens (prompt plus `max_tokens`) pass this fails at
    /// creation with Azure's `token_limit_exceeded`.
    pub enqueued_token_limit: Option<u64>,
}
