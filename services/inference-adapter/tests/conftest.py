"""Helpers shared by the scheduler tests."""

from __future__ import annotations

from sluice_inference_adapter.scheduler import FinishEvent, SequenceHandle, TokenEvent


async def collect(handle: SequenceHandle) -> tuple[str, FinishEvent]:
    """A sequence's whole text and its finish event."""
    text = ""
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            text += event.text
        else:
            return text, event
    raise AssertionError("no finish event")
