//! Seeded generators of model answers and their wire forms (whole and streamed, Anthropic and
//! OpenAI), for the property and fuzz-style tests. The same seed always gives the same cases.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

const PIECES: &[&str] = &[
    "Hello",
    " world",
    ", ",
    "é",
    "ü",
    "日本",
    "🙂",
    "\"quoted\"",
    "\\",
    "\n",
    "{",
    "}",
    "tab\t",
    " ",
    "data: ",
    "[DONE]",
    "\u{2028}",
];

pub fn text_piece(rng: &mut StdRng) -> String {
    let n = rng.random_range(1..4);
    (0..n)
        .map(|_| PIECES[rng.random_range(0..PIECES.len())])
        .collect()
}

fn json_leaf(rng: &mut StdRng) -> Value {
    match rng.random_range(0..5) {
        0 => json!(text_piece(rng)),
        1 => json!(rng.random_range(-1000..1000)),
        2 => json!(rng.random_bool(0.5)),
        3 => json!(rng.random_range(0.0..10.0)),
        _ => Value::Null,
    }
}

/// A tool input: an object of a few fields, sometimes nested.
pub fn tool_input(rng: &mut StdRng) -> Value {
    let mut map = Map::new();
    for i in 0..rng.random_range(0..4) {
        let value = match rng.random_range(0..4) {
            0 => json!([json_leaf(rng), json_leaf(rng)]),
            1 => json!({"inner": json_leaf(rng)}),
            _ => json_leaf(rng),
        };
        map.insert(format!("k{i}{}", text_piece(rng)), value);
    }
    Value::Object(map)
}

#[derive(Debug, Clone)]
pub struct Call {
    pub id: String,
    pub name: String,
    pub input: Value,
}

/// A model answer, independent of any dialect.
#[derive(Debug, Clone)]
pub struct Answer {
    pub pieces: Vec<String>,
    pub calls: Vec<Call>,
    /// An Anthropic stop reason (tool_use when there are calls).
    pub stop: &'static str,
    pub input_tokens: u64,
    pub cache_read: u64,
    pub cache_write: u64,
    pub output_tokens: u64,
}

impl Answer {
    pub fn text(&self) -> String {
        self.pieces.concat()
    }

    pub fn finish_reason(&self) -> &'static str {
        match self.stop {
            "max_tokens" => "length",
            "tool_use" => "tool_calls",
            "refusal" => "content_filter",
            _ => "stop",
        }
    }
}

pub fn answer(rng: &mut StdRng) -> Answer {
    let pieces = (0..rng.random_range(0..6))
        .map(|_| text_piece(rng))
        .collect();
    let calls: Vec<Call> = (0..rng.random_range(0..4))
        .map(|i| Call {
            id: format!("toolu_{i}{}", rng.random_range(0..1_000_000)),
            name: ["get_weather", "get_time", "search"][rng.random_range(0..3)].to_owned(),
            input: tool_input(rng),
        })
        .collect();
    let stop = match calls.is_empty() {
        false => "tool_use",
        true => ["end_turn", "max_tokens", "stop_sequence", "refusal"][rng.random_range(0..4)],
    };
    Answer {
        pieces,
        calls,
        stop,
        input_tokens: rng.random_range(1..5000),
        cache_read: rng.random_range(0..3) * rng.random_range(0..2000),
        cache_write: rng.random_range(0..2) * rng.random_range(0..500),
        output_tokens: rng.random_range(1..2000),
    }
}

/// `text` cut into 1..4 fragments at character boundaries (the first sometimes empty).
pub fn fragments(rng: &mut StdRng, text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let mut cuts: Vec<usize> = (0..rng.random_range(0..4))
        .map(|_| rng.random_range(0..=chars.len()))
        .collect();
    cuts.sort_unstable();
    let mut out = Vec::new();
    if rng.random_bool(0.5) {
        out.push(String::new());
    }
    let mut from = 0;
    for cut in cuts.into_iter().chain([chars.len()]) {
        out.push(chars[from..cut].iter().collect());
        from = cut;
    }
    out
}

fn anthropic_usage(a: &Answer) -> Value {
    json!({"input_tokens": a.input_tokens, "cache_read_input_tokens": a.cache_read,
        "cache_creation_input_tokens": a.cache_write, "output_tokens": a.output_tokens})
}

/// The whole Anthropic `message`.
pub fn anthropic_message(a: &Answer) -> Value {
    let mut content = Vec::new();
    if !a.text().is_empty() {
        content.push(json!({"type": "text", "text": a.text()}));
    }
    for c in &a.calls {
        content.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.input}));
    }
    json!({"id": "msg_prop", "type": "message", "role": "assistant", "model": "claude-prop",
        "content": content, "stop_reason": a.stop, "stop_sequence": null, "usage": anthropic_usage(a)})
}

fn named(out: &mut String, data: &Value) {
    let name = data["type"].as_str().unwrap_or("message");
    out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
}

