//! The Anthropic Messages wire format: headers it insists on, its error shape, messages and the
//! named-event stream.

use hyper::{HeaderMap, Method, StatusCode};
use serde_json::{json, Value};

use crate::dialect::{self, Ctx, Op, Payload, Reject, Route, Wire};
use crate::ident;
use crate::quota::{Kind, Snapshot};
use bytes::Bytes;

use crate::reply::{Finish, Reply, ToolCall};
use crate::request::Chat;
use crate::response::put;
use crate::stream::{named_event, Script};

pub struct Anthropic;

impl Wire for Anthropic {
    fn route(&self, method: &Method, path: &str, _query: Option<&str>) -> Result<Route, Reject> {
        if method != Method::POST || path != "/v1/messages" {
            return Err(Reject::NoRoute);
        }
        Ok(Route {
            op: Op::Chat,
            deployment: None,
            api_version: None,
        })
    }

    fn check_headers(&self, headers: &HeaderMap, key: Option<&str>) -> Result<(), Reject> {
        let presented = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        dialect::check_key(key, presented)?;
        if !headers.contains_key("anthropic-version") {
            let message = "anthropic-version: header is required".to_owned();
            return Err(Reject::Invalid(message));
        }
        Ok(())
    }

    fn parse_chat(&self, body: &Value) -> Result<Chat, Reject> {
        Chat::anthropic(body)
    }

    fn request_id(&self) -> String {
        ident::token("req_011C", 20)
    }

    fn reject(&self, reject: &Reject, ctx: &Ctx) -> (StatusCode, Value) {
        let (status, message) = match reject {
            Reject::NoRoute => (StatusCode::NOT_FOUND, "Not Found".to_owned()),
            Reject::Unauthorized(None) => (
                StatusCode::UNAUTHORIZED,
                "x-api-key header is required".to_owned(),
            ),
            Reject::Unauthorized(Some(_)) => {
                (StatusCode::UNAUTHORIZED, "invalid x-api-key".to_owned())
            }
            Reject::UnknownDeployment(model) => (StatusCode::NOT_FOUND, format!("model: {model}")),
            Reject::Missing(field) => (StatusCode::BAD_REQUEST, format!("{field}: Field required")),
            Reject::Invalid(message) => (StatusCode::BAD_REQUEST, message.clone()),
            Reject::ContentFilter => (
                StatusCode::BAD_REQUEST,
                "Output blocked by content filtering policy".to_owned(),
            ),
            Reject::ContextTooLong { limit, tokens } => (
                StatusCode::BAD_REQUEST,
                format!("prompt is too long: {tokens} tokens > {limit} maximum"),
            ),
            Reject::RateLimited { throttle, .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                rate_limit_message(throttle.as_ref()),
            ),
            Reject::Status(status) => injected(*status),
            Reject::UnknownResponse(_) => (StatusCode::NOT_FOUND, "Not Found".to_owned()),
        };
        (status, error_body(status, &message, &ctx.request_id))
    }

    fn decorate(&self, h: &mut HeaderMap, ctx: &Ctx, quota: Option<&Snapshot>, retry: Option<u64>) {
        put(h, "request-id", &ctx.request_id);
        if let Some(q) = quota {
            rate_limit_headers(h, q);
        }
        if let Some(s) = retry {
            put(h, "retry-after", s);
        }
    }

    fn chat(&self, chat: &Chat, reply: &Reply, model: &str) -> Payload {
        let thinking = match chat.thinking {
            true => crate::thinking::blocks(chat.prompt_tokens, chat.redacted_thinking),
            false => Vec::new(),
        };
        let message = Message {
            id: ident::token("msg_01", 22),
            model,
            input_tokens: chat.prompt_tokens,
            cached: chat.cached_prefix,
            thinking,
        };
        if chat.stream {
            Payload::Stream(message.events(reply))
        } else {
            Payload::Json(message.whole(reply))
        }
    }
}

fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

fn error_body(status: StatusCode, message: &str, request_id: &str) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(status), "message": message},
        "request_id": request_id,
    })
}

