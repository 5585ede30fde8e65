//! `onedoor demo`: a simulated fleet on loopback (subscriptions in several regions, one throttled,
//! one down, one reached only with the gateway's Entra ID token, an Anthropic endpoint and Claude
//! on Azure AI Foundry), a simulated Entra ID for the gateway's own tokens, a simulated OIDC
//! issuer whose tokens the demo tenant's application may present instead of its key, and the
//! gateway in front of it all, on an embedded config.

use std::fmt::Write as _;
use std::path::Path;

use onedoor_mock::{
    refusing_port, Behavior, DeploymentSpec, EndpointSpec, Fleet, IdentityServer, IdentitySpec,
    Issuer, DEFAULT_AUDIENCE,
};

use crate::keys::{new_key, sha256_hex};
use crate::{problems_text, stopped, Failure};

/// Where the demo records usage: the gateway's default file, so `onedoor usage report` without
/// flags reads it.
const DEMO_USAGE_FILE: &str = "onedoor-usage.db";
/// A batch on the simulated fleet runs from validating to completed in this long.
const DEMO_BATCH_MS: u64 = 3_000;
/// The simulated Entra ID's tokens live two minutes, so the gateway's refresh is seen at work.
const DEMO_TOKEN_LIFETIME_S: u64 = 120;

/// Upstreams that answer like real ones: a first token after a pause, then a steady trickle.
fn lifelike() -> Behavior {
    Behavior {
        ttft_ms: 120,
        inter_token_ms: 25,
        reply_words: Some(12),
        batch_ms: Some(DEMO_BATCH_MS),
        ..Behavior::default()
    }
}

fn fleet_specs() -> Vec<EndpointSpec> {
    let gpt4o = || DeploymentSpec::new("gpt-4o").model("gpt-4o-2024-11-20");
    let embed = || DeploymentSpec::new("text-embedding-3-large");
    let realtime = || DeploymentSpec::new("gpt-4o-realtime").model("gpt-4o-realtime-preview");
    // A global batch deployment: it takes batches only.
    let batch = || DeploymentSpec::new("gpt-4o-batch").model("gpt-4o-2024-11-20");
    vec![
        // Key authentication off, as enterprise policy has it: only the gateway's token passes.
        EndpointSpec::azure("sub1-swedencentral-ptu", "swedencentral")
            .entra("https://cognitiveservices.azure.com")
            .deployment(gpt4o())
            .deployment(embed())
            .deployment(realtime()),
        EndpointSpec::azure("sub1-francecentral", "francecentral")
            .deployment(gpt4o())
            .deployment(DeploymentSpec::new("gpt-4o-mini").model("gpt-4o-mini-2024-07-18"))
            .deployment(embed())
            .deployment(batch()),
        EndpointSpec::azure("sub2-norwayeast", "norwayeast")
            .deployment(gpt4o())
            .deployment(realtime())
            .deployment(batch()),
        EndpointSpec::azure("sub2-westeurope-throttled", "westeurope").deployment(gpt4o().rpm(1)),
        EndpointSpec::azure("sub3-eastus", "eastus")
            .deployment(gpt4o())
            .deployment(DeploymentSpec::new("gpt-4.1").model("gpt-4.1-2025-04-14")),
        EndpointSpec::azure("sub5-westeurope-flaky", "westeurope")
            .deployment(gpt4o())
            .behavior(Behavior {
                cut_after: Some(4),
                ..lifelike()
            }),
        EndpointSpec::anthropic("anthropic-eu", "europe").deployment(
            DeploymentSpec::new("claude-sonnet-4-5").model("claude-sonnet-4-5-20250929"),
        ),
        EndpointSpec::anthropic("foundry-claude-swedencentral", "swedencentral")
            .entra("https://ai.azure.com")
            .deployment(
                DeploymentSpec::new("claude-sonnet-4-5").model("claude-sonnet-4-5-20250929"),
            ),
    ]
    .into_iter()
    .map(|spec| match spec.behavior == Behavior::default() {
        true => spec.behavior(lifelike()),
        false => spec,
    })
    .collect()
}

