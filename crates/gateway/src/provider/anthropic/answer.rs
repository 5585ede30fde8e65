//! Anthropic answers -> OpenAI Chat Completions answers (reference sections 4.2, 4.3, 4.5): a
//! message becomes a `chat.completion` (all text blocks joined, `tool_use` blocks as tool calls,
//! `stop_reason` mapped, usage with the cache buckets counted in the prompt), an error body the
//! OpenAI envelope with the codes routing and OpenAI SDKs read.

use serde_json::{json, Value};

use crate::usage::Usage;

/// The OpenAI `finish_reason` of an Anthropic `stop_reason`; never the raw Anthropic value.
pub fn finish_reason(stop_reason: &Value) -> &'static str {
    match stop_reason.as_str() {
        Some("max_tokens" | "model_context_window_exceeded" | "compaction") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// The `chat.completion` for an Anthropic `message`, created at `created` (Unix seconds), and
/// its usage.
pub fn completion(message: &Value, created: u64) -> (Value, Option<Usage>) {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in message["content"].as_array().into_iter().flatten() {
        match block["type"].as_str() {
            Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
            Some("tool_use") => tool_calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": arguments(&block["input"])},
            })),
            _ => {}
        }
    }
    let mut reply = json!({
        "role": "assistant",
        "content": if text.is_empty() && !tool_calls.is_empty() { Value::Null } else { json!(text) },
        "refusal": null,
    });
    if !tool_calls.is_empty() {
        reply["tool_calls"] = Value::Array(tool_calls);
    }
    let usage = Usage::from_anthropic(&message["usage"]);
    let mut body = json!({
        "id": message["id"],
        "object": "chat.completion",
        "created": created,
        "model": message["model"],
        "choices": [{
            "index": 0,
            "message": reply,
            "logprobs": null,
            "finish_reason": finish_reason(&message["stop_reason"]),
        }],
    });
    if let Some(usage) = usage {
        body["usage"] = usage.to_openai();
    }
    (body, usage)
}

/// Tool input as the JSON string OpenAI carries arguments in.
pub fn arguments(input: &Value) -> String {
    match input {
        Value::Null => "{}".to_owned(),
        other => other.to_string(),
    }
}

/// An Anthropic error body in the OpenAI envelope: the message kept, the type and code an
/// OpenAI client (and the gateway's routing) expects for that kind of error.
pub fn error(body: &Value) -> Value {
    let error = &body["error"];
    let message = error["message"]
        .as_str()
        .unwrap_or("the Anthropic backend failed");
    let (kind, code) = match error["type"].as_str().unwrap_or_default() {
        "invalid_request_error" if message.contains("prompt is too long") => {
            ("invalid_request_error", json!("context_length_exceeded"))
        }
        "authentication_error" => ("invalid_request_error", json!("invalid_api_key")),
        "not_found_error" => ("invalid_request_error", json!("model_not_found")),
        "rate_limit_error" if error["details"]["error_code"] == "enforced_spend_limit_reached" => {
            ("insufficient_quota", json!("insufficient_quota"))
        }
        "rate_limit_error" => ("tokens", json!("rate_limit_exceeded")),
        "api_error" | "overloaded_error" => ("server_error", Value::Null),
        _ => ("invalid_request_error", Value::Null),
    };
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}
