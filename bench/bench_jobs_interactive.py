"""make bench-jobs-interactive: interactive p99 time to first token with a bulk job running beside
it vs without, side by side in one run (issue 6: target <= 1.5x, the job still progressing).

Interactive TTFT (time from sending Generate to the first chunk with text, max_tokens small) is
measured in rounds of two phases, "no job running" and "a job running", so that both see the same
machine (a shared 2-core box drifts over a minute); which phase goes first alternates from round to
round (the no-job phase went first in every round until 2026-12-07), so neither always follows the
other's tail. The job is one
generation job published as a plain producer would (JSON, the producer contract of docs/developers/jobs.md), from the same tenant
as the interactive streams: the shared allowance keeps its interactive floor, and the adapter puts
interactive sequences ahead of bulk ones. Between the job phases the job is cancelled, and a fresh
one is published for the next job phase.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.jobs.v1 import jobs_pb2

from bench_load import counter_total
from sluice_stack import Stack, StackPorts

DEMO_KEY = "sk-sluice-demo"
MODEL = "smollm2-135m-instruct"


def auth() -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {DEMO_KEY}"),)


ROUNDS = 4
STREAMS = 2  # interactive clients at once
# Requests per client per phase: 2 x 8 = 16 samples a phase, 4 x 16 = 64 a side over the rounds, so
# that the p99 is not simply the one worst sample of a shared, noisy box.
PER_STREAM = 8
JOB_ROWS = 400  # more than a phase can finish; the rest is cancelled
JOB_MAX_TOKENS = 8


def interactive(i: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=f"Name a colour ({i}).")],
        sampling=types_pb2.SamplingParams(max_tokens=4, temperature=0),
    )


@dataclass(frozen=True)
class Sample:
    ttft_s: float  # as the client saw it
    adapter_ttft_s: float  # from the adapter's arrival to its first token (the final chunk's timings)
    adapter_queue_s: float  # of which waiting before the prefill was scheduled


def ttft_s(gateway: Any, i: int) -> Sample:
    started = time.perf_counter()
    first = None
    timings = None
    for response in gateway.Generate(interactive(i), metadata=auth(), timeout=60):
        if first is None and response.text:
            first = time.perf_counter() - started
        if response.HasField("timings"):
            timings = response.timings
    assert first is not None and timings is not None, "no token or no timings came back"
    return Sample(first, timings.time_to_first_token_ms / 1000, timings.queue_time_ms / 1000)


def phase(gateway: Any, tag: int) -> list[Sample]:
    """STREAMS clients, PER_STREAM requests each, one after another; every TTFT."""
    samples: list[Sample] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(PER_STREAM):
            value = ttft_s(gateway, tag * 1000 + c * 100 + k)
            with lock:
                samples.append(value)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(STREAMS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples


def phase_order(round_index: int) -> tuple[bool, bool]:
    """Whether each of a round's two phases runs the job: the no-job phase first in even rounds, the
    job phase first in odd ones, so that neither phase always follows the other's tail."""
    return (False, True) if round_index % 2 == 0 else (True, False)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def publish(stack: Stack, job_id: str) -> None:
    rows = [
        {
            "custom_id": f"r{i}",
            "generate": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Write a short line about the number {i}."}],
                "sampling": {"max_tokens": JOB_MAX_TOKENS, "temperature": 0},
            },
        }
        for i in range(JOB_ROWS)
    ]

    async def go() -> None:
        connection = await aio_pika.connect(stack.amqp_url)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
            body = json.dumps({"job_id": job_id, "api_key": DEMO_KEY, "rows": rows}).encode()
            await exchange.publish(aio_pika.Message(body, content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "job")

    asyncio.run(go())


def get_job(gateway: Any, job_id: str) -> jobs_pb2.Job | None:
    try:
        return gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=auth(), timeout=10).job
    except Exception:  # noqa: BLE001 - not recorded yet
        return None


