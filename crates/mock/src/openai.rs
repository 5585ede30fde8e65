//! The OpenAI wire format: routes, error envelopes, rate-limit headers, completions and chunks.
//! Azure reuses the bodies and chunks, adding its annotations on top.

use std::time::Duration;

use hyper::{HeaderMap, Method, StatusCode};
use serde_json::{json, Value};

use crate::dialect::{self, Ctx, Op, Payload, Reject, Route, Wire};
use crate::ident;
use crate::quota::{Kind, Snapshot};
use crate::reply::{Finish, Reply, ToolCall};
use crate::request::Chat;
use crate::response::put;
use crate::state::Shared;
use crate::stream::{data_event, done_event, Script};

const FINGERPRINT: &str = "fp_0d00r0m0ck";

pub struct OpenAi;

impl Wire for OpenAi {
    fn route(&self, method: &Method, path: &str, _query: Option<&str>) -> Result<Route, Reject> {
        let op = match (method, path) {
            (&Method::POST, "/v1/chat/completions") => Op::Chat,
            (&Method::POST, "/v1/embeddings") => Op::Embeddings,
            (&Method::POST, "/v1/responses") => Op::Responses,
            (&Method::GET, "/v1/models") => Op::Models,
            _ => return Err(Reject::NoRoute),
        };
        Ok(Route {
            op,
            deployment: None,
            api_version: None,
        })
    }

    fn check_headers(&self, headers: &HeaderMap, key: Option<&str>) -> Result<(), Reject> {
        dialect::check_key(key, dialect::bearer(headers))
    }

    fn request_id(&self) -> String {
        ident::token("req_", 32)
    }

    fn reject(&self, reject: &Reject, ctx: &Ctx) -> (StatusCode, Value) {
        let model = ctx.model.as_deref().unwrap_or("unknown");
        match reject {
            Reject::NoRoute => not_found(&format!("Invalid URL ({})", ctx.target)),
            Reject::Unauthorized(presented) => unauthorized(presented.as_deref()),
            Reject::UnknownDeployment(name) => model_not_found(name),
            Reject::Missing(field) => missing(field),
            Reject::Invalid(message) => invalid(message),
            Reject::ContentFilter => (
                StatusCode::BAD_REQUEST,
                envelope(
                    "The prompt was filtered.",
                    Some("invalid_request_error"),
                    Some("prompt"),
                    Some("content_filter"),
                ),
            ),
            Reject::ContextTooLong { limit, tokens } => context_too_long(*limit, *tokens),
            Reject::RateLimited {
                throttle,
                retry_after_s,
            } => rate_limited(model, throttle.as_ref().map(|t| (t, *retry_after_s))),
            Reject::Status(status) => injected(*status, model),
            Reject::UnknownResponse(id) => unknown_response(id),
        }
    }

    fn decorate(&self, h: &mut HeaderMap, ctx: &Ctx, quota: Option<&Snapshot>, retry: Option<u64>) {
        put(h, "x-request-id", &ctx.request_id);
        if let Some(q) = quota {
            rate_limit_headers(h, q);
        }
        if let Some(s) = retry {
            put(h, "retry-after", s);
        }
    }

    fn chat(&self, chat: &Chat, reply: &Reply, model: &str) -> Payload {
        if chat.stream {
            Payload::Stream(chunks(chat, reply, model).script())
        } else {
            Payload::Json(completion(chat, reply, model))
        }
    }
}

/// The OpenAI error envelope, which Azure also uses for errors from its model layer.
pub fn envelope(
    message: &str,
    kind: Option<&str>,
    param: Option<&str>,
    code: Option<&str>,
) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
}

/// A Responses follow-up naming a response that is not stored here.
pub fn unknown_response(id: &str) -> (StatusCode, Value) {
    let message = format!("Previous response with id '{id}' not found.");
    let body = envelope(
        &message,
        Some("invalid_request_error"),
        Some("previous_response_id"),
        Some("previous_response_not_found"),
    );
    (StatusCode::BAD_REQUEST, body)
}

fn invalid(message: &str) -> (StatusCode, Value) {
    (
        StatusCode::BAD_REQUEST,
        envelope(message, Some("invalid_request_error"), None, None),
    )
}

pub fn missing(field: &str) -> (StatusCode, Value) {
    let message = format!("Missing required parameter: '{field}'.");
    let body = envelope(
        &message,
        Some("invalid_request_error"),
        Some(field),
        Some("missing_required_parameter"),
    );
    (StatusCode::BAD_REQUEST, body)
}

pub fn context_too_long(limit: u64, tokens: u64) -> (StatusCode, Value) {
    let message = format!(
        "This model's maximum context length is {limit} tokens. However, your messages resulted in {tokens} tokens. Please reduce the length of the messages."
    );
    let body = envelope(
        &message,
        Some("invalid_request_error"),
        Some("messages"),
        Some("context_length_exceeded"),
    );
    (StatusCode::BAD_REQUEST, body)
}

