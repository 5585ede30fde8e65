//! A bounded, seeded fuzz run of every stream parser and translator, in the normal test suite
//! (the cargo-fuzz targets in `fuzz/` need a nightly toolchain): random bytes, and valid streams
//! and bodies mutated (bytes flipped, cut, spliced, SSE syntax and JSON of the wrong type
//! inserted). Nothing may panic, and whatever a stream translator emits is SSE whose data is JSON
//! or `[DONE]`: the relay never forwards what it could not read.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod generate;

use generate::rng;
use onedoor_gateway::translate;
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};

const CASES: u64 = 3000;

const SPLICES: &[&str] = &[
    "\n\n",
    "\r\n\r\n",
    "\n",
    "data: ",
    "data:",
    "event: error\n",
    "event: message_stop\n",
    "data: [DONE]\n\n",
    "{",
    "}",
    "[",
    "]",
    "\"",
    "\\",
    ":",
    ",",
    "null",
    "-1",
    "1e999",
    "\u{0}",
    "é",
    "🙂",
    ": comment\n\n",
    "{\"type\":\"content_block_delta\",\"index\":99,\"delta\":{\"type\":\"input_json_delta\",\"partial_json\":\"{\"}}",
    "{\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"tool_use\"}}",
    "{\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":18446744073709551615}]}}]}",
    "{\"choices\":null,\"usage\":{\"prompt_tokens\":-5}}",
    "{\"error\":null}",
    "{\"type\":\"message_delta\",\"usage\":{\"output_tokens\":\"x\"}}",
];

fn mutate(rng: &mut StdRng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..rng.random_range(1..6) {
        let at = match out.is_empty() {
            true => 0,
            false => rng.random_range(0..=out.len()),
        };
        match rng.random_range(0..5) {
            0 if !out.is_empty() => {
                let i = rng.random_range(0..out.len());
                out[i] ^= 1 << rng.random_range(0..8);
            }
            1 => out.truncate(at),
            2 => {
                let splice = SPLICES[rng.random_range(0..SPLICES.len())].as_bytes();
                out.splice(at..at, splice.iter().copied());
            }
            3 if !out.is_empty() => {
                let from = rng.random_range(0..out.len());
                let to = rng.random_range(from..=out.len().min(from + 64));
                let copy = out[from..to].to_vec();
                out.splice(at..at, copy);
            }
            _ => {
                let end = rng.random_range(at..=out.len().min(at + 16));
                out.drain(at..end);
            }
        }
    }
    out
}

fn noise(rng: &mut StdRng) -> Vec<u8> {
    (0..rng.random_range(0..512))
        .map(|_| rng.random())
        .collect()
}

/// Every event of an emitted stream carries JSON (or `[DONE]`) data, or is a comment.
fn assert_well_formed(output: &[u8], what: &str, seed: u64) {
    assert_events(output, what, seed, |data| {
        serde_json::from_str::<Value>(data).is_ok()
    });
}

/// As [`assert_well_formed`], for events passed through as they came: their data is JSON by its
/// grammar (a number too large for a float is JSON, though no `Value` holds it).
fn assert_passed_well_formed(output: &[u8], what: &str, seed: u64) {
    assert_events(output, what, seed, |data| {
        serde_json::from_str::<serde::de::IgnoredAny>(data).is_ok()
    });
}

fn assert_events(output: &[u8], what: &str, seed: u64, json: impl Fn(&str) -> bool) {
    let text = String::from_utf8(output.to_vec())
        .unwrap_or_else(|_| panic!("{what} seed {seed}: not UTF-8"));
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        if event.starts_with(':') {
            continue;
        }
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        assert!(
            !data.is_empty(),
            "{what} seed {seed}: an event without data: {event:?}"
        );
        let data = data.join("\n");
        assert!(
            data == "[DONE]" || json(&data),
            "{what} seed {seed}: data that is not JSON: {data:?}"
        );
    }
}

fn inputs(rng: &mut StdRng, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let answer = generate::answer(rng);
    let anthropic = generate::anthropic_stream(rng, &answer).into_bytes();
    let openai = generate::openai_stream(rng, &answer, seed.is_multiple_of(2)).into_bytes();
    let responses = format!(
        "event: response.created\ndata: {}\n\nevent: response.output_text.delta\ndata: {}\n\nevent: response.completed\ndata: {}\n\n",
        json!({"type": "response.created", "response": {"id": "resp_1"}}),
        json!({"type": "response.output_text.delta", "delta": answer.text()}),
        json!({"type": "response.completed", "response": {"usage": {"input_tokens": 3, "output_tokens": 2}}}),
    )
    .into_bytes();
    (anthropic, openai, responses)
}

