//! Property: the streamed and the whole translation of the same answer agree on text, tool calls,
//! finish reason and usage, in both directions (Anthropic upstream to OpenAI clients, OpenAI
//! upstream, lax ones included, to Anthropic clients). Cases come from a seeded generator.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod generate;

use std::collections::BTreeMap;

use generate::{rng, Answer};
use onedoor_gateway::translate;
use serde_json::{json, Value};

const CASES: u64 = 400;

fn data(sse: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(sse)
        .split("\n\n")
        .filter_map(|event| {
            event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_owned)
        })
        .filter(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}")))
        .collect()
}

/// What an OpenAI client makes of an answer: text, (id, name, arguments) per call, finish, usage.
#[derive(Debug, PartialEq)]
struct Seen {
    text: String,
    calls: Vec<(String, String, Value)>,
    finish: String,
    usage: (u64, u64, u64),
}

fn usage_of(u: &Value) -> (u64, u64, u64) {
    (
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["completion_tokens"].as_u64().unwrap_or(0),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

fn arguments(raw: &Value) -> Value {
    serde_json::from_str(raw.as_str().unwrap_or("null")).unwrap_or(Value::Null)
}

fn seen_completion(body: &Value) -> Seen {
    let message = &body["choices"][0]["message"];
    Seen {
        text: message["content"].as_str().unwrap_or_default().to_owned(),
        calls: message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                (
                    c["id"].as_str().unwrap().to_owned(),
                    c["function"]["name"].as_str().unwrap().to_owned(),
                    arguments(&c["function"]["arguments"]),
                )
            })
            .collect(),
        finish: body["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_owned(),
        usage: usage_of(&body["usage"]),
    }
}

/// Accumulates chunks as the OpenAI SDK does: text appended, tool calls by their index.
fn seen_chunks(chunks: &[Value]) -> Seen {
    let mut text = String::new();
    let mut calls: BTreeMap<u64, (String, String, String)> = BTreeMap::new();
    let mut finish = String::new();
    let mut usage = (0, 0, 0);
    for chunk in chunks {
        if !chunk["usage"].is_null() {
            usage = usage_of(&chunk["usage"]);
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            text.push_str(delta["content"].as_str().unwrap_or_default());
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                let entry = calls.entry(call["index"].as_u64().unwrap()).or_default();
                if let Some(id) = call["id"].as_str() {
                    entry.0 = id.to_owned();
                }
                if let Some(name) = call["function"]["name"].as_str() {
                    entry.1 = name.to_owned();
                }
                entry
                    .2
                    .push_str(call["function"]["arguments"].as_str().unwrap_or_default());
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = f.to_owned();
            }
        }
    }
    let calls = calls
        .into_values()
        .map(|(id, name, args)| {
            let args = serde_json::from_str(&args).unwrap_or(Value::Null);
            (id, name, args)
        })
        .collect();
    Seen {
        text,
        calls,
        finish,
        usage,
    }
}

fn expected(a: &Answer) -> Seen {
    Seen {
        text: a.text(),
        calls: a
            .calls
            .iter()
            .map(|c| (c.id.clone(), c.name.clone(), c.input.clone()))
            .collect(),
        finish: a.finish_reason().to_owned(),
        usage: (
            a.input_tokens + a.cache_read + a.cache_write,
            a.output_tokens,
            a.cache_read,
        ),
    }
}

#[test]
fn anthropic_answers_reach_openai_clients_the_same_whole_or_streamed() {
    for seed in 0..CASES {
        let mut rng = rng(seed);
        let answer = generate::answer(&mut rng);
        let message = generate::anthropic_message(&answer).to_string();
        let (whole, whole_usage) = translate::anthropic_answer(message.as_bytes());
        let stream = generate::anthropic_stream(&mut rng, &answer);
        let streamed = translate::anthropic_stream(stream.as_bytes(), true);
        let whole_seen = seen_completion(&serde_json::from_slice(&whole).unwrap());
        let stream_seen = seen_chunks(&data(&streamed.output));
        assert_eq!(whole_seen, expected(&answer), "seed {seed}: whole");
        assert_eq!(stream_seen, whole_seen, "seed {seed}: streamed\n{stream}");
        assert_eq!(
            Some(streamed.usage),
            whole_usage,
            "seed {seed}: the usage either way"
        );
        assert_eq!(streamed.usage.source.as_str(), "measured");
    }
}

/// What an Anthropic client makes of an answer: text, (id, name, input) per call, stop, usage.
#[derive(Debug, PartialEq)]
struct Claude {
    text: String,
    calls: Vec<(String, String, Value)>,
    stop: String,
    usage: (u64, u64, u64),
}

fn claude_usage(u: &Value) -> (u64, u64, u64) {
    (
        u["input_tokens"].as_u64().unwrap_or(0),
        u["output_tokens"].as_u64().unwrap_or(0),
        u["cache_read_input_tokens"].as_u64().unwrap_or(0),
    )
}

