"""ScriptPipeline against the real Redis: one pipeline per loop turn, each call its own answer."""

from __future__ import annotations

import asyncio
import socket
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from conftest import REDIS_URL
from redis.exceptions import ResponseError

from sluice_rate_limit.script_pipeline import MAX_PIPELINE, ScriptPipeline

# A comment unique to each run: Redis has never seen the script, so its first EVALSHA is NOSCRIPT.
ECHO = "-- {tag}\nif ARGV[1] == 'bad' then return redis.error_reply('bad argument') end\nreturn {{KEYS[1], ARGV[1]}}"


class CountingRedis(aioredis.Redis):
    """The real client, counting the pipelines it opens."""

    pipelines = 0

    def pipeline(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        CountingRedis.pipelines += 1
        return super().pipeline(*args, **kwargs)


@pytest.fixture
async def client():
    CountingRedis.pipelines = 0
    redis = CountingRedis.from_url(REDIS_URL)
    yield redis
    await redis.aclose()


async def test_calls_of_one_loop_turn_share_a_pipeline_and_get_their_own_replies(client) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    scripts = ScriptPipeline(client)
    replies = await asyncio.gather(*(scripts.call(script, [f"k{i}"], [f"v{i}"]) for i in range(20)))
    assert [[key.decode(), value.decode()] for key, value in replies] == [[f"k{i}", f"v{i}"] for i in range(20)]
    # 20 calls, one pipeline; Redis did not know the script, so it was loaded and the 20 sent again.
    assert CountingRedis.pipelines == 2
    again = await asyncio.gather(*(scripts.call(script, ["k"], [str(i)]) for i in range(5)))
    assert [value.decode() for _, value in again] == [str(i) for i in range(5)]
    assert CountingRedis.pipelines == 3


async def test_a_pipeline_holds_at_most_max_pipeline_calls(client) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    scripts = ScriptPipeline(client)
    await scripts.call(script, ["k"], ["load"])
    count = 2 * MAX_PIPELINE + 5
    replies = await asyncio.gather(*(scripts.call(script, ["k"], [str(i)]) for i in range(count)))
    assert [value.decode() for _, value in replies] == [str(i) for i in range(count)]
    assert CountingRedis.pipelines == 3


async def test_a_call_alone_goes_straight_out(client) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    key, value = await ScriptPipeline(client).call(script, ["k"], ["v"])
    assert (key, value) == (b"k", b"v") and CountingRedis.pipelines == 0


@pytest.mark.parametrize("known", [True, False], ids=["loaded", "noscript"])
async def test_one_failing_script_fails_only_its_own_call(client, known: bool) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    scripts = ScriptPipeline(client)
    if known:
        await scripts.call(script, ["k"], ["load"])
    results = await asyncio.gather(
        scripts.call(script, ["k"], ["a"]), scripts.call(script, ["k"], ["bad"]), scripts.call(script, ["k"], ["b"]),
        return_exceptions=True,
    )  # fmt: skip
    assert results[0] == [b"k", b"a"] and results[2] == [b"k", b"b"]
    assert isinstance(results[1], ResponseError) and "bad argument" in str(results[1])


async def test_an_unreachable_redis_fails_every_call_of_the_pipeline() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dead = aioredis.Redis.from_url(f"redis://127.0.0.1:{port}/0", socket_connect_timeout=0.2)
    script = dead.register_script(ECHO.format(tag="dead"))
    scripts = ScriptPipeline(dead)
    results = await asyncio.gather(*(scripts.call(script, ["k"], [str(i)]) for i in range(3)), return_exceptions=True)
    assert all(isinstance(r, RedisConnectionError) for r in results), results
    await dead.aclose()


async def test_a_caller_that_gives_up_does_not_break_the_others(client) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    scripts = ScriptPipeline(client)
    impatient = asyncio.ensure_future(scripts.call(script, ["k"], ["gone"]))
    patient = asyncio.ensure_future(scripts.call(script, ["k"], ["here"]))
    await asyncio.sleep(0)
    impatient.cancel()
    assert await patient == [b"k", b"here"]
    with pytest.raises(asyncio.CancelledError):
        await impatient


async def test_calls_that_come_while_a_pipeline_is_out_go_together_in_the_next(client) -> None:
    script = client.register_script(ECHO.format(tag=uuid.uuid4().hex))
    scripts = ScriptPipeline(client, max_in_flight=1)
    await scripts.call(script, ["k"], ["load"])
    first = asyncio.ensure_future(scripts.call(script, ["k"], ["first"]))
    later = []
    for i in range(3):  # each in a loop turn of its own, while the first is out
        await asyncio.sleep(0)
        later.append(asyncio.ensure_future(scripts.call(script, ["k"], [str(i)])))
    assert (await first)[1] == b"first"
    assert [(await call)[1] for call in later] == [b"0", b"1", b"2"]
    # The first went alone (no pipeline); the three that waited for it shared one.
    assert CountingRedis.pipelines == 1
