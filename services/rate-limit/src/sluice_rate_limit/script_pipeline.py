"""Lua script calls made in the same event-loop turn go to Redis as one pipeline.

Every Acquire and Commit is one EVALSHA. Under load many arrive together, and redis-py's cost per
call (a connection from the pool, packing, a write, parsing the reply) is paid by the rate-limit
process on the request path, not by Redis. Sending the calls of one loop turn as one pipeline
pays that once: one write and one read for all of them. Each script still runs atomically on its
own (a pipeline without MULTI), so nothing about a decision changes, only how it travels.

While MAX_IN_FLIGHT pipelines are out, new calls wait for one of them to come back and then go
together (auto-pipelining, as ioredis and Lettuce do): calls that reach the server one per loop turn
(each decision of a Decide stream is read in a turn of its own) still share pipelines under load,
and a call never waits longer than one pipeline's round trip for its turn.

A call alone in its turn goes straight out, as before. A failed pipeline (timeout, connection
lost) fails every call in it, each with the same exception; an error of one script (a Lua error)
fails only that call. Scripts Redis has forgotten (NOSCRIPT after a restart) are loaded once and
their calls sent again. A pipeline holds at most MAX_PIPELINE calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError


MAX_PIPELINE = 64
# Measured with make bench-ratelimit (Redis, 16 callers): 1 gave the most decisions/s; 2 and 64
# (no bound) sent more, smaller pipelines and spent more of rate-limit's CPU on redis-py per call.
MAX_IN_FLIGHT = 1


@dataclass
class _Call:
    script: AsyncScript
    keys: Sequence[Any]
    args: Sequence[Any]
    result: asyncio.Future[Any]


class ScriptPipeline:
    def __init__(self, client: aioredis.Redis, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self._client = client
        self._max_in_flight = max_in_flight
        self._pending: list[_Call] = []
        self._flush_due = False
        self._sending: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        """Waits for the pipelines in flight (before the client closes)."""
        await asyncio.gather(*self._sending, return_exceptions=True)

    async def call(self, script: AsyncScript, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        loop = asyncio.get_running_loop()
        call = _Call(script, keys, args, loop.create_future())
        self._pending.append(call)
        if not self._flush_due and len(self._sending) < self._max_in_flight:
            self._flush_due = True
            loop.call_soon(self._flush)
        return await call.result

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        # The calls that waited for this pipeline go now: they have waited one round trip already.
        if self._pending and not self._flush_due:
            self._flush()

    def _flush(self) -> None:
        self._flush_due = False
        pending, self._pending = self._pending, []
        # Bounded pipelines: every caller of a pipeline waits for its last reply, so a huge one
        # would hold them all past their timeout together.
        for start in range(0, len(pending), MAX_PIPELINE):
            task = asyncio.get_running_loop().create_task(self._send(pending[start : start + MAX_PIPELINE]))
            self._sending.add(task)
            task.add_done_callback(self._sent)

    async def _send(self, batch: list[_Call]) -> None:
        batch = [call for call in batch if not call.result.done()]  # callers that gave up
        if not batch:
            return
        try:
            if len(batch) == 1:
                results: list[Any] = [await batch[0].script(keys=batch[0].keys, args=batch[0].args)]
            else:
                results = await self._pipelined(batch)
        except BaseException as exc:  # noqa: BLE001 - every caller gets the failure, as a direct call would
            for call in batch:
                if not call.result.done():
                    call.result.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for call, result in zip(batch, results):
            if call.result.done():
                continue
            if isinstance(result, Exception):
                call.result.set_exception(result)
            else:
                call.result.set_result(result)

    async def _pipelined(self, batch: list[_Call]) -> list[Any]:
        results = await self._execute(batch)
        unknown = [i for i, result in enumerate(results) if isinstance(result, NoScriptError)]
        if unknown:
            # Redis forgot the scripts (a restart, SCRIPT FLUSH): load each once, send those again.
            for script in {id(batch[i].script): batch[i].script for i in unknown}.values():
                script.sha = await self._client.script_load(script.script)
            for i, result in zip(unknown, await self._execute([batch[i] for i in unknown])):
                results[i] = result
        return results

    async def _execute(self, calls: list[_Call]) -> list[Any]:
        """One pipeline; a script's own error comes back in its place, not raised."""
        pipe = self._client.pipeline(transaction=False)
        for call in calls:
            # EVALSHA itself, not script(client=pipe): that would ask SCRIPT EXISTS on every send.
            pipe.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        return list(await pipe.execute(raise_on_error=False))