fn injected(status: u16) -> (StatusCode, String) {
    let code = dialect::status_code(status);
    let message = match code.as_u16() {
        500 => "Internal server error",
        529 => "Overloaded",
        _ => dialect::reason(code),
    };
    (code, message.to_owned())
}

fn rate_limit_message(throttle: Option<&crate::quota::Throttle>) -> String {
    let Some(t) = throttle else {
        return "Number of request tokens has exceeded your per-minute rate limit. Please try again later.".to_owned();
    };
    let unit = match t.kind {
        Kind::Requests => "requests",
        Kind::Tokens => "input tokens",
    };
    format!(
        "This request would exceed the rate limit for your organization of {} {unit} per minute. For details, refer to: https://docs.claude.com/en/api/rate-limits. You can see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later.",
        t.limit
    )
}

/// Anthropic reports resets as RFC 3339 instants rather than durations.
fn rate_limit_headers(h: &mut HeaderMap, q: &Snapshot) {
    let reset = rfc3339(ident::unix_now() + q.reset.as_secs());
    if let (Some(limit), Some(remaining)) = (q.limits.rpm, q.remaining_requests) {
        put(h, "anthropic-ratelimit-requests-limit", limit);
        put(h, "anthropic-ratelimit-requests-remaining", remaining);
        put(h, "anthropic-ratelimit-requests-reset", &reset);
    }
    if let (Some(limit), Some(remaining)) = (q.limits.tpm, q.remaining_tokens) {
        put(h, "anthropic-ratelimit-tokens-limit", limit);
        put(h, "anthropic-ratelimit-tokens-remaining", remaining);
        put(h, "anthropic-ratelimit-tokens-reset", &reset);
    }
}

/// Seconds since the epoch as "2025-08-21T12:40:59Z" (civil-from-days, proleptic Gregorian).
fn rfc3339(unix: u64) -> String {
    let (days, secs) = (unix / 86_400, unix % 86_400);
    let z = days + 719_468;
    let (era, doe) = (z / 146_097, z % 146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

struct Message<'a> {
    id: String,
    model: &'a str,
    /// The whole prompt's tokens, its cached prefix included.
    input_tokens: u64,
    /// The prompt's prefix up to its last cache breakpoint, read from the cache or written now.
    cached: Option<crate::thinking::CachedPrefix>,
    /// The thinking blocks the answer starts with (extended thinking on).
    thinking: Vec<Value>,
}

fn stop_reason(reply: &Reply) -> &'static str {
    match reply.finish {
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
    }
}

fn tool_id() -> String {
    ident::token("toolu_01", 22)
}

/// A tool call's input object (the reply keeps it serialised).
fn input(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}))
}

