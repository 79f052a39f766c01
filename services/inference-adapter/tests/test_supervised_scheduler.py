"""A scheduler that dies under supervision: health NOT_SERVING at once, its callers failed, restarted.

The fault is injected in the scheduler's own loop (a step answer it cannot apply: a bug, not a
backend failure, which it handles by itself), with the adapter's real gRPC server and health
service around it.
"""

from __future__ import annotations

import asyncio
import time

import grpc
from conftest import collect
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_scheduler import RecordingStepModel, request

from sluice_common.server import create_server
from sluice_common.supervision import Supervisor
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.sequence import Finish


class FaultyOnce(RecordingStepModel):
    """Its first answer lacks every field the scheduler reads; later ones are right."""

    def __init__(self) -> None:
        super().__init__()
        self.faulty = True

    async def round(self, rows, steps, follows=False, interruptible=False):  # type: ignore[no-untyped-def]
        if self.faulty:
            self.faulty = False
            yield [object() for _ in rows]
            return
        async for answers in super().round(rows, steps, follows, interruptible):
            yield answers


async def test_a_dead_scheduler_turns_health_not_serving_within_a_second_and_fails_its_callers() -> None:
    running = await create_server("127.0.0.1", 0, -1, lambda server: ["sluice.inference.v1.InferenceService"])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    health = health_pb2_grpc.HealthStub(channel)

    async def status() -> int:
        return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status

    scheduler = Scheduler(FaultyOnce(), SchedulerLimits(max_batch_size=4))
    scheduler.start(Supervisor(running.report, restart_delay_s=1.5))
    try:
        assert await status() == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        waiting = [scheduler.submit(request(max_tokens=3)) for _ in range(3)]
        finishes = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in waiting)), timeout=1.0)
        assert all(f.finish is Finish.ERROR and "generation scheduler failed" in f.error for _, f in finishes)
        while await status() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() - started < 1.0, "health still SERVING a second after the scheduler died"
            await asyncio.sleep(0.01)
        # Restarted with an empty batch: health comes back and the next request is served.
        deadline = time.monotonic() + 5
        while await status() != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the scheduler was not restarted"
            await asyncio.sleep(0.05)
        text, finish = await asyncio.wait_for(collect(scheduler.submit(request(max_tokens=2))), timeout=5)
        assert finish.finish is Finish.LENGTH and text == "t1 t2 "
    finally:
        await scheduler.stop()
        await channel.close()
        await running.shutdown(0)
