//! Extended thinking and prompt caching as the Anthropic API has them. A request that enables
//! thinking gets a `thinking` block (its text and a signature over it) before its answer, and a
//! `redacted_thinking` block too when its prompt holds the trigger string. Thinking handed back
//! must be handed back as it was given: a block whose signature does not match its text, or
//! redacted data the mock never issued, is refused as Anthropic refuses it, and so is a final
//! assistant turn with tool calls that lost its thinking. A `cache_control` breakpoint makes the
//! prompt up to it a cache entry: written the first time, read after.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::{json, Value};

use crate::dialect::Reject;
use crate::request::{estimate, text_of};

/// A prompt holding this string gets a `redacted_thinking` block too, as on the real API.
pub const REDACTED_TRIGGER: &str = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING";

/// Whether the request asks for extended thinking.
pub fn enabled(body: &Value) -> bool {
    matches!(
        body["thinking"]["type"].as_str(),
        Some("enabled" | "adaptive")
    )
}

fn hash_hex(parts: &[&str]) -> String {
    let mut out = String::new();
    for salt in 0..4u8 {
        let mut hasher = DefaultHasher::new();
        salt.hash(&mut hasher);
        parts.hash(&mut hasher);
        out.push_str(&format!("{:016x}", hasher.finish()));
    }
    out
}

/// The signature the mock gives a thinking text: only that text has it.
pub fn signature(thinking: &str) -> String {
    format!("EqMock{}", hash_hex(&["thinking", thinking]))
}

/// Redacted thinking data that proves the mock issued it.
pub fn redacted_data(nonce: &str) -> String {
    format!("EmwMock.{nonce}.{}", hash_hex(&["redacted", nonce]))
}

fn issued(data: &str) -> bool {
    let Some((nonce, mac)) = data
        .strip_prefix("EmwMock.")
        .and_then(|rest| rest.split_once('.'))
    else {
        return false;
    };
    mac == hash_hex(&["redacted", nonce])
}

/// The thinking blocks the answer to a prompt of `prompt_tokens` starts with.
pub fn blocks(prompt_tokens: u64, redacted: bool) -> Vec<Value> {
    let text = format!("The prompt holds {prompt_tokens} tokens. I will answer it plainly.");
    let mut blocks =
        vec![json!({"type": "thinking", "thinking": text, "signature": signature(&text)})];
    if redacted {
        let nonce = crate::ident::token("", 24);
        blocks.push(json!({"type": "redacted_thinking", "data": redacted_data(&nonce)}));
    }
    blocks
}

/// Checks the thinking the assistant turns of `messages` hand back.
pub fn check(messages: &[Value], thinking: bool) -> Result<(), Reject> {
    for (i, message) in messages.iter().enumerate() {
        if message["role"] != "assistant" {
            continue;
        }
        for (j, block) in message["content"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let at = format!("messages.{i}.content.{j}");
            let intact = match block["type"].as_str() {
                Some("thinking") => {
                    let text = block["thinking"].as_str().unwrap_or_default();
                    block["signature"].as_str() == Some(&signature(text))
                }
                Some("redacted_thinking") => block["data"].as_str().is_some_and(issued),
                _ => true,
            };
            if !intact {
                let what = match block["type"].as_str() {
                    Some("thinking") => "`signature` in `thinking`",
                    _ => "`data` in `redacted_thinking`",
                };
                return Err(Reject::Invalid(format!("{at}: Invalid {what} block")));
            }
        }
    }
    if thinking {
        final_turn_keeps_its_thinking(messages)?;
    }
    Ok(())
}

/// With thinking on, the last assistant turn that called tools must start with its thinking.
fn final_turn_keeps_its_thinking(messages: &[Value]) -> Result<(), Reject> {
    let Some((i, last)) = messages
        .iter()
        .enumerate()
        .rev()
        .find(|(_, m)| m["role"] == "assistant")
    else {
        return Ok(());
    };
    let blocks = last["content"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    let calls = blocks.iter().any(|b| b["type"] == "tool_use");
    let first = blocks
        .first()
        .and_then(|b| b["type"].as_str())
        .unwrap_or("text");
    if calls && !matches!(first, "thinking" | "redacted_thinking") {
        return Err(Reject::Invalid(format!(
            "messages.{i}.content.0.type: Expected `thinking` or `redacted_thinking`, but found `{first}`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks)."
        )));
    }
    Ok(())
}

/// The prompt up to the last `cache_control` breakpoint: its key and its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CachedPrefix {
    pub key: u64,
    pub tokens: u64,
    /// It was in the cache already (read), rather than written now.
    pub read: bool,
}

/// The cached prefix of a Messages request: tools, then system blocks, then message blocks,
/// in order, up to and with the last one marked `cache_control`.
pub fn cached_prefix(body: &Value) -> Option<CachedPrefix> {
    let list = |v: &Value| v.as_array().cloned().unwrap_or_default();
    let mut items = list(&body["tools"]);
    items.extend(list(&body["system"]));
    for message in body["messages"].as_array().into_iter().flatten() {
        items.extend(list(&message["content"]));
    }
    let mut hasher = DefaultHasher::new();
    let mut chars = 0;
    let mut prefix = None;
    for item in &items {
        item.to_string().hash(&mut hasher);
        chars += text_of(item).chars().count();
        if !item["cache_control"].is_null() {
            prefix = Some(CachedPrefix {
                key: hasher.finish(),
                tokens: estimate(chars),
                read: false,
            });
        }
    }
    prefix
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_belongs_to_its_text_alone() {
        let blocks = blocks(12, true);
        let turn =
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": blocks}]);
        let turns = turn.as_array().unwrap();
        assert!(check(turns, true).is_ok());
        let mut changed = turn.clone();
        changed[1]["content"][0]["thinking"] = json!("The prompt holds 13 tokens.");
        assert!(check(changed.as_array().unwrap(), true).is_err());
        let mut forged = turn.clone();
        forged[1]["content"][1]["data"] = json!("EmwMock.abc.def");
        assert!(check(forged.as_array().unwrap(), true).is_err());
    }

    #[test]
    fn a_final_tool_turn_without_its_thinking_is_refused_when_thinking_is_on() {
        let turns = json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "1"}]},
        ]);
        let turns = turns.as_array().unwrap();
        assert!(check(turns, false).is_ok());
        assert!(check(turns, true).is_err());
    }

    #[test]
    fn the_prefix_ends_at_the_last_breakpoint() {
        let body = json!({"system": [{"type": "text", "text": "long", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "hi"}]});
        let prefix = cached_prefix(&body).unwrap();
        assert!(prefix.tokens > 0);
        let other = json!({"system": [{"type": "text", "text": "other", "cache_control": {"type": "ephemeral"}}]});
        assert_ne!(cached_prefix(&other).unwrap().key, prefix.key);
        assert_eq!(cached_prefix(&json!({"messages": []})), None);
    }
}