def wait_for(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def settle_cancel(gateway: Any, job_id: str) -> None:
    gateway.CancelJob(gateway_pb2.CancelJobRequest(job_id=job_id), metadata=auth(), timeout=10)
    wait_for(lambda: (j := get_job(gateway, job_id)) is not None and j.state == jobs_pb2.JOB_STATE_CANCELLED, 60, "the cancel")


def measure(stack: Stack, gateway: Any) -> None:
    for i in range(4):  # warm the path (first requests pay connection and cache set-up)
        ttft_s(gateway, -1 - i)
    baseline: list[Sample] = []
    with_job: list[Sample] = []
    progress: list[tuple[int, int]] = []
    for r in range(ROUNDS):
        for job_phase in phase_order(r):
            if not job_phase:
                baseline += phase(gateway, 2 * r)
                continue
            job_id = f"beside-{uuid.uuid4().hex[:6]}"
            publish(stack, job_id)
            # The job is running, and has had time to fill its share of the batch.
            wait_for(lambda: (j := get_job(gateway, job_id)) is not None and j.completed_rows >= 8, 120, "the job to start")
            before = get_job(gateway, job_id).completed_rows  # type: ignore[union-attr]
            with_job += phase(gateway, 2 * r + 1)
            after = get_job(gateway, job_id)
            progress.append((before, after.completed_rows if after else before))
            settle_cancel(gateway, job_id)
    print(f"job rows completed during each job phase (before, after): {progress}")
    adapter = stack.metrics_url("inference-adapter")
    for counter in ("sluice_adapter_bulk_held_total", "sluice_adapter_round_end_asked_again_total", "sluice_adapter_interrupts_asked_total"):
        print(f"{counter}: {counter_total(adapter, counter):.0f}")
    engine = stack.metrics_url("triton-local")
    for counter in ('sluice_triton_local_interrupt_asks_total{found="none"}', "sluice_triton_local_steps_interrupted_total"):
        print(f"{counter}: {counter_total(engine, counter):.0f}")
    # Where the time went: the adapter's own view (queue + prefill step), the rest is the hops.
    for name, pick in (("adapter ttft", lambda x: x.adapter_ttft_s), ("adapter queue", lambda x: x.adapter_queue_s)):
        for label, samples in (("without job", baseline), ("with job", with_job)):
            values = [pick(x) for x in samples]
            print(f"{name} {label}: p50 {statistics.median(values) * 1000:.0f} ms, p99 {p99(values) * 1000:.0f} ms")
    base = [x.ttft_s for x in baseline]
    job = [x.ttft_s for x in with_job]
    base_p99, job_p99 = p99(base), p99(job)
    print(f"BENCH jobs_interactive_ttft_p50_without_job {statistics.median(base) * 1000:.0f} ms")
    print(f"BENCH jobs_interactive_ttft_p99_without_job {base_p99 * 1000:.0f} ms")
    print(f"BENCH jobs_interactive_ttft_p50_with_job {statistics.median(job) * 1000:.0f} ms")
    print(f"BENCH jobs_interactive_ttft_p99_with_job {job_p99 * 1000:.0f} ms")
    print(f"BENCH jobs_interactive_ttft_p99_ratio {job_p99 / base_p99:.2f} x (target <= 1.5)")
    print(f"BENCH jobs_rows_during_job_phases {sum(a - b for b, a in progress)} rows")


def main() -> None:
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(run_dir=Path(run_dir), ports=StackPorts.ephemeral(), amqp_prefix=f"sluice-bench-{uuid.uuid4().hex[:6]}")
        print("starting the stack ...", flush=True)
        stack.start()
        try:
            with grpc.insecure_channel(stack.gateway_address) as channel:
                measure(stack, gateway_pb2_grpc.GatewayServiceStub(channel))
        finally:
            stack.stop()


if __name__ == "__main__":
    main()