fn not_found(message: &str) -> (StatusCode, Value) {
    (
        StatusCode::NOT_FOUND,
        envelope(message, Some("invalid_request_error"), None, None),
    )
}

fn model_not_found(model: &str) -> (StatusCode, Value) {
    let message = format!("The model `{model}` does not exist or you do not have access to it.");
    let body = envelope(
        &message,
        Some("invalid_request_error"),
        None,
        Some("model_not_found"),
    );
    (StatusCode::NOT_FOUND, body)
}

fn unauthorized(presented: Option<&str>) -> (StatusCode, Value) {
    let body = match presented {
        None => envelope(
            "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            Some("invalid_request_error"),
            None,
            None,
        ),
        Some(key) => {
            let shown: String = key.chars().take(3).collect();
            let message = format!(
                "Incorrect API key provided: {shown}***. You can find your API key at https://platform.openai.com/account/api-keys."
            );
            envelope(&message, Some("invalid_request_error"), None, Some("invalid_api_key"))
        }
    };
    (StatusCode::UNAUTHORIZED, body)
}

/// A 429, quoting the limit that refused it when there was one.
fn rate_limited(
    model: &str,
    earned: Option<(&crate::quota::Throttle, u64)>,
) -> (StatusCode, Value) {
    let body = match earned {
        None => envelope(
            "Rate limit reached for requests. Please try again later.",
            Some("requests"),
            None,
            Some("rate_limit_exceeded"),
        ),
        Some((t, retry_after_s)) => {
            let (kind, per_min) = match t.kind {
                Kind::Requests => ("requests", "requests per min (RPM)"),
                Kind::Tokens => ("tokens", "tokens per min (TPM)"),
            };
            let message = format!(
                "Rate limit reached for {model} in organization org-onedoor-mock on {per_min}: Limit {}, Used {}, Requested {}. Please try again in {}. Visit https://platform.openai.com/account/rate-limits to learn more.",
                t.limit,
                t.used,
                t.requested,
                go_duration(Duration::from_secs(retry_after_s)),
            );
            envelope(&message, Some(kind), None, Some("rate_limit_exceeded"))
        }
    };
    (StatusCode::TOO_MANY_REQUESTS, body)
}

fn injected(status: u16, model: &str) -> (StatusCode, Value) {
    let code = dialect::status_code(status);
    match code.as_u16() {
        401 => unauthorized(Some("sk-mock")),
        404 => model_not_found(model),
        500 => (code, server_error()),
        503 => (
            code,
            envelope(
                "The engine is currently overloaded, please try again later.",
                Some("server_error"),
                None,
                None,
            ),
        ),
        _ if code.is_client_error() => (
            code,
            envelope(
                dialect::reason(code),
                Some("invalid_request_error"),
                None,
                None,
            ),
        ),
        _ => (
            code,
            envelope(dialect::reason(code), Some("server_error"), None, None),
        ),
    }
}

fn server_error() -> Value {
    envelope(
        "The server had an error while processing your request. Sorry about that!",
        Some("server_error"),
        None,
        None,
    )
}

fn rate_limit_headers(h: &mut HeaderMap, q: &Snapshot) {
    let reset = go_duration(q.reset);
    if let (Some(limit), Some(remaining)) = (q.limits.rpm, q.remaining_requests) {
        put(h, "x-ratelimit-limit-requests", limit);
        put(h, "x-ratelimit-remaining-requests", remaining);
        put(h, "x-ratelimit-reset-requests", &reset);
    }
    if let (Some(limit), Some(remaining)) = (q.limits.tpm, q.remaining_tokens) {
        put(h, "x-ratelimit-limit-tokens", limit);
        put(h, "x-ratelimit-remaining-tokens", remaining);
        put(h, "x-ratelimit-reset-tokens", &reset);
    }
}

/// A duration the way Go prints it, as OpenAI's reset headers do: "12ms", "1.5s", "6m0s", "1h2m3s".
fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (hours, minutes, ms) = (ms / 3_600_000, ms / 60_000 % 60, ms % 60_000);
    let seconds = match ms % 1000 {
        0 => format!("{}s", ms / 1000),
        frac => format!(
            "{}.{}s",
            ms / 1000,
            format!("{frac:03}").trim_end_matches('0')
        ),
    };
    match (hours, minutes) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

pub fn usage(prompt: u64, completion: u64) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0, "audio_tokens": 0,
            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0
        }
    })
}

fn finish_reason(reply: &Reply) -> &'static str {
    match reply.finish {
        Finish::Stop => "stop",
        Finish::Length => "length",
        // Lax servers say "stop" even when the turn ends in tool calls.
        Finish::ToolCalls if reply.quirks => "stop",
        Finish::ToolCalls => "tool_calls",
    }
}

/// Tool call arguments as OpenAI sends them (a JSON string), or as a lax server does (an object).
fn arguments(call: &ToolCall, quirks: bool) -> Value {
    match quirks {
        true => serde_json::from_str(&call.arguments).unwrap_or(Value::Null),
        false => json!(call.arguments),
    }
}

fn call_id() -> String {
    ident::token("call_", 24)
}

