//! Same dialect, nothing lost, through real HTTP: an Anthropic client on an Anthropic backend
//! has its request sent as it came but for the model (thinking blocks and their signatures,
//! `cache_control`, `metadata`, `tool_choice`, fields nobody knows yet, its `anthropic-beta`
//! header), and its answer, whole or streamed, back as the upstream wrote it, usage read (the
//! cache buckets with it); OpenAI and Azure clients likewise keep the fields the gateway does
//! not know. Failover across dialects still translates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use bytes::Bytes;
use common::*;
use http::Method;
use serde_json::{json, Value};

const CLAUDE: &str = "claude-sonnet-4-5";
const REDACTED: &str = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_46C9A13E193C177646C7398A98432ECCCE4C1253D5E2D82641AC0E52CC2876CB";

fn fleet() -> Vec<EndpointSpec> {
    vec![
        EndpointSpec::anthropic("claude", "europe")
            .deployment(DeploymentSpec::new(CLAUDE).model("claude-sonnet-4-5-20250929")),
        EndpointSpec::azure("az", "swedencentral").deployment(DeploymentSpec::new("gpt-4o")),
        EndpointSpec::openai("vllm", "onprem").deployment(DeploymentSpec::new("llama")),
    ]
}

const CONFIG: &str = r#"backends:
  - { name: claude, provider: anthropic, region: europe, url: "{url:claude}", anthropic_version: 2023-06-01 }
  - { name: az, provider: azure, region: swedencentral, url: "{url:az}" }
  - { name: vllm, provider: openai, region: onprem, url: "{url:vllm}" }
models:
  - name: claude
    targets: [{ backend: claude, model: claude-sonnet-4-5 }]
  - name: gpt
    targets: [{ backend: az, deployment: gpt-4o }]
  - name: llama
    targets: [{ backend: vllm, model: llama }]
  - name: claude-then-gpt
    targets:
      - { backend: claude, model: claude-sonnet-4-5, priority: 1 }
      - { backend: az, deployment: gpt-4o, priority: 2 }
  - name: gpt-then-claude
    targets:
      - { backend: az, deployment: gpt-4o, priority: 1 }
      - { backend: claude, model: claude-sonnet-4-5, priority: 2 }
"#;

async fn harness() -> Harness {
    Harness::start(fleet(), CONFIG).await
}

const CLIENT: [(&str, &str); 3] = [
    ("x-api-key", KEY),
    ("anthropic-version", "2023-06-01"),
    ("content-type", "application/json"),
];

async fn messages_raw(h: &Harness, extra: &[(&str, &str)], body: &str) -> Answer {
    let mut headers = CLIENT.to_vec();
    headers.extend_from_slice(extra);
    let body = Bytes::from(body.to_owned());
    h.send(Method::POST, h.url("/v1/messages"), &headers, body)
        .await
}

async fn messages(h: &Harness, body: &Value) -> Answer {
    messages_raw(h, &[], &body.to_string()).await
}

/// The body the endpoint last received, as it arrived.
fn received(h: &Harness, endpoint: &str) -> String {
    let last = h.endpoint(endpoint).last_request();
    last["body"].as_str().unwrap_or_default().to_owned()
}

fn weather_tool() -> Value {
    json!({"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object",
        "properties": {"location": {"type": "string"}}, "required": ["location"]}})
}

fn thinking_ask(model: &str, stream: bool) -> Value {
    json!({
        "model": model, "max_tokens": 2048, "stream": stream,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [weather_tool()],
        "messages": [{"role": "user", "content": format!("Weather in Paris? {REDACTED}")}],
    })
}

/// The SSE events of a body: (name, data), the gateway's usage comment and `[DONE]` left out.
fn events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty() && !e.starts_with(':'))
        .filter_map(|e| {
            let name = e
                .lines()
                .find_map(|l| l.strip_prefix("event: "))
                .unwrap_or("");
            let data = e.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
            let data = serde_json::from_str(data).ok()?;
            Some((name.to_owned(), data))
        })
        .collect()
}

