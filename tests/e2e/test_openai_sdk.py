"""The official `openai` Python SDK, unmodified, against `onedoor demo`.

Clients are built with max_retries=0: the SDK's own retries would hide a failed answer.
"""

import openai
import pytest
from openai import AzureOpenAI, OpenAI

HELLO = [{"role": "user", "content": "Hello"}]
AZURE_API_VERSION = "2024-10-21"


@pytest.fixture(scope="module")
def client(demo):
    return OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def azure(demo):
    return AzureOpenAI(
        azure_endpoint=demo.url, api_key=demo.key, api_version=AZURE_API_VERSION, max_retries=0, timeout=30
    )


def attempts(raw) -> list[str]:
    header = raw.headers.get("x-onedoor-attempts", "")
    return [a for a in header.split(",") if a]


def collect(stream) -> tuple[list, str]:
    """Every chunk of a stream (the SDK parses each one) and the text their deltas add up to."""
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks, text


# --- OpenAI client on /v1 ---------------------------------------------------------------------


def test_chat_non_streaming(client):
    raw = client.chat.completions.with_raw_response.create(model="chat-default", messages=HELLO)
    assert raw.headers.get("x-onedoor-backend"), dict(raw.headers)
    assert raw.headers.get("x-onedoor-request-id"), dict(raw.headers)
    completion = raw.parse()
    assert completion.choices, completion
    assert completion.choices[0].message.content, completion
    assert completion.choices[0].finish_reason == "stop", completion
    assert completion.usage is not None, completion
    assert completion.usage.prompt_tokens > 0, completion.usage
    assert completion.usage.completion_tokens > 0, completion.usage
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens


def test_chat_streaming(client):
    chunks, text = collect(
        client.chat.completions.create(
            model="chat-default", messages=[{"role": "user", "content": "Stream, please"}], stream=True
        )
    )
    assert chunks, "the stream had no chunks"
    assert text.strip(), [c.model_dump() for c in chunks]
    # Plain OpenAI paths carry no Azure filter-only chunks: code that reads choices[0] must not break.
    assert all(c.choices for c in chunks), [c.model_dump() for c in chunks if not c.choices]
    assert chunks[-1].choices[0].finish_reason == "stop", chunks[-1].model_dump()
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_models_list(client):
    ids = [m.id for m in client.models.list()]
    assert "chat-default" in ids, ids
    assert "embed-default" in ids, ids
    assert "*" not in ids, ids


def test_embeddings(client):
    # The SDK asks for base64 unless told otherwise and decodes it; ask for both forms.
    default = client.embeddings.create(model="embed-default", input="Hello")
    floats = client.embeddings.create(model="embed-default", input=["Hello", "World"], encoding_format="float")
    assert len(default.data) == 1
    vector = default.data[0].embedding
    assert len(vector) > 0 and all(isinstance(x, float) for x in vector)
    assert [d.index for d in floats.data] == [0, 1]
    assert all(len(d.embedding) == len(vector) for d in floats.data)
    assert default.usage.prompt_tokens > 0


def test_wrong_key_is_authentication_error(demo):
    wrong = OpenAI(base_url=demo.url + "/v1", api_key="sk-not-a-onedoor-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model="chat-default", messages=HELLO)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key", caught.value.body


def test_unknown_alias_is_not_found(client):
    # The demo has a "*" alias, so the name is first looked for on its backends; none has it.
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="no-such-model-anywhere", messages=HELLO)
    error = caught.value
    assert isinstance(error, openai.NotFoundError), (
        f"{type(error).__name__} {error.status_code} {error.body}; "
        f"x-onedoor-attempts: {error.response.headers.get('x-onedoor-attempts')}"
    )


def test_wildcard_discovers_the_one_endpoint_that_serves_a_model(client):
    ask = [{"role": "user", "content": "Which endpoint serves gpt-4.1?"}]
    first = client.chat.completions.with_raw_response.create(model="gpt-4.1", messages=ask)
    assert first.headers.get("x-onedoor-backend") == "sub3-eastus", dict(first.headers)
    assert first.parse().choices[0].message.content
    second = client.chat.completions.with_raw_response.create(model="gpt-4.1", messages=ask)
    assert second.parse().choices[0].message.content
    # What the first request learnt (who lacks gpt-4.1, who is down) spares the second every detour.
    assert attempts(second) == ["sub3-eastus=200"], (attempts(first), attempts(second))


def test_a_stream_cut_midway_raises_in_the_sdk_instead_of_ending_normally(client):
    stream = client.chat.completions.create(model="chat-flaky", messages=HELLO, stream=True)
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                received.append(chunk.choices[0].delta.content)
    assert received, "content arrived before the cut"
    assert "midway" in str(raised.value) or "ended before" in str(raised.value), raised.value


def test_a_continued_stream_gives_one_whole_answer(client):
    chunks, text = collect(client.chat.completions.create(model="chat-resilient", messages=HELLO, stream=True))
    assert text.startswith("Hello from sub5-westeurope-flaky/gpt-4o"), text
    assert "continued by sub2-norwayeast/gpt-4o" in text, text
    assert len({c.id for c in chunks}) == 1, {c.id for c in chunks}
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"], finishes


# --- AzureOpenAI client on /openai/deployments/{alias}/... -----------------------------------


def test_azure_chat_non_streaming(azure):
    raw = azure.chat.completions.with_raw_response.create(model="chat-default", messages=HELLO)
    assert raw.headers.get("x-onedoor-backend"), dict(raw.headers)
    completion = raw.parse()
    assert completion.choices[0].message.content, completion
    assert completion.usage is not None and completion.usage.total_tokens > 0, completion


def test_azure_chat_streaming(azure):
    chunks, text = collect(
        azure.chat.completions.create(
            model="chat-default", messages=[{"role": "user", "content": "Stream, please"}], stream=True
        )
    )
    assert text.strip(), [c.model_dump() for c in chunks]
    # Azure's first chunk carries only the prompt filter results, with no choices; it is kept on
    # Azure paths and the SDK takes it in its stride.
    assert chunks[0].choices == [], chunks[0].model_dump()
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished and finished[-1].choices[0].finish_reason == "stop", [c.model_dump() for c in chunks]


def test_azure_embeddings(azure):
    result = azure.embeddings.create(model="embed-default", input="Hello")
    assert len(result.data) == 1 and len(result.data[0].embedding) > 0
