"""One API over every backend, with the official SDKs, unmodified, against `onedoor demo`:
the `openai` SDK on an alias backed by the Anthropic endpoint (`claude`), the `anthropic` SDK on
an alias backed by Azure deployments (`chat-default`), plain, streaming and tool calling, and the
Responses API with its follow-ups.

Clients are built with max_retries=0: the SDK's own retries would hide a failed answer.
"""

import json

import anthropic
import pytest
from anthropic import Anthropic
from openai import OpenAI

HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now",
        "parameters": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
    },
}
CLAUDE_WEATHER = {
    "name": "get_weather",
    "description": "The weather now",
    "input_schema": WEATHER["function"]["parameters"],
}


@pytest.fixture(scope="module")
def openai_sdk(demo):
    return OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def claude_sdk(demo):
    return Anthropic(base_url=demo.url, api_key=demo.key, max_retries=0, timeout=30)


# --- the openai SDK, Anthropic upstream --------------------------------------------------------


def test_openai_sdk_on_an_anthropic_upstream(openai_sdk):
    raw = openai_sdk.chat.completions.with_raw_response.create(model="claude", messages=HELLO)
    assert raw.headers.get("x-onedoor-backend") == "anthropic-eu", dict(raw.headers)
    assert raw.headers.get("x-onedoor-usage") == "measured", dict(raw.headers)
    completion = raw.parse()
    assert completion.id.startswith("msg_"), completion
    assert completion.model == "claude-sonnet-4-5-20250929", completion
    choice = completion.choices[0]
    assert choice.message.content.startswith("Hello from anthropic-eu/claude-sonnet-4-5"), completion
    assert choice.finish_reason == "stop", completion
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0, completion.usage
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_openai_sdk_streams_from_an_anthropic_upstream(openai_sdk):
    stream = openai_sdk.chat.completions.create(
        model="claude", messages=HELLO, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1, "one id per stream"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("Hello from anthropic-eu/claude-sonnet-4-5"), text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finished] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0, chunks[-1]


def test_openai_sdk_tool_calling_round_trip_on_an_anthropic_upstream(openai_sdk):
    asked = openai_sdk.chat.completions.create(
        model="claude", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER]
    )
    choice = asked.choices[0]
    assert choice.finish_reason == "tool_calls", asked
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"location": "Paris"}
    answered = openai_sdk.chat.completions.create(
        model="claude",
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18C and sunny"},
        ],
    )
    assert "18C and sunny" in answered.choices[0].message.content, answered
    assert answered.choices[0].finish_reason == "stop"


def test_openai_sdk_streams_tool_calls_from_an_anthropic_upstream(openai_sdk):
    chunks = list(
        openai_sdk.chat.completions.create(
            model="claude", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], stream=True
        )
    )
    calls = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert calls and calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather", calls
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.index == 0)
    assert json.loads(arguments) == {"location": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


# --- the anthropic SDK, Azure upstream ---------------------------------------------------------


def test_anthropic_sdk_on_an_azure_upstream(claude_sdk):
    raw = claude_sdk.messages.with_raw_response.create(model="chat-default", max_tokens=256, messages=HELLO)
    assert raw.headers.get("x-onedoor-backend", "").startswith("sub"), dict(raw.headers)
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant"
    assert message.model == "gpt-4o-2024-11-20", message
    assert message.content[0].type == "text"
    assert message.content[0].text.startswith("Hello from sub"), message
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0, message.usage


def test_anthropic_sdk_with_a_bearer_token_and_a_current_version(demo):
    client = Anthropic(
        base_url=demo.url,
        auth_token=demo.key,
        default_headers={"anthropic-version": "2026-10-21"},
        max_retries=0,
        timeout=30,
    )
    message = client.messages.create(model="chat-default", max_tokens=64, messages=HELLO)
    assert message.content[0].text.startswith("Hello from"), message


def test_anthropic_sdk_streams_from_an_azure_upstream(claude_sdk):
    with claude_sdk.messages.stream(model="chat-default", max_tokens=256, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.startswith("Hello from sub"), text
    assert final.content[0].text == text
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0, final.usage


def test_anthropic_sdk_tool_use_round_trip_on_an_azure_upstream(claude_sdk):
    weather = [{"role": "user", "content": "Weather in Paris?"}]
    asked = claude_sdk.messages.create(
        model="chat-default",
        max_tokens=256,
        messages=weather,
        tools=[CLAUDE_WEATHER],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True},
    )
    assert asked.stop_reason == "tool_use", asked
    tool_use = next(b for b in asked.content if b.type == "tool_use")
    assert tool_use.name == "get_weather" and tool_use.input == {"location": "Paris"}
    answered = claude_sdk.messages.create(
        model="chat-default",
        max_tokens=256,
        tools=[CLAUDE_WEATHER],
        messages=weather
        + [
            {"role": "assistant", "content": [b.model_dump() for b in asked.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C and sunny"}]},
        ],
    )
    assert "18C and sunny" in answered.content[0].text, answered


def test_anthropic_sdk_streams_tool_use_from_an_azure_upstream(claude_sdk):
    with claude_sdk.messages.stream(
        model="chat-default",
        max_tokens=256,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[CLAUDE_WEATHER],
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    tool_uses = [b for b in final.content if b.type == "tool_use"]
    assert tool_uses and tool_uses[0].input == {"location": "Paris"}, final


def test_anthropic_sdk_errors_come_in_anthropics_shape(demo, claude_sdk):
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude_sdk.messages.create(model="no-such-alias-anywhere", max_tokens=16, messages=HELLO)
    assert caught.value.body["type"] == "error", caught.value.body
    assert caught.value.body["error"]["type"] == "not_found_error", caught.value.body
    wrong = Anthropic(base_url=demo.url, api_key="not-a-onedoor-key", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model="chat-default", max_tokens=16, messages=HELLO)
    assert caught.value.body["error"]["type"] == "authentication_error", caught.value.body


# --- the Responses API ---------------------------------------------------------------------


def test_responses_follow_ups_stay_on_the_backend_that_holds_the_response(openai_sdk):
    raw = openai_sdk.responses.with_raw_response.create(model="chat-default", input="Hello")
    holder = raw.headers.get("x-onedoor-backend")
    first = raw.parse()
    assert first.output_text.startswith("Hello from sub"), first
    assert first.usage.output_tokens > 0, first.usage
    previous = first.id
    for _ in range(3):
        raw = openai_sdk.responses.with_raw_response.create(
            model="chat-default", input="And then?", previous_response_id=previous
        )
        assert raw.headers.get("x-onedoor-backend") == holder, dict(raw.headers)
        previous = raw.parse().id


def test_responses_stream(openai_sdk):
    events = list(openai_sdk.responses.create(model="chat-default", input="Hello", stream=True))
    assert events[0].type == "response.created", events[0]
    assert events[-1].type == "response.completed", events[-1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text, (text, events[-1])
    assert events[-1].response.usage.output_tokens > 0
