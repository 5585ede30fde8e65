//! OpenAI answers -> Anthropic answers for Claude-speaking clients: a `chat.completion` becomes
//! a `message` (text and `tool_use` blocks, `stop_reason`, usage with `input_tokens` excluding
//! the cache buckets), an error body Anthropic's `{"type":"error","error":{...}}`.

use http::StatusCode;
use serde_json::{json, Value};

use crate::usage::Usage;

/// The Anthropic `stop_reason` of an OpenAI `finish_reason`.
pub fn stop_reason(finish_reason: &str) -> &'static str {
    match finish_reason {
        "length" => "max_tokens",
        "tool_calls" | "function_call" => "tool_use",
        "content_filter" => "refusal",
        _ => "end_turn",
    }
}

/// Tool call arguments (a JSON string) as the input object Anthropic carries.
pub fn input(arguments: &Value) -> Value {
    match arguments {
        Value::String(s) if s.trim().is_empty() => json!({}),
        Value::String(s) => serde_json::from_str(s).unwrap_or_else(|_| json!({})),
        Value::Object(_) => arguments.clone(),
        _ => json!({}),
    }
}

/// The `message` for a `chat.completion`.
pub fn message(completion: &Value, usage: &Usage) -> Value {
    let choice = &completion["choices"][0];
    let reply = &choice["message"];
    let mut content = Vec::new();
    match &reply["content"] {
        Value::String(text) if !text.is_empty() => {
            content.push(json!({"type": "text", "text": text}))
        }
        Value::Array(parts) => {
            for part in parts.iter().filter_map(|p| p["text"].as_str()) {
                content.push(json!({"type": "text", "text": part}));
            }
        }
        _ => {}
    }
    if let Some(refusal) = reply["refusal"].as_str().filter(|r| !r.is_empty()) {
        content.push(json!({"type": "text", "text": refusal}));
    }
    for call in reply["tool_calls"].as_array().into_iter().flatten() {
        content.push(json!({
            "type": "tool_use",
            "id": call["id"],
            "name": call["function"]["name"],
            "input": input(&call["function"]["arguments"]),
        }));
    }
    json!({
        "id": completion["id"],
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str().unwrap_or("stop")),
        "stop_sequence": null,
        "usage": usage.to_anthropic(),
    })
}

/// Anthropic's `error.type` for an HTTP status.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// Anthropic's error body for `message` at `status`.
pub fn error(status: StatusCode, message: &str) -> Value {
    json!({"type": "error", "error": {"type": error_type(status), "message": message}})
}

/// An upstream's error body (OpenAI or Azure envelope) in Anthropic's shape, its message kept.
pub fn upstream_error(status: StatusCode, body: &[u8]) -> Value {
    let value: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let message = value["error"]["message"]
        .as_str()
        .or_else(|| value["message"].as_str())
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned());
    error(status, &message)
}
