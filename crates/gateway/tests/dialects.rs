//! One API over every backend, through real HTTP: OpenAI clients on Anthropic backends, Anthropic
//! clients on Azure (and Anthropic) backends, streaming included; usage measured where the
//! upstream reports it and labelled an estimate where it does not; the quirks of lax
//! OpenAI-compatible servers repaired; Responses follow-ups pinned to the backend that holds them.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use bytes::Bytes;
use common::*;
use http::Method;
use serde_json::{json, Value};

const CLAUDE: &str = "claude-sonnet-4-5";

fn config(models: &str) -> String {
    format!(
        "backends:\n  - {{ name: claude, provider: anthropic, region: europe, url: \"{{url:claude}}\", anthropic_version: 2023-06-01 }}\n  - {{ name: az, provider: azure, region: swedencentral, url: \"{{url:az}}\" }}\n  - {{ name: az2, provider: azure, region: francecentral, url: \"{{url:az2}}\" }}\n  - {{ name: vllm, provider: openai, region: onprem, url: \"{{url:vllm}}\" }}\nmodels:\n{models}"
    )
}

fn fleet() -> Vec<EndpointSpec> {
    vec![
        EndpointSpec::anthropic("claude", "europe")
            .deployment(DeploymentSpec::new(CLAUDE).model("claude-sonnet-4-5-20250929")),
        EndpointSpec::azure("az", "swedencentral")
            .deployment(DeploymentSpec::new("gpt-4o").model("gpt-4o-2024-11-20"))
            .deployment(DeploymentSpec::new("embed")),
        EndpointSpec::azure("az2", "francecentral")
            .deployment(DeploymentSpec::new("gpt-4o").model("gpt-4o-2024-11-20")),
        EndpointSpec::openai("vllm", "onprem").deployment(DeploymentSpec::new("llama")),
    ]
}

const MODELS: &str = "  - name: claude\n    targets: [{ backend: claude, model: claude-sonnet-4-5 }]\n  - name: gpt\n    targets: [{ backend: az, deployment: gpt-4o }]\n  - name: llama\n    targets: [{ backend: vllm, model: llama }]\n  - name: embed\n    targets: [{ backend: az, deployment: embed }]\n  - name: resp\n    targets:\n      - { backend: az, deployment: gpt-4o }\n      - { backend: az2, deployment: gpt-4o }\n      - { backend: claude, model: claude-sonnet-4-5 }\n";

async fn harness() -> Harness {
    Harness::start(fleet(), &config(MODELS)).await
}

/// The data payloads of an SSE body, `[DONE]` left out.
fn chunks(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn event_names(body: &str) -> Vec<&str> {
    body.lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect()
}

fn text(chunks: &[Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect()
}

/// The usage the stream's final comment tells: (source, prompt, completion).
fn usage_comment(body: &str) -> (String, u64, u64) {
    let line = body
        .lines()
        .find_map(|l| l.strip_prefix(": x-onedoor-usage: "))
        .unwrap_or_else(|| panic!("no usage comment in {body}"));
    let source = line.split(' ').next().unwrap().to_owned();
    let number = |key: &str| {
        line.split(' ')
            .find_map(|w| w.strip_prefix(&format!("{key}=")))
            .unwrap()
            .parse()
            .unwrap()
    };
    (source, number("prompt_tokens"), number("completion_tokens"))
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]}}})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}})
}

fn weather_tool_anthropic() -> Value {
    json!({"name": "get_weather", "description": "Weather now", "input_schema": weather_tool()["function"]["parameters"]})
}

