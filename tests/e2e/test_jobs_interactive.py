"""A bulk job and interactive streams at once: both are served, the job keeps progressing.

How much the job slows interactive time to first token is a speed figure, measured side by
side in `make bench-jobs-interactive`, not asserted here.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

import aio_pika
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, MODEL, auth, scrape_total, wait_for
from sluice_stack import Stack
from test_jobs import all_results, job_rows_in_state, wait_job


# Rows the job must complete while interactive streams keep coming.
PROGRESS_ROWS = 4


def publish_job(stack: Stack, job_id: str, rows: int) -> None:
    publish_rows(
        stack,
        job_id,
        [{"custom_id": f"r{i}", "generate": {"model": MODEL, "prompt": f"Count: {i},", "sampling": {"max_tokens": 4}}} for i in range(rows)],
    )


def publish_rows(stack: Stack, job_id: str, rows: list[dict[str, object]]) -> None:
    body = {"job_id": job_id, "api_key": DEMO_KEY, "rows": rows}

    async def go() -> None:
        connection = await aio_pika.connect(stack.amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
            message = aio_pika.Message(json.dumps(body).encode(), content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
            await exchange.publish(message, "job")

    asyncio.run(go())


def completed(gateway, job_id: str) -> int:
    try:
        return gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth(), timeout=10).job.completed_rows
    except Exception:  # noqa: BLE001 - not recorded yet
        return -1


def test_interactive_streams_are_served_while_a_job_keeps_progressing(stack: Stack, gateway) -> None:
    """Interactive streams run back to back from six clients, and the job completes rows all the while.

    The streams keep coming until the job has completed `PROGRESS_ROWS` more rows: a single wave of
    short streams can be over before any bulk row could finish (the scheduler lets interactive
    prefills go first, bulk rows step at least every BULK_MAX_WAIT_S, and the worker's rows start and
    finish together), which says nothing about whether the job stalls.
    """
    job_id = f"beside-{uuid.uuid4().hex[:6]}"
    publish_job(stack, job_id, rows=300)
    wait_for(lambda: completed(gateway, job_id) >= 4, "the job's first rows", timeout_s=120)
    before = completed(gateway, job_id)
    stop = threading.Event()
    answers: dict[int, list[str]] = {i: [] for i in range(6)}
    errors: list[BaseException] = []

    def interactive(i: int) -> None:
        try:
            while not stop.is_set():
                request = gateway_pb2.GenerateRequest(
                    model=MODEL,
                    messages=[types_pb2.ChatMessage(role="user", content=f"Name a colour ({i}.{len(answers[i])}).")],
                    sampling=types_pb2.SamplingParams(max_tokens=4),
                )
                answers[i].append("".join(r.text for r in gateway.Generate(request, metadata=auth(), timeout=120)))
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=interactive, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while completed(gateway, job_id) < before + PROGRESS_ROWS and time.monotonic() < deadline and not errors:
            time.sleep(0.2)
        after = completed(gateway, job_id)
        served_throughout = all(thread.is_alive() for thread in threads)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=180)
    gateway.CancelJob(gateway_pb2.CancelJobRequest(job_id=job_id), metadata=auth(), timeout=10)
    assert not errors and served_throughout, f"an interactive stream failed: {errors!r}"
    assert all(answers[i] and all(answers[i]) for i in answers), answers
    assert after >= before + PROGRESS_ROWS, f"the job completed {after - before} rows in 60 s while interactive streams ran"
    job = gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth(), timeout=10).job
    assert job.state in (jobs_pb2.JOB_STATE_CANCELLING, jobs_pb2.JOB_STATE_CANCELLED)


def greedy_question(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Tell me a fact about the number {i}."}]


def test_bulk_steps_stopped_midway_for_interactive_requests_lose_and_repeat_no_token(stack: Stack, gateway) -> None:
    """Interactive requests interrupt the job's steps in the engine (llama.cpp stops them between
    graph nodes); every greedy row of the job still reads as the same prompt asked through Generate."""
    engine_metrics = stack.metrics_url("triton-local")
    interrupted_before = scrape_total(engine_metrics, "sluice_triton_local_steps_interrupted_total")
    job_id = f"interrupted-{uuid.uuid4().hex[:6]}"
    sampling = {"max_tokens": 12, "temperature": 0}
    rows = [{"custom_id": f"r{i}", "generate": {"model": MODEL, "messages": greedy_question(i), "sampling": sampling}} for i in range(16)]
    publish_rows(stack, job_id, rows)
    # Ask from the moment the worker runs the job's rows: once one has completed, the rest may all
    # be in their last steps (rows run in groups as large as the worker's bound, beside what is left
    # of the jobs before), leaving no bulk step for an arrival to interrupt.
    wait_for(lambda: bool(job_rows_in_state(stack, job_id, "running")), "the job's first rows to run", timeout_s=120)

    usage: dict[str, str] = {}

    def ask(i: int) -> str:
        request = gateway_pb2.GenerateRequest(
            model=MODEL,
            messages=[types_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in greedy_question(i)],
            sampling=types_pb2.SamplingParams(max_tokens=12, temperature=0),
        )
        responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
        usage[f"r{i}"] = f"{_usage_line(responses[-1].usage)}, request {responses[-1].request_id}"
        return "".join(r.text for r in responses)

    # Interactive requests, one after another, while the job runs (each arrival interrupts).
    asked = {f"r{i}": ask(i) for i in range(16)}
    job = wait_job(gateway, job_id)
    assert job.state == jobs_pb2.JOB_STATE_COMPLETED and job.completed_rows == 16
    assert scrape_total(engine_metrics, "sluice_triton_local_steps_interrupted_total") > interrupted_before, "no step was interrupted"
    results = {r.custom_id: r for r in all_results(gateway, job_id)}
    # A mismatch was seen once (an earlier session) and not explained: say what each side reused
    # from the prefix cache and which request ids to look up in the services' logs.
    mismatched = [
        f"{key}: job {results[key].output!r} ({_usage_line(results[key].usage)}, request {results[key].request_id}) vs Generate {asked[key]!r} ({usage[key]})"
        for key in asked
        if results[key].output != asked[key]
    ]
    assert not mismatched, "\n".join(mismatched)


def _usage_line(usage: types_pb2.Usage) -> str:
    return f"prompt {usage.prompt_tokens}, cached {usage.cached_tokens}, completion {usage.completion_tokens}"