fn url(fleet: &Fleet, name: &str) -> String {
    fleet.endpoint(name).map(|e| e.url()).unwrap_or_default()
}

/// The `azp` of the demo application's tokens: the claim its principal names.
const DEMO_APP: &str = "demo-app";

fn config_yaml(
    fleet: &Fleet,
    issuer: &str,
    port: u16,
    down_port: u16,
    key_hash: &str,
    admin_token: &str,
) -> String {
    let azure = |name: &str, region: &str, url: &str| {
        let credential = match name {
            "sub1-swedencentral-ptu" => ", identity: gateway",
            _ => "",
        };
        format!("  - {{ name: {name}, provider: azure, region: {region}, url: \"{url}\", api_version: 2024-10-21, circuit_breaker: default{credential} }}\n")
    };
    let mut backends = String::new();
    for (name, region) in [
        ("sub1-swedencentral-ptu", "swedencentral"),
        ("sub1-francecentral", "francecentral"),
        ("sub2-norwayeast", "norwayeast"),
        ("sub2-westeurope-throttled", "westeurope"),
        ("sub3-eastus", "eastus"),
        ("sub5-westeurope-flaky", "westeurope"),
    ] {
        backends.push_str(&azure(name, region, &url(fleet, name)));
    }
    backends.push_str(&azure(
        "sub4-eastus2-down",
        "eastus2",
        &format!("http://127.0.0.1:{down_port}"),
    ));
    let _ = writeln!(
        backends,
        "  - {{ name: anthropic-eu, provider: anthropic, region: europe, url: \"{}\" }}",
        url(fleet, "anthropic-eu")
    );
    let _ = writeln!(
        backends,
        "  - {{ name: foundry-claude-swedencentral, provider: anthropic, region: swedencentral, url: \"{}/anthropic\", identity: gateway, scope: https://ai.azure.com/.default }}",
        url(fleet, "foundry-claude-swedencentral")
    );
    let imds = fleet.identity().map(|i| i.imds_url()).unwrap_or_default();
    format!(
        r#"listen: 127.0.0.1:{port}
admin: {{ listen: 127.0.0.1:0, token: "{admin_token}" }}
usage: {{ store: "sqlite://{DEMO_USAGE_FILE}" }}
routing: {{ max_attempts: 4, not_served_ttl: 10m, timeouts: {{ connect: 1s, first_token: 20s }} }}
batch: {{ poll_interval: 2s }}
client_auth:
  jwt:
    - {{ issuer: "{issuer}", audience: "{DEFAULT_AUDIENCE}" }}
circuit_breakers:
  default:
    rules:
      - {{ name: unreachable, failures: {{ count: 2, within: 30s, status: [connect_error, timeout] }}, trip: 30s }}
      - {{ name: server-errors, failures: {{ count: 5, within: 60s, status: [500-599] }}, trip: 15s }}
      - {{ name: throttled, failures: {{ count: 1, within: 10s, status: [429] }}, trip: 5s, accept_retry_after: true }}
identities:
  gateway: {{ kind: managed_identity, endpoint: "{imds}" }}
regions:
  eu: [swedencentral, francecentral, norwayeast, westeurope]
  us: [eastus, eastus2]
backends:
{backends}models:
  - name: chat-default
    price: {{ input_per_1m: 2.50, output_per_1m: 10.00 }}
    targets:
      - {{ backend: sub1-swedencentral-ptu, deployment: gpt-4o, priority: 1, price: {{ input_per_1m: 0, output_per_1m: 0 }} }}
      - {{ backend: sub2-westeurope-throttled, deployment: gpt-4o, priority: 2 }}
      - {{ backend: sub1-francecentral, deployment: gpt-4o, priority: 2, weight: 3 }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o, priority: 2, weight: 1 }}
      - {{ backend: sub4-eastus2-down, deployment: gpt-4o, priority: 3 }}
  - name: chat-flaky
    price: {{ input_per_1m: 2.50, output_per_1m: 10.00 }}
    targets:
      - {{ backend: sub5-westeurope-flaky, deployment: gpt-4o, priority: 1 }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o, priority: 2 }}
  - name: chat-resilient
    continue_cut_streams: true
    price: {{ input_per_1m: 2.50, output_per_1m: 10.00 }}
    targets:
      - {{ backend: sub5-westeurope-flaky, deployment: gpt-4o, priority: 1 }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o, priority: 2, accepts_prefill: true }}
  - name: chat-mini
    price: {{ input_per_1m: 0.15, output_per_1m: 0.60 }}
    targets:
      - {{ backend: sub1-francecentral, deployment: gpt-4o-mini }}
  - name: chat-batch
    price: {{ input_per_1m: 2.50, output_per_1m: 10.00 }}
    targets:
      - {{ backend: sub1-francecentral, deployment: gpt-4o-batch, priority: 1, batch: true }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o-batch, priority: 2, batch: true }}
  - name: claude
    price: {{ input_per_1m: 3.00, output_per_1m: 15.00 }}
    targets:
      - {{ backend: anthropic-eu, model: claude-sonnet-4-5 }}
  - name: claude-foundry
    price: {{ input_per_1m: 3.00, output_per_1m: 15.00 }}
    targets:
      - {{ backend: foundry-claude-swedencentral, model: claude-sonnet-4-5 }}
  - name: voice-default
    targets:
      - {{ backend: sub1-swedencentral-ptu, deployment: gpt-4o-realtime, priority: 1 }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o-realtime, priority: 2 }}
  - name: assistants
    session_affinity: true
    price: {{ input_per_1m: 2.50, output_per_1m: 10.00 }}
    targets:
      - {{ backend: sub1-francecentral, deployment: gpt-4o }}
      - {{ backend: sub2-norwayeast, deployment: gpt-4o }}
  - name: embed-default
    price: {{ input_per_1m: 0.13, output_per_1m: 0 }}
    targets:
      - {{ backend: sub1-swedencentral-ptu, deployment: text-embedding-3-large }}
      - {{ backend: sub1-francecentral, deployment: text-embedding-3-large }}
  - name: "*"
    targets:
      - {{ backends: [sub4-eastus2-down, sub1-swedencentral-ptu, sub1-francecentral, sub2-norwayeast, sub3-eastus] }}