/// The Anthropic event stream of the same answer, with pings and a thinking block sprinkled in.
pub fn anthropic_stream(rng: &mut StdRng, a: &Answer) -> String {
    let mut out = String::new();
    let start_usage = json!({"input_tokens": a.input_tokens, "cache_read_input_tokens": a.cache_read,
        "cache_creation_input_tokens": a.cache_write, "output_tokens": 1});
    named(
        &mut out,
        &json!({"type": "message_start", "message": {"id": "msg_prop", "type": "message", "role": "assistant",
        "model": "claude-prop", "content": [], "stop_reason": null, "stop_sequence": null, "usage": start_usage}}),
    );
    let mut index = 0;
    if rng.random_bool(0.3) {
        named(
            &mut out,
            &json!({"type": "content_block_start", "index": index, "content_block": {"type": "thinking", "thinking": ""}}),
        );
        named(
            &mut out,
            &json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        );
        named(
            &mut out,
            &json!({"type": "content_block_stop", "index": index}),
        );
        index += 1;
    }
    if !a.text().is_empty() {
        let (first, rest) = match rng.random_bool(0.3) {
            true => (a.pieces[0].clone(), &a.pieces[1..]),
            false => (String::new(), &a.pieces[..]),
        };
        named(
            &mut out,
            &json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": first}}),
        );
        for piece in rest {
            if rng.random_bool(0.2) {
                named(&mut out, &json!({"type": "ping"}));
            }
            named(
                &mut out,
                &json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}}),
            );
        }
        named(
            &mut out,
            &json!({"type": "content_block_stop", "index": index}),
        );
        index += 1;
    }
    for c in &a.calls {
        named(
            &mut out,
            &json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}}),
        );
        let input = c.input.to_string();
        let input = if input == "{}" && rng.random_bool(0.5) {
            String::new()
        } else {
            input
        };
        for fragment in fragments(rng, &input) {
            named(
                &mut out,
                &json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": fragment}}),
            );
        }
        named(
            &mut out,
            &json!({"type": "content_block_stop", "index": index}),
        );
        index += 1;
    }
    let usage = match rng.random_bool(0.5) {
        true => anthropic_usage(a),
        false => json!({"output_tokens": a.output_tokens}),
    };
    named(
        &mut out,
        &json!({"type": "message_delta", "delta": {"stop_reason": a.stop, "stop_sequence": null}, "usage": usage}),
    );
    named(&mut out, &json!({"type": "message_stop"}));
    out
}

fn openai_usage(a: &Answer) -> Value {
    let prompt = a.input_tokens + a.cache_read;
    json!({"prompt_tokens": prompt, "completion_tokens": a.output_tokens, "total_tokens": prompt + a.output_tokens,
        "prompt_tokens_details": {"cached_tokens": a.cache_read}})
}

/// The whole `chat.completion`; `lax` sends arguments as objects and `stop` after tool calls.
pub fn openai_completion(a: &Answer, lax: bool) -> Value {
    let content = if a.text().is_empty() && !a.calls.is_empty() {
        Value::Null
    } else {
        json!(a.text())
    };
    let mut message = json!({"role": "assistant", "content": content});
    if !a.calls.is_empty() {
        let calls: Vec<Value> = a
            .calls
            .iter()
            .map(|c| {
                let arguments = if lax { c.input.clone() } else { json!(c.input.to_string()) };
                json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments}})
            })
            .collect();
        message["tool_calls"] = json!(calls);
    }
    let finish = if lax && !a.calls.is_empty() {
        "stop"
    } else {
        a.finish_reason()
    };
    json!({"id": "chatcmpl-prop", "object": "chat.completion", "created": 1, "model": "gpt-prop",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": openai_usage(a)})
}

/// The chat completion stream of the same answer (with the usage chunk); `lax` puts every call
/// at index 0 and sends `stop` after tool calls.
pub fn openai_stream(rng: &mut StdRng, a: &Answer, lax: bool) -> String {
    let mut out = String::new();
    let chunk = |out: &mut String, choices: Value, usage: Value| {
        let c = json!({"id": "chatcmpl-prop", "object": "chat.completion.chunk", "created": 1, "model": "gpt-prop", "choices": choices, "usage": usage});
        out.push_str(&format!("data: {c}\n\n"));
    };
    let delta = |d: Value, f: Value| json!([{"index": 0, "delta": d, "finish_reason": f}]);
    if rng.random_bool(0.3) {
        out.push_str("data: {\"id\":\"\",\"choices\":[],\"created\":0,\"model\":\"\",\"object\":\"\",\"prompt_filter_results\":[]}\n\n");
    }
    chunk(
        &mut out,
        delta(json!({"role": "assistant", "content": ""}), Value::Null),
        Value::Null,
    );
    for piece in &a.pieces {
        chunk(
            &mut out,
            delta(json!({"content": piece}), Value::Null),
            Value::Null,
        );
    }
    for (i, c) in a.calls.iter().enumerate() {
        let index = if lax { 0 } else { i };
        let arguments = c.input.to_string();
        let parts = fragments(rng, &arguments);
        let first = json!({"index": index, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": parts[0]}});
        chunk(
            &mut out,
            delta(json!({"tool_calls": [first]}), Value::Null),
            Value::Null,
        );
        for part in &parts[1..] {
            let next = json!({"index": index, "function": {"arguments": part}});
            chunk(
                &mut out,
                delta(json!({"tool_calls": [next]}), Value::Null),
                Value::Null,
            );
        }
    }
    let finish = if lax && !a.calls.is_empty() {
        "stop"
    } else {
        a.finish_reason()
    };
    chunk(&mut out, delta(json!({}), json!(finish)), Value::Null);
    chunk(&mut out, json!([]), openai_usage(a));
    out.push_str("data: [DONE]\n\n");
    out
}
