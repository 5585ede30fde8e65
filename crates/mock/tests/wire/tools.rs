//! Simulated models offered tools call them, and answer from a tool result; a lax
//! OpenAI-compatible server shows its quirks; the Responses API stores what follow-ups name.

use onedoor_mock::{Behavior, DeploymentSpec, EndpointSpec, Fleet};
use serde_json::{json, Value};

use crate::client::{post, post_stream, user};

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["location"]}}})
}

async fn openai(behavior: Behavior) -> (Fleet, String) {
    let spec = EndpointSpec::openai("oai", "us")
        .deployment(DeploymentSpec::new("gpt-4o"))
        .behavior(behavior);
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = fleet.endpoints()[0].url();
    (fleet, url)
}

#[tokio::test]
async fn an_openai_model_calls_the_offered_tool_with_schema_arguments() {
    let (_fleet, url) = openai(Behavior::default()).await;
    let ask = json!({"model": "gpt-4o", "messages": [user("weather?")], "tools": [weather_tool()]});
    let answer = post(&format!("{url}/chat/completions"), &[], &ask)
        .await
        .json();
    let choice = &answer["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"location":"Paris"}"#);
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
}

#[tokio::test]
async fn streamed_tool_calls_carry_their_index_and_argument_fragments() {
    let (_fleet, url) = openai(Behavior::default()).await;
    let second = json!({"type": "function", "function": {"name": "get_time", "parameters": {}}});
    let ask = json!({"model": "gpt-4o", "stream": true, "messages": [user("weather?")], "tools": [weather_tool(), second]});
    let streamed = post_stream(&format!("{url}/chat/completions"), &[], &ask).await;
    let chunks = streamed.chunks();
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    let indices: Vec<u64> = calls.iter().map(|c| c["index"].as_u64().unwrap()).collect();
    assert_eq!(indices, [0, 0, 0, 1, 1, 1], "{}", streamed.text);
    let arguments: String = calls
        .iter()
        .filter(|c| c["index"] == 0)
        .filter_map(|c| c["function"]["arguments"].as_str())
        .collect();
    assert_eq!(arguments, r#"{"location":"Paris"}"#);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
}

#[tokio::test]
async fn a_tool_result_is_quoted_in_the_reply() {
    let (_fleet, url) = openai(Behavior::default()).await;
    let messages = json!([user("weather?"),
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]);
    let ask = json!({"model": "gpt-4o", "messages": messages, "tools": [weather_tool()]});
    let answer = post(&format!("{url}/chat/completions"), &[], &ask)
        .await
        .json();
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    let text = answer["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with("Hello from oai/gpt-4o got 18C"), "{text}");
}

#[tokio::test]
async fn a_lax_server_sends_no_usage_index_zero_object_arguments_and_stop() {
    let quirks = Behavior {
        compat_quirks: true,
        ..Behavior::default()
    };
    let (_fleet, url) = openai(quirks).await;
    let second = json!({"type": "function", "function": {"name": "get_time", "parameters": {}}});
    let ask = json!({"model": "gpt-4o", "stream": true, "stream_options": {"include_usage": true},
        "messages": [user("weather?")], "tools": [weather_tool(), second]});
    let streamed = post_stream(&format!("{url}/chat/completions"), &[], &ask).await;
    let chunks = streamed.chunks();
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "{}",
        streamed.text
    );
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0))
        .collect();
    assert_eq!(calls.len(), 2);
    assert!(calls
        .iter()
        .all(|c| c["index"] == 0 && c["function"]["arguments"].is_object()));
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn an_anthropic_model_streams_text_then_tool_use_blocks() {
    let spec = EndpointSpec::anthropic("claude", "eu")
        .deployment(DeploymentSpec::new("claude-sonnet-4-5"));
    let fleet = Fleet::start(vec![spec]).await.unwrap();
    let url = format!("{}/v1/messages", fleet.endpoints()[0].url());
    let tool =
        json!({"name": "get_weather", "input_schema": weather_tool()["function"]["parameters"]});
    let ask = json!({"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": true,
        "messages": [user("weather?")], "tools": [tool],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}});
    let streamed = post_stream(&url, &[("anthropic-version", "2023-06-01")], &ask).await;
    let expected = [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ];
    assert_eq!(streamed.events(), expected);
    let chunks = streamed.chunks();
    assert_eq!(chunks[6]["content_block"]["type"], "tool_use");
    assert_eq!(chunks[6]["index"], 1);
    let input: String = chunks
        .iter()
        .filter_map(|c| c["delta"]["partial_json"].as_str())
        .collect();
    assert_eq!(input, r#"{"location":"Paris"}"#);
    assert_eq!(chunks[11]["delta"]["stop_reason"], "tool_use");
}

#[tokio::test]
async fn a_response_can_be_followed_up_only_where_it_is_stored() {
    let (_fleet, url) = openai(Behavior::default()).await;
    let ask = json!({"model": "gpt-4o", "input": "Hello"});
    let first = post(&format!("{url}/responses"), &[], &ask).await;
    assert_eq!(first.status, 200);
    let first = first.json();
    assert_eq!(first["object"], "response");
    assert_eq!(first["status"], "completed");
    let text = first["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("Hello from oai/gpt-4o"), "{text}");
    assert_eq!(first["usage"]["output_tokens"], 8);
    let id = first["id"].as_str().unwrap();
    let follow = json!({"model": "gpt-4o", "input": "More", "previous_response_id": id});
    assert_eq!(
        post(&format!("{url}/responses"), &[], &follow).await.status,
        200
    );
    let unknown = json!({"model": "gpt-4o", "input": "More", "previous_response_id": "resp_nope"});
    let refused = post(&format!("{url}/responses"), &[], &unknown).await;
    assert_eq!(refused.status, 400);
    assert_eq!(
        refused.json()["error"]["code"],
        "previous_response_not_found"
    );
}

#[tokio::test]
async fn a_streamed_response_ends_with_response_completed_and_its_usage() {
    let (_fleet, url) = openai(Behavior::default()).await;
    let ask = json!({"model": "gpt-4o", "input": "Hello", "stream": true});
    let streamed = post_stream(&format!("{url}/responses"), &[], &ask).await;
    let events = streamed.events();
    assert_eq!(events.first(), Some(&"response.created"));
    assert_eq!(events.last(), Some(&"response.completed"));
    let chunks = streamed.chunks();
    let text: String = chunks
        .iter()
        .filter(|c| c["type"] == "response.output_text.delta")
        .filter_map(|c| c["delta"].as_str())
        .collect();
    let done = chunks.last().unwrap();
    assert_eq!(
        done["response"]["output"][0]["content"][0]["text"],
        text.as_str()
    );
    assert_eq!(done["response"]["usage"]["output_tokens"], 8);
    let sequence: Vec<u64> = chunks
        .iter()
        .map(|c| c["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(sequence, (0..chunks.len() as u64).collect::<Vec<_>>());
}
