#!/usr/bin/env python3
"""Writes corpus.json: chat requests with the prompt tokens OpenAI's own `tiktoken` counts for them.

The text of every request is counted by `tiktoken` (PyPI), the reference implementation. The
chat overhead, tool-schema and image rules around it are OpenAI's cookbook recipes, written out
here independently of the Rust code (src/tokens.rs) that must match them.

tiktoken downloads its vocabularies on first use, which this machine cannot do. They are given to
it offline instead: the same files ship inside the `bpe-openai` crate (data/*.tiktoken.gz), and
tiktoken itself checks each file's sha256 against the digest it expects before using it, so the
counts below come from the genuine vocabularies.

    python3 -m venv /tmp/tk && /tmp/tk/bin/pip install tiktoken
    /tmp/tk/bin/python crates/gateway/tests/data/tokens/generate.py
"""

import base64
import glob
import gzip
import hashlib
import json
import math
import os
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


def offline_vocabularies():
    """Puts the crate's vocabularies where tiktoken looks for its download cache."""
    found = sorted(glob.glob(os.path.expanduser("~/.cargo/registry/src/*/bpe-openai-*/data")))
    if not found:
        sys.exit("bpe-openai's data folder not found: run `cargo build -p onedoor-gateway` first")
    cache = tempfile.mkdtemp(prefix="tiktoken-cache-")
    for name in ("cl100k_base", "o200k_base"):
        with gzip.open(os.path.join(found[-1], name + ".tiktoken.gz"), "rb") as f:
            data = f.read()
        key = hashlib.sha1(URL.format(name).encode()).hexdigest()
        with open(os.path.join(cache, key), "wb") as f:
            f.write(data)
    os.environ["TIKTOKEN_CACHE_DIR"] = cache


offline_vocabularies()
import tiktoken  # noqa: E402  (after the cache is in place)

O200K = ["gpt-5", "gpt-4.1", "gpt-4.5", "gpt-4o", "chatgpt-4o-", "o1", "o3", "o4", "codex-mini", "gpt-oss-"]
CL100K = ["gpt-4", "gpt-3.5", "gpt-35", "text-embedding-", "davinci", "babbage", "text-davinci", "code-davinci"]


def family(model):
    """(encoding name, image rule, func_init) by the reference's prefix table."""
    m = model.lower()
    starts = lambda prefixes: any(m.startswith(p) for p in prefixes)
    encoding = "o200k_base" if starts(O200K) else "cl100k_base" if starts(CL100K) else "o200k_base"
    if starts(["gpt-4.1-mini", "gpt-5-mini"]):
        images = ("patches", 1.62)
    elif starts(["gpt-4.1-nano", "gpt-5-nano"]):
        images = ("patches", 2.46)
    elif m.startswith("o4-mini"):
        images = ("patches", 1.72)
    elif m.startswith("gpt-4o-mini"):
        images = ("tiles", 2833, 5667)
    elif starts(["o1", "o3"]):
        images = ("tiles", 75, 150)
    else:
        images = ("tiles", 85, 170)
    return encoding, images, 10 if encoding == "cl100k_base" else 7


def png(width, height):
    """A PNG header (signature and IHDR) declaring width x height, as a data URL."""
    header = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + struct.pack(">II", width, height)
    header += bytes([8, 6, 0, 0, 0]) + b"\0\0\0\0"
    return "data:image/png;base64," + base64.b64encode(header).decode()


def png_size(url):
    if not url.startswith("data:image/png;base64,"):
        return 1024, 1024  # a remote image is not fetched: counted as 1024 x 1024
    raw = base64.b64decode(url.split(",", 1)[1])
    return struct.unpack(">II", raw[16:24])


def image_tokens(rule, width, height, detail):
    w, h = float(max(width, 1)), float(max(height, 1))
    if rule[0] == "tiles":
        base, per_tile = rule[1], rule[2]
        if detail == "low":
            return base
        long = max(w, h)
        if long > 2048.0:
            w, h = w * 2048.0 / long, h * 2048.0 / long
        short = min(w, h)
        if short > 768.0:
            w, h = w * 768.0 / short, h * 768.0 / short
        return base + per_tile * math.ceil(w / 512.0) * math.ceil(h / 512.0)
    factor = rule[1]
    patches = math.ceil(w / 32.0) * math.ceil(h / 32.0)
    if patches > 1536:
        r = math.sqrt(32.0 * 32.0 * 1536.0 / (w * h))
        r *= min(math.floor(w * r / 32.0) / (w * r / 32.0), math.floor(h * r / 32.0) / (h * r / 32.0))
        patches = min(math.ceil(w * r / 32.0) * math.ceil(h * r / 32.0), 1536)
    return math.ceil(patches * factor)


