"""Client channels over several replicas: round robin among those whose health says SERVING."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import grpc
import pytest

from sluice_common.channels import open_channel, wait_for_replica
from sluice_common.server import RunningServer, create_server

SERVICE = "test.Who"


async def replica(name: str) -> RunningServer:
    async def who(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return name.encode()

    handlers = grpc.method_handlers_generic_handler(SERVICE, {"Who": grpc.unary_unary_rpc_method_handler(who, lambda b: b, lambda b: b)})

    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((handlers,))
        return [SERVICE]

    return await create_server("127.0.0.1", 0, -1, register)


async def answers(channel: grpc.aio.Channel, calls: int) -> Counter[str]:
    who = channel.unary_unary(f"/{SERVICE}/Who")
    return Counter([(await who(b"", timeout=5)).decode() for _ in range(calls)])


async def test_calls_spread_over_replicas_and_skip_one_that_is_not_serving() -> None:
    a, b = await replica("a"), await replica("b")
    channel = open_channel(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}")
    try:
        await channel.channel_ready()
        await asyncio.sleep(0.2)  # both subchannels connected and their health watched
        assert set(await answers(channel, 20)) == {"a", "b"}
        await a.set_serving(False)  # draining: its port is still open
        await asyncio.sleep(0.2)
        assert await answers(channel, 20) == Counter({"b": 20})
        await a.set_serving(True)
        await asyncio.sleep(0.2)
        assert set(await answers(channel, 20)) == {"a", "b"}
    finally:
        await channel.close()
        await a.shutdown(0)
        await b.shutdown(0)


async def test_a_call_waits_for_a_replica_back_from_restart_rather_than_failing_at_once() -> None:
    a, b = await replica("a"), await replica("b")
    channel = open_channel(f"ipv4:127.0.0.1:{a.port},127.0.0.1:{b.port}")
    who = channel.unary_unary(f"/{SERVICE}/Who")
    try:
        await channel.channel_ready()
        await a.set_serving(False)  # restarting: not back yet
        await b.set_serving(False)  # the next replica drains
        await asyncio.sleep(0.3)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await who(b"", timeout=5)  # no replica to call: fails at once
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        started = time.monotonic()
        await wait_for_replica(channel, 0.3)  # nothing comes back: the wait is bounded
        assert 0.25 <= time.monotonic() - started < 2
        asyncio.get_running_loop().call_later(0.5, lambda: asyncio.ensure_future(a.set_serving(True)))
        await wait_for_replica(channel, 10)
        assert await who(b"", timeout=5) == b"a"
    finally:
        await channel.close()
        await a.shutdown(0)
        await b.shutdown(0)


async def test_health_watch_streams_status_changes_through_the_interceptor() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server = await replica("a")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            first = await asyncio.wait_for(watch.read(), 5)
            await server.set_serving(False)
            second = await asyncio.wait_for(watch.read(), 5)
            watch.cancel()
        assert (first.status, second.status) == (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    finally:
        await server.shutdown(0)
