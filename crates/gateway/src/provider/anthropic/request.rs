//! OpenAI Chat Completions request -> Anthropic Messages request (reference section 4.1): every
//! system and developer message merged into `system`, tool calls and results as blocks (the
//! results of one turn in one user message), images as base64 or url sources, `tool_choice`
//! and `parallel_tool_calls`, `stop`, a `max_tokens` default, temperature clamped to 0..1.

use serde_json::{json, Map, Value};

/// `max_tokens` is required by Anthropic; this is sent when the client set none.
pub const DEFAULT_MAX_TOKENS: u64 = 4096;

/// A request that cannot be expressed in the Messages API; the caller gets a 400 saying why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Untranslatable(pub String);

fn refuse<T>(message: impl Into<String>) -> Result<T, Untranslatable> {
    Err(Untranslatable(message.into()))
}

/// The Messages request for `chat`, asking `model`.
pub fn translate(chat: &Value, model: &str) -> Result<Value, Untranslatable> {
    let Some(body) = chat.as_object() else {
        return refuse("the request body must be a JSON object");
    };
    refuse_unsupported(body)?;
    let messages = body
        .get("messages")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let (system, turns) = conversation(messages)?;
    let mut out = Map::new();
    out.insert("model".into(), json!(model));
    let max_tokens = body
        .get("max_completion_tokens")
        .and_then(Value::as_u64)
        .or_else(|| body.get("max_tokens").and_then(Value::as_u64))
        .unwrap_or(DEFAULT_MAX_TOKENS);
    out.insert("max_tokens".into(), json!(max_tokens));
    if !system.is_empty() {
        out.insert("system".into(), Value::Array(system));
    }
    out.insert("messages".into(), Value::Array(turns));
    if let Some(stop) = stop_sequences(body.get("stop")) {
        out.insert("stop_sequences".into(), stop);
    }
    if let Some(t) = body.get("temperature").and_then(Value::as_f64) {
        out.insert("temperature".into(), json!(t.clamp(0.0, 1.0)));
    }
    if let Some(p) = body.get("top_p").filter(|v| v.is_number()) {
        out.insert("top_p".into(), p.clone());
    }
    let tools = tools(body.get("tools"))?;
    if !tools.is_empty() {
        let parallel = body.get("parallel_tool_calls").and_then(Value::as_bool);
        if let Some(choice) = tool_choice(body.get("tool_choice"), parallel)? {
            out.insert("tool_choice".into(), choice);
        }
        out.insert("tools".into(), Value::Array(tools));
    }
    if let Some(user) = body.get("user").and_then(Value::as_str) {
        // Anthropic refuses ids that look like an email address or a phone number.
        let personal = user.contains('@') || user.chars().filter(char::is_ascii_digit).count() >= 7;
        if !personal && !user.is_empty() {
            out.insert("metadata".into(), json!({"user_id": user}));
        }
    }
    if body.get("stream").and_then(Value::as_bool) == Some(true) {
        out.insert("stream".into(), json!(true));
    }
    Ok(Value::Object(out))
}

/// What Anthropic has no equivalent for, and that would change the answer if dropped.
fn refuse_unsupported(body: &Map<String, Value>) -> Result<(), Untranslatable> {
    if body.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return refuse("`n` greater than 1 is not supported by Anthropic backends");
    }
    if body.get("logprobs").and_then(Value::as_bool) == Some(true) {
        return refuse("`logprobs` is not supported by Anthropic backends");
    }
    match body.get("response_format").map(|f| &f["type"]) {
        None | Some(Value::Null) => Ok(()),
        Some(kind) if kind == "text" => Ok(()),
        Some(kind) => refuse(format!(
            "`response_format` of type {kind} is not supported by Anthropic backends"
        )),
    }
}

/// The system blocks and the alternating turns of `messages`.
fn conversation(messages: &[Value]) -> Result<(Vec<Value>, Vec<Value>), Untranslatable> {
    let mut system = Vec::new();
    let mut turns: Vec<(String, Vec<Value>)> = Vec::new();
    for (i, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().unwrap_or_default();
        let (role, blocks) = match role {
            "system" | "developer" => {
                system.extend(text_blocks(&message["content"], i)?);
                continue;
            }
            "user" => ("user", user_blocks(&message["content"], i)?),
            "assistant" => ("assistant", assistant_blocks(message, i)?),
            "tool" => ("user", vec![tool_result(message)]),
            other => {
                return refuse(format!(
                    "messages[{i}]: the role `{other}` is not supported by Anthropic backends"
                ))
            }
        };
        match turns.last_mut() {
            Some((last, existing)) if last == role => existing.extend(blocks),
            _ => turns.push((role.to_owned(), blocks)),
        }
    }
    let last = turns.len().saturating_sub(1);
    let turns = turns
        .into_iter()
        .enumerate()
        .map(|(i, (role, blocks))| {
            let blocks = match (role.as_str(), i == last) {
                ("user", _) => results_first(blocks),
                // A final assistant turn is a prefill, which may not end in whitespace.
                ("assistant", true) => trim_prefill(blocks),
                _ => blocks,
            };
            json!({"role": role, "content": blocks})
        })
        .collect();
    Ok((system, turns))
}

