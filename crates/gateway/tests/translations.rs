//! Snapshot tests of every dialect translation, in both directions: requests, whole answers,
//! errors, and each stream event kind, against the JSON the reference (wire-protocols.md,
//! sections 2 to 4) says each side must see.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use onedoor_gateway::translate;
use serde_json::{json, Value};

fn parse(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(bytes)))
}

/// The data payloads of an SSE text, `[DONE]` as the string "[DONE]".
fn data(sse: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(sse)
        .split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data: "))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .map(|d| match d.as_str() {
            "[DONE]" => json!("[DONE]"),
            _ => parse(d.as_bytes()),
        })
        .collect()
}

/// The `event:` names of an SSE text.
fn names(sse: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(sse)
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .map(str::to_owned)
        .collect()
}

fn sse(events: &[(&str, Value)]) -> Vec<u8> {
    let mut out = String::new();
    for (name, data) in events {
        out.push_str(&format!("event: {name}\ndata: {data}\n\n"));
    }
    out.into_bytes()
}

fn chunks(values: &[Value]) -> Vec<u8> {
    let mut out = String::new();
    for v in values {
        out.push_str(&format!("data: {v}\n\n"));
    }
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

// --- OpenAI Chat Completions -> Anthropic Messages (requests) ----------------------------------

const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg==";

#[test]
fn a_chat_request_becomes_a_messages_request() {
    let chat = json!({
        "model": "chat-default",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this image, and what's the weather in Paris?"},
                // Declared as JPEG, but the bytes are a PNG: the real type is sent.
                {"type": "image_url", "image_url": {"url": format!("data:image/jpeg;base64,{PNG}"), "detail": "high"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg", "detail": "low"}}
            ], "name": "alice"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": ""}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\":18}"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
            {"role": "user", "content": "Thanks, and summarize."}
        ],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Get current weather",
                "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ],
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "stop": ["\n\nHuman:", "  "],
        "temperature": 1.7,
        "top_p": 0.9,
        "seed": 42,
        "user": "user-1234",
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    let out =
        translate::chat_request_to_anthropic(chat.to_string().as_bytes(), "claude-sonnet-4-5")
            .unwrap();
    let expected = json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 4096,
        "system": [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What is in this image, and what's the weather in Paris?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}
            ]},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"location": "Paris"}},
                {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "{\"temp_c\":18}"},
                {"type": "tool_result", "tool_use_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
                {"type": "text", "text": "Thanks, and summarize."}
            ]}
        ],
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 1.0,
        "top_p": 0.9,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "tools": [
            {"name": "get_weather", "description": "Get current weather",
             "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}},
            {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
        ],
        "metadata": {"user_id": "user-1234"},
        "stream": true
    });
    assert_eq!(parse(&out), expected);
}

#[test]
fn tool_choice_and_max_tokens_map_each_way() {
    let ask = |extra: Value| {
        let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        parse(&translate::chat_request_to_anthropic(body.to_string().as_bytes(), "claude").unwrap())
    };
    assert_eq!(ask(json!({}))["tool_choice"], Value::Null);
    assert_eq!(
        ask(json!({"tool_choice": "auto"}))["tool_choice"],
        json!({"type": "auto"})
    );
    assert_eq!(
        ask(json!({"tool_choice": "none"}))["tool_choice"],
        json!({"type": "none"})
    );
    assert_eq!(
        ask(json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}))["tool_choice"],
        json!({"type": "tool", "name": "f"})
    );
    assert_eq!(
        ask(json!({"parallel_tool_calls": false}))["tool_choice"],
        json!({"type": "auto", "disable_parallel_tool_use": true})
    );
    assert_eq!(ask(json!({"max_tokens": 100}))["max_tokens"], 100);
    assert_eq!(
        ask(json!({"max_tokens": 100, "max_completion_tokens": 50}))["max_tokens"],
        50
    );
    assert_eq!(ask(json!({"temperature": 0.3}))["temperature"], 0.3);
    assert_eq!(
        ask(json!({"stop": "END"}))["stop_sequences"],
        json!(["END"])
    );
    assert_eq!(
        ask(json!({"user": "jo@example.com"}))["metadata"],
        Value::Null
    );
}