tenants:
  - name: demo
    keys:
      - {{ id: demo-key, sha256: {key_hash} }}
    principals:
      - {{ id: demo-app, claim: azp, equals: {DEMO_APP} }}
"#
    )
}

fn examples(url: &str, key: &str, issuer: &str, admin: &str, admin_token: &str) -> String {
    format!(
        r#"
Paste into a shell:

export ONEDOOR_URL={url}
export ONEDOOR_KEY={key}

curl (the gateway's headers say which backend answered and what it tried):

curl -si $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"chat-default","messages":[{{"role":"user","content":"Hello"}}]}}'

curl -sN $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"chat-default","stream":true,"messages":[{{"role":"user","content":"Hello"}}]}}'

curl -si $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"gpt-4.1","messages":[{{"role":"user","content":"Which endpoint serves gpt-4.1?"}}]}}'

The gateway reaches sub1-swedencentral-ptu and Claude on Azure AI Foundry with its own Entra ID
token (a managed identity, here from the simulated Entra ID; refreshed before it expires):

curl -si $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"claude-foundry","messages":[{{"role":"user","content":"Hello from Foundry"}}]}}'

A stream that the upstream cuts midway ends with an explicit error event (chat-flaky); on an
alias that continues cut streams, another backend finishes the answer from what was sent (chat-resilient):

curl -sN $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"chat-flaky","stream":true,"messages":[{{"role":"user","content":"Hello"}}]}}'

curl -sN $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"chat-resilient","stream":true,"messages":[{{"role":"user","content":"Hello"}}]}}'

The openai Python SDK (pip install openai):

python3 - <<'PY'
import os
from openai import OpenAI
client = OpenAI(base_url=os.environ["ONEDOOR_URL"] + "/v1", api_key=os.environ["ONEDOOR_KEY"])
reply = client.chat.completions.create(model="chat-default", messages=[{{"role": "user", "content": "Hello"}}])
print(reply.choices[0].message.content)
for chunk in client.chat.completions.create(model="chat-default", messages=[{{"role": "user", "content": "Stream, please"}}], stream=True):
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
PY

