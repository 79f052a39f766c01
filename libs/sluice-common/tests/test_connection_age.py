"""Every server ages its connections out (grpc.max_connection_age_ms), so that clients resolve the
headless names they dial again and replicas added later get calls from clients already connected;
over real gRPC: the GOAWAY costs no call, and a stream longer than the age is not cut."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from sluice_common.channels import open_channel
from sluice_common.config import ConfigError, ConnectionAge
from sluice_common.server import connection_age_options, create_server

SERVICE = "test.Aged"
AGE_S = 0.3


async def test_calls_across_the_connection_age_never_fail_and_long_streams_are_not_cut() -> None:
    peers: list[str] = []

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        peers.append(context.peer())
        return request

    async def ticks(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(int(request)):
            yield b"tick"
            await asyncio.sleep(0.1)

    identity = lambda b: b  # noqa: E731 - raw bytes on the wire
    handlers = grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, identity, identity),
            "Ticks": grpc.unary_stream_rpc_method_handler(ticks, identity, identity),
        },
    )

    def register(server: grpc.aio.Server) -> list[str]:
        server.add_generic_rpc_handlers((handlers,))
        return [SERVICE]

    running = await create_server("127.0.0.1", 0, -1, register, connection_age=ConnectionAge(AGE_S))
    channel = open_channel(f"127.0.0.1:{running.port}")  # the services' own channels: round robin, health checked
    try:
        unary_call = channel.unary_unary(f"/{SERVICE}/Unary")
        # A stream of 2.5 s: several ages, and no grace cuts it.
        stream = channel.unary_stream(f"/{SERVICE}/Ticks")(b"25")
        streamed = asyncio.ensure_future(_count(stream))
        failures: list[str] = []
        calls = 0
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            try:
                assert await unary_call(b"x", timeout=5) == b"x"
                calls += 1
            except grpc.aio.AioRpcError as error:
                failures.append(f"{error.code().name}: {error.details()}")
            await asyncio.sleep(0.01)
        assert failures == []
        assert await asyncio.wait_for(streamed, 10) == 25
        assert await stream.code() == grpc.StatusCode.OK
        # The age did move the calls to new connections (each a new client port), several times.
        assert len(set(peers)) >= 3, (calls, sorted(set(peers)))
    finally:
        await channel.close()
        await running.shutdown(0)


async def _count(stream: grpc.aio.UnaryStreamCall) -> int:
    return len([message async for message in stream])


def test_the_age_is_one_shared_variable_with_an_unlimited_grace() -> None:
    assert ConnectionAge.from_environ({}).max_connection_age_s == 120.0
    options = dict(connection_age_options(ConnectionAge.from_environ({"SLUICE_MAX_CONNECTION_AGE_S": "90"})))
    # Streams in flight finish however long they take: gRPC's INT_MAX is "unlimited".
    assert options == {"grpc.max_connection_age_ms": 90_000, "grpc.max_connection_age_grace_ms": 2**31 - 1}
    assert connection_age_options(ConnectionAge.from_environ({"SLUICE_MAX_CONNECTION_AGE_S": "0"})) == []
    with pytest.raises(ConfigError, match="SLUICE_MAX_CONNECTION_AGE_S"):
        ConnectionAge.from_environ({"SLUICE_MAX_CONNECTION_AGE_S": "-1"})
