"""The Redis backend's own bookkeeping (the shared rules are in test_backends.py)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError
from conftest import REDIS_URL, delete_keys
from test_backends import paced_tpm, rif, tpm

from sluice_rate_limit.budgets import LeaseNotFound
from sluice_rate_limit.redis_backend import SWEEP_MAX, RedisBackend


@pytest.fixture
async def redis_backend() -> AsyncIterator[tuple[RedisBackend, aioredis.Redis, str]]:
    prefix = f"test:rl:{uuid.uuid4().hex[:8]}"
    backend = RedisBackend(REDIS_URL, prefix, 2.0, timeout_s=0.1)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        yield backend, client, prefix
    finally:
        await delete_keys(prefix)
        await client.aclose()
        await backend.close()


async def test_a_lease_expired_beyond_the_sweeps_batch_is_freed_not_settled(redis_backend) -> None:
    """The settle script settled a lease past its expiry that its sweep had not reached."""
    backend, client, prefix = redis_backend
    lease = await backend.acquire([rif(1)], True, 0.2, False, "m")
    pipe = client.pipeline(transaction=False)
    for i in range(SWEEP_MAX + 100):  # a backlog of leases that expired long before it
        pipe.hset(f"{prefix}:{{m}}:l", f"old{i}.m", '{"i":0,"e":[]}')
        pipe.zadd(f"{prefix}:{{m}}:x", {f"old{i}.m": i})
    await pipe.execute()
    await asyncio.sleep(0.3)
    with pytest.raises(LeaseNotFound):
        await backend.settle(lease.lease_id, 0)
    assert (await backend.peek([rif(1)], "m"))[0].remaining == 1  # its slot was freed with it


async def test_a_refund_after_the_windows_keys_expired_creates_no_key_without_a_ttl(redis_backend) -> None:
    """A late refund wrote the pace into a fresh hash with no TTL: one key for ever per window."""
    backend, client, prefix = redis_backend
    lease = await backend.acquire([paced_tpm(1000, 400, burst=50)], True, 30, False, "m")
    window_keys = [key async for key in client.scan_iter(f"{prefix}:*") if b":a:" in key or b":w:" in key]
    assert len(window_keys) == 2
    await client.delete(*window_keys)  # what their TTL does while the lease lives on
    await backend.settle(lease.lease_id, 0)
    for key in window_keys:
        assert await client.pttl(key) != -1, key  # absent (-2) or expiring


async def test_a_settle_with_an_impossible_used_count_changes_nothing(redis_backend) -> None:
    """The settle script deleted the lease and freed its slot, then failed on HINCRBY: half applied."""
    backend, _client, _prefix = redis_backend
    lease = await backend.acquire([rif(1), tpm(1000, 100)], True, 30, False, "m")
    with pytest.raises(ResponseError, match="used tokens"):
        await backend.settle(lease.lease_id, 2**63 - 1)
    assert not (await backend.acquire([rif(1)], True, 30, False, "m")).allowed  # still in flight
    assert await backend.settle(lease.lease_id, 10)  # and still settles