/// Tool results answer the previous turn, so Anthropic wants them before anything else.
fn results_first(blocks: Vec<Value>) -> Vec<Value> {
    let (mut results, rest): (Vec<Value>, Vec<Value>) =
        blocks.into_iter().partition(|b| b["type"] == "tool_result");
    results.extend(rest);
    results
}

fn trim_prefill(mut blocks: Vec<Value>) -> Vec<Value> {
    if let Some(last) = blocks.last_mut().filter(|b| b["type"] == "text") {
        let trimmed = last["text"]
            .as_str()
            .unwrap_or_default()
            .trim_end()
            .to_owned();
        if trimmed.is_empty() {
            blocks.pop();
        } else {
            last["text"] = json!(trimmed);
        }
    }
    blocks
}

/// Text content (a string or text parts) as text blocks; empty text is left out, as Anthropic
/// refuses empty text blocks. `cache_control` on a part is kept.
fn text_blocks(content: &Value, i: usize) -> Result<Vec<Value>, Untranslatable> {
    match content {
        Value::Null => Ok(Vec::new()),
        Value::String(s) => Ok(text_block(s).into_iter().collect()),
        Value::Array(parts) => {
            let mut blocks = Vec::new();
            for part in parts {
                match part["type"].as_str() {
                    Some("text") => blocks.extend(text_part(part)),
                    _ => return refuse(format!("messages[{i}]: only text parts are allowed here")),
                }
            }
            Ok(blocks)
        }
        _ => refuse(format!(
            "messages[{i}].content must be a string or an array of parts"
        )),
    }
}

fn text_block(text: &str) -> Option<Value> {
    (!text.is_empty()).then(|| json!({"type": "text", "text": text}))
}

fn text_part(part: &Value) -> Option<Value> {
    let mut block = text_block(part["text"].as_str().unwrap_or_default())?;
    if let Some(cache) = part.get("cache_control") {
        block["cache_control"] = cache.clone();
    }
    Some(block)
}

fn user_blocks(content: &Value, i: usize) -> Result<Vec<Value>, Untranslatable> {
    let Value::Array(parts) = content else {
        return text_blocks(content, i);
    };
    let mut blocks = Vec::new();
    for part in parts {
        match part["type"].as_str() {
            Some("text") => blocks.extend(text_part(part)),
            Some("image_url") => blocks.push(image(&part["image_url"], i)?),
            Some(other) => {
                return refuse(format!(
                    "messages[{i}]: content parts of type `{other}` are not supported by Anthropic backends"
                ))
            }
            None => return refuse(format!("messages[{i}]: a content part has no `type`")),
        }
    }
    Ok(blocks)
}

/// An `image_url` part: a data URL becomes a base64 source with the image's real media type
/// (read from its first bytes, as a declared type may be wrong), an http(s) URL a url source.
fn image(image_url: &Value, i: usize) -> Result<Value, Untranslatable> {
    let url = image_url
        .as_str()
        .or_else(|| image_url["url"].as_str())
        .unwrap_or_default();
    if let Some(rest) = url.strip_prefix("data:") {
        let Some((declared, data)) = rest.split_once(";base64,") else {
            return refuse(format!(
                "messages[{i}]: an image data URL must be base64-encoded"
            ));
        };
        let media_type = sniff_image(data).unwrap_or(declared);
        if !matches!(
            media_type,
            "image/jpeg" | "image/png" | "image/gif" | "image/webp"
        ) {
            return refuse(format!(
                "messages[{i}]: images of type `{media_type}` are not supported by Anthropic backends (jpeg, png, gif, webp are)"
            ));
        }
        return Ok(
            json!({"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}),
        );
    }
    if url.starts_with("https://") || url.starts_with("http://") {
        return Ok(json!({"type": "image", "source": {"type": "url", "url": url}}));
    }
    refuse(format!(
        "messages[{i}]: an image URL must be a data: URL or an http(s) URL"
    ))
}

/// The media type the first bytes of base64 `data` announce.
fn sniff_image(data: &str) -> Option<&'static str> {
    let head = decode_base64_prefix(data.get(..16.min(data.len()))?);
    let starts = |magic: &[u8]| head.starts_with(magic);
    if starts(&[0x89, b'P', b'N', b'G']) {
        Some("image/png")
    } else if starts(&[0xFF, 0xD8, 0xFF]) {
        Some("image/jpeg")
    } else if starts(b"GIF8") {
        Some("image/gif")
    } else if head.len() >= 12 && starts(b"RIFF") && &head[8..12] == b"WEBP" {
        Some("image/webp")
    } else {
        None
    }
}

/// Decodes whole base64 quartets from the start of `text` (enough to read magic bytes).
fn decode_base64_prefix(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' | b'-' => Some(62),
        b'/' | b'_' => Some(63),
        _ => None,
    };
    let mut out = Vec::new();
    for quartet in text.as_bytes().chunks_exact(4) {
        let Some(v) = quartet
            .iter()
            .map(|c| value(*c))
            .collect::<Option<Vec<u8>>>()
        else {
            break;
        };
        let n = v.iter().fold(0u32, |n, d| (n << 6) | u32::from(*d));
        out.extend_from_slice(&n.to_be_bytes()[1..]);
    }
    out
}