def plain(value):
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def count(model, body):
    encoding, images, func_init = family(model)
    enc = tiktoken.get_encoding(encoding)
    n = lambda text: len(enc.encode_ordinary(text))

    def content(value):
        if isinstance(value, str):
            return n(value)
        total = 0
        for part in value if isinstance(value, list) else []:
            if isinstance(part.get("text"), str):
                total += n(part["text"])
            elif isinstance(part.get("image_url"), dict):
                width, height = png_size(part["image_url"]["url"])
                total += image_tokens(images, width, height, part["image_url"].get("detail"))
            elif part.get("content") is not None:
                total += content(part["content"])
        return total

    total = 3  # every reply is primed with <|start|>assistant<|message|>
    for message in body["messages"]:
        total += 3  # <|start|>{role/name}\n{content}<|end|>\n
        for key in ("role", "tool_call_id", "refusal"):
            if isinstance(message.get(key), str):
                total += n(message[key])
        if isinstance(message.get("name"), str):
            total += n(message["name"]) + 1
        if message.get("content") is not None:
            total += content(message["content"])
        calls = [c["function"] for c in message.get("tool_calls") or []]
        if message.get("function_call"):
            calls.append(message["function_call"])
        for call in calls:
            total += 1 + n(call.get("name") or "") + n(call.get("arguments") or "")

    for tools in (body.get("tools"), body.get("functions")):
        if not tools:
            continue
        total += 12  # func_end
        for tool in tools:
            function = tool.get("function", tool)
            name = function.get("name") if isinstance(function.get("name"), str) else ""
            description = plain(function["description"]) if "description" in function else ""
            total += func_init + n(f"{name}:{description.removesuffix('.')}")
            properties = (function.get("parameters") or {}).get("properties")
            if not isinstance(properties, dict) or not properties:
                continue
            total += 3  # prop_init
            for key, prop in properties.items():
                total += 3  # prop_key
                if isinstance(prop.get("enum"), list):
                    total += -3  # enum_init
                    for item in prop["enum"]:
                        total += 3 + n(plain(item))  # enum_item
                kind = plain(prop["type"]) if "type" in prop else ""
                description = plain(prop["description"]) if "description" in prop else ""
                total += n(f"{key}:{kind}:{description.removesuffix('.')}")
    return total


def user(text):
    return {"role": "user", "content": text}


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "description": "The unit.", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search_documents",
        "description": "Full-text search over the legal archive",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Words to look for."},
                "limit": {"type": "integer", "description": "At most this many hits"},
                "since": {"type": ["string", "null"], "description": "ISO date"},
            },
        },
    },
}
NO_PARAMS = {"type": "function", "function": {"name": "now", "description": "The current time."}}

LONG_ENGLISH = (
    "The gateway estimates every prompt before it asks an upstream, reserves the estimate plus the "
    "completion budget against the tenant's limits, and replaces the reservation with the usage the "
    "upstream reports. " * 12
)
CODE = 'fn main() {\n    let xs: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!("{:?}", xs);\n}\n\n\n    // trailing   spaces   \t\n'