#[test]
fn a_final_assistant_message_is_a_prefill_without_trailing_whitespace() {
    let chat = json!({"model": "m", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello from first "}
    ]});
    let out = parse(
        &translate::chat_request_to_anthropic(chat.to_string().as_bytes(), "claude").unwrap(),
    );
    assert_eq!(
        out["messages"][1],
        json!({"role": "assistant", "content": [{"type": "text", "text": "Hello from first"}]})
    );
}

#[test]
fn what_anthropic_cannot_say_is_refused_with_the_reason() {
    let refused = |body: Value| {
        translate::chat_request_to_anthropic(body.to_string().as_bytes(), "claude").unwrap_err()
    };
    let user =
        |content: Value| json!({"model": "m", "messages": [{"role": "user", "content": content}]});
    let audio = json!([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]);
    assert!(refused(user(audio)).contains("input_audio"));
    let pdf = json!([{"type": "image_url", "image_url": {"url": "data:application/pdf;base64,JVBERi0x"}}]);
    assert!(refused(user(pdf)).contains("application/pdf"));
    let mut n = user(json!("hi"));
    n["n"] = json!(2);
    assert!(refused(n).contains("`n`"));
    let mut schema = user(json!("hi"));
    schema["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
    assert!(refused(schema).contains("response_format"));
    let bad_arguments = json!({"model": "m", "messages": [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]});
    assert!(refused(bad_arguments).contains("not a JSON object"));
}

// --- Anthropic answers -> OpenAI answers ----------------------------------------------------------

#[test]
fn a_message_becomes_a_chat_completion() {
    let message = json!({
        "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "type": "message", "role": "assistant",
        "model": "claude-3-7-sonnet-20250219",
        "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Let me check "},
            {"type": "text", "text": "the weather."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"location": "Paris"}}
        ],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 2095, "cache_creation_input_tokens": 10, "cache_read_input_tokens": 100, "output_tokens": 503}
    });
    let (out, usage) = translate::anthropic_answer(message.to_string().as_bytes());
    let expected = json!({
        "id": "msg_013Zva2CMHLNnXjNJJKqJ2EF", "object": "chat.completion", "created": translate::CREATED,
        "model": "claude-3-7-sonnet-20250219",
        "choices": [{"index": 0, "logprobs": null, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Let me check the weather.", "refusal": null,
            "tool_calls": [{"id": "toolu_01", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}]
        }}],
        "usage": {"prompt_tokens": 2205, "completion_tokens": 503, "total_tokens": 2708,
            "prompt_tokens_details": {"cached_tokens": 100}, "cache_creation_input_tokens": 10}
    });
    assert_eq!(parse(&out), expected);
    let usage = usage.unwrap();
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens,
            usage.cache_write_tokens
        ),
        (2205, 503, 100, 10)
    );
}

#[test]
fn each_stop_reason_has_its_finish_reason() {
    for (stop, finish) in [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
        ("pause_turn", "stop"),
        ("model_context_window_exceeded", "length"),
    ] {
        let message = json!({"id": "m", "type": "message", "model": "c", "content": [], "stop_reason": stop, "usage": {"input_tokens": 1, "output_tokens": 1}});
        let (out, _) = translate::anthropic_answer(message.to_string().as_bytes());
        assert_eq!(parse(&out)["choices"][0]["finish_reason"], finish, "{stop}");
    }
}

