//! What the mock reads from a chat request: its size in tokens, its limits, its streaming
//! options, and the tools it offers (a simulated model calls them, then answers from their result).

use serde_json::Value;

use crate::dialect::Reject;

/// A prompt containing this word trips the (Azure) input content filter.
pub const FLAGGED_WORD: &str = "forbidden-word";

/// What admission charges for completion tokens when the request sets no maximum.
const DEFAULT_MAX_TOKENS: u64 = 16;

pub struct Chat {
    /// The estimate: all message text in chars / 4, rounded up, plus 3 per message.
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    pub include_usage: bool,
    /// The last message is the assistant's, so the reply continues it.
    pub prefill: bool,
    pub flagged: bool,
    /// The tools the model may call (none when `tool_choice` says none).
    pub tools: Vec<Tool>,
    /// More than one tool may be called in one turn.
    pub parallel_tools: bool,
    /// The last message is a tool result: its text, which the reply quotes.
    pub tool_result: Option<String>,
    /// Responses API: the stored response this request continues.
    pub previous_response_id: Option<String>,
    /// The request's `mock_echo` field, a field no API knows: OpenAI-shaped answers carry it
    /// back in fields of the same name (top level, message or delta), no SDK knowing them either.
    pub echo: Option<Value>,
    /// Anthropic: extended thinking is on, so the answer starts with its thinking.
    pub thinking: bool,
    /// Anthropic: the prompt asks for redacted thinking too.
    pub redacted_thinking: bool,
    /// Anthropic: the prompt up to its last `cache_control` breakpoint.
    pub cached_prefix: Option<crate::thinking::CachedPrefix>,
}

/// A tool offered to the model: its name and JSON schema.
#[derive(Clone, Debug)]
pub struct Tool {
    pub name: String,
    pub schema: Value,
}

impl Chat {
    /// Reads an OpenAI (or Azure) chat completion request.
    pub fn openai(body: &Value) -> Result<Chat, Reject> {
        let max_tokens = body
            .get("max_completion_tokens")
            .or_else(|| body.get("max_tokens"))
            .and_then(Value::as_u64);
        let mut chat = Chat::measure(body, messages(body)?, None, max_tokens)?;
        if body["tool_choice"] != "none" {
            chat.tools = tools(&body["tools"], |t| {
                (&t["function"]["name"], &t["function"]["parameters"])
            });
        }
        chat.parallel_tools = body["parallel_tool_calls"].as_bool() != Some(false);
        chat.tool_result = messages(body)?
            .last()
            .filter(|m| m["role"] == "tool")
            .map(|m| text_of(&m["content"]));
        Ok(chat)
    }

    /// Reads a Responses API request: `input` (a string or items) and `instructions`.
    pub fn responses(body: &Value) -> Result<Chat, Reject> {
        let input = match body.get("input") {
            None | Some(Value::Null) => return Err(Reject::Missing("input")),
            Some(Value::String(s)) => vec![serde_json::json!({"role": "user", "content": s})],
            Some(Value::Array(items)) => items.clone(),
            Some(_) => return Err(Reject::Invalid("Invalid type for 'input'.".to_owned())),
        };
        let max_tokens = body.get("max_output_tokens").and_then(Value::as_u64);
        let mut chat = Chat::measure(body, &input, body.get("instructions"), max_tokens)?;
        chat.prefill = false;
        chat.previous_response_id = body["previous_response_id"].as_str().map(str::to_owned);
        Ok(chat)
    }