CASES = [
    ("plain", "gpt-4o", {"messages": [user("Hello there")]}),
    ("plain-cl100k", "gpt-35-turbo", {"messages": [user("Hello there")]}),
    ("empty-content", "gpt-4o", {"messages": [user("")]}),
    ("system-and-user", "gpt-4o-2024-11-20", {"messages": [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        user("What is the capital of Sweden?")]}),
    ("multi-turn", "gpt-4.1", {"messages": [
        {"role": "system", "content": "You are helpful."},
        user("Write a haiku about rate limits."),
        {"role": "assistant", "content": "Tokens drip slowly,\nthe bucket fills, then empties:\nsixty seconds pass."},
        user("Now one about Redis."),
        {"role": "assistant", "content": "Single-threaded heart,\nLua scripts run all at once,\nTIME keeps every clock."},
        user("Thanks! One more, about failover?")]}),
    ("multi-turn-cl100k", "gpt-4-turbo", {"messages": [
        {"role": "system", "content": "You are helpful."},
        user("Write a haiku about rate limits."),
        {"role": "assistant", "content": "Tokens drip slowly,\nthe bucket fills, then empties:\nsixty seconds pass."},
        user("Now one about Redis.")]}),
    ("names", "gpt-4o", {"messages": [
        {"role": "system", "name": "example_user", "content": "New synergies will help drive top-line growth."},
        {"role": "system", "name": "example_assistant", "content": "Things working well together will increase revenue."},
        {"role": "user", "name": "alice", "content": "Let's circle back when we have more bandwidth."}]}),
    ("names-cl100k", "gpt-3.5-turbo", {"messages": [
        {"role": "user", "name": "bob_the_builder", "content": "Can we fix it?"},
        {"role": "assistant", "name": "narrator", "content": "Yes we can."}]}),
    ("unicode", "gpt-4o", {"messages": [user("Grüße aus Zürich! 東京は晴れです。Привет, мир. 🙂🚀 naïve café — “quotes”")]}),
    ("unicode-cl100k", "gpt-4", {"messages": [user("Grüße aus Zürich! 東京は晴れです。Привет, мир. 🙂🚀 naïve café — “quotes”")]}),
    ("code-and-whitespace", "gpt-4o", {"messages": [user(CODE)]}),
    ("code-and-whitespace-cl100k", "gpt-4", {"messages": [user(CODE)]}),
    ("numbers-and-contractions", "o3-mini", {"messages": [user("I'd say it's 1234567 or 3.14159, they'll know; we've WON'T YOU'LL 2026-12-01T10:00Z")]}),
    ("long-run-without-spaces", "gpt-4o", {"messages": [user("a" * 5000 + "".join(chr(0x4e00 + i % 500) for i in range(2000)))]}),
    ("long-english", "gpt-4o", {"messages": [user(LONG_ENGLISH)]}),
    ("content-parts", "gpt-4o", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "First part."}, {"type": "text", "text": " Second part, with more words."}]}]}),
    ("image-high", "gpt-4o", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": png(1024, 1024), "detail": "high"}}]}]}),
    ("image-tall-auto", "gpt-4o", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(2048, 4096)}}, {"type": "text", "text": "Describe it."}]}]}),
    ("image-low", "gpt-4.1", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(4000, 3000), "detail": "low"}}]}]}),
    ("image-remote-url", "gpt-4o", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "And this one?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}]}]}),
    ("image-4o-mini", "gpt-4o-mini", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(800, 600)}}]}]}),
    ("image-patches", "gpt-4.1-mini", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(1920, 1080)}},
        {"type": "image_url", "image_url": {"url": png(500, 300)}}]}]}),
    ("image-o1", "o1", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png(3000, 1000)}}]}]}),
    ("tools", "gpt-4o", {"tools": [WEATHER], "messages": [user("What's the weather like in Boston?")]}),
    ("tools-cl100k", "gpt-4", {"tools": [WEATHER, SEARCH], "messages": [user("Find rulings about data residency since 2024.")]}),
    ("tools-several", "gpt-4o", {"tools": [WEATHER, SEARCH, NO_PARAMS], "messages": [
        {"role": "system", "content": "Use tools when they help."}, user("Weather in Oslo, and the time?")]}),
    ("tool-call-round-trip", "gpt-4o", {"tools": [WEATHER], "messages": [
        user("What's the weather like in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_abc123", "type": "function", "function": {
            "name": "get_current_weather", "arguments": "{\"location\": \"Paris, France\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_abc123", "content": "{\"temperature\": 14, \"sky\": \"overcast\"}"}]}),
    ("legacy-functions", "gpt-3.5-turbo", {"functions": [WEATHER["function"]], "messages": [
        user("Weather in Rome?"),
        {"role": "assistant", "content": None, "function_call": {"name": "get_current_weather", "arguments": "{\"location\":\"Rome\"}"}},
        {"role": "function", "name": "get_current_weather", "content": "sunny, 24 C"}]}),
    ("refusal", "gpt-4o", {"messages": [user("Tell me a secret."), {"role": "assistant", "content": None, "refusal": "I can't help with that."}]}),
]


def main():
    corpus = [{"name": name, "model": model, "body": {"model": model, **body}, "prompt_tokens": count(model, body)}
              for name, model, body in CASES]
    with open(os.path.join(HERE, "corpus.json"), "w", encoding="utf-8") as f:
        json.dump(corpus, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for case in corpus:
        print(f"{case['prompt_tokens']:6}  {case['name']} ({case['model']})")


if __name__ == "__main__":
    main()