#[test]
fn anthropic_errors_get_the_openai_envelope_and_codes_routing_reads() {
    let cases = [
        (
            json!({"type": "invalid_request_error", "message": "prompt is too long: 300000 tokens > 200000 maximum"}),
            json!({"type": "invalid_request_error", "code": "context_length_exceeded"}),
        ),
        (
            json!({"type": "authentication_error", "message": "invalid x-api-key"}),
            json!({"type": "invalid_request_error", "code": "invalid_api_key"}),
        ),
        (
            json!({"type": "not_found_error", "message": "model: claude-9"}),
            json!({"type": "invalid_request_error", "code": "model_not_found"}),
        ),
        (
            json!({"type": "rate_limit_error", "message": "slow down"}),
            json!({"type": "tokens", "code": "rate_limit_exceeded"}),
        ),
        (
            json!({"type": "overloaded_error", "message": "Overloaded"}),
            json!({"type": "server_error", "code": null}),
        ),
        (
            json!({"type": "api_error", "message": "Internal server error"}),
            json!({"type": "server_error", "code": null}),
        ),
        (
            json!({"type": "permission_error", "message": "no"}),
            json!({"type": "invalid_request_error", "code": null}),
        ),
    ];
    for (error, expected) in cases {
        let message = error["message"].clone();
        let body = json!({"type": "error", "error": error, "request_id": "req_1"});
        let out = parse(&translate::anthropic_error(body.to_string().as_bytes()).unwrap());
        assert_eq!(
            out,
            json!({"error": {"message": message, "type": expected["type"], "param": null, "code": expected["code"]}})
        );
    }
    assert_eq!(
        translate::anthropic_error(br#"{"error":{"code":"x"}}"#),
        None
    );
}

// --- Anthropic stream -> OpenAI chunks ------------------------------------------------------------

fn text_stream() -> Vec<u8> {
    sse(&[
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_01", "type": "message", "role": "assistant", "model": "claude-sonnet-4-5-20250929", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 12, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 1}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        ),
        ("ping", json!({"type": "ping"})),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hello"}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "! How are you?"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null}, "usage": {"output_tokens": 30}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ])
}

fn chunk(delta: Value, finish: Value) -> Value {
    json!({"id": "msg_01", "object": "chat.completion.chunk", "created": translate::CREATED, "model": "claude-sonnet-4-5-20250929",
        "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
}

#[test]
fn an_anthropic_text_stream_becomes_openai_chunks() {
    let out = translate::anthropic_stream(&text_stream(), false);
    let expected = vec![
        chunk(json!({"role": "assistant", "content": ""}), Value::Null),
        chunk(json!({"content": "Hello"}), Value::Null),
        chunk(json!({"content": "! How are you?"}), Value::Null),
        chunk(json!({}), json!("stop")),
        json!("[DONE]"),
    ];
    assert_eq!(data(&out.output), expected);
    let usage = out.usage;
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.cached_tokens
        ),
        (16, 30, 4)
    );
    assert_eq!(usage.source.as_str(), "measured");
}

#[test]
fn the_usage_chunk_comes_after_the_finish_when_the_client_asked() {
    let out = data(&translate::anthropic_stream(&text_stream(), true).output);
    assert_eq!(out.len(), 6);
    assert!(out[..4]
        .iter()
        .all(|c| c["usage"].is_null() && c.get("usage").is_some()));
    assert_eq!(out[4]["choices"], json!([]));
    assert_eq!(
        out[4]["usage"],
        json!({"prompt_tokens": 16, "completion_tokens": 30, "total_tokens": 46, "prompt_tokens_details": {"cached_tokens": 4}})
    );
    assert_eq!(out[5], "[DONE]");
}

#[test]
fn anthropic_tool_blocks_get_a_running_openai_tool_index() {
    let stream = sse(&[
        (
            "message_start",
            json!({"type": "message_start", "message": {"id": "msg_02", "model": "claude-haiku-4-5", "usage": {"input_tokens": 849, "output_tokens": 10}}}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": "Checking."}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 0}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": ""}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"location\": "}}),
        ),
        (
            "content_block_delta",
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "\"Paris\"}"}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 1}),
        ),
        (
            "content_block_start",
            json!({"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_b", "name": "get_time", "input": {}}}),
        ),
        (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": 2}),
        ),
        (
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"input_tokens": 849, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 47}}),
        ),
        ("message_stop", json!({"type": "message_stop"})),
    ]);
    let out = translate::anthropic_stream(&stream, false);
    let c = |delta: Value, finish: Value| {
        let mut v = chunk(delta, finish);
        v["id"] = json!("msg_02");
        v["model"] = json!("claude-haiku-4-5");
        v
    };
    let expected = vec![
        c(json!({"role": "assistant", "content": ""}), Value::Null),
        c(json!({"content": "Checking."}), Value::Null),
        c(
            json!({"tool_calls": [{"index": 0, "id": "toolu_a", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"location\": "}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 1, "id": "toolu_b", "type": "function", "function": {"name": "get_time", "arguments": ""}}]}),
            Value::Null,
        ),
        // No fragments at all: the arguments are still a JSON object.
        c(
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}),
            Value::Null,
        ),
        c(json!({}), json!("tool_calls")),
        json!("[DONE]"),
    ];
    assert_eq!(data(&out.output), expected);
    assert_eq!(
        (out.usage.prompt_tokens, out.usage.completion_tokens),
        (849, 47)
    );
}

