"""Bulk jobs from RabbitMQ producers (issue 6), on the real stack and the real broker.

The producer here is a plain aio-pika script that publishes JSON exactly as docs/developers/jobs.md documents
("Bulk jobs: the producer contract"): no Sluice code on the producer's side.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request
import uuid
from collections import Counter
from typing import Any

import aio_pika
import grpc
import pytest
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, EMBEDDING_MODEL, MODEL, auth, read_store
from sluice_stack import Stack

RESULT_TYPE = "sluice.jobs.v1.RowResult"
SUMMARY_TYPE = "sluice.jobs.v1.Job"
# At temperature 0 SmolLM2-135M counts on past 1,024 tokens (digits are single tokens): measured here
# with llama.cpp on the same GGUF, it stopped for length at 1,024 (it reached 227).
LONG_PROMPT = "Write the numbers from 1 to 1000, separated by commas."


def gen_row(custom_id: str, max_tokens: int = 2) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "generate": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Say a number ({custom_id})"}],
            "sampling": {"max_tokens": max_tokens, "temperature": 0},
        },
    }


def embed_row(custom_id: str) -> dict[str, Any]:
    return {"custom_id": custom_id, "embed": {"model": EMBEDDING_MODEL, "inputs": [f"sentence number {custom_id}"]}}


async def publish_and_collect(
    stack: Stack,
    job: dict[str, Any] | bytes,
    expect: int,
    timeout_s: float = 240.0,
    content_type: str = "application/json",
    summary: bool = False,
    linger_s: float = 0.0,
) -> list[dict[str, Any]]:
    """Publishes like a producer would, then reads replies from its own reply queue until `expect`
    distinct ones (results or a rejection; by message id) have come. The job's summary (type
    sluice.jobs.v1.Job) is left out, unless `summary`: then it is waited for too and listed.
    `linger_s`: go on reading that long, to catch repeats."""
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        reply_to = f"{stack.amqp_prefix}-test-replies-{uuid.uuid4().hex[:8]}"
        replies = await channel.declare_queue(reply_to, durable=True)
        if isinstance(job, dict):
            job = {**job, "reply_to": reply_to}
            body = json.dumps(job).encode()
        else:
            body = job
        exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
        await exchange.publish(
            aio_pika.Message(body, content_type=content_type, delivery_mode=aio_pika.DeliveryMode.PERSISTENT, reply_to=reply_to),
            routing_key="job",
        )
        received: list[dict[str, Any]] = []
        summaries: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s

        def waiting() -> bool:
            return len({r["_id"] for r in received}) < expect or (summary and not summaries)

        async with replies.iterator() as messages:
            while True:
                if not waiting() and deadline > time.monotonic() + linger_s:
                    deadline = time.monotonic() + linger_s
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    message = await asyncio.wait_for(messages.__anext__(), remaining)
                except TimeoutError:
                    break
                async with message.process():
                    reply = {"_id": message.message_id, "_type": message.type, **json.loads(message.body)}
                    (summaries if message.type == SUMMARY_TYPE else received).append(reply)
        await replies.delete(if_unused=False, if_empty=False)
        return received + summaries if summary else received


def wait_job(gateway: Any, job_id: str, timeout_s: float = 240.0) -> jobs_pb2.Job:
    """The job once it has ended (an expired one: once every row is stored)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job = gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth(), timeout=10).job
            if job.state in (jobs_pb2.JOB_STATE_COMPLETED, jobs_pb2.JOB_STATE_CANCELLED, jobs_pb2.JOB_STATE_FAILED):
                return job
            if job.state == jobs_pb2.JOB_STATE_EXPIRED and job.completed_rows + job.failed_rows >= job.total_rows:
                return job
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise
        time.sleep(0.25)
    raise AssertionError(f"job {job_id} did not finish within {timeout_s}s")


def all_results(gateway: Any, job_id: str) -> list[jobs_pb2.RowResult]:
    results: list[jobs_pb2.RowResult] = []
    token = ""
    while True:
        reply = gateway.ListJobResults(gateway_pb2.ListJobResultsRequest(job_id=job_id, page_size=200, page_token=token), metadata=auth(), timeout=10)
        results += reply.results
        token = reply.next_page_token
        if not token:
            return results


