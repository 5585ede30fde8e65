"""Realtime over WebSocket through `onedoor demo`: the official `openai` SDK's realtime clients
(GA on /v1, and the Azure client on /openai/realtime), and a plain `websockets` client for what
the SDK does not show (binary frames, pings, close codes). The demo's `voice-default` alias
routes to simulated Azure realtime deployments."""

import asyncio
import json

import pytest
import websockets
from openai import AsyncAzureOpenAI, AsyncOpenAI

ALIAS = "voice-default"


def ws_url(demo) -> str:
    return demo.url.replace("http://", "ws://", 1)


async def say_hello(connection) -> tuple[str, dict]:
    """One user message and one response; the text of its deltas and its usage."""
    await connection.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}]}
    )
    await connection.response.create()
    text = ""
    async for event in connection:
        if event.type in ("response.output_text.delta", "response.text.delta"):
            text += event.delta
        elif event.type == "error":
            pytest.fail(f"the session reported an error: {event}")
        elif event.type == "response.done":
            return text, event.response.usage.to_dict()
    pytest.fail("the session ended before response.done")


def test_the_sdk_realtime_client_talks_through_the_gateway(demo):
    async def main():
        client = AsyncOpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0)
        async with client.realtime.connect(model=ALIAS) as connection:
            await connection.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            return await say_hello(connection)

    text, usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert text.startswith("Hello from sub1-swedencentral-ptu/gpt-4o-realtime"), text
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > 0, usage


def test_the_azure_sdk_client_uses_the_azure_realtime_path(demo):
    async def main():
        client = AsyncAzureOpenAI(
            azure_endpoint=demo.url,
            websocket_base_url=ws_url(demo) + "/openai",
            api_key=demo.key,
            api_version="2024-10-01-preview",
            max_retries=0,
        )
        async with client.beta.realtime.connect(model=ALIAS) as connection:
            await connection.session.update(session={"modalities": ["text"]})
            return await say_hello(connection)

    text, usage = asyncio.run(asyncio.wait_for(main(), 30))
    assert "gpt-4o-realtime" in text, text
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], usage


def test_binary_frames_pings_and_close_codes_pass_both_ways(demo):
    async def main():
        url = f"{ws_url(demo)}/v1/realtime?model={ALIAS}"
        headers = {"Authorization": f"Bearer {demo.key}"}
        async with websockets.connect(url, additional_headers=headers, subprotocols=["realtime"], max_size=None) as ws:
            assert ws.subprotocol == "realtime"
            assert ws.response.headers["x-onedoor-backend"] == "sub1-swedencentral-ptu"
            created = json.loads(await ws.recv())
            assert created["type"] == "session.created"
            audio = bytes(range(256)) * 4096  # 1 MiB
            await ws.send(audio)
            assert await ws.recv() == audio
            latency = await asyncio.wait_for(await ws.ping(b"hi"), 5)
            assert latency >= 0
            await ws.send(json.dumps({"type": "mock.close", "code": 4003, "reason": "done talking"}))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    await ws.recv()
            return closed.value.rcvd

    frame = asyncio.run(asyncio.wait_for(main(), 30))
    assert (frame.code, frame.reason) == (4003, "done talking")


def test_a_client_close_code_comes_back_and_a_bad_key_is_refused_before_the_upgrade(demo):
    async def main():
        url = f"{ws_url(demo)}/v1/realtime?model={ALIAS}"
        with pytest.raises(websockets.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers={"Authorization": "Bearer nope"}):
                pass
        assert refused.value.response.status_code == 401
        async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {demo.key}"}) as ws:
            await ws.recv()
            await ws.close(code=4000, reason="bye")
            return ws.close_code, ws.close_reason

    assert asyncio.run(asyncio.wait_for(main(), 30)) == (4000, "bye")