#[test]
fn an_anthropic_error_event_becomes_an_openai_error_event() {
    let stream = text_stream();
    let text = String::from_utf8_lossy(&stream);
    let cut = text
        .split("event: content_block_delta")
        .next()
        .unwrap()
        .to_owned();
    let mut stream = cut.into_bytes();
    stream.extend(sse(&[(
        "error",
        json!({"type": "error", "error": {"details": null, "type": "overloaded_error", "message": "Overloaded"}}),
    )]));
    let out = data(&translate::anthropic_stream(&stream, false).output);
    assert_eq!(
        out.last().unwrap(),
        &json!({"error": {"message": "Overloaded", "type": "server_error", "param": null, "code": "overloaded_error"}})
    );
    assert!(!out.contains(&json!("[DONE]")));
}

#[test]
fn a_cut_anthropic_stream_counts_its_output_as_an_estimate() {
    let stream = text_stream();
    let upto = String::from_utf8_lossy(&stream)
        .find("event: content_block_stop")
        .unwrap();
    let out = translate::anthropic_stream(&stream[..upto], false);
    assert_eq!(out.usage.source.as_str(), "estimated");
    assert_eq!(
        out.usage.prompt_tokens, 16,
        "the input is known from message_start"
    );
    assert_eq!(
        out.usage.completion_tokens, 5,
        "19 characters sent, about 4 a token"
    );
}

// --- OpenAI-shaped streams (Azure, OpenAI-compatible) ----------------------------------------------

#[test]
fn a_well_formed_openai_stream_is_relayed_byte_for_byte() {
    let stream = concat!(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"f\",\"arguments\":\"\"}}]},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{}\"}}]},\"finish_reason\":null}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}],\"usage\":null}\n\n",
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4o\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,\"total_tokens\":11,\"prompt_tokens_details\":{\"cached_tokens\":3}}}\n\n",
        "data: [DONE]\n\n",
    );
    let asked = translate::chat_stream(stream.as_bytes(), true);
    assert_eq!(String::from_utf8(asked.output).unwrap(), stream);
    assert_eq!(
        (
            asked.usage.prompt_tokens,
            asked.usage.completion_tokens,
            asked.usage.cached_tokens
        ),
        (9, 2, 3)
    );
    // The usage chunk the gateway asked for on the client's behalf is not the client's to see.
    let unasked = translate::chat_stream(stream.as_bytes(), false);
    let without: String = stream
        .split_inclusive("\n\n")
        .filter(|e| !e.contains("\"choices\":[]"))
        .collect();
    assert_eq!(String::from_utf8(unasked.output).unwrap(), without);
    assert_eq!(unasked.usage.total_tokens(), 11);
}

#[test]
fn a_lax_servers_tool_calls_are_repaired() {
    let c = |delta: Value, finish: Value| {
        json!({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let stream = chunks(&[
        c(json!({"role": "assistant"}), Value::Null),
        c(
            json!({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"y\":2}"}}]}),
            Value::Null,
        ),
        c(json!({}), json!("stop")),
    ]);
    let out = translate::chat_stream(&stream, true);
    let expected = vec![
        c(json!({"role": "assistant"}), Value::Null),
        c(
            json!({"tool_calls": [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": "{\"x\":1}"}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 1, "id": "b", "type": "function", "function": {"name": "g", "arguments": ""}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"y\":2}"}}]}),
            Value::Null,
        ),
        c(json!({}), json!("tool_calls")),
        // No usage came, and the client asked: the gateway's estimate.
        json!({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 0, "completion_tokens": 4, "total_tokens": 4, "prompt_tokens_details": {"cached_tokens": 0}}}),
        json!("[DONE]"),
    ];
    assert_eq!(data(&out.output), expected);
    assert_eq!(out.usage.source.as_str(), "estimated");
}

