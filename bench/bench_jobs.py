"""`make bench-jobs`: a bulk job's rows completed per minute against the limit-implied maximum.

One run, side by side:
1. Starts the real stack and measures the backend's capacity for exactly the job's rows (generate,
   max_tokens 1) through the gateway: BENCH_JOBS_PROBE_CONCURRENCY requests at once in the bulk
   class for BENCH_JOBS_PROBE_S seconds (after a warm-up), from the tenant `private`, which has no
   per-minute budget here.
2. Sets the job tenant's (`demo`) requests-per-minute limit to BENCH_JOBS_LIMIT_SHARE (0.7) of that
   capacity (the limits file is reloaded live), so that the premise "rate limit below the
   backend's capacity" holds on whatever machine runs it. BENCH_JOBS_RPM fixes it instead.
3. Publishes one job of BENCH_JOBS_ROWS rows to `<prefix>.jobs` as a plain aio-pika producer would
   (JSON), and reads the results from its reply queue. While it runs, the job worker's adaptive
   bound (sluice_jobs_concurrency_limit) is sampled every second.

Only rows that succeeded count: a RowResult with `error` set (a failed or expired row) is
reported separately (jobs_row_errors) and never counted as completed, each row is counted once
by its custom_id (delivery is at least once), and the rows figures are checked against the job's
own summary (the Job message told to reply_to after the last row: completed_rows, failed_rows).
The rate counts succeeded rows from the first succeeded result to the last (the sliding window
starts empty, so the very first seconds may burst); target >= 0.95.
Ends with `BENCH <name> <value> <unit>` lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import aio_pika
import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_stack import Stack, StackPorts

ROWS = int(os.environ.get("BENCH_JOBS_ROWS", "2000"))
FIXED_RPM = int(os.environ.get("BENCH_JOBS_RPM", "0"))
LIMIT_SHARE = float(os.environ.get("BENCH_JOBS_LIMIT_SHARE", "0.7"))
PROBE_S = float(os.environ.get("BENCH_JOBS_PROBE_S", "20"))
PROBE_CONCURRENCY = int(os.environ.get("BENCH_JOBS_PROBE_CONCURRENCY", "16"))
MODEL = "smollm2-135m-instruct"
JOB_KEY, PROBE_KEY = "sk-sluice-demo", "sk-sluice-private"


def limits_toml(rpm: int) -> str:
    """`demo` (the job) gets `rpm`; `private` (the capacity probe) has no per-minute budget."""
    return f"""
[defaults]
requests_per_minute = 0
tokens_per_minute = 0
requests_in_flight = 256
tokens_in_flight = 10000000
interactive_floor = 0.0

[tenants.demo]
requests_per_minute = {rpm}

[models."{MODEL}"]
requests_in_flight = 256
tokens_in_flight = 10000000
interactive_floor = 0.0
"""


def row_request(i: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        prompt=f"Number {i}:",
        sampling=types_pb2.SamplingParams(max_tokens=1, temperature=0),
        priority_class=types_pb2.PRIORITY_CLASS_BULK,
    )


async def probe_capacity(stack: Stack) -> float:
    """Rows per second the backend sustains for the job's rows, with nothing limiting the rate."""
    done: list[float] = []
    async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        stop_at = time.monotonic() + 3.0 + PROBE_S
        counter = iter(range(10**9))

        async def client() -> None:
            while time.monotonic() < stop_at:
                async for _ in stub.Generate(row_request(-next(counter)), metadata=(("authorization", f"Bearer {PROBE_KEY}"),), timeout=120):
                    pass
                done.append(time.monotonic())

        await asyncio.gather(*(client() for _ in range(PROBE_CONCURRENCY)))
    measured = [t for t in done if t >= stop_at - PROBE_S]  # the first 3 s warm up
    return len(measured) / PROBE_S


def gauge(url: str, name: str) -> float:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            match = re.search(rf"^{name} ([0-9.eE+-]+)$", reply.read().decode(), re.M)
        return float(match.group(1)) if match else float("nan")
    except OSError:
        return float("nan")


