"""Same dialect, nothing lost, with the official SDKs against `onedoor demo`: the `anthropic` SDK
on the alias backed by the Anthropic endpoint (`claude`) gets extended thinking with its
signatures and hands it back through a tool call (the simulated upstream refuses a thinking
block that changed on the way, as Anthropic does); prompt-caching usage reaches the SDK and the
usage record; the `openai` SDK on an Azure deployment sends a field no API knows and gets one
back.

Clients are built with max_retries=0: the SDK's own retries would hide a failed answer.
"""

import sqlite3
import time
import uuid

import pytest
from anthropic import Anthropic
from openai import OpenAI

from conftest import running_demo

REDACTED = "ANTHROPIC_MAGIC_STRING_TRIGGER_REDACTED_THINKING_46C9A13E193C177646C7398A98432ECCCE4C1253D5E2D82641AC0E52CC2876CB"
WEATHER = {
    "name": "get_weather",
    "description": "The weather now",
    "input_schema": {"type": "object", "properties": {"location": {"type": "string"}}, "required": ["location"]},
}
THINKING = {"type": "enabled", "budget_tokens": 1024}
ASK = [{"role": "user", "content": f"Weather in Paris? {REDACTED}"}]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("passthrough-demo")


@pytest.fixture(scope="module")
def recorded_demo(demo_dir):
    """A demo of this module's own, whose usage file the tests read."""
    with running_demo(cwd=str(demo_dir)) as started:
        yield started


@pytest.fixture(scope="module")
def claude_sdk(recorded_demo):
    return Anthropic(base_url=recorded_demo.url, api_key=recorded_demo.key, max_retries=0, timeout=30)


def kinds(message):
    return [block.type for block in message.content]


def follow_up(claude_sdk, asked):
    """The next turn: the assistant's content handed back as the SDK returned it, then the result."""
    tool_use = next(b for b in asked.content if b.type == "tool_use")
    return claude_sdk.messages.create(
        model="claude",
        max_tokens=2048,
        thinking=THINKING,
        tools=[WEATHER],
        messages=ASK
        + [
            {"role": "assistant", "content": asked.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C and sunny"}]},
        ],
    )


def test_extended_thinking_with_its_signature_round_trips_through_a_tool_call(claude_sdk):
    asked = claude_sdk.messages.create(model="claude", max_tokens=2048, thinking=THINKING, tools=[WEATHER], messages=ASK)
    assert kinds(asked) == ["thinking", "redacted_thinking", "text", "tool_use"], asked
    thinking = asked.content[0]
    assert thinking.thinking and thinking.signature.startswith("EqMock"), thinking
    assert asked.content[1].data, asked.content[1]
    assert asked.stop_reason == "tool_use"
    answered = follow_up(claude_sdk, asked)
    assert answered.stop_reason == "end_turn", answered
    assert any(b.type == "text" and "18C and sunny" in b.text for b in answered.content), answered


def test_streamed_thinking_round_trips_through_a_tool_call(claude_sdk):
    with claude_sdk.messages.stream(
        model="claude", max_tokens=2048, thinking=THINKING, tools=[WEATHER], messages=ASK
    ) as stream:
        events = [event.type for event in stream]
        asked = stream.get_final_message()
    assert "thinking" in events and "signature" in events, events
    assert kinds(asked) == ["thinking", "redacted_thinking", "text", "tool_use"], asked
    assert asked.content[0].signature.startswith("EqMock"), asked.content[0]
    answered = follow_up(claude_sdk, asked)
    assert answered.stop_reason == "end_turn", answered


def test_a_thinking_block_changed_on_the_way_is_refused_by_the_upstream(claude_sdk):
    import anthropic

    asked = claude_sdk.messages.create(model="claude", max_tokens=2048, thinking=THINKING, tools=[WEATHER], messages=ASK)
    forged = [b.model_dump() for b in asked.content]
    forged[0]["thinking"] = "Something I never thought."
    tool_use = next(b for b in asked.content if b.type == "tool_use")
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude_sdk.messages.create(
            model="claude",
            max_tokens=2048,
            thinking=THINKING,
            tools=[WEATHER],
            messages=ASK
            + [
                {"role": "assistant", "content": forged},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "18C"}]},
            ],
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error", caught.value.body
    assert "signature" in caught.value.body["error"]["message"], caught.value.body


def record_of(demo_dir, request_id, within_s=15.0):
    """The usage record of `request_id` in the demo's usage file, once it is written."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with sqlite3.connect(f"file:{demo_dir / 'onedoor-usage.db'}?mode=ro", uri=True) as db:
                row = db.execute(
                    "SELECT input_tokens, output_tokens, cached_tokens, cache_write_tokens, source"
                    " FROM usage_records WHERE request_id = ?",
                    (request_id,),
                ).fetchone()
        except sqlite3.OperationalError:
            row = None
        if row or time.monotonic() > deadline:
            return row
        time.sleep(0.2)


def test_prompt_caching_usage_reaches_the_client_and_the_usage_record(claude_sdk, demo_dir):
    system = [
        {
            "type": "text",
            "text": f"Reference {uuid.uuid4()}. " + "The assistant answers in one short sentence. " * 40,
            "cache_control": {"type": "ephemeral"},
        }
    ]

    def ask():
        return claude_sdk.messages.with_raw_response.create(
            model="claude", max_tokens=128, system=system, messages=[{"role": "user", "content": "Colour of the sky?"}]
        )

    written = ask()
    usage = written.parse().usage
    assert usage.cache_creation_input_tokens > 300 and usage.cache_read_input_tokens == 0, usage
    read = ask()
    again = read.parse().usage
    assert again.cache_read_input_tokens == usage.cache_creation_input_tokens, again
    assert again.cache_creation_input_tokens == 0, again
    assert read.headers.get("x-onedoor-usage") == "measured"
    # The record counts every input token, those read from the cache and written to it among them.
    for raw, seen in [(written, usage), (read, again)]:
        row = record_of(demo_dir, raw.headers["x-onedoor-request-id"])
        assert row, "no usage record"
        total_input = seen.input_tokens + seen.cache_read_input_tokens + seen.cache_creation_input_tokens
        expected = (total_input, seen.output_tokens, seen.cache_read_input_tokens, seen.cache_creation_input_tokens)
        assert row == expected + ("measured",), (row, seen)

    with claude_sdk.messages.stream(
        model="claude", max_tokens=128, system=system, messages=[{"role": "user", "content": "Colour of the sky?"}]
    ) as stream:
        streamed = stream.get_final_message().usage
    assert streamed.cache_read_input_tokens == usage.cache_creation_input_tokens, streamed


def test_openai_sdk_unknown_fields_survive_both_ways_on_azure(recorded_demo):
    client = OpenAI(base_url=recorded_demo.url + "/v1", api_key=recorded_demo.key, max_retries=0, timeout=30)
    echo = {"seen": [1, "two"], "at": str(uuid.uuid4())}
    completion = client.chat.completions.create(
        model="chat-mini", messages=[{"role": "user", "content": "Hello"}], extra_body={"mock_echo": echo}
    )
    # The simulated deployment echoes the request's unknown field in unknown fields of its answer.
    assert completion.model_extra.get("mock_echo") == echo, completion
    assert completion.choices[0].message.model_extra.get("mock_echo") == echo, completion
    stream = client.chat.completions.create(
        model="chat-mini",
        messages=[{"role": "user", "content": "Hello"}],
        stream=True,
        extra_body={"mock_echo": echo},
    )
    chunks = [c for c in stream if c.choices]
    assert chunks and all(c.model_extra.get("mock_echo") == echo for c in chunks), chunks