#[test]
fn a_lax_servers_whole_answer_is_repaired() {
    let body = json!({"id": "x", "object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}}]});
    let (out, usage) = translate::chat_answer(body.to_string().as_bytes());
    let out = parse(&out);
    assert_eq!(out["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!(
        out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
        "{\"x\":1}"
    );
    assert_eq!(usage, None);
    let fine = r#"{"id":"x","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#;
    assert_eq!(translate::chat_answer(fine.as_bytes()).0, fine.as_bytes());
}

// --- Responses API streams ----------------------------------------------------------------------

#[test]
fn a_responses_stream_is_relayed_as_it_came_and_its_usage_read() {
    let stream = sse(&[
        (
            "response.created",
            json!({"type": "response.created", "sequence_number": 0, "response": {"id": "resp_1", "status": "in_progress", "output": []}}),
        ),
        (
            "response.output_text.delta",
            json!({"type": "response.output_text.delta", "sequence_number": 1, "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "Hi"}),
        ),
        (
            "response.completed",
            json!({"type": "response.completed", "sequence_number": 2, "response": {"id": "resp_1", "status": "completed",
            "usage": {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 8}}}),
        ),
    ]);
    let out = translate::responses_stream(&stream);
    assert_eq!(out.output, stream);
    assert_eq!(
        (out.usage.prompt_tokens, out.usage.completion_tokens),
        (7, 1)
    );
}

// --- Anthropic Messages clients: Messages -> Chat Completions and back -----------------------------

#[test]
fn a_messages_request_becomes_a_chat_request() {
    let body = json!({
        "model": "claude",
        "max_tokens": 1024,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "What's in this image?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo"}},
                {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}}
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me check."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"location": "Paris"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "{\"temp_c\":18}"},
                {"type": "text", "text": "Thanks, and summarize."}
            ]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true, "content": [{"type": "text", "text": "no clock"}]}]}
        ],
        "tools": [{"name": "get_weather", "description": "Get current weather", "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "metadata": {"user_id": "user-1234"},
        "stream": true
    });
    let out = parse(&translate::messages_request(body.to_string().as_bytes()).unwrap());
    let expected = json!({
        "model": "claude",
        "messages": [
            {"role": "system", "content": "You are terse.\nBe kind."},
            {"role": "user", "content": [
                {"type": "text", "text": "What's in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo"}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}
            ]},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "{\"temp_c\":18}"},
            {"role": "user", "content": "Thanks, and summarize."},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            ]},
            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"}
        ],
        "max_tokens": 1024,
        "temperature": 0.7, "top_p": 0.9,
        "stop": ["\n\nHuman:"],
        "user": "user-1234",
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get current weather", "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}],
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    assert_eq!(out, expected);
}

#[test]
fn a_messages_request_without_max_tokens_is_refused_like_anthropic_does() {
    let err = translate::messages_request(br#"{"model":"m","messages":[]}"#).unwrap_err();
    assert_eq!(err, "missing required field `max_tokens`");
    let server_tool = br#"{"model":"m","max_tokens":1,"messages":[],"tools":[{"type":"web_search_20250305","name":"web_search"}]}"#;
    let err = translate::messages_request(server_tool).unwrap_err();
    assert!(err.contains("server tools"), "{err}");
}

#[test]
fn a_chat_completion_becomes_a_message() {
    let completion = json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "gpt-4o-2024-11-20",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": "Calling.",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"location\":\"Paris\"}"}}]}}],
        "usage": {"prompt_tokens": 19, "completion_tokens": 10, "total_tokens": 29, "prompt_tokens_details": {"cached_tokens": 4}}});
    let out = parse(&translate::messages_answer(
        completion.to_string().as_bytes(),
    ));
    let expected = json!({"id": "chatcmpl-1", "type": "message", "role": "assistant", "model": "gpt-4o-2024-11-20",
        "content": [{"type": "text", "text": "Calling."}, {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"location": "Paris"}}],
        "stop_reason": "tool_use", "stop_sequence": null,
        "usage": {"input_tokens": 15, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 10}});
    assert_eq!(out, expected);
    for (finish, stop) in [
        ("stop", "end_turn"),
        ("length", "max_tokens"),
        ("content_filter", "refusal"),
    ] {
        let mut c = completion.clone();
        c["choices"][0]["finish_reason"] = json!(finish);
        let out = parse(&translate::messages_answer(c.to_string().as_bytes()));
        assert_eq!(out["stop_reason"], stop);
    }
}