#[test]
fn stream_translators_survive_random_and_mutated_input() {
    for seed in 0..CASES {
        let mut rng = rng(seed);
        let (anthropic, openai, responses) = inputs(&mut rng, seed);
        // Passed through, a whole stream comes out as it went in.
        let passed = translate::anthropic_passed_stream(&anthropic);
        assert_eq!(passed.output, anthropic, "seed {seed}: passed through");
        let cases = [
            ("anthropic", mutate(&mut rng, &anthropic)),
            ("anthropic", noise(&mut rng)),
            ("openai", mutate(&mut rng, &openai)),
            ("openai", noise(&mut rng)),
            ("responses", mutate(&mut rng, &responses)),
        ];
        for (kind, input) in cases {
            let include_usage = rng.random_bool(0.5);
            match kind {
                "anthropic" => {
                    let out = translate::anthropic_stream(&input, include_usage);
                    assert_well_formed(&out.output, "anthropic stream", seed);
                    let encoded = translate::messages_stream(&out.output);
                    assert_well_formed(&encoded, "round trip", seed);
                    let passed = translate::anthropic_passed_stream(&input);
                    assert_passed_well_formed(&passed.output, "passed through", seed);
                }
                "openai" => {
                    let out = translate::chat_stream(&input, include_usage);
                    assert_well_formed(&out.output, "chat stream", seed);
                    let encoded = translate::messages_stream(&out.output);
                    assert_well_formed(&encoded, "messages stream", seed);
                    let raw = translate::messages_stream(&input);
                    assert_well_formed(&raw, "messages stream (raw)", seed);
                }
                _ => {
                    let _ = translate::responses_stream(&input);
                }
            }
        }
    }
}

/// A JSON value of a random shape, with the keys translators look for.
fn random_json(rng: &mut StdRng, depth: u32) -> Value {
    const KEYS: &[&str] = &[
        "role",
        "content",
        "type",
        "text",
        "tool_calls",
        "function",
        "arguments",
        "name",
        "id",
        "image_url",
        "url",
        "source",
        "media_type",
        "data",
        "tool_use_id",
        "tool_call_id",
        "input",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "parameters",
        "input_schema",
        "max_tokens",
        "stop",
        "stop_sequences",
        "temperature",
        "choices",
        "message",
        "usage",
        "stream",
        "parallel_tool_calls",
        "is_error",
        "n",
        "response_format",
        "user",
        "metadata",
    ];
    const WORDS: &[&str] = &[
        "user",
        "assistant",
        "tool",
        "system",
        "text",
        "image_url",
        "tool_use",
        "tool_result",
        "image",
        "function",
    ];
    match (depth, rng.random_range(0..8)) {
        (0, _) | (_, 0) => json!(generate::text_piece(rng)),
        (_, 1) => json!(rng.random_range(-3..5000)),
        (_, 2) => json!(rng.random_bool(0.5)),
        (_, 3) => Value::Null,
        (_, 4) => json!(WORDS[rng.random_range(0..WORDS.len())]),
        (_, 5) => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| random_json(rng, depth - 1))
                .collect(),
        ),
        _ => {
            let mut map = serde_json::Map::new();
            for _ in 0..rng.random_range(0..6) {
                let key = KEYS[rng.random_range(0..KEYS.len())].to_owned();
                map.insert(key, random_json(rng, depth - 1));
            }
            Value::Object(map)
        }
    }
}

#[test]
fn request_and_answer_translators_survive_random_and_mutated_bodies() {
    let chat = json!({"model": "m", "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo"}}]},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "r"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}], "tool_choice": "auto"})
    .to_string();
    let messages = json!({"model": "m", "max_tokens": 5, "system": "s", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "t"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}})
    .to_string();
    for seed in 0..CASES {
        let mut rng = rng(10_000_000 + seed);
        let answer = generate::answer(&mut rng);
        let message = generate::anthropic_message(&answer).to_string();
        let completion = generate::openai_completion(&answer, seed.is_multiple_of(2)).to_string();
        let nested = json!({"model": "m", "max_tokens": 3, "messages": random_json(&mut rng, 4)});
        let bodies = [
            mutate(&mut rng, chat.as_bytes()),
            mutate(&mut rng, messages.as_bytes()),
            mutate(&mut rng, message.as_bytes()),
            mutate(&mut rng, completion.as_bytes()),
            random_json(&mut rng, 5).to_string().into_bytes(),
            nested.to_string().into_bytes(),
            noise(&mut rng),
        ];
        for body in bodies {
            let _ = translate::chat_request_to_anthropic(&body, "claude");
            let _ = translate::messages_request(&body);
            let _ = translate::anthropic_answer(&body);
            let _ = translate::anthropic_error(&body);
            let _ = translate::chat_answer(&body);
            let _ = translate::messages_answer(&body);
            let _ = translate::messages_error(rng.random_range(100..600), &body);
        }
    }
}