def test_a_500_row_job_from_a_plain_producer_reports_every_row_once(stack: Stack, gateway: Any) -> None:
    job_id = f"job-{uuid.uuid4().hex[:8]}"
    rows = [embed_row(f"e{i}") for i in range(470)] + [gen_row(f"g{i}") for i in range(30)]
    job = {"job_id": job_id, "api_key": DEMO_KEY, "rows": rows}
    replies = asyncio.run(publish_and_collect(stack, job, expect=500))
    counts = Counter(r["custom_id"] for r in replies)
    assert set(counts) == {r["custom_id"] for r in rows}
    assert max(counts.values()) == 1
    assert all("error" not in r for r in replies), [r for r in replies if "error" in r][:3]
    generated = [r for r in replies if r["custom_id"].startswith("g")]
    assert all(r["output"] and r["usage"]["completion_tokens"] >= 1 for r in generated)
    embedded = [r for r in replies if r["custom_id"].startswith("e")]
    assert all(len(r["embeddings"][0]["values"]) == 384 for r in embedded)
    final = wait_job(gateway, job_id)
    assert (final.state, final.total_rows, final.completed_rows, final.failed_rows) == (jobs_pb2.JOB_STATE_COMPLETED, 500, 500, 0)
    listed = all_results(gateway, job_id)
    assert sorted(r.custom_id for r in listed) == sorted(counts)


def test_a_malformed_job_is_rejected_to_its_reply_to(stack: Stack, gateway: Any) -> None:
    bad_key = {"job_id": "bad-key", "api_key": "sk-nope", "rows": [embed_row("a")]}
    (rejection,) = asyncio.run(publish_and_collect(stack, bad_key, expect=1, timeout_s=30))
    assert rejection["job_id"] == "bad-key" and "api_key" in rejection["reason"]
    assert rejection["_type"] == "sluice.jobs.v1.JobRejection"
    job_id = f"dup-{uuid.uuid4().hex[:6]}"
    duplicate = {"job_id": job_id, "api_key": DEMO_KEY, "rows": [embed_row("a"), embed_row("a")]}
    (rejection,) = asyncio.run(publish_and_collect(stack, duplicate, expect=1, timeout_s=30))
    assert "repeated" in rejection["reason"]
    assert wait_job(gateway, job_id, 10).state == jobs_pb2.JOB_STATE_FAILED
    (rejection,) = asyncio.run(publish_and_collect(stack, b'{"job_id": "x", "rows": 7', expect=1, timeout_s=30))
    assert "not a JobRequest" in rejection["reason"]


def test_a_poison_row_is_dead_lettered_and_the_job_completes(stack: Stack, gateway: Any) -> None:
    job_id = f"poison-{uuid.uuid4().hex[:6]}"
    rows = [embed_row(f"ok{i}") for i in range(5)] + [{"custom_id": "poison"}]
    job = {"job_id": job_id, "api_key": DEMO_KEY, "rows": rows}
    replies = asyncio.run(publish_and_collect(stack, job, expect=6, timeout_s=60, summary=True))
    (summary,) = [r for r in replies if r["_type"] == SUMMARY_TYPE]
    by_id = {r["custom_id"]: r for r in replies if r["_type"] == RESULT_TYPE}
    assert len(by_id) == 6
    assert "dead-lettered" in by_id["poison"]["error"]["message"]
    assert all("error" not in by_id[f"ok{i}"] for i in range(5))
    # The summary: the Job, once every row is stored, told as completed (finalizing is the moment between).
    assert summary["_id"] == f"{job_id}/summary"
    assert (summary["job_id"], summary["state"], summary["total_rows"]) == (job_id, "JOB_STATE_COMPLETED", 6)
    assert (summary["completed_rows"], summary["failed_rows"]) == (5, 1)
    final = wait_job(gateway, job_id, 30)
    assert (final.state, final.completed_rows, final.failed_rows) == (jobs_pb2.JOB_STATE_COMPLETED, 5, 1)

    async def dead_copy() -> dict[str, Any]:
        connection = await aio_pika.connect(stack.amqp_url)
        async with connection:
            queue = await (await connection.channel()).get_queue(f"{stack.amqp_prefix}.jobs.dead")
            while True:
                message = await queue.get(fail=False, timeout=5)
                if message is None:
                    return {}
                await message.ack()
                if message.message_id == f"{job_id}/poison":
                    return dict(message.headers or {})

    headers = asyncio.run(dead_copy())
    assert "neither a generate nor an embed" in str(headers.get("x-sluice-dead-reason"))