    /// Reads an Anthropic Messages request, where `max_tokens` is required and `system` is top-level.
    pub fn anthropic(body: &Value) -> Result<Chat, Reject> {
        let messages = messages(body)?;
        let max_tokens = body
            .get("max_tokens")
            .ok_or(Reject::Missing("max_tokens"))?;
        let max_tokens = max_tokens.as_u64().ok_or_else(|| {
            Reject::Invalid("max_tokens: Input should be a valid integer".to_owned())
        })?;
        let mut chat = Chat::measure(body, messages, body.get("system"), Some(max_tokens))?;
        chat.thinking = crate::thinking::enabled(body);
        crate::thinking::check(messages, chat.thinking)?;
        chat.redacted_thinking =
            chat.thinking && body.to_string().contains(crate::thinking::REDACTED_TRIGGER);
        chat.cached_prefix = crate::thinking::cached_prefix(body);
        if body["tool_choice"]["type"] != "none" {
            chat.tools = tools(&body["tools"], |t| (&t["name"], &t["input_schema"]));
        }
        chat.parallel_tools = body["tool_choice"]["disable_parallel_tool_use"] != true;
        chat.tool_result = messages.last().and_then(|m| {
            let results: Vec<String> = m["content"]
                .as_array()?
                .iter()
                .filter(|b| b["type"] == "tool_result")
                .map(|b| text_of(&b["content"]))
                .collect();
            (!results.is_empty()).then(|| results.join(" "))
        });
        Ok(chat)
    }

    fn measure(
        body: &Value,
        messages: &[Value],
        system: Option<&Value>,
        max_tokens: Option<u64>,
    ) -> Result<Chat, Reject> {
        let texts: Vec<String> = system
            .into_iter()
            .chain(messages.iter().map(|m| &m["content"]))
            .map(text_of)
            .collect();
        let chars: usize = texts.iter().map(|t| t.chars().count()).sum();
        Ok(Chat {
            prompt_tokens: estimate(chars) + 3 * texts.len() as u64,
            max_tokens,
            stream: body["stream"].as_bool().unwrap_or(false),
            include_usage: body["stream_options"]["include_usage"]
                .as_bool()
                .unwrap_or(false),
            prefill: messages.last().is_some_and(|m| m["role"] == "assistant"),
            flagged: texts.iter().any(|t| t.contains(FLAGGED_WORD)),
            tools: Vec::new(),
            parallel_tools: true,
            tool_result: None,
            previous_response_id: None,
            echo: body.get("mock_echo").cloned(),
            thinking: false,
            redacted_thinking: false,
            cached_prefix: None,
        })
    }

    /// Tokens charged at admission: the prompt plus everything the reply may use.
    pub fn cost(&self) -> u64 {
        self.prompt_tokens + self.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS)
    }
}

/// The tools of a request, each read by `fields` as (name, schema).
fn tools(list: &Value, fields: impl Fn(&Value) -> (&Value, &Value)) -> Vec<Tool> {
    list.as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| {
            let (name, schema) = fields(t);
            Some(Tool {
                name: name.as_str()?.to_owned(),
                schema: schema.clone(),
            })
        })
        .collect()
}

fn messages(body: &Value) -> Result<&[Value], Reject> {
    match body.get("messages") {
        None | Some(Value::Null) => Err(Reject::Missing("messages")),
        Some(Value::Array(items)) => Ok(items),
        Some(_) => Err(Reject::Invalid(
            "messages: Input should be a valid list".to_owned(),
        )),
    }
}

/// The text of a message content: a string, or parts and blocks (text, tool results) holding text.
pub fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().map(text_of).collect(),
        Value::Object(part) => [part.get("text"), part.get("content")]
            .into_iter()
            .flatten()
            .map(text_of)
            .collect(),
        _ => String::new(),
    }
}

/// The mock's tokenizer: four characters to a token, rounded up.
pub fn estimate(chars: usize) -> u64 {
    chars.div_ceil(4) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn estimates_text_and_message_overhead() {
        let body = json!({"messages": [
            {"role": "system", "content": "12345"},
            {"role": "user", "content": [{"type": "text", "text": "abc"}]},
        ]});
        let chat = Chat::openai(&body).unwrap();
        assert_eq!(chat.prompt_tokens, 2 + 6);
        assert_eq!(chat.cost(), 8 + 16);
        assert!(!chat.prefill && !chat.stream);
    }

    #[test]
    fn anthropic_counts_system_and_sees_prefill() {
        let body = json!({"max_tokens": 5, "system": "abcd", "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Sure,"},
        ]});
        let chat = Chat::anthropic(&body).unwrap();
        assert_eq!(chat.prompt_tokens, 3 + 9);
        assert!(chat.prefill);
        assert!(matches!(
            Chat::anthropic(&json!({"messages": []})),
            Err(Reject::Missing("max_tokens"))
        ));
    }
}
