"""The passthrough scheduler, with a stand-in for a self-batching engine's stream.

`CountingEngine` streams one text chunk per token like Triton's vLLM backend and records
how many streams are open at once; the real decoupled model is tested in
tests/e2e/test_passthrough.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from conftest import collect

from sluice_inference_adapter.passthrough import PassthroughLimits, PassthroughScheduler
from sluice_inference_adapter.scheduler import Finish, GenerationRequest
from sluice_inference_adapter.step_rows import PromptSpec, SamplingSpec
from sluice_inference_adapter.waiting_queue import Priority


class CountingEngine:
    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self.closed_early = 0
        self.started: list[str] = []

    async def stream(self, text: str, sampling: SamplingSpec) -> AsyncIterator[str]:
        self.open += 1
        self.peak = max(self.peak, self.open)
        self.started.append(text)
        finished = False
        try:
            for index in range(sampling.max_tokens):
                await asyncio.sleep(0.005)
                yield f"t{index} "
            finished = True
        finally:
            self.open -= 1
            self.closed_early += not finished


def request(max_tokens: int, prompt: str = "p", priority: Priority = Priority.INTERACTIVE) -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(prompt=prompt), SamplingSpec(max_tokens=max_tokens), priority)


async def test_streams_to_the_end_with_length_and_usage() -> None:
    engine = CountingEngine()
    scheduler = PassthroughScheduler(engine, PassthroughLimits(max_in_flight=2))
    scheduler.start()
    try:
        text, finish = await collect(scheduler.submit(request(3)))
    finally:
        await scheduler.stop()
    assert text == "t0 t1 t2 " and finish.finish is Finish.LENGTH and finish.completion_tokens == 3


async def test_never_more_streams_open_than_the_bound() -> None:
    engine = CountingEngine()
    scheduler = PassthroughScheduler(engine, PassthroughLimits(max_in_flight=2))
    scheduler.start()
    try:
        await asyncio.gather(*(collect(scheduler.submit(request(4))) for _ in range(7)))
    finally:
        await scheduler.stop()
    assert engine.peak == 2


async def test_cancel_closes_the_stream() -> None:
    engine = CountingEngine()
    scheduler = PassthroughScheduler(engine, PassthroughLimits(max_in_flight=2))
    scheduler.start()
    try:
        handle = scheduler.submit(request(1000))
        events = handle.events()
        await anext(events)
        handle.cancel()
        finish = [event async for event in events][-1]
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.CANCELLED
    assert engine.closed_early == 1 and engine.open == 0


async def test_interactive_takes_the_free_place_before_bulk() -> None:
    engine = CountingEngine()
    scheduler = PassthroughScheduler(engine, PassthroughLimits(max_in_flight=1))
    handles = [scheduler.submit(request(1, "bulk", Priority.BULK)), scheduler.submit(request(1, "interactive"))]
    scheduler.start()
    try:
        await asyncio.gather(*(collect(h) for h in handles))
    finally:
        await scheduler.stop()
    assert engine.started == ["interactive", "bulk"]