#[test]
fn upstream_errors_reach_an_anthropic_client_in_its_shape() {
    let azure_filter = br#"{"error":{"message":"The response was filtered","type":null,"param":"prompt","code":"content_filter","status":400}}"#;
    assert_eq!(
        parse(&translate::messages_error(400, azure_filter)),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "The response was filtered"}})
    );
    let azure_own =
        br#"{"error":{"code":"429","message":"Requests ... Please retry after 6 seconds."}}"#;
    assert_eq!(
        parse(&translate::messages_error(429, azure_own))["error"]["type"],
        "rate_limit_error"
    );
    assert_eq!(
        parse(&translate::messages_error(503, b"oops"))["error"],
        json!({"type": "overloaded_error", "message": "oops"})
    );
}

#[test]
fn openai_chunks_become_the_anthropic_event_sequence() {
    let c = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": null})
    };
    let mut stream = Vec::new();
    stream.extend(b"data: {\"id\":\"\",\"choices\":[],\"created\":0,\"model\":\"\",\"object\":\"\",\"prompt_filter_results\":[]}\n\n");
    for v in [
        c(json!({"role": "assistant", "content": ""}), Value::Null),
        c(json!({"content": "Calling"}), Value::Null),
        c(json!({"content": " get_weather."}), Value::Null),
        c(
            json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"location\""}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 0, "function": {"arguments": ":\"Paris\"}"}}]}),
            Value::Null,
        ),
        c(
            json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}),
            Value::Null,
        ),
        c(json!({}), json!("tool_calls")),
        json!({"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 1, "model": "gpt-4o", "choices": [],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29}}),
    ] {
        stream.extend(format!("data: {v}\n\n").into_bytes());
    }
    stream.extend(b": x-onedoor-usage: measured prompt_tokens=20\n\ndata: [DONE]\n\n");
    let out = translate::messages_stream(&stream);
    assert_eq!(
        names(&out),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    let events = data(&out);
    assert_eq!(
        events[0],
        json!({"type": "message_start", "message": {"id": "chatcmpl-9", "type": "message", "role": "assistant",
        "model": "gpt-4o", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}})
    );
    assert_eq!(
        events[1],
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    );
    assert_eq!(
        events[2],
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Calling"}})
    );
    assert_eq!(
        events[5],
        json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}})
    );
    assert_eq!(
        events[6],
        json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"location\""}})
    );
    assert_eq!(events[9]["content_block"]["id"], "call_2");
    assert_eq!(
        events[10],
        json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{}"}})
    );
    assert_eq!(
        events[12],
        json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
        "usage": {"input_tokens": 20, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 9}})
    );
    assert_eq!(events[13], json!({"type": "message_stop"}));
    assert!(
        String::from_utf8_lossy(&out).contains(": x-onedoor-usage: measured"),
        "the usage comment passes through"
    );
}

#[test]
fn an_openai_error_event_becomes_an_anthropic_error_event() {
    let stream = b"data: {\"id\":\"c\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: {\"error\":{\"message\":\"cut\",\"type\":\"server_error\",\"param\":null,\"code\":\"upstream_failed\"}}\n\n";
    let out = translate::messages_stream(stream);
    assert_eq!(
        names(&out),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "error"
        ]
    );
    assert_eq!(
        data(&out)[3],
        json!({"type": "error", "error": {"type": "api_error", "message": "cut"}})
    );
}