impl Message<'_> {
    /// The input tokens outside the cache, those read from it and those written to it.
    fn input(&self) -> (u64, u64, u64) {
        let Some(prefix) = self.cached else {
            return (self.input_tokens, 0, 0);
        };
        let cached = prefix.tokens.min(self.input_tokens);
        let rest = self.input_tokens - cached;
        match prefix.read {
            true => (rest, cached, 0),
            false => (rest, 0, cached),
        }
    }

    fn usage(&self, output_tokens: u64) -> Value {
        let (input, read, write) = self.input();
        json!({
            "input_tokens": input,
            "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read,
            "cache_creation": {"ephemeral_5m_input_tokens": write, "ephemeral_1h_input_tokens": 0},
            "output_tokens": output_tokens,
            "service_tier": "standard",
        })
    }

    fn envelope(&self, content: Value, stop_reason: Option<&str>, output_tokens: u64) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": null,
            "usage": self.usage(output_tokens),
        })
    }

    fn whole(&self, reply: &Reply) -> Value {
        let mut content = self.thinking.clone();
        content.push(json!({"type": "text", "text": reply.text()}));
        for call in &reply.tool_calls {
            content.push(json!({"type": "tool_use", "id": tool_id(), "name": call.name, "input": input(call)}));
        }
        self.envelope(json!(content), Some(stop_reason(reply)), reply.tokens())
    }

    /// One tool_use block at `index`: its start (input always `{}`), an empty first fragment,
    /// the input JSON in two fragments, its stop.
    fn tool_events(index: usize, call: &ToolCall) -> Vec<Bytes> {
        let start = json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": tool_id(), "name": call.name, "input": {}}});
        let split = call.arguments.len() / 2;
        let split = (split..=call.arguments.len())
            .find(|i| call.arguments.is_char_boundary(*i))
            .unwrap_or(call.arguments.len());
        let (head, tail) = call.arguments.split_at(split);
        let mut events = vec![named_event("content_block_start", &start)];
        for fragment in ["", head, tail] {
            let delta = json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": fragment}});
            events.push(named_event("content_block_delta", &delta));
        }
        let stop = json!({"type": "content_block_stop", "index": index});
        events.push(named_event("content_block_stop", &stop));
        events
    }

    /// message_start, content_block_start, ping, one delta per word, content_block_stop, a
    /// tool_use block per tool call, message_delta (cumulative usage), message_stop. No
    /// [DONE]: message_stop ends it.
    fn events(&self, reply: &Reply) -> Script {
        let mut preamble = vec![named_event(
            "message_start",
            &json!({"type": "message_start", "message": self.envelope(json!([]), None, 1)}),
        )];
        for (index, block) in self.thinking.iter().enumerate() {
            preamble.extend(thinking_events(index, block));
        }
        let text = self.thinking.len();
        preamble.extend([
            named_event(
                "content_block_start",
                &json!({"type": "content_block_start", "index": text, "content_block": {"type": "text", "text": ""}}),
            ),
            named_event("ping", &json!({"type": "ping"})),
        ]);
        let mut content: Vec<Bytes> = reply
            .chunks
            .iter()
            .map(|w| {
                let delta = json!({"type": "content_block_delta", "index": text, "delta": {"type": "text_delta", "text": w}});
                named_event("content_block_delta", &delta)
            })
            .collect();
        let text_stop = named_event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": text}),
        );
        if !reply.tool_calls.is_empty() {
            content.push(text_stop.clone());
            for (i, call) in reply.tool_calls.iter().enumerate() {
                content.extend(Self::tool_events(text + 1 + i, call));
            }
        }
        let (input, read, write) = self.input();
        let usage = json!({
            "input_tokens": input, "cache_creation_input_tokens": write,
            "cache_read_input_tokens": read, "output_tokens": reply.tokens(),
        });
        let mut tail = Vec::new();
        if reply.tool_calls.is_empty() {
            tail.push(text_stop);
        }
        tail.extend([
            named_event(
                "message_delta",
                &json!({"type": "message_delta", "delta": {"stop_reason": stop_reason(reply), "stop_sequence": null}, "usage": usage}),
            ),
            named_event("message_stop", &json!({"type": "message_stop"})),
        ]);
        Script {
            preamble,
            content,
            tail,
        }
    }
}

/// A thinking block as the stream tells it: its start (empty, for thinking), its text in two
/// deltas and its signature, its stop; a redacted block whole in its start.
fn thinking_events(index: usize, block: &Value) -> Vec<Bytes> {
    let start = |content_block: Value| {
        let start =
            json!({"type": "content_block_start", "index": index, "content_block": content_block});
        named_event("content_block_start", &start)
    };
    let delta = |delta: Value| {
        let delta = json!({"type": "content_block_delta", "index": index, "delta": delta});
        named_event("content_block_delta", &delta)
    };
    let mut events = Vec::new();
    if block["type"] == "thinking" {
        let text = block["thinking"].as_str().unwrap_or_default();
        let split = (text.len() / 2..=text.len())
            .find(|i| text.is_char_boundary(*i))
            .unwrap_or(text.len());
        let (head, tail) = text.split_at(split);
        events.push(start(
            json!({"type": "thinking", "thinking": "", "signature": ""}),
        ));
        for part in [head, tail] {
            events.push(delta(json!({"type": "thinking_delta", "thinking": part})));
        }
        events.push(delta(
            json!({"type": "signature_delta", "signature": block["signature"]}),
        ));
    } else {
        events.push(start(block.clone()));
    }
    let stop = json!({"type": "content_block_stop", "index": index});
    events.push(named_event("content_block_stop", &stop));
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(1_755_780_059), "2025-08-21T12:40:59Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }
}
