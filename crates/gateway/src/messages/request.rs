//! Anthropic Messages request -> OpenAI Chat Completions request, so a Claude-speaking client
//! can use any alias: `system` as a system message, text and image blocks as content parts,
//! `tool_use` blocks as tool calls, `tool_result` blocks as `tool` messages (before the rest of
//! their user turn), tools, `tool_choice`, `stop_sequences`, `metadata.user_id`. The usage chunk
//! is always asked for: an Anthropic stream reports usage in its `message_delta`. What chat
//! requests cannot say (documents, server tools, other block types) is refused as
//! [`Refusal::Untranslatable`]: an Anthropic backend still takes such a request as it came.

use serde_json::{json, Map, Value};

use crate::errors::GatewayError;

/// Why a Messages body has no Chat Completions form.
#[derive(Debug)]
pub enum Refusal {
    /// The body is wrong whichever backend would serve it: the caller gets a 400.
    Invalid(GatewayError),
    /// The body is a valid Messages request that chat requests cannot say; only a backend of
    /// its own dialect can take it.
    Untranslatable(String),
}

fn invalid<T>(message: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::Invalid(GatewayError::InvalidRequest(
        message.into(),
    )))
}

fn untranslatable<T>(message: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::Untranslatable(message.into()))
}

/// The Chat Completions body for a Messages body.
pub fn to_chat(body: &[u8]) -> Result<Value, Refusal> {
    let body: Value = serde_json::from_slice(body).map_err(|e| {
        Refusal::Invalid(GatewayError::InvalidRequest(format!(
            "the request body is not valid JSON: {e}"
        )))
    })?;
    let Some(fields) = body.as_object() else {
        return invalid("the request body must be a JSON object");
    };
    let Some(max_tokens) = fields.get("max_tokens") else {
        return invalid("missing required field `max_tokens`");
    };
    let Some(max_tokens) = max_tokens.as_u64() else {
        return invalid("`max_tokens` must be a non-negative integer");
    };
    let Some(turns) = fields.get("messages").and_then(Value::as_array) else {
        return invalid("missing required field `messages` (an array)");
    };
    let mut messages = Vec::with_capacity(turns.len() + 1);
    if let Some(system) = system_text(fields.get("system"))? {
        messages.push(json!({"role": "system", "content": system}));
    }
    for (i, turn) in turns.iter().enumerate() {
        match turn["role"].as_str() {
            Some("user") => user(turn, i, &mut messages)?,
            Some("assistant") => messages.push(assistant(turn, i)?),
            _ => return invalid(format!("messages.{i}.role must be `user` or `assistant`")),
        }
    }
    let mut out = Map::new();
    if let Some(model) = fields.get("model") {
        out.insert("model".into(), model.clone());
    }
    out.insert("messages".into(), Value::Array(messages));
    out.insert("max_tokens".into(), json!(max_tokens));
    for key in ["temperature", "top_p"] {
        if let Some(v) = fields.get(key).filter(|v| v.is_number()) {
            out.insert(key.into(), v.clone());
        }
    }
    if let Some(stop) = fields.get("stop_sequences").filter(|v| v.is_array()) {
        out.insert("stop".into(), stop.clone());
    }
    if let Some(user) = fields.get("metadata").and_then(|m| m["user_id"].as_str()) {
        out.insert("user".into(), json!(user));
    }
    tools(fields, &mut out)?;
    if fields.get("stream").and_then(Value::as_bool) == Some(true) {
        out.insert("stream".into(), json!(true));
        out.insert("stream_options".into(), json!({"include_usage": true}));
    }
    Ok(Value::Object(out))
}

fn system_text(system: Option<&Value>) -> Result<Option<String>, Refusal> {
    match system {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok((!s.is_empty()).then(|| s.clone())),
        Some(Value::Array(blocks)) => {
            let texts: Vec<&str> = blocks.iter().filter_map(|b| b["text"].as_str()).collect();
            Ok((!texts.is_empty()).then(|| texts.join("\n")))
        }
        Some(_) => invalid("`system` must be a string or an array of text blocks"),
    }
}

