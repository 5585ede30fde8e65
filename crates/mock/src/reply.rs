//! The text a simulated model answers with: it names who answered, so tests can tell upstreams
//! apart. Offered tools, it calls them (the first, or the first two when parallel calls are
//! allowed) with arguments made from their schemas; given a tool result, it quotes it.

use serde_json::{json, Map, Value};

use crate::request::{estimate, Chat};

/// Words padding a reply to the requested length.
const FILLER: [&str; 6] = ["this", "is", "a", "simulated", "reply", "indeed"];

const DEFAULT_WORDS: u32 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    Stop,
    /// The reply was cut at the request's max tokens.
    Length,
    /// The reply calls tools.
    ToolCalls,
}

/// A call the simulated model makes.
#[derive(Clone, Debug)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON object, serialised.
    pub arguments: String,
}

/// A reply as its stream chunks, one word each, leading space included.
pub struct Reply {
    pub chunks: Vec<String>,
    pub finish: Finish,
    pub tool_calls: Vec<ToolCall>,
    /// Answer like a lax OpenAI-compatible server (see `Behavior::compat_quirks`).
    pub quirks: bool,
}

impl Reply {
    /// "Hello from {who} this is a ..." — or, continuing an assistant prefill,
    /// " continued by {who} this is ...". One word is one completion token.
    pub fn compose(who: &str, words: Option<u32>, prefill: bool, max_tokens: Option<u64>) -> Reply {
        let opening = if prefill {
            ["continued", "by", who]
        } else {
            ["Hello", "from", who]
        };
        let wanted = words.unwrap_or(DEFAULT_WORDS) as usize;
        let allowed = max_tokens.map_or(usize::MAX, |m| usize::try_from(m).unwrap_or(usize::MAX));
        let chunks = opening
            .into_iter()
            .chain(FILLER.into_iter().cycle())
            .take(wanted.min(allowed))
            .enumerate()
            .map(|(i, w)| {
                if i == 0 && !prefill {
                    w.to_owned()
                } else {
                    format!(" {w}")
                }
            })
            .collect();
        let finish = if allowed < wanted {
            Finish::Length
        } else {
            Finish::Stop
        };
        Reply {
            chunks,
            finish,
            tool_calls: Vec::new(),
            quirks: false,
        }
    }

    /// The reply to `chat`: tool calls when it offers tools (and is not answering a tool
    /// result), a reply quoting the result when it is, otherwise [`Reply::compose`].
    pub fn answer(who: &str, words: Option<u32>, chat: &Chat) -> Reply {
        if let Some(result) = &chat.tool_result {
            let mut reply = Reply::compose(who, words, false, chat.max_tokens);
            let at = reply.chunks.len().min(3);
            reply.chunks.insert(at, format!(" got {result}"));
            return reply;
        }
        if chat.tools.is_empty() || chat.prefill {
            return Reply::compose(who, words, chat.prefill, chat.max_tokens);
        }
        let count = if chat.parallel_tools { 2 } else { 1 };
        let tool_calls: Vec<ToolCall> = chat
            .tools
            .iter()
            .take(count)
            .map(|tool| ToolCall {
                name: tool.name.clone(),
                arguments: arguments(&tool.schema).to_string(),
            })
            .collect();
        let names: Vec<&str> = tool_calls.iter().map(|c| c.name.as_str()).collect();
        Reply {
            chunks: vec!["Calling".to_owned(), format!(" {}.", names.join(" and "))],
            finish: Finish::ToolCalls,
            tool_calls,
            quirks: false,
        }
    }

    pub fn text(&self) -> String {
        self.chunks.concat()
    }

    /// One token a word, and the mock's estimate of each call's arguments.
    pub fn tokens(&self) -> u64 {
        let calls: u64 = self
            .tool_calls
            .iter()
            .map(|c| estimate(c.arguments.len()))
            .sum();
        self.chunks.len() as u64 + calls
    }
}

/// Arguments that fit a JSON schema: its required properties (all of them when none is
/// required), strings "Paris" (or the first enum value), numbers 1, booleans true.
fn arguments(schema: &Value) -> Value {
    let properties = schema["properties"].as_object();
    let required: Vec<&str> = schema["required"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    let mut out = Map::new();
    for (name, property) in properties.into_iter().flatten() {
        if !required.is_empty() && !required.contains(&name.as_str()) {
            continue;
        }
        let value = match (property["enum"].get(0), property["type"].as_str()) {
            (Some(first), _) => first.clone(),
            (_, Some("integer" | "number")) => json!(1),
            (_, Some("boolean")) => json!(true),
            (_, Some("array")) => json!([]),
            (_, Some("object")) => json!({}),
            _ => json!("Paris"),
        };
        out.insert(name.clone(), value);
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_who_answered_and_pads() {
        let r = Reply::compose("ep/dep", None, false, None);
        assert_eq!(r.text(), "Hello from ep/dep this is a simulated reply");
        assert_eq!((r.tokens(), r.finish), (8, Finish::Stop));
    }

    #[test]
    fn continues_prefill_and_truncates() {
        let r = Reply::compose("ep/dep", Some(10), true, Some(4));
        assert_eq!(r.text(), " continued by ep/dep this");
        assert_eq!(r.finish, Finish::Length);
    }
}