async def run(stack: Stack, limits: Path) -> None:
    capacity = await probe_capacity(stack)
    rpm = FIXED_RPM or int(capacity * 60 * LIMIT_SHARE)
    limits.write_text(limits_toml(rpm))
    print(f"backend capacity {capacity:.2f} rows/s = {capacity * 60:.0f} rows/min; job limit set to {rpm} rows/min")
    await asyncio.sleep(3.0)  # the rate-limit service re-reads the file every second
    job_id = f"bench-{uuid.uuid4().hex[:8]}"
    rows = [
        {
            "custom_id": f"r{i}",
            "generate": {"model": MODEL, "prompt": f"Number {i}:", "sampling": {"max_tokens": 1, "temperature": 0}},
        }
        for i in range(ROWS)
    ]
    metrics = stack.metrics_url("job-worker")
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        reply_to = f"{stack.amqp_prefix}-bench-replies"
        replies = await channel.declare_queue(reply_to, durable=True)
        exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
        body = json.dumps({"job_id": job_id, "api_key": JOB_KEY, "reply_to": reply_to, "rows": rows}).encode()
        started = time.monotonic()
        await exchange.publish(aio_pika.Message(body, content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "job")
        succeeded: dict[str, float] = {}  # custom_id -> when its result came (s since publish)
        failed: dict[str, str] = {}  # custom_id -> its error code
        summary: dict | None = None
        bounds: list[tuple[float, float, float]] = []
        next_sample = started
        all_rows_at: float | None = None
        inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await replies.consume(inbox.put)
        # Until the job's summary (told after its last row), or a short grace after every row
        # has reported if the summary is late; an hour at most.
        while summary is None:
            now = time.monotonic()
            if now >= next_sample:
                bounds.append((now - started, gauge(metrics, "sluice_jobs_concurrency_limit"), gauge(metrics, "sluice_jobs_rows_in_flight")))
                next_sample += 1.0
            if all_rows_at is None and len(succeeded) + len(failed) >= ROWS:
                all_rows_at = now
            if now - started > 3600 or (all_rows_at is not None and now - all_rows_at > 30):
                break
            try:
                message = await asyncio.wait_for(inbox.get(), 1.0)
            except TimeoutError:
                continue
            await message.ack()
            payload = json.loads(message.body)
            if message.type == "sluice.jobs.v1.Job":
                summary = payload  # the job's summary, told after its rows: not a row
            elif message.type == "sluice.jobs.v1.JobRejection":
                raise SystemExit(f"the job was rejected: {payload.get('reason')}")
            elif "error" in payload:  # set means failed, even when empty (the JSON of RowError())
                failed.setdefault(payload["custom_id"], payload["error"].get("code") or "UNKNOWN")
            else:
                succeeded.setdefault(payload["custom_id"], time.monotonic() - started)
        await replies.delete(if_unused=False, if_empty=False)
    times = sorted(succeeded.values())
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    per_min = (len(times) - 1) / span * 60 if span > 0 else float("nan")
    if failed:
        codes: dict[str, int] = {}
        for code in failed.values():
            codes[code] = codes.get(code, 0) + 1
        print(f"failed rows by code: {codes}")
    missing = ROWS - len(succeeded) - len(failed)
    if missing:
        print(f"warning: {missing} rows reported no result")
    if summary is None:
        print("warning: the job's summary never came; its counts are not checked")
    else:
        # The proto's JSON mapping leaves out fields equal to 0.
        told = (int(summary.get("completed_rows", 0)), int(summary.get("failed_rows", 0)))
        print(f"job summary: state {summary.get('state')}, completed_rows {told[0]}, failed_rows {told[1]}")
        if told != (len(succeeded), len(failed)):
            print(f"warning: the summary's counts {told} differ from the rows received {(len(succeeded), len(failed))}")
    print("\nadaptive bound over time (s since publish: bound, rows in flight):")
    step = max(1, len(bounds) // 30)
    for t, bound, in_flight in bounds[::step]:
        print(f"  t={t:6.1f}s  bound={bound:6.2f}  in_flight={in_flight:4.0f}")
    print()
    print(f"BENCH jobs_backend_capacity_rows_per_min {capacity * 60:.1f} rows/min")
    print(f"BENCH jobs_rows {len(succeeded)} rows (succeeded, of {ROWS})")
    print(f"BENCH jobs_row_errors {len(failed)} rows (failed or expired, not counted above)")
    print(f"BENCH jobs_rows_per_min {per_min:.1f} rows/min")
    print(f"BENCH jobs_limit_rows_per_min {rpm} rows/min")
    print(f"BENCH jobs_rate_vs_limit {per_min / rpm:.3f} ratio")
    print(f"BENCH jobs_wall {times[-1] if times else float('nan'):.1f} s (publish to the last succeeded row)")
    finite = [b for _, b, _ in bounds if b == b]
    if finite:
        print(f"BENCH jobs_bound_start {finite[0]:.2f} rows")
        print(f"BENCH jobs_bound_max {max(finite):.2f} rows")
        print(f"BENCH jobs_bound_end {finite[-1]:.2f} rows")


def main() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-jobs-"))
    limits = run_dir / "limits.toml"
    limits.write_text(limits_toml(1))
    stack = Stack(run_dir=run_dir, ports=StackPorts.ephemeral(), limits_file=limits, amqp_prefix=f"sluice-bench-{uuid.uuid4().hex[:8]}")
    print(f"starting the stack in {run_dir} (rows={ROWS})")
    stack.start(timeout_s=300)
    try:
        asyncio.run(run(stack, limits))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
