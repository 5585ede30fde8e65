"""Callers with Entra ID-style tokens instead of keys: the official `openai` SDK's
`AzureOpenAI(azure_ad_token_provider=...)` against `onedoor demo`, with tokens minted by the
demo's simulated OIDC issuer (its `POST /_mock/tokens`, as azure.identity would fetch them from
Entra ID). The gateway checks each token against the issuer's published keys.
"""

import json
import re
import urllib.request

import openai
import pytest
from openai import AzureOpenAI

HELLO = [{"role": "user", "content": "Hello"}]
AZURE_API_VERSION = "2024-10-21"
# The demo tenant's principal: tokens whose azp is this are the demo tenant's.
DEMO_APP = "demo-app"


@pytest.fixture(scope="module")
def issuer(demo) -> str:
    found = re.search(r"^\s*entra-id-issuer\s+(http://\S+) \(OIDC issuer\)$", demo.text, re.M)
    assert found, demo.text
    return found.group(1)


def mint(issuer: str, **ask) -> str:
    request = urllib.request.Request(
        issuer + "/_mock/tokens", data=json.dumps(ask).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["access_token"]


def client_with(demo, provider) -> AzureOpenAI:
    return AzureOpenAI(
        azure_endpoint=demo.url,
        azure_ad_token_provider=provider,
        api_version=AZURE_API_VERSION,
        max_retries=0,
        timeout=30,
    )


def test_azure_ad_token_provider_tokens_are_served_as_the_tenants_principal(demo, issuer):
    asked = []

    def provider() -> str:
        asked.append(1)
        return mint(issuer, claims={"azp": DEMO_APP})

    client = client_with(demo, provider)
    raw = client.chat.completions.with_raw_response.create(model="chat-default", messages=HELLO)
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert raw.headers.get("x-onedoor-backend"), dict(raw.headers)
    assert asked, "the SDK asked the provider for a token"

    chunks = list(client.chat.completions.create(model="chat-default", messages=HELLO, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(client.embeddings.create(model="embed-default", input="Hello").data[0].embedding) > 0


def test_an_es256_token_is_served_too(demo, issuer):
    client = client_with(demo, lambda: mint(issuer, key="ec", claims={"azp": DEMO_APP}))
    assert client.chat.completions.create(model="chat-default", messages=HELLO).choices[0].message.content


@pytest.mark.parametrize(
    "ask, reason",
    [
        ({"claims": {"azp": DEMO_APP}, "lifetime": -600}, "expired"),
        ({"claims": {"azp": DEMO_APP, "aud": "api://someone-else"}, "lifetime": 600}, "wrong audience"),
        ({"claims": {"azp": "not-a-principal"}}, "no tenant's principal matches it"),
        ({"claims": {"azp": DEMO_APP}, "kid": "forged-kid"}, 'unknown kid "forged-kid"'),
    ],
)
def test_a_bad_token_is_refused_401_invalid_token_with_its_reason(demo, issuer, ask, reason):
    token = mint(issuer, **ask)
    client = client_with(demo, lambda: token)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model="chat-default", messages=HELLO)
    error = refused.value
    assert error.status_code == 401
    assert error.code == "invalid_token", error.body
    assert reason in error.message, error.message
    assert token not in error.message