#[tokio::test]
async fn an_anthropic_request_reaches_an_anthropic_backend_as_it_came_but_for_its_model() {
    let h = harness().await;
    // Written by hand, spacing and member order included, with fields onedoor does not know.
    let body = r#"{"model": "claude", "max_tokens": 300,
 "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
 "metadata": {"user_id": "u-42"}, "tool_choice": {"type": "auto", "disable_parallel_tool_use": true},
 "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
 "messages": [{"role": "user", "content": [
   {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The sky is blue."}, "citations": {"enabled": true}},
   {"type": "text", "text": "What colour is the sky?", "cache_control": {"type": "ephemeral"}}]}],
 "future_field": {"nested": [1, 2.50, "x\u00e9"]},
 "top_k": 5}"#;
    let answer = messages_raw(
        &h,
        &[("anthropic-beta", "interleaved-thinking-2025-05-14")],
        body,
    )
    .await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.header("x-onedoor-backend"), "claude");
    let sent = received(&h, "claude");
    let expected = body.replacen(r#""model": "claude""#, r#""model":"claude-sonnet-4-5""#, 1);
    // Members are written back without the spaces between them; every value is as it came.
    let members = |text: &str| -> Vec<(String, String)> {
        let map: serde_json::Map<String, Value> = serde_json::from_str(text).unwrap();
        map.into_iter().map(|(k, v)| (k, v.to_string())).collect()
    };
    assert_eq!(members(&sent), members(&expected));
    for value in [
        r#"{"nested": [1, 2.50, "x\u00e9"]}"#,
        r#"{"type": "ephemeral", "ttl": "1h"}"#,
        r#"[{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]"#,
    ] {
        assert!(sent.contains(value), "{value} not byte for byte in {sent}");
    }
    let headers = &h.endpoint("claude").last_request()["headers"];
    assert_eq!(headers["anthropic-beta"], "interleaved-thinking-2025-05-14");
    assert_eq!(headers["anthropic-version"], "2023-06-01");
}

#[tokio::test]
async fn a_request_only_anthropic_can_take_goes_to_anthropic_targets_and_is_refused_by_others() {
    let h = harness().await;
    let body = json!({"model": "gpt", "max_tokens": 100, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]});
    let answer = messages(&h, &body).await;
    assert_eq!(answer.status, 400, "{}", answer.body);
    let error = answer.json();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "invalid_request_error");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(message.contains("`document`"), "{message}");
    assert_eq!(h.endpoint("az").total_requests(), 0);
    // On an alias with an Anthropic target too, that target takes it, whatever its priority.
    let mut both = body.clone();
    both["model"] = json!("gpt-then-claude");
    let answer = messages(&h, &both).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.attempts(), "claude=200");
    assert_eq!(h.endpoint("az").total_requests(), 0);
    // A request that is wrong whoever serves it is refused at the door, as before.
    let no_max = json!({"model": "claude", "messages": [{"role": "user", "content": "hi"}]});
    let asked = h.endpoint("claude").total_requests();
    let answer = messages(&h, &no_max).await;
    assert_eq!(answer.status, 400);
    assert_eq!(h.endpoint("claude").total_requests(), asked);
}

#[tokio::test]
async fn thinking_with_its_signature_round_trips_through_a_tool_call() {
    let h = harness().await;
    let first = messages(&h, &thinking_ask("claude", false)).await;
    assert_eq!(first.status, 200, "{}", first.body);
    // The answer is the upstream's own text, byte for byte.
    let message = first.json();
    let kinds: Vec<&str> = message["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["thinking", "redacted_thinking", "text", "tool_use"]);
    assert!(message["content"][0]["signature"]
        .as_str()
        .unwrap()
        .starts_with("EqMock"));
    assert_eq!(message["stop_reason"], "tool_use");
    assert_eq!(first.header("x-onedoor-usage"), "measured");
    // The next turn hands the thinking back; the mock checks each signature and the redacted data.
    let call = &message["content"][3];
    let follow = json!({
        "model": "claude", "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [weather_tool()],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": message["content"]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "18C"}]},
        ],
    });
    let second = messages(&h, &follow).await;
    assert_eq!(second.status, 200, "{}", second.body);
    let thinking_sent = message["content"][0].to_string();
    assert!(received(&h, "claude").contains(&thinking_sent));
    // A block whose text changed on the way is refused by the upstream, in Anthropic's shape.
    let mut forged = follow.clone();
    forged["messages"][1]["content"][0]["thinking"] = json!("something else");
    let refused = messages(&h, &forged).await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert_eq!(refused.json()["error"]["type"], "invalid_request_error");
    assert!(
        refused.body.contains("Invalid `signature`"),
        "{}",
        refused.body
    );
}

