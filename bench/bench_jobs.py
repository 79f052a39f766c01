"""`make bench-jobs`: a bulk job's rows completed per minute against the limit-implied maximum.

Starts the real stack with a requests-per-minute limit set below the backend's capacity
(BENCH_JOBS_RPM, interactive_floor 0 so bulk may use all of it), publishes one job of BENCH_JOBS_ROWS
generation rows (max_tokens 1) to `<prefix>.jobs` as a plain aio-pika producer would (JSON), and
reads the results from its reply queue. While it runs, the job worker's adaptive bound
(sluice_jobs_concurrency_limit) is sampled every second.

The ratio counts from the first result to the last (the sliding window starts empty, so the very
first seconds may burst); target >= 0.95. Ends with `BENCH <name> <value> <unit>` lines.
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

from sluice_stack import Stack, StackPorts

ROWS = int(os.environ.get("BENCH_JOBS_ROWS", "2000"))
RPM = int(os.environ.get("BENCH_JOBS_RPM", "600"))
MODEL = "smollm2-135m-instruct"
LIMITS = f"""
[defaults]
requests_per_minute = {RPM}
tokens_per_minute = 100000000
requests_in_flight = 256
tokens_in_flight = 10000000
interactive_floor = 0.0
"""


def gauge(url: str, name: str) -> float:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            match = re.search(rf"^{name} ([0-9.eE+-]+)$", reply.read().decode(), re.M)
        return float(match.group(1)) if match else float("nan")
    except OSError:
        return float("nan")


async def run(stack: Stack) -> None:
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
        reply_to = f"{stack.amqp_prefix}.bench-replies"
        replies = await channel.declare_queue(reply_to, durable=True)
        exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
        body = json.dumps({"job_id": job_id, "api_key": "sk-sluice-demo", "reply_to": reply_to, "rows": rows}).encode()
        started = time.monotonic()
        await exchange.publish(
            aio_pika.Message(body, content_type="application/json", delivery_mode=aio_pika.DeliveryMode.PERSISTENT), "job"
        )
        times: list[float] = []
        errors = 0
        bounds: list[tuple[float, float, float]] = []
        next_sample = started
        inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        await replies.consume(inbox.put)
        while len(times) < ROWS:
            now = time.monotonic()
            if now >= next_sample:
                bounds.append((now - started, gauge(metrics, "sluice_jobs_concurrency_limit"), gauge(metrics, "sluice_jobs_rows_in_flight")))
                next_sample += 1.0
            try:
                message = await asyncio.wait_for(inbox.get(), 1.0)
            except TimeoutError:
                if now - started > 3600:
                    break
                continue
            await message.ack()
            times.append(time.monotonic() - started)
            errors += "error" in json.loads(message.body)
        await replies.delete(if_unused=False, if_empty=False)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    per_min = (len(times) - 1) / span * 60 if span > 0 else float("nan")
    print("\nadaptive bound over time (s since publish: bound, rows in flight):")
    step = max(1, len(bounds) // 30)
    for t, bound, in_flight in bounds[::step]:
        print(f"  t={t:6.1f}s  bound={bound:6.2f}  in_flight={in_flight:4.0f}")
    print()
    print(f"BENCH jobs_rows {len(times)} rows")
    print(f"BENCH jobs_row_errors {errors} rows")
    print(f"BENCH jobs_rows_per_min {per_min:.1f} rows/min")
    print(f"BENCH jobs_limit_rows_per_min {RPM} rows/min")
    print(f"BENCH jobs_rate_vs_limit {per_min / RPM:.3f} ratio")
    print(f"BENCH jobs_wall {times[-1]:.1f} s")
    finite = [b for _, b, _ in bounds if b == b]
    if finite:
        print(f"BENCH jobs_bound_start {finite[0]:.2f} rows")
        print(f"BENCH jobs_bound_max {max(finite):.2f} rows")
        print(f"BENCH jobs_bound_end {finite[-1]:.2f} rows")


def main() -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="sluice-bench-jobs-"))
    limits = run_dir / "limits.toml"
    limits.write_text(LIMITS)
    stack = Stack(run_dir=run_dir, ports=StackPorts.ephemeral(), limits_file=limits, amqp_prefix=f"sluice-bench-{uuid.uuid4().hex[:8]}")
    print(f"starting the stack in {run_dir} (rows={ROWS}, limit={RPM} requests/min)")
    stack.start(timeout_s=300)
    try:
        asyncio.run(run(stack))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