/// A user turn: its tool results as `tool` messages first (they answer the previous assistant
/// turn), then the rest as one user message.
fn user(turn: &Value, i: usize, messages: &mut Vec<Value>) -> Result<(), Refusal> {
    let blocks = match &turn["content"] {
        Value::String(s) => {
            messages.push(json!({"role": "user", "content": s}));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => return invalid(format!("messages.{i}.content must be a string or an array")),
    };
    let mut parts = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => parts.push(json!({"type": "text", "text": block["text"]})),
            Some("image") => parts.push(image(&block["source"], i)?),
            Some("tool_result") => messages.push(json!({
                "role": "tool",
                "tool_call_id": block["tool_use_id"],
                "content": tool_result_text(block),
            })),
            Some(other) => {
                return untranslatable(format!(
                    "messages.{i}: content blocks of type `{other}` are not supported by onedoor"
                ))
            }
            None => return invalid(format!("messages.{i}: a content block has no `type`")),
        }
    }
    match parts.as_slice() {
        [] => {}
        [only] if only["type"] == "text" => {
            messages.push(json!({"role": "user", "content": only["text"]}))
        }
        _ => messages.push(json!({"role": "user", "content": parts})),
    }
    Ok(())
}

fn image(source: &Value, i: usize) -> Result<Value, Refusal> {
    let url = match source["type"].as_str() {
        Some("base64") => format!(
            "data:{};base64,{}",
            source["media_type"].as_str().unwrap_or("image/png"),
            source["data"].as_str().unwrap_or_default()
        ),
        Some("url") => source["url"].as_str().unwrap_or_default().to_owned(),
        _ => {
            return untranslatable(format!(
                "messages.{i}: an image source must be base64 or url"
            ))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// A tool result's content as text (OpenAI tool messages carry text); an error is said so.
fn tool_result_text(block: &Value) -> String {
    let text = match &block["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    };
    match block["is_error"].as_bool() {
        Some(true) => format!("Error: {text}"),
        _ => text,
    }
}

fn assistant(turn: &Value, i: usize) -> Result<Value, Refusal> {
    let blocks = match &turn["content"] {
        Value::String(s) => return Ok(json!({"role": "assistant", "content": s})),
        Value::Array(blocks) => blocks,
        _ => return invalid(format!("messages.{i}.content must be a string or an array")),
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
            Some("tool_use") => calls.push(json!({
                "id": block["id"],
                "type": "function",
                "function": {"name": block["name"], "arguments": block["input"].to_string()},
            })),
            // Thinking is the model's own scratchpad; other models cannot take it back.
            Some("thinking" | "redacted_thinking") => {}
            Some(other) => {
                return untranslatable(format!(
                    "messages.{i}: content blocks of type `{other}` are not supported by onedoor"
                ))
            }
            None => return invalid(format!("messages.{i}: a content block has no `type`")),
        }
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        if text.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = Value::Array(calls);
    }
    Ok(message)
}

fn tools(fields: &Map<String, Value>, out: &mut Map<String, Value>) -> Result<(), Refusal> {
    let Some(tools) = fields.get("tools").and_then(Value::as_array) else {
        return Ok(());
    };
    let mut functions = Vec::with_capacity(tools.len());
    for tool in tools {
        if !matches!(tool["type"].as_str(), None | Some("custom")) {
            return untranslatable(format!(
                "tools of type `{}` (Anthropic server tools) are not supported by onedoor",
                tool["type"].as_str().unwrap_or_default()
            ));
        }
        let mut function = json!({"name": tool["name"], "parameters": tool["input_schema"]});
        if let Some(description) = tool["description"].as_str() {
            function["description"] = json!(description);
        }
        functions.push(json!({"type": "function", "function": function}));
    }
    if functions.is_empty() {
        return Ok(());
    }
    out.insert("tools".into(), Value::Array(functions));
    let Some(choice) = fields.get("tool_choice") else {
        return Ok(());
    };
    let mapped = match choice["type"].as_str() {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => json!({"type": "function", "function": {"name": choice["name"]}}),
        _ => return invalid("`tool_choice.type` must be auto, any, none or tool"),
    };
    out.insert("tool_choice".into(), mapped);
    if choice["disable_parallel_tool_use"].as_bool() == Some(true) {
        out.insert("parallel_tool_calls".into(), json!(false));
    }
    Ok(())
}