#[tokio::test]
async fn an_anthropic_stream_passes_event_by_event_with_its_thinking_and_usage() {
    let h = harness().await;
    let answer = messages(&h, &thinking_ask("claude", true)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(answer
        .header("content-type")
        .starts_with("text/event-stream"));
    let events = events(&answer.body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["message_start"];
    // Thinking: start, two thinking deltas, the signature, stop; redacted: start, stop.
    expected.extend([
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
    ]);
    expected.extend(["content_block_delta", "content_block_stop"]);
    expected.extend(["content_block_start", "content_block_stop"]);
    expected.extend(["content_block_start", "ping"]);
    assert_eq!(names[..expected.len()], expected[..], "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"));
    assert!(events[0].1["message"]["id"]
        .as_str()
        .unwrap()
        .starts_with("msg_01"));
    assert_eq!(events[4].1["delta"]["type"], "signature_delta");
    assert_eq!(events[6].1["content_block"]["type"], "redacted_thinking");
    // The stream's thinking is the signed text: the signature checks out on the way back.
    let thought: String = events
        .iter()
        .filter_map(|(_, e)| e["delta"]["thinking"].as_str())
        .collect();
    let signature = events[4].1["delta"]["signature"].as_str().unwrap();
    let follow = json!({
        "model": "claude", "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": signature}, {"type": "text", "text": "Sunny."}]},
            {"role": "user", "content": "Thanks"},
        ],
    });
    let second = messages(&h, &follow).await;
    assert_eq!(second.status, 200, "{}", second.body);
    let comment = answer
        .body
        .lines()
        .find(|l| l.starts_with(": x-onedoor-usage: measured"))
        .unwrap_or_else(|| panic!("{}", answer.body));
    assert!(comment.contains("completion_tokens="), "{comment}");
}