fn claude_message(body: &Value) -> Claude {
    let blocks = body["content"].as_array().cloned().unwrap_or_default();
    Claude {
        text: blocks.iter().filter_map(|b| b["text"].as_str()).collect(),
        calls: blocks
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| {
                (
                    b["id"].as_str().unwrap().to_owned(),
                    b["name"].as_str().unwrap().to_owned(),
                    b["input"].clone(),
                )
            })
            .collect(),
        stop: body["stop_reason"].as_str().unwrap().to_owned(),
        usage: claude_usage(&body["usage"]),
    }
}

/// Accumulates Anthropic events as the anthropic SDK does: blocks by index, JSON input parsed
/// at the end of its block.
fn claude_events(events: &[Value]) -> Claude {
    let mut blocks: BTreeMap<u64, (Value, String)> = BTreeMap::new();
    let mut stop = String::new();
    let mut usage = (0, 0, 0);
    for event in events {
        let index = event["index"].as_u64().unwrap_or(0);
        match event["type"].as_str().unwrap_or_default() {
            "content_block_start" => {
                blocks.insert(index, (event["content_block"].clone(), String::new()));
            }
            "content_block_delta" => {
                let (block, json) = blocks.get_mut(&index).expect("a delta for a started block");
                match event["delta"]["type"].as_str() {
                    Some("text_delta") => {
                        let text = block["text"].as_str().unwrap_or_default().to_owned()
                            + event["delta"]["text"].as_str().unwrap();
                        block["text"] = json!(text);
                    }
                    Some("input_json_delta") => {
                        json.push_str(event["delta"]["partial_json"].as_str().unwrap())
                    }
                    other => panic!("unexpected delta {other:?}"),
                }
            }
            "message_delta" => {
                stop = event["delta"]["stop_reason"].as_str().unwrap().to_owned();
                usage = claude_usage(&event["usage"]);
            }
            _ => {}
        }
    }
    let content: Vec<Value> = blocks
        .into_values()
        .map(|(mut block, json)| {
            if block["type"] == "tool_use" {
                block["input"] = match json.is_empty() {
                    true => json!({}),
                    false => serde_json::from_str(&json).unwrap(),
                };
            }
            block
        })
        .collect();
    let usage = json!({"input_tokens": usage.0, "output_tokens": usage.1, "cache_read_input_tokens": usage.2});
    claude_message(&json!({"content": content, "stop_reason": stop, "usage": usage}))
}

#[test]
fn openai_answers_reach_anthropic_clients_the_same_whole_or_streamed() {
    for seed in 0..CASES {
        let mut rng = rng(1_000_000 + seed);
        let mut answer = generate::answer(&mut rng);
        // OpenAI has no cache-write bucket.
        answer.cache_write = 0;
        let lax = seed.is_multiple_of(3);
        let completion = generate::openai_completion(&answer, lax).to_string();
        let (whole, _) = translate::chat_answer(completion.as_bytes());
        let message = translate::messages_answer(&whole);
        let stream = generate::openai_stream(&mut rng, &answer, lax);
        let relayed = translate::chat_stream(stream.as_bytes(), true);
        let events = translate::messages_stream(&relayed.output);
        let whole_seen = claude_message(&serde_json::from_slice(&message).unwrap());
        let stream_seen = claude_events(&data(&events));
        let stop = match answer.finish_reason() {
            "length" => "max_tokens",
            "tool_calls" => "tool_use",
            "content_filter" => "refusal",
            _ => "end_turn",
        };
        let expected = Claude {
            text: answer.text(),
            calls: answer
                .calls
                .iter()
                .map(|c| (c.id.clone(), c.name.clone(), c.input.clone()))
                .collect(),
            stop: stop.to_owned(),
            usage: (answer.input_tokens, answer.output_tokens, answer.cache_read),
        };
        assert_eq!(whole_seen, expected, "seed {seed}: whole");
        assert_eq!(stream_seen, whole_seen, "seed {seed}: streamed\n{stream}");
    }
}

#[test]
fn anthropic_answers_survive_the_round_trip_through_the_gateways_shape() {
    for seed in 0..CASES {
        let mut rng = rng(2_000_000 + seed);
        let answer = generate::answer(&mut rng);
        let original = generate::anthropic_message(&answer).to_string();
        let (whole, _) = translate::anthropic_answer(original.as_bytes());
        let message =
            claude_message(&serde_json::from_slice(&translate::messages_answer(&whole)).unwrap());
        let stream = generate::anthropic_stream(&mut rng, &answer);
        let chunks = translate::anthropic_stream(stream.as_bytes(), true);
        let events = claude_events(&data(&translate::messages_stream(&chunks.output)));
        assert_eq!(events, message, "seed {seed}");
        assert_eq!(message.text, answer.text());
        // stop_sequence comes back as end_turn: OpenAI's "stop" cannot tell them apart.
        let stop = match answer.stop {
            "stop_sequence" => "end_turn",
            other => other,
        };
        assert_eq!(message.stop, stop);
        assert_eq!(
            message.usage,
            (answer.input_tokens, answer.output_tokens, answer.cache_read)
        );
    }
}