pub fn completion(chat: &Chat, reply: &Reply, model: &str) -> Value {
    let mut message =
        json!({"role": "assistant", "content": reply.text(), "refusal": null, "annotations": []});
    if !reply.tool_calls.is_empty() {
        let calls: Vec<Value> = reply
            .tool_calls
            .iter()
            .map(|c| json!({"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": arguments(c, reply.quirks)}}))
            .collect();
        message["tool_calls"] = json!(calls);
    }
    let mut body = json!({
        "id": ident::token("chatcmpl-", 29),
        "object": "chat.completion",
        "created": ident::unix_now(),
        "model": model,
        "system_fingerprint": FINGERPRINT,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(reply),
        }],
        "usage": usage(chat.prompt_tokens, reply.tokens()),
        "service_tier": "default",
    });
    if reply.quirks {
        if let Some(body) = body.as_object_mut() {
            body.remove("usage");
        }
    }
    if let Some(echo) = &chat.echo {
        body["mock_echo"] = echo.clone();
        body["choices"][0]["message"]["mock_echo"] = echo.clone();
    }
    body
}

/// The deltas of one streamed tool call: id and name first, then the arguments in two
/// fragments; a lax server sends it all at once, at index 0, with arguments as an object.
fn tool_call_deltas(index: usize, call: &ToolCall, quirks: bool) -> Vec<Value> {
    if quirks {
        let whole = json!({"index": 0, "id": call_id(), "type": "function", "function": {"name": call.name, "arguments": arguments(call, true)}});
        return vec![json!({"tool_calls": [whole]})];
    }
    let first = json!({"index": index, "id": call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}});
    let middle = call
        .arguments
        .char_indices()
        .map(|(i, _)| i)
        .nth(call.arguments.chars().count() / 2)
        .unwrap_or(call.arguments.len());
    let (head, tail) = call.arguments.split_at(middle);
    let mut deltas = vec![json!({"tool_calls": [first]})];
    for fragment in [head, tail].into_iter().filter(|f| !f.is_empty()) {
        deltas.push(json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}));
    }
    deltas
}

/// A chat completion stream as JSON chunks, before framing, so Azure can annotate them.
pub struct Chunks {
    pub preamble: Vec<Value>,
    pub content: Vec<Value>,
    pub tail: Vec<Value>,
}

impl Chunks {
    pub fn script(self) -> Script {
        let frame = |chunks: Vec<Value>| chunks.iter().map(data_event).collect::<Vec<_>>();
        let mut tail = frame(self.tail);
        tail.push(done_event());
        Script {
            preamble: frame(self.preamble),
            content: frame(self.content),
            tail,
        }
    }
}

pub fn chunks(chat: &Chat, reply: &Reply, model: &str) -> Chunks {
    // Every chunk carries the same id, created and model; with include_usage they also carry
    // "usage": null until the final usage chunk.
    let id = ident::token("chatcmpl-", 29);
    let created = ident::unix_now();
    let chunk = |choices: Value| {
        let mut c = json!({
            "id": id, "object": "chat.completion.chunk", "created": created,
            "model": model, "system_fingerprint": FINGERPRINT, "choices": choices,
        });
        if chat.include_usage && !reply.quirks {
            c["usage"] = Value::Null;
        }
        if let Some(echo) = &chat.echo {
            c["mock_echo"] = echo.clone();
        }
        c
    };
    let choice = |delta: Value, finish: Option<&str>| json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
    let preamble = vec![chunk(choice(
        json!({"role": "assistant", "content": "", "refusal": null}),
        None,
    ))];
    let mut content: Vec<Value> = reply
        .chunks
        .iter()
        .map(|w| chunk(choice(json!({"content": w}), None)))
        .collect();
    for (i, call) in reply.tool_calls.iter().enumerate() {
        for delta in tool_call_deltas(i, call, reply.quirks) {
            content.push(chunk(choice(delta, None)));
        }
    }
    let mut tail = vec![chunk(choice(json!({}), Some(finish_reason(reply))))];
    if chat.include_usage && !reply.quirks {
        let mut last = chunk(json!([]));
        last["usage"] = usage(chat.prompt_tokens, reply.tokens());
        tail.push(last);
    }
    Chunks {
        preamble,
        content,
        tail,
    }
}

/// `GET /v1/models`: one entry per configured deployment.
pub fn models(shared: &Shared) -> Value {
    let data: Vec<Value> = shared
        .deployments
        .iter()
        .map(|d| json!({"id": d.spec.name, "object": "model", "created": 1_715_367_049, "owned_by": "onedoor-mock"}))
        .collect();
    json!({"object": "list", "data": data})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_print_like_go() {
        let ms = Duration::from_millis;
        assert_eq!(go_duration(ms(0)), "0s");
        assert_eq!(go_duration(ms(12)), "12ms");
        assert_eq!(go_duration(ms(1500)), "1.5s");
        assert_eq!(go_duration(ms(360_000)), "6m0s");
        assert_eq!(go_duration(ms(3_723_000)), "1h2m3s");
    }
}
