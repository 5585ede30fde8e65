"""The batch and files APIs through the official `openai` SDK, unmodified, against `onedoor demo`:
`files.create/retrieve/content` and `batches.create/retrieve/list/cancel`, for `OpenAI` on /v1 and
`AzureOpenAI` on /openai, with the demo's batch alias `chat-batch` (global batch deployments)."""

import io
import json
import time

import openai
import pytest
from openai import AzureOpenAI, OpenAI

AZURE_API_VERSION = "2024-10-21"
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def client(demo):
    return OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def azure(demo):
    return AzureOpenAI(
        azure_endpoint=demo.url, api_key=demo.key, api_version=AZURE_API_VERSION, max_retries=0, timeout=30
    )


def jsonl(url: str, n: int = 3) -> io.BytesIO:
    lines = [
        {
            "custom_id": f"ticket-{i}",
            "method": "POST",
            "url": url,
            "body": {"model": "chat-batch", "max_tokens": 40, "messages": [{"role": "user", "content": f"Summarise ticket {i}"}]},
        }
        for i in range(n)
    ]
    return io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())


def until_ended(sdk, batch_id: str):
    deadline = time.monotonic() + 30
    batch = sdk.batches.retrieve(batch_id)
    while batch.status not in ENDED:
        assert time.monotonic() < deadline, f"the batch is still {batch.status} after 30 s"
        time.sleep(0.5)
        batch = sdk.batches.retrieve(batch_id)
    return batch


def run_batch(sdk, endpoint: str):
    upload = sdk.files.create(file=("tickets.jsonl", jsonl(endpoint)), purpose="batch")
    assert upload.id.startswith("file-") and upload.purpose == "batch", upload
    assert sdk.files.retrieve(upload.id).bytes == upload.bytes
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    assert batch.object == "batch" and batch.input_file_id == upload.id, batch
    ended = until_ended(sdk, batch.id)
    assert ended.status == "completed", ended
    assert ended.request_counts.total == 3 and ended.request_counts.completed == 3, ended.request_counts
    output = sdk.files.content(ended.output_file_id).text
    answers = [json.loads(line) for line in output.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["ticket-0", "ticket-1", "ticket-2"]
    for answer in answers:
        body = answer["response"]["body"]
        assert body["choices"][0]["message"]["content"], body
        assert body["usage"]["prompt_tokens"] > 0, body
    return upload, ended


def test_the_openai_client_runs_a_batch_to_its_output(client):
    upload, ended = run_batch(client, "/v1/chat/completions")
    listed = [b.id for b in client.batches.list(limit=100)]
    assert ended.id in listed
    assert client.files.content(upload.id).text.count("\n") == 3


def test_the_azure_client_runs_a_batch_to_its_output(azure):
    _, ended = run_batch(azure, "/chat/completions")
    assert ended.id in [b.id for b in azure.batches.list()]


def test_a_batch_can_be_cancelled(client):
    upload = client.files.create(file=("tickets.jsonl", jsonl("/v1/chat/completions")), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    assert until_ended(client, batch.id).status == "cancelled"


def test_a_bad_line_is_refused_with_its_number(client):
    bad = io.BytesIO(b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "chat-batch"}}\nnot json\n')
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", bad), purpose="batch")
    assert "line 2" in str(refused.value)


def test_an_unknown_batch_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nosuchbatch")