fn chat(model: &str, extra: Value) -> Value {
    let mut body = chat_body(model, false);
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

async fn messages(h: &Harness, headers: &[(&str, &str)], body: Value) -> Answer {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    h.send(
        Method::POST,
        h.url("/v1/messages"),
        &all,
        Bytes::from(body.to_string()),
    )
    .await
}

fn claude_ask(model: &str, extra: Value) -> Value {
    let mut body = json!({"model": model, "max_tokens": 256, "messages": [{"role": "user", "content": "Hello there"}]});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    body
}

const OLD_SDK: [(&str, &str); 2] = [("x-api-key", KEY), ("anthropic-version", "2023-06-01")];

// --- OpenAI clients, Anthropic backend -------------------------------------------------------------

#[tokio::test]
async fn an_openai_client_gets_a_chat_completion_from_an_anthropic_backend() {
    let h = harness().await;
    let answer = h.chat("claude").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-backend"), "claude");
    assert_eq!(answer.header("x-onedoor-usage"), "measured");
    assert_eq!(answer.header("content-type"), "application/json");
    let body = answer.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "claude-sonnet-4-5-20250929");
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    let choice = &body["choices"][0];
    assert_eq!(
        choice["message"]["content"],
        "Hello from claude/claude-sonnet-4-5 this is a simulated reply"
    );
    assert_eq!(choice["finish_reason"], "stop");
    // The mock counts "Hello there" as 3 tokens plus 3 for the message, and a word a token.
    assert_eq!(body["usage"]["prompt_tokens"], 6);
    assert_eq!(body["usage"]["completion_tokens"], 8);
    assert_eq!(body["usage"]["total_tokens"], 14);
}

