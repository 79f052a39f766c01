"""The next round, sent while the one in flight runs (step_protocol's FOLLOWS_ROUND).

Between two rounds the engine would otherwise wait a round trip for the scheduler: the last
response's way back, the scheduler's planning, the next request's way in. Sent ahead, the next
round waits at the engine and starts the moment the current one ends. It is planned from what
the scheduler knew when the current round's first response came: a sequence that finishes in
the rest of the current round costs the next one a row answered "not running" (no engine work),
which the scheduler skips as it skips any answer for a sequence that has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from sluice_inference_adapter.sequence import Sequence
from sluice_inference_adapter.step_rows import StepOutcome, StepRow


class SentResponses:
    """A round's responses whose request is sent now, not when they are first read: the first
    response is awaited in the background, the rest as they are read."""

    def __init__(self, responses: AsyncGenerator[list[StepOutcome], None]) -> None:
        self._responses = responses
        self._first: asyncio.Task[list[StepOutcome]] | None = asyncio.get_running_loop().create_task(self._read_first())

    async def _read_first(self) -> list[StepOutcome]:
        return await anext(self._responses)

    def __aiter__(self) -> SentResponses:
        return self

    async def __anext__(self) -> list[StepOutcome]:
        if self._first is not None:
            first, self._first = self._first, None
            return await first
        return await anext(self._responses)

    async def aclose(self) -> None:
        """Ends the request (a round not read to its end is cancelled by the backend)."""
        if self._first is not None:
            first, self._first = self._first, None
            first.cancel()
            await asyncio.wait([first])  # a cancel of the caller's own still reaches it
            if not first.cancelled():
                first.exception()  # discarded with the round, whatever it raised
        await self._responses.aclose()


@dataclass
class RoundAhead:
    """A round sent ahead: its rows, the sequences whose rows make tokens, its steps, its
    responses on their way, and whether it was sent interruptible."""

    rows: list[StepRow]
    stepped: list[Sequence]
    steps: int
    responses: SentResponses
    interruptible: bool = False
    seq_ids: set[int] = field(init=False)

    def __post_init__(self) -> None:
        self.seq_ids = {s.seq_id for s in self.stepped}