def test_submit_watch_list_and_cancel_over_grpc(stack: Stack, gateway: Any) -> None:
    job_id = f"grpc-{uuid.uuid4().hex[:6]}"
    job = jobs_pb2.JobRequest(job_id=job_id)
    job.rows.add(custom_id="a").embed.inputs.append("one")
    job.rows[0].embed.model = EMBEDDING_MODEL
    job.rows.add(custom_id="b").embed.inputs.append("two")
    job.rows[1].embed.model = EMBEDDING_MODEL
    submitted = gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=job), metadata=auth(), timeout=10).job
    assert submitted.state == jobs_pb2.JOB_STATE_VALIDATING and submitted.total_rows == 2
    states = [r.job.state for r in gateway.WatchJob(gateway_pb2.WatchJobRequest(job_id=job_id), metadata=auth(), timeout=60)]
    assert states[-1] == jobs_pb2.JOB_STATE_COMPLETED
    assert {r.custom_id for r in all_results(gateway, job_id)} == {"a", "b"}
    with pytest.raises(grpc.RpcError) as caught:
        gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth("sk-sluice-private"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # type: ignore[attr-defined]

    # Cancellation: a long generation job; no row may start later than 1 s after CancelJob.
    long_id = f"cancel-{uuid.uuid4().hex[:6]}"
    long_job = jobs_pb2.JobRequest(job_id=long_id)
    for i in range(200):
        row = long_job.rows.add(custom_id=f"r{i}").generate
        row.model = MODEL
        row.messages.add(role="user", content=f"Count to {i}")
        row.sampling.max_tokens = 2
    gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=long_job), metadata=auth(), timeout=10)
    deadline = time.monotonic() + 120
    while gateway.GetJob(gateway_pb2.GetJobRequest(job_id=long_id), metadata=auth(), timeout=10).job.completed_rows < 3:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    cancelled_at = time.time()
    state = gateway.CancelJob(gateway_pb2.CancelJobRequest(job_id=long_id), metadata=auth(), timeout=10).job.state
    assert state in (jobs_pb2.JOB_STATE_CANCELLING, jobs_pb2.JOB_STATE_CANCELLED)
    final = wait_job(gateway, long_id, 60)
    assert final.state == jobs_pb2.JOB_STATE_CANCELLED
    assert final.completed_rows < 200
    # Rows finished after the cancel were already running: at most one bound's worth, all ended soon.
    assert final.updated_at.ToNanoseconds() / 1e9 - cancelled_at < 30
    time.sleep(1.5)
    after = gateway.GetJob(gateway_pb2.GetJobRequest(job_id=long_id), metadata=auth(), timeout=10).job
    assert after.completed_rows + after.failed_rows == final.completed_rows + final.failed_rows


def test_a_worker_killed_mid_job_loses_no_row_and_reports_none_twice(stack: Stack, gateway: Any) -> None:
    job_id = f"kill-{uuid.uuid4().hex[:6]}"
    rows = [gen_row(f"g{i}", max_tokens=2) for i in range(40)]
    stored_at_kill: set[str] = set()

    async def run() -> list[dict[str, Any]]:
        task = asyncio.create_task(publish_and_collect(stack, {"job_id": job_id, "api_key": DEMO_KEY, "rows": rows}, expect=40, linger_s=1.0))
        deadline = time.monotonic() + 120
        while True:
            await asyncio.sleep(0.2)
            try:
                job = gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth(), timeout=10).job
            except grpc.RpcError:
                continue
            if job.completed_rows >= 5:
                break
            assert time.monotonic() < deadline
        stack.service("job-worker").kill()  # SIGKILL: rows in flight are unacked
        stored_at_kill.update(job_rows_in_state(stack, job_id, "done"))
        await asyncio.to_thread(stack.add_job_worker, f"job-worker-{uuid.uuid4().hex[:4]}")
        return await task

    replies = asyncio.run(run())
    final = wait_job(gateway, job_id)
    assert (final.state, final.completed_rows, final.failed_rows) == (jobs_pb2.JOB_STATE_COMPLETED, 40, 0)
    listed = Counter(r.custom_id for r in all_results(gateway, job_id))
    assert set(listed) == {r["custom_id"] for r in rows} and max(listed.values()) == 1
    told = Counter(r["custom_id"] for r in replies)
    assert set(told) == set(listed)
    # A row is told again only when the worker died after storing it but before its ack: the
    # redelivery finds it stored and tells the same result again, never running it twice.
    told_twice = {custom_id for custom_id, times in told.items() if times > 1}
    assert told_twice <= stored_at_kill, f"{told_twice - stored_at_kill} told twice but not stored when the worker died"
    assert max(told.values()) <= 2
    for custom_id in told_twice:
        first, second = [r for r in replies if r["custom_id"] == custom_id]
        assert first == second


def job_rows_in_state(stack: Stack, job_id: str, state: str) -> set[str]:
    """The custom ids of the job's rows in `state` ('running': claimed by a worker and not finished;
    'done': stored), read from the worker's SQLite store."""
    with read_store(stack, "jobs.sqlite3") as db:
        return {row[0] for row in db.execute("SELECT custom_id FROM job_rows WHERE job_id = ? AND state = ?", (job_id, state))}


