"""Backends under test: in memory (with a clock the test moves) and the real Redis on 6379."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from sluice_rate_limit.memory_backend import MemoryBackend
from sluice_rate_limit.redis_backend import RedisBackend

REDIS_URL = "redis://127.0.0.1:6379/0"


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Harness:
    """A backend plus a way to let time pass: moves the fake clock, or sleeps for Redis."""

    def __init__(self, backend, clock: FakeClock | None) -> None:  # type: ignore[no-untyped-def]
        self.backend = backend
        self.clock = clock

    async def advance(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)


@pytest.fixture(params=["memory", "redis"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    # A 2 s window keeps the Redis variant fast while the arithmetic stays the same.
    if request.param == "memory":
        clock = FakeClock()
        yield Harness(MemoryBackend(2.0, clock=clock), clock)
        return
    prefix = f"test:rl:{uuid.uuid4().hex[:8]}"
    backend = RedisBackend(REDIS_URL, prefix, 2.0, timeout_s=0.1)
    try:
        yield Harness(backend, None)
    finally:
        await delete_keys(prefix)
        await backend.close()


async def delete_keys(prefix: str) -> None:
    """A test's keys off the shared Redis."""
    client = aioredis.Redis.from_url(REDIS_URL)
    keys = [key async for key in client.scan_iter(f"{prefix}:*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()