#[tokio::test]
async fn prompt_cache_usage_reaches_the_client_whole_and_streamed() {
    let h = harness().await;
    let long = "The assistant answers in one word. ".repeat(40);
    let ask = |stream: bool| {
        json!({"model": "claude", "max_tokens": 100, "stream": stream,
            "system": [{"type": "text", "text": long, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Colour of the sky?"}]})
    };
    let first = messages(&h, &ask(false)).await;
    let usage = &first.json()["usage"];
    let written = usage["cache_creation_input_tokens"].as_u64().unwrap();
    assert!(written > 300, "{usage}");
    assert_eq!(usage["cache_read_input_tokens"], 0);
    assert_eq!(
        usage["cache_creation"]["ephemeral_5m_input_tokens"],
        written
    );
    let second = messages(&h, &ask(true)).await;
    let events = events(&second.body);
    let start = &events[0].1["message"]["usage"];
    assert_eq!(start["cache_read_input_tokens"], written, "{start}");
    let delta = events
        .iter()
        .find(|(n, _)| n == "message_delta")
        .map(|(_, e)| &e["usage"])
        .unwrap();
    assert_eq!(delta["cache_read_input_tokens"], written);
    let input = start["input_tokens"].as_u64().unwrap();
    let comment = second
        .body
        .lines()
        .find_map(|l| l.strip_prefix(": x-onedoor-usage: "))
        .unwrap();
    assert!(
        comment.contains(&format!("prompt_tokens={} ", input + written)),
        "{comment}"
    );
    assert!(
        comment.contains(&format!("cached_tokens={written} ")),
        "{comment}"
    );
}

#[tokio::test]
async fn an_anthropic_client_fails_over_across_dialects_both_ways() {
    let h = harness().await;
    h.endpoint("claude").set_behavior(Behavior {
        status: Some(529),
        ..Behavior::default()
    });
    let answer = messages(&h, &thinking_ask("claude-then-gpt", false)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        answer.attempts().ends_with("az=200"),
        "{}",
        answer.attempts()
    );
    let message = answer.json();
    assert_eq!(message["type"], "message");
    assert!(message["id"].as_str().unwrap().starts_with("chatcmpl-"));
    // The Azure deployment got the chat form.
    let sent: Value = serde_json::from_str(&received(&h, "az")).unwrap();
    assert!(
        sent["messages"].is_array() && sent.get("thinking").is_none(),
        "{sent}"
    );

    h.endpoint("claude").set_behavior(Behavior::default());
    h.endpoint("az").set_behavior(Behavior {
        status: Some(503),
        ..Behavior::default()
    });
    let answer = messages(&h, &thinking_ask("gpt-then-claude", true)).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert!(
        answer.attempts().ends_with("claude=200"),
        "{}",
        answer.attempts()
    );
    let events = events(&answer.body);
    assert_eq!(events[1].1["content_block"]["type"], "thinking");
}

#[tokio::test]
async fn an_anthropic_backends_error_reaches_an_anthropic_client_in_its_shape() {
    let h = harness().await;
    h.endpoint("claude").set_behavior(Behavior {
        status: Some(429),
        retry_after_s: Some(7),
        ..Behavior::default()
    });
    let answer = messages(&h, &thinking_ask("claude", false)).await;
    assert_eq!(answer.status, 429, "{}", answer.body);
    let error = answer.json();
    assert_eq!(error["type"], "error");
    assert_eq!(error["error"]["type"], "rate_limit_error");
    assert!(!answer.header("x-onedoor-request-id").is_empty());
}

#[tokio::test]
async fn unknown_fields_survive_openai_and_azure_both_ways() {
    let h = harness().await;
    for (model, endpoint) in [("llama", "vllm"), ("gpt", "az")] {
        for stream in [false, true] {
            let body = format!(
                r#"{{"model":"{model}","messages":[{{"role":"user","content":"hi","future_part":{{"a":1}}}}],"stream":{stream},"mock_echo":{{"seen":[1,"two"]}},"reasoning_effort":"low"}}"#
            );
            let answer = h
                .send(
                    Method::POST,
                    h.url("/v1/chat/completions"),
                    &[
                        ("authorization", &format!("Bearer {KEY}")),
                        ("content-type", "application/json"),
                    ],
                    Bytes::from(body.clone()),
                )
                .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            let sent = received(&h, endpoint);
            assert!(sent.contains(r#""future_part":{"a":1}"#), "{sent}");
            assert!(sent.contains(r#""mock_echo":{"seen":[1,"two"]}"#), "{sent}");
            assert!(sent.contains(r#""reasoning_effort":"low""#), "{sent}");
            match stream {
                false => {
                    let answer = answer.json();
                    assert_eq!(answer["mock_echo"], json!({"seen": [1, "two"]}));
                    assert_eq!(
                        answer["choices"][0]["message"]["mock_echo"]["seen"][1],
                        "two"
                    );
                }
                true => {
                    let chunks = events(&answer.body);
                    let echoed = chunks
                        .iter()
                        .filter(|(_, c)| c["mock_echo"]["seen"][0] == 1);
                    assert!(echoed.count() >= 3, "{}", answer.body);
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_usage_record_counts_prompt_cache_reads_and_writes_whole_and_streamed() {
    let dir = std::env::temp_dir().join(format!("onedoor-passthrough-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("usage.db");
    let config = format!(
        "usage: {{ store: \"sqlite://{}\" }}\n{CONFIG}",
        db.display()
    );
    let h = Harness::start(fleet(), &config).await;
    let long = "Answer in one word, always, whatever is asked. ".repeat(30);
    let ask = |stream: bool| {
        json!({"model": "claude", "max_tokens": 100, "stream": stream,
            "system": [{"type": "text", "text": long, "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": "Colour of the sky?"}]})
    };
    let written = messages(&h, &ask(false)).await;
    let usage = written.json()["usage"].clone();
    let read = messages(&h, &ask(true)).await;
    assert_eq!(read.status, 200, "{}", read.body);
    let ids = [&written, &read].map(|a| a.header("x-onedoor-request-id").to_owned());
    let Harness { gateway, fleet, .. } = h;
    gateway.shutdown().await;
    fleet.shutdown().await;
    let db = rusqlite::Connection::open(&db).unwrap();
    let row = |id: &str| -> (i64, i64, i64, String) {
        db.query_row(
            "SELECT input_tokens, cached_tokens, cache_write_tokens, source FROM usage_records WHERE request_id = ?1",
            [id],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)),
        )
        .unwrap()
    };
    let n = |key: &str| usage[key].as_i64().unwrap();
    let prefix = n("cache_creation_input_tokens");
    assert!(prefix > 0, "{usage}");
    let total = n("input_tokens") + prefix;
    assert_eq!(row(&ids[0]), (total, 0, prefix, "measured".to_owned()));
    assert_eq!(row(&ids[1]), (total, prefix, 0, "measured".to_owned()));
}

#[tokio::test]
async fn a_passed_through_stream_cut_midway_ends_with_anthropics_error_event() {
    let h = harness().await;
    h.endpoint("claude").set_behavior(Behavior {
        cut_after: Some(3),
        reply_words: Some(20),
        ..Behavior::default()
    });
    let ask = json!({"model": "claude", "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "Hello"}]});
    let answer = messages(&h, &ask).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let events = events(&answer.body);
    let (name, last) = events.last().unwrap();
    assert_eq!(name, "error", "{}", answer.body);
    assert_eq!(last["type"], "error");
    assert_eq!(last["error"]["type"], "api_error");
    assert!(events.iter().all(|(n, _)| n != "message_stop"));
    assert_eq!(answer.header("x-onedoor-backend"), "claude");
}