#[tokio::test]
async fn an_anthropic_stream_reaches_an_openai_client_as_chunks_with_measured_usage() {
    let h = harness().await;
    let ask = chat(
        "claude",
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let answer = h.post("/v1/chat/completions", ask).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("content-type"), "text/event-stream");
    assert_eq!(answer.header("x-onedoor-usage"), "measured");
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    let chunks = chunks(&answer.body);
    let ids: std::collections::BTreeSet<String> =
        chunks.iter().map(|c| c["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "one id per stream: {ids:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(
        text(&chunks),
        "Hello from claude/claude-sonnet-4-5 this is a simulated reply"
    );
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["prompt_tokens"], 6);
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    assert_eq!(usage_comment(&answer.body), ("measured".into(), 6, 8));
}

#[tokio::test]
async fn an_openai_client_calls_tools_on_an_anthropic_backend_and_gets_the_answer() {
    let h = harness().await;
    let ask = chat("claude", json!({"tools": [weather_tool(), time_tool()]}));
    let asked = h.post("/v1/chat/completions", ask).await;
    assert_eq!(asked.status, 200, "{}", asked.body);
    let message = asked.json()["choices"][0]["message"].clone();
    assert_eq!(asked.json()["choices"][0]["finish_reason"], "tool_calls");
    let calls = message["tool_calls"].as_array().unwrap().clone();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert_eq!(
        calls[0]["function"]["arguments"],
        "{\"location\":\"Paris\"}"
    );
    assert!(calls[0]["id"].as_str().unwrap().starts_with("toolu_"));
    let history = json!([
        {"role": "user", "content": "Hello there"},
        message,
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18C"},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "noon"},
    ]);
    let follow = chat(
        "claude",
        json!({"messages": history, "tools": [weather_tool()]}),
    );
    let answered = h.post("/v1/chat/completions", follow).await;
    assert_eq!(answered.status, 200, "{}", answered.body);
    let content = answered.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        content.starts_with("Hello from claude/claude-sonnet-4-5 got 18C noon"),
        "both results came back in one user turn: {content}"
    );
}

#[tokio::test]
async fn streamed_tool_calls_from_anthropic_get_running_openai_indices() {
    let h = harness().await;
    let ask = chat(
        "claude",
        json!({"stream": true, "tools": [weather_tool(), time_tool()]}),
    );
    let answer = h.post("/v1/chat/completions", ask).await;
    let chunks = chunks(&answer.body);
    assert_eq!(text(&chunks), "Calling get_weather and get_time.");
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    let starts: Vec<(u64, &str)> = calls
        .iter()
        .filter(|call| call.get("id").is_some())
        .map(|call| {
            (
                call["index"].as_u64().unwrap(),
                call["function"]["name"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(starts, [(0, "get_weather"), (1, "get_time")]);
    let arguments: String = calls
        .iter()
        .filter(|call| call["index"] == 0)
        .filter_map(|call| call["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, "{\"location\":\"Paris\"}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
}

#[tokio::test]
async fn an_overloaded_anthropic_backend_fails_over_like_a_503() {
    let models = "  - name: chat\n    targets:\n      - { backend: claude, model: claude-sonnet-4-5, priority: 1 }\n      - { backend: az, deployment: gpt-4o, priority: 2 }\n";
    let h = Harness::start(fleet(), &config(models)).await;
    h.endpoint("claude").set_behavior(Behavior {
        status: Some(529),
        ..Behavior::default()
    });
    let answer = h.chat("chat").await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "claude=529,claude=529,az=200");
}

#[tokio::test]
async fn an_anthropic_rate_limit_cools_the_target_for_its_retry_after() {
    let models = "  - name: chat\n    targets:\n      - { backend: claude, model: claude-sonnet-4-5, priority: 1 }\n      - { backend: az, deployment: gpt-4o, priority: 2 }\n";
    let h = Harness::start(fleet(), &config(models)).await;
    h.endpoint("claude").set_behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(30),
        ..Behavior::default()
    });
    let first = h.chat("chat").await;
    assert_eq!(first.attempts(), "claude=429,az=200");
    let second = h.chat("chat").await;
    assert_eq!(second.attempts(), "az=200", "claude cools down for 30 s");
}

#[tokio::test]
async fn a_request_anthropic_cannot_take_is_refused_in_openai_shape() {
    let h = harness().await;
    let answer = h
        .post("/v1/chat/completions", chat("claude", json!({"n": 3})))
        .await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    assert!(answer.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`n`"));
}

// --- Anthropic clients --------------------------------------------------------------------------

#[tokio::test]
async fn an_anthropic_client_gets_a_message_from_an_azure_deployment() {
    let h = harness().await;
    let bearer = format!("Bearer {KEY}");
    let new_sdk = [
        ("authorization", bearer.as_str()),
        ("anthropic-version", "2026-10-21"),
    ];
    for headers in [OLD_SDK, new_sdk] {
        let answer = messages(&h, &headers, claude_ask("gpt", json!({}))).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.header("x-onedoor-backend"), "az");
        assert_eq!(answer.header("x-onedoor-usage"), "measured");
        let body = answer.json();
        assert_eq!(body["type"], "message");
        assert_eq!(body["role"], "assistant");
        assert_eq!(body["model"], "gpt-4o-2024-11-20");
        assert_eq!(
            body["content"],
            json!([{"type": "text", "text": "Hello from az/gpt-4o this is a simulated reply"}])
        );
        assert_eq!(body["stop_reason"], "end_turn");
        assert_eq!(body["usage"]["input_tokens"], 6);
        assert_eq!(body["usage"]["output_tokens"], 8);
    }
}

#[tokio::test]
async fn an_anthropic_client_streams_from_azure_in_anthropics_event_sequence() {
    let h = harness().await;
    let answer = messages(&h, &OLD_SDK, claude_ask("gpt", json!({"stream": true}))).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("content-type"), "text/event-stream");
    let mut expected = vec!["message_start", "content_block_start"];
    expected.extend(["content_block_delta"; 8]);
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(event_names(&answer.body), expected, "{}", answer.body);
    let data = chunks(&answer.body);
    let streamed: String = data
        .iter()
        .filter_map(|d| d["delta"]["text"].as_str())
        .collect();
    assert_eq!(streamed, "Hello from az/gpt-4o this is a simulated reply");
    let delta = &data[data.len() - 2];
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["input_tokens"], 6);
    assert_eq!(delta["usage"]["output_tokens"], 8);
    assert_eq!(usage_comment(&answer.body), ("measured".into(), 6, 8));
}

#[tokio::test]
async fn an_anthropic_client_calls_tools_on_azure() {
    let h = harness().await;
    let ask = claude_ask(
        "gpt",
        json!({"tools": [weather_tool_anthropic()], "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}}),
    );
    let answer = messages(&h, &OLD_SDK, ask).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body = answer.json();
    assert_eq!(body["stop_reason"], "tool_use");
    let tool_use = body["content"][1].clone();
    assert_eq!(tool_use["type"], "tool_use");
    assert_eq!(tool_use["name"], "get_weather");
    assert_eq!(tool_use["input"], json!({"location": "Paris"}));
    let follow = json!({"model": "gpt", "max_tokens": 256, "tools": [weather_tool_anthropic()], "messages": [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": body["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use["id"], "content": "18C"}]},
    ]});
    let answered = messages(&h, &OLD_SDK, follow).await;
    assert_eq!(answered.status, 200, "{}", answered.body);
    let text = answered.json()["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(text.starts_with("Hello from az/gpt-4o got 18C"), "{text}");
    let ask = claude_ask(
        "gpt",
        json!({"stream": true, "tools": [weather_tool_anthropic()]}),
    );
    let streamed = messages(&h, &OLD_SDK, ask).await;
    let data = chunks(&streamed.body);
    let tool_start = data
        .iter()
        .find(|d| d["content_block"]["type"] == "tool_use")
        .unwrap();
    assert_eq!(tool_start["index"], 1);
    let input: String = data
        .iter()
        .filter_map(|d| d["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(input, "{\"location\":\"Paris\"}");
    assert_eq!(data[data.len() - 2]["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn an_anthropic_client_on_an_anthropic_backend_gets_the_message_back() {
    let h = harness().await;
    let answer = messages(&h, &OLD_SDK, claude_ask("claude", json!({}))).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body = answer.json();
    assert_eq!(body["type"], "message");
    assert!(body["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(
        body["content"][0]["text"],
        "Hello from claude/claude-sonnet-4-5 this is a simulated reply"
    );
    assert_eq!(body["usage"]["input_tokens"], 6);
}

#[tokio::test]
async fn an_anthropic_client_gets_every_error_in_anthropics_shape() {
    let h = harness().await;
    let unknown = messages(&h, &OLD_SDK, claude_ask("nope", json!({}))).await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.json()["type"], "error");
    assert_eq!(unknown.json()["error"]["type"], "not_found_error");
    assert_eq!(unknown.header("x-onedoor-error"), "model_not_found");
    let wrong_key = messages(
        &h,
        &[("x-api-key", "nope"), ("anthropic-version", "2023-06-01")],
        claude_ask("gpt", json!({})),
    )
    .await;
    assert_eq!(wrong_key.status, 401);
    assert_eq!(wrong_key.json()["error"]["type"], "authentication_error");
    let mut no_max = claude_ask("gpt", json!({}));
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let refused = messages(&h, &OLD_SDK, no_max).await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused.json(),
        json!({"type": "error", "error": {"type": "invalid_request_error", "message": "missing required field `max_tokens`"}})
    );
    let flagged = json!({"model": "gpt", "max_tokens": 10, "messages": [{"role": "user", "content": "a forbidden-word here"}]});
    let filtered = messages(&h, &OLD_SDK, flagged).await;
    assert_eq!(filtered.status, 400, "{}", filtered.body);
    assert_eq!(filtered.json()["type"], "error");
    assert_eq!(filtered.json()["error"]["type"], "invalid_request_error");
    assert!(filtered.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("content management policy"));
}

// --- Usage on OpenAI-shaped streams ------------------------------------------------------------

#[tokio::test]
async fn an_azure_stream_is_measured_without_showing_the_usage_chunk_the_client_did_not_ask_for() {
    let h = harness().await;
    let answer = h.post("/v1/chat/completions", chat_body("gpt", true)).await;
    assert_eq!(answer.header("x-onedoor-usage"), "measured");
    let chunks = chunks(&answer.body);
    assert!(
        chunks
            .iter()
            .all(|c| c["choices"].as_array().is_some_and(|c| !c.is_empty())),
        "{}",
        answer.body
    );
    assert_eq!(usage_comment(&answer.body), ("measured".into(), 6, 8));
    assert!(answer.body.ends_with("data: [DONE]\n\n"));
    let ask = chat(
        "gpt",
        json!({"stream": true, "stream_options": {"include_usage": true}}),
    );
    let asked = h
        .post(
            "/openai/deployments/gpt/chat/completions?api-version=2024-10-21",
            ask,
        )
        .await;
    let chunks = self::chunks(&asked.body);
    assert_eq!(
        chunks[0]["choices"],
        json!([]),
        "Azure paths keep the filter chunk"
    );
    assert_eq!(chunks.last().unwrap()["usage"]["total_tokens"], 14);
}

#[tokio::test]
async fn a_lax_openai_compatible_server_is_repaired_and_its_usage_estimated() {
    let h = harness().await;
    h.endpoint("vllm").set_behavior(Behavior {
        compat_quirks: true,
        ..Behavior::default()
    });
    let ask = chat(
        "llama",
        json!({"stream": true, "tools": [weather_tool(), time_tool()]}),
    );
    let answer = h.post("/v1/chat/completions", ask).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        answer.header("x-onedoor-usage"),
        "",
        "unknown until the end"
    );
    let chunks = chunks(&answer.body);
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[1]["index"], 1);
    assert_eq!(
        calls[0]["function"]["arguments"],
        "{\"location\":\"Paris\"}"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    let (source, _, completion) = usage_comment(&answer.body);
    assert_eq!(source, "estimated");
    assert!(completion > 0);
    let ask = chat("llama", json!({"tools": [weather_tool(), time_tool()]}));
    let whole = h.post("/v1/chat/completions", ask).await;
    assert_eq!(whole.header("x-onedoor-usage"), "estimated");
    let body = whole.json();
    assert_eq!(body["choices"][0]["finish_reason"], "tool_calls");
    assert!(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"].is_string());
}

#[tokio::test]
async fn a_well_behaved_openai_compatible_stream_is_measured() {
    let h = harness().await;
    let answer = h
        .post("/v1/chat/completions", chat_body("llama", true))
        .await;
    assert_eq!(usage_comment(&answer.body), ("measured".into(), 6, 8));
    assert!(!answer.body.contains("\"choices\":[]"), "{}", answer.body);
}

#[tokio::test]
async fn embeddings_usage_is_measured() {
    let h = harness().await;
    let answer = h
        .post(
            "/v1/embeddings",
            json!({"model": "embed", "input": ["abcdefgh", "ijkl"]}),
        )
        .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-usage"), "measured");
    assert_eq!(answer.json()["usage"]["prompt_tokens"], 3);
}

// --- Responses API ------------------------------------------------------------------------------

fn responses_ask(previous: Option<&str>) -> Value {
    let mut body = json!({"model": "resp", "input": "Hello there"});
    if let Some(previous) = previous {
        body["previous_response_id"] = json!(previous);
    }
    body
}

#[tokio::test]
async fn responses_follow_ups_go_to_the_backend_that_holds_the_response() {
    let h = harness().await;
    for _ in 0..3 {
        let first = h.post("/v1/responses", responses_ask(None)).await;
        assert_eq!(first.status, 200, "{}", first.body);
        assert_eq!(first.header("x-onedoor-usage"), "measured");
        let holder = first.header("x-onedoor-backend").to_owned();
        assert!(holder == "az" || holder == "az2", "{holder}");
        let mut previous = first.json()["id"].as_str().unwrap().to_owned();
        for _ in 0..4 {
            let next = h
                .post("/v1/responses", responses_ask(Some(&previous)))
                .await;
            assert_eq!(next.status, 200, "{}", next.body);
            assert_eq!(next.header("x-onedoor-backend"), holder);
            previous = next.json()["id"].as_str().unwrap().to_owned();
        }
    }
    assert!(h.endpoint("az").requests("gpt-4o") > 0 && h.endpoint("az2").requests("gpt-4o") > 0);
    assert_eq!(
        h.endpoint("claude").total_requests(),
        0,
        "Anthropic does not serve Responses"
    );
}

#[tokio::test]
async fn a_streamed_response_is_relayed_and_pinned() {
    let h = harness().await;
    let ask = json!({"model": "resp", "input": "Hello", "stream": true});
    let answer = h.post("/v1/responses", ask).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let names = event_names(&answer.body);
    assert_eq!(names.first(), Some(&"response.created"));
    assert_eq!(names.last(), Some(&"response.completed"));
    let data = chunks(&answer.body);
    let id = data[0]["response"]["id"].as_str().unwrap().to_owned();
    let streamed: String = data
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .filter_map(|d| d["delta"].as_str())
        .collect();
    assert!(streamed.starts_with("Hello from az"), "{streamed}");
    let (source, _, completion) = usage_comment(&answer.body);
    assert_eq!((source.as_str(), completion), ("measured", 8));
    let holder = answer.header("x-onedoor-backend").to_owned();
    for _ in 0..4 {
        let next = h.post("/v1/responses", responses_ask(Some(&id))).await;
        assert_eq!(next.header("x-onedoor-backend"), holder, "{}", next.body);
    }
}

#[tokio::test]
async fn an_openai_compatible_server_serves_responses() {
    let models = "  - name: resp\n    targets: [{ backend: vllm, model: llama }]\n";
    let h = Harness::start(fleet(), &config(models)).await;
    let answer = h.post("/v1/responses", responses_ask(None)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.json()["object"], "response");
    assert_eq!(answer.json()["model"], "llama");
}

// --- Cut streams ------------------------------------------------------------------------------

#[tokio::test]
async fn a_cut_anthropic_stream_ends_in_an_error_event() {
    let h = harness().await;
    h.endpoint("claude").set_behavior(Behavior {
        cut_after: Some(3),
        ..Behavior::default()
    });
    let answer = h
        .post("/v1/chat/completions", chat_body("claude", true))
        .await;
    let chunks = chunks(&answer.body);
    assert!(
        chunks.last().unwrap().get("error").is_some(),
        "{}",
        answer.body
    );
    assert!(!answer.body.contains("[DONE]"));
    let (source, prompt, _) = usage_comment(&answer.body);
    assert_eq!((source.as_str(), prompt), ("estimated", 6));
}

#[tokio::test]
async fn a_cut_stream_is_continued_by_an_anthropic_prefill_target() {
    let models = "  - name: chat\n    continue_cut_streams: true\n    targets:\n      - { backend: az, deployment: gpt-4o, priority: 1 }\n      - { backend: claude, model: claude-sonnet-4-5, priority: 2, accepts_prefill: true }\n";
    let h = Harness::start(fleet(), &config(models)).await;
    h.endpoint("az").set_behavior(Behavior {
        cut_after: Some(3),
        ..Behavior::default()
    });
    let answer = h
        .post("/v1/chat/completions", chat_body("chat", true))
        .await;
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    let chunks = chunks(&answer.body);
    let ids: std::collections::BTreeSet<String> =
        chunks.iter().map(|c| c["id"].to_string()).collect();
    assert_eq!(ids.len(), 1, "{ids:?}");
    let text = text(&chunks);
    assert!(
        text.starts_with("Hello from az/gpt-4o continued by claude/claude-sonnet-4-5"),
        "{text}"
    );
    assert_eq!(
        usage_comment(&answer.body).0,
        "estimated",
        "the cut part was counted"
    );
}