fn assistant_blocks(message: &Value, i: usize) -> Result<Vec<Value>, Untranslatable> {
    let mut blocks = match &message["content"] {
        Value::Array(parts) => parts
            .iter()
            .filter(|p| p["type"] == "text")
            .filter_map(text_part)
            .collect(),
        content => text_blocks(content, i)?,
    };
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        let function = &call["function"];
        let input = match &function["arguments"] {
            Value::Null => json!({}),
            Value::String(s) if s.trim().is_empty() => json!({}),
            Value::String(s) => match serde_json::from_str::<Value>(s) {
                Ok(value @ Value::Object(_)) => value,
                _ => {
                    return refuse(format!(
                        "messages[{i}]: the arguments of tool call `{}` are not a JSON object",
                        call["id"].as_str().unwrap_or_default()
                    ))
                }
            },
            value @ Value::Object(_) => value.clone(),
            _ => {
                return refuse(format!(
                    "messages[{i}]: tool call arguments must be a JSON string"
                ))
            }
        };
        blocks.push(json!({
            "type": "tool_use",
            "id": call["id"],
            "name": function["name"],
            "input": input,
        }));
    }
    Ok(blocks)
}

/// A `tool` message as a `tool_result` block: string content as it is, parts as text blocks.
fn tool_result(message: &Value) -> Value {
    let content = match &message["content"] {
        Value::Array(parts) => Value::Array(parts.iter().filter_map(text_part).collect()),
        Value::String(s) => json!(s),
        Value::Null => json!(""),
        other => json!(other.to_string()),
    };
    json!({"type": "tool_result", "tool_use_id": message["tool_call_id"], "content": content})
}

fn stop_sequences(stop: Option<&Value>) -> Option<Value> {
    let list: Vec<&str> = match stop? {
        Value::String(s) => vec![s.as_str()],
        Value::Array(items) => items.iter().filter_map(Value::as_str).collect(),
        _ => return None,
    };
    // Anthropic refuses whitespace-only stop sequences.
    let kept: Vec<&str> = list.into_iter().filter(|s| !s.trim().is_empty()).collect();
    (!kept.is_empty()).then(|| json!(kept))
}

fn tools(tools: Option<&Value>) -> Result<Vec<Value>, Untranslatable> {
    let mut out = Vec::new();
    for tool in tools.and_then(Value::as_array).into_iter().flatten() {
        if tool["type"] != "function" {
            return refuse("only tools of type `function` are supported by Anthropic backends");
        }
        let function = &tool["function"];
        let schema = match &function["parameters"] {
            Value::Object(schema) if !schema.is_empty() => Value::Object(schema.clone()),
            _ => json!({"type": "object", "properties": {}}),
        };
        let mut out_tool = json!({"name": function["name"], "input_schema": schema});
        if let Some(description) = function["description"].as_str() {
            out_tool["description"] = json!(description);
        }
        out.push(out_tool);
    }
    Ok(out)
}

/// `tool_choice` (auto, required -> any, none, a named function -> tool), with
/// `parallel_tool_calls: false` as `disable_parallel_tool_use`.
fn tool_choice(
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<Value>, Untranslatable> {
    let mut out = match choice {
        None | Some(Value::Null) => json!({"type": "auto"}),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => json!({"type": "auto"}),
            "required" => json!({"type": "any"}),
            "none" => json!({"type": "none"}),
            other => {
                return refuse(format!(
                    "`tool_choice` `{other}` is not one of auto, required, none"
                ))
            }
        },
        Some(named) => match named["function"]["name"].as_str() {
            Some(name) => json!({"type": "tool", "name": name}),
            None => return refuse("`tool_choice` must be a string or name a function"),
        },
    };
    if parallel == Some(false) && out["type"] != "none" {
        out["disable_parallel_tool_use"] = json!(true);
    } else if choice.is_none() {
        return Ok(None);
    }
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_magic_bytes_are_read() {
        assert_eq!(sniff_image("iVBORw0KGgoAAAANSUhEUg"), Some("image/png"));
        assert_eq!(sniff_image("/9j/4AAQSkZJRgABAQ"), Some("image/jpeg"));
        assert_eq!(sniff_image("R0lGODlhAQABAIAAAP"), Some("image/gif"));
        assert_eq!(sniff_image("UklGRiQAAABXRUJQVlA4"), Some("image/webp"));
        assert_eq!(sniff_image("aGVsbG8gd29ybGQ="), None);
        assert_eq!(sniff_image("é"), None);
    }
}
