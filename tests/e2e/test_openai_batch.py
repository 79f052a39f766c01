"""OpenAI's Batch API on the real stack, with the official openai SDK: a JSONL file uploaded, a
batch run by the job worker through the real adapter and Triton, its output and error files read
back; cancel; another tenant's 404; and the docs' curl block (docs/developers/openai-batch.md)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import openai
import pytest
from openai.types import Batch
from openai.types.chat import ChatCompletion

from conftest import DEMO_KEY, MODEL
from sluice_stack import REPO_ROOT, Stack
from test_openai_http import evallog, record_of  # noqa: F401 - evallog is a fixture

PRIVATE_KEY = "sk-sluice-private"
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def jsonl(lines: list[dict]) -> bytes:  # type: ignore[type-arg]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, question: str, model: str = MODEL, max_tokens: int = 8) -> dict:  # type: ignore[type-arg]
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def wait_ended(client: openai.OpenAI, batch_id: str, timeout_s: float = 300.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ENDED:
            return batch
        time.sleep(0.5)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s}s")


def test_a_batch_runs_on_the_job_workers_and_answers_as_the_endpoint(client: openai.OpenAI, evallog) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    questions = {"colour": "Name a colour.", "city": "Name a city.", "animal": "Name an animal."}
    lines = [chat_line(custom_id, question) for custom_id, question in questions.items()]
    lines.append(chat_line("unknown-model", "Hi.", model="no-such-model"))  # valid JSON, fails when run
    uploaded = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"suite": "e2e"})
    assert created.status in ("validating", "in_progress") and created.metadata == {"suite": "e2e"}
    assert created.request_counts is not None and created.request_counts.total == 4

    batch = wait_ended(client, created.id)
    assert batch.status == "completed" and batch.completed_at is not None and batch.expires_at is not None
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.output_file_id and batch.error_file_id

    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(record["custom_id"] for record in output) == sorted(questions)
    for record in output:
        assert record["error"] is None and record["response"]["status_code"] == 200
        reply = ChatCompletion.model_validate(record["response"]["body"])
        assert reply.object == "chat.completion" and reply.model == MODEL and reply.choices[0].message.content
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 8
        assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
        # The response's request_id is the one the row ran under: it finds the row's evaluation record.
        event = record_of(evallog, record["response"]["request_id"]).event
        assert event.output == reply.choices[0].message.content and event.custom_id == record["custom_id"]
    [error] = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    # A request that failed with an HTTP error is that response (OpenAI's batch output: `error` is
    # for failures that are not HTTP errors, such as an expired batch).
    assert error["custom_id"] == "unknown-model" and error["error"] is None
    assert error["response"]["status_code"] == 400 and error["response"]["request_id"]
    assert error["response"]["body"]["error"]["code"] == "invalid_argument" and "no-such-model" in error["response"]["body"]["error"]["message"]

    listed = client.batches.list(limit=100)
    assert created.id in [b.id for b in listed.data]


def test_a_bad_line_is_refused_at_upload_naming_it(client: openai.OpenAI) -> None:
    lines = [chat_line("a", "Hi."), {**chat_line("b", "Hi."), "body": {"model": MODEL, "messages": "not a list"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    assert refused.value.status_code == 400 and "Line 2" in refused.value.message
    assert refused.value.body["type"] == "invalid_request_error" and refused.value.body["param"] == "body.messages"  # type: ignore[index]


def test_cancel_stops_a_batch(client: openai.OpenAI) -> None:
    lines = [chat_line(f"r{i}", f"Count to {i + 20}.", max_tokens=64) for i in range(12)]
    uploaded = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    cancelling = client.batches.cancel(created.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    batch = wait_ended(client, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert batch.request_counts is not None and batch.request_counts.completed + batch.request_counts.failed < 12
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait_ended(client, client.batches.create(
            input_file_id=client.files.create(file=("one.jsonl", jsonl([chat_line("x", "Hi.", max_tokens=2)])), purpose="batch").id,
            endpoint="/v1/chat/completions", completion_window="24h",
        ).id).id)  # fmt: skip


def test_another_tenant_gets_404(client: openai.OpenAI, stack: Stack) -> None:
    uploaded = client.files.create(file=("mine.jsonl", jsonl([chat_line("a", "Hi.", max_tokens=2)])), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    other = openai.OpenAI(base_url=stack.openai_base_url, api_key=PRIVATE_KEY, max_retries=0, timeout=60)
    for call in (
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.batches.retrieve(created.id),
        lambda: other.batches.cancel(created.id),
        lambda: other.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert created.id not in [b.id for b in other.batches.list().data]
    assert wait_ended(client, created.id).status == "completed"


def documented_batch_block() -> str:
    """The first bash block of the Batch API's page (the README's "OpenAI Batch API" section before)."""
    page = (REPO_ROOT / "docs" / "developers" / "openai-batch.md").read_text()
    return re.findall(r"```bash\n(.*?)```", page, re.S)[0]


def test_documented_batch_curl_block_works(stack: Stack, tmp_path: Path) -> None:
    port = stack.openai_base_url.split(":")[2].split("/")[0]
    script = "set -euo pipefail\n" + documented_batch_block().replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, (done.stdout, done.stderr)
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(r["custom_id"] for r in records) == ["q1", "q2"]
    assert all(r["response"]["body"]["object"] == "chat.completion" and r["response"]["body"]["usage"]["total_tokens"] > 0 for r in records)