def test_a_job_past_its_completion_window_expires_and_still_reports_every_row_once(stack: Stack, gateway: Any) -> None:
    job_id = f"expire-{uuid.uuid4().hex[:6]}"
    # Far more than 4 s of generation here (a batch of 8 makes ~50 tokens/s); 4 s is long enough for
    # a loaded machine to claim some rows before the window ends.
    rows = [gen_row(f"g{i}", max_tokens=16) for i in range(60)]
    job = {"job_id": job_id, "api_key": DEMO_KEY, "completion_window": "4s", "rows": rows}
    started = time.monotonic()
    replies = asyncio.run(publish_and_collect(stack, job, expect=60, timeout_s=120, summary=True, linger_s=1.0))
    elapsed = time.monotonic() - started
    results = [r for r in replies if r["_type"] == RESULT_TYPE]
    summaries = [r for r in replies if r["_type"] == SUMMARY_TYPE]
    told = Counter(r["custom_id"] for r in results)
    assert set(told) == {r["custom_id"] for r in rows} and max(told.values()) == 1, "every row told exactly once"
    assert all(r["_id"] == f"{job_id}/{r['custom_id']}" for r in results)
    ran = [r for r in results if "error" not in r]
    expired = [r for r in results if "error" in r]
    assert ran, "rows claimed within the window run and report their results"
    assert expired, f"60 generations of 16 tokens all ran within 4 s ({elapsed:.1f}s in all)"
    assert all(r["error"]["code"] == "EXPIRED" for r in expired), expired[:2]
    assert "completion window (4s) ended before this row ran" in expired[0]["error"]["message"]
    assert all(r["output"] for r in ran)
    (summary,) = summaries
    assert summary["_id"] == f"{job_id}/summary"
    assert (summary["state"], summary["total_rows"]) == ("JOB_STATE_EXPIRED", 60)
    assert (summary.get("completed_rows", 0), summary["failed_rows"]) == (len(ran), len(expired))
    final = wait_job(gateway, job_id, 30)
    assert (final.state, final.completed_rows, final.failed_rows) == (jobs_pb2.JOB_STATE_EXPIRED, len(ran), len(expired))
    # Times are stored as float seconds: at today's epoch a double resolves ~0.24 us.
    assert abs(final.expires_at.ToNanoseconds() - final.created_at.ToNanoseconds() - 4_000_000_000) < 1_000_000
    listed = {r.custom_id: r for r in all_results(gateway, job_id)}
    assert {cid for cid, r in listed.items() if r.error.code == "EXPIRED"} == {r["custom_id"] for r in expired}


def job_worker_metric(worker: Any, name: str, labels: str) -> float | None:
    """One sample from a job worker's /metrics, or None when it has none."""
    port = worker.env["SLUICE_GATEWAY_WORKER_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(rf"^{name}\{{{labels}\}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def test_a_1024_token_row_completes_past_the_warm_up_deadline(stack: Stack, gateway: Any) -> None:
    """Issue 22: a row's deadline grows with its max_tokens. A worker that has seen no rows yet gets
    a deadline of WORKER_ROW_TIMEOUT_S (5 s here, so that this box's pace cannot hide the cap: 1,024
    tokens take far longer) for short rows; the 1,024-token row gets 2 x 1,024 x 0.25 s instead, and
    completes in one attempt. With the cap it was cut off at 5 s, retried and dead-lettered."""
    running = [s for s in stack.services if s.name.startswith("job-worker") and s.process is not None and s.process.poll() is None]
    for worker in running:
        worker.stop()  # the row must reach the worker under test
    name = f"job-worker-long-{uuid.uuid4().hex[:4]}"
    worker = stack.add_job_worker(name, env={"SLUICE_GATEWAY_WORKER_ROW_TIMEOUT_S": "5", "SLUICE_GATEWAY_WORKER_ROW_TIMEOUT_FLOOR_S": "1"})
    try:
        job_id = f"long-{uuid.uuid4().hex[:6]}"
        row = {
            "custom_id": "long",
            "generate": {
                "model": MODEL,
                "messages": [{"role": "user", "content": LONG_PROMPT}],
                "sampling": {"max_tokens": 1024, "temperature": 0},
            },
        }
        (result,) = asyncio.run(publish_and_collect(stack, {"job_id": job_id, "api_key": DEMO_KEY, "rows": [row]}, expect=1, timeout_s=600))
        assert "error" not in result, result["error"]
        assert result["finish_reason"] == "FINISH_REASON_LENGTH" and result["usage"]["completion_tokens"] == 1024, result["usage"]
        final = wait_job(gateway, job_id, 30)
        assert (final.state, final.completed_rows, final.failed_rows) == (jobs_pb2.JOB_STATE_COMPLETED, 1, 0)
        # One attempt, given the long row's deadline, and none cut off.
        assert job_worker_metric(worker, "sluice_jobs_row_timeout_seconds", 'kind="generate"') == 2 * 1024 * 0.25
        assert not job_worker_metric(worker, "sluice_jobs_row_timeouts_total", 'kind="generate"')
    finally:
        worker.stop()
        for stopped in running:  # the stack as the tests after this one expect it, ports included
            stopped.start_ready(120)