The AzureOpenAI client (only the endpoint and the key change):

python3 - <<'PY'
import os
from openai import AzureOpenAI
client = AzureOpenAI(azure_endpoint=os.environ["ONEDOOR_URL"], api_key=os.environ["ONEDOOR_KEY"], api_version="2024-10-21")
reply = client.chat.completions.create(model="chat-default", messages=[{{"role": "user", "content": "Hello"}}])
print(reply.choices[0].message.content)
print(len(client.embeddings.create(model="embed-default", input="Hello").data[0].embedding), "dimensions")
PY

An application with an Entra ID identity instead of a key: the AzureOpenAI client's
azure_ad_token_provider gets a token (here from the simulated issuer, as from
azure.identity's get_bearer_token_provider on Azure) and the gateway checks it against the
issuer's keys; the token's azp makes it the demo tenant's principal "{DEMO_APP}":

python3 - <<'PY'
import json, os, urllib.request
from openai import AzureOpenAI
def entra_token():
    ask = urllib.request.Request("{issuer}/_mock/tokens", data=json.dumps({{"claims": {{"azp": "{DEMO_APP}"}}}}).encode(), headers={{"content-type": "application/json"}})
    return json.load(urllib.request.urlopen(ask))["access_token"]
client = AzureOpenAI(azure_endpoint=os.environ["ONEDOOR_URL"], azure_ad_token_provider=entra_token, api_version="2024-10-21")
print(client.chat.completions.create(model="chat-default", messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)
PY

One API for every backend: the anthropic SDK (pip install anthropic) on /v1/messages against the
Azure-backed alias, the openai SDK on "claude" (the Anthropic endpoint) and on the Responses API:

python3 - <<'PY'
import os
from anthropic import Anthropic
from openai import OpenAI
claude_sdk = Anthropic(base_url=os.environ["ONEDOOR_URL"], api_key=os.environ["ONEDOOR_KEY"])
print(claude_sdk.messages.create(model="chat-default", max_tokens=256, messages=[{{"role": "user", "content": "Hello"}}]).content[0].text)
openai_sdk = OpenAI(base_url=os.environ["ONEDOOR_URL"] + "/v1", api_key=os.environ["ONEDOOR_KEY"])
print(openai_sdk.chat.completions.create(model="claude", messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)
print(openai_sdk.responses.create(model="chat-default", input="Hello").output_text)
PY

An alias with session affinity: the answer carries a session token (x-onedoor-session, and a
cookie); requests that send it back stay on the backend that holds the conversation:

curl -si $ONEDOOR_URL/v1/chat/completions -H "Authorization: Bearer $ONEDOOR_KEY" -H 'content-type: application/json' -d '{{"model":"assistants","messages":[{{"role":"user","content":"Hello"}}]}}'

A realtime session over WebSocket (pip install "openai[realtime]"), routed once at the handshake
and pinned to its backend until it closes:

python3 - <<'PY'
import asyncio, os
from openai import AsyncOpenAI
async def main():
    client = AsyncOpenAI(base_url=os.environ["ONEDOOR_URL"] + "/v1", api_key=os.environ["ONEDOOR_KEY"])
    async with client.realtime.connect(model="voice-default") as connection:
        await connection.session.update(session={{"type": "realtime", "output_modalities": ["text"]}})
        await connection.conversation.item.create(item={{"type": "message", "role": "user", "content": [{{"type": "input_text", "text": "Hello"}}]}})
        await connection.response.create()
        async for event in connection:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            elif event.type == "response.done":
                print()
                break
asyncio.run(main())
PY

A batch at half the price (the batch API, as the openai SDK sends it): its lines name an alias,
the gateway keeps the file, holds its estimated tokens against the tenant's quotas, places it on
a batch deployment (chat-batch), and records its usage when it completes:

python3 - <<'PY'
import io, json, os, time
from openai import OpenAI
client = OpenAI(base_url=os.environ["ONEDOOR_URL"] + "/v1", api_key=os.environ["ONEDOOR_KEY"])
lines = [{{"custom_id": f"ticket-{{n}}", "method": "POST", "url": "/v1/chat/completions", "body": {{"model": "chat-batch", "max_tokens": 50, "messages": [{{"role": "user", "content": f"Summarise ticket {{n}}"}}]}}}} for n in range(3)]
upload = client.files.create(file=("tickets.jsonl", io.BytesIO("".join(json.dumps(l) + "\n" for l in lines).encode())), purpose="batch")
batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
while batch.status not in ("completed", "failed", "expired", "cancelled"):
    time.sleep(1)
    batch = client.batches.retrieve(batch.id)
print(batch.id, batch.status, batch.request_counts)
for line in client.files.content(batch.output_file_id).text.splitlines():
    answer = json.loads(line)
    print(answer["custom_id"], answer["response"]["body"]["choices"][0]["message"]["content"])
PY

What the gateway has learned (not-served deployments, cooldowns):

curl -s {admin}/admin/backends -H "Authorization: Bearer {admin_token}"

The dashboard (backends, breakers, tenants' limits, the last hour's traffic, recent errors):

{admin}/dashboard#token={admin_token}

Every request is a usage record in ./{DEMO_USAGE_FILE}; chargeback per tenant, alias and backend:

onedoor usage report --by tenant,alias,backend

and batch spend beside synchronous spend:

onedoor usage report --by tenant,kind

Ctrl-C stops it all.
"#
    )
}

pub async fn run(port: u16) -> Result<(), Failure> {
    onedoor_gateway::configure_idle_poll().map_err(Failure::BadInput)?;
    let cannot =
        |e: std::io::Error| Failure::Runtime(format!("cannot start the simulated fleet: {e}"));
    let identity = IdentityServer::start(IdentitySpec::default().lifetime_s(DEMO_TOKEN_LIFETIME_S))
        .await
        .map_err(cannot)?;
    let fleet = Fleet::start(fleet_specs())
        .await
        .map_err(cannot)?
        .with_identity(identity);
    let issuer = Issuer::start(None)
        .await
        .map_err(|e| Failure::Runtime(format!("cannot start the simulated issuer: {e}")))?;
    let key = new_key();
    let admin_token = new_key();
    // The "down" subscription: held for as long as the demo runs.
    let (_refusing, down_port) = refusing_port()
        .map_err(|e| Failure::Runtime(format!("cannot reserve a down port: {e}")))?;
    let yaml = config_yaml(
        &fleet,
        &issuer.url(),
        port,
        down_port,
        &sha256_hex(&key),
        &admin_token,
    );
    let snapshot = onedoor_config::parse(&yaml, Path::new("<demo>"), &|_| None).map_err(|p| {
        Failure::Runtime(format!(
            "the embedded demo config is invalid:\n{}",
            problems_text(&p)
        ))
    })?;
    let running = onedoor_gateway::start(snapshot).await.map_err(|e| {
        Failure::Runtime(format!(
            "cannot listen on 127.0.0.1:{port}: {e} (try --port)"
        ))
    })?;
    println!(
        "onedoor demo: the gateway listens on http://{} in front of {} simulated upstreams (and one that is down):",
        running.addr(),
        fleet.endpoints().len()
    );
    for endpoint in fleet.endpoints() {
        println!("  {:<28} {}", endpoint.name(), endpoint.url());
    }
    if let Some(identity) = fleet.identity() {
        println!(
            "  {:<28} {} (sub1-swedencentral-ptu and foundry-claude-swedencentral take only its tokens)",
            "entra-id (simulated)",
            identity.authority()
        );
    }
    println!("  {:<28} {} (OIDC issuer)", "entra-id-issuer", issuer.url());
    let url = format!("http://{}", running.addr());
    let admin = format!("http://{}", running.admin_addr());
    println!(
        "{}",
        examples(&url, &key, &issuer.url(), &admin, &admin_token)
    );
    stopped().await;
    // No drain delay: nothing routes to the demo by endpoint lists. A second signal stops at once.
    tokio::select! {
        () = running.shutdown() => {}
        () = stopped() => {}
    }
    fleet.shutdown().await;
    issuer.shutdown();
    Ok(())
}
