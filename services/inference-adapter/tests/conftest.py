"""Helpers shared by the scheduler and replica pool tests."""

from __future__ import annotations

from contextlib import aclosing

from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.scheduler import FinishEvent, GenerationRequest, SequenceHandle, TokenEvent


async def collect(handle: SequenceHandle) -> tuple[str, FinishEvent]:
    """A sequence's whole text and its finish event."""
    text = ""
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            text += event.text
        else:
            return text, event
    raise AssertionError("no finish event")


async def run_through(pool: ReplicaPool, request: GenerationRequest) -> tuple[int, FinishEvent]:
    """A request through the pool: how many tokens it streamed, and its finish event."""
    tokens = 0
    async with aclosing(pool.generate(request)) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                tokens += 1
            else:
                return tokens, event
    raise AssertionError("no finish")
