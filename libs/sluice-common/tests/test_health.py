"""grpc.health.v1 as every Sluice server serves it (sluice_common.health), over real gRPC servers.

The deployment review's scenarios (grpcio-health-checking 1.81's async servicer failed them): one
client's Watch ending left every other watcher of the service deaf to later changes, so a gateway
kept away from an adapter that had gone NOT_SERVING and come back; and an open Watch held
`server.stop(grace)` for the whole grace."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_common.channels import open_channel
from sluice_common.server import RunningServer, create_server, drain

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SERVICE = "test.Service"
# A client of its own (not sharing the test's other channels' subchannels, as another pod would
# not), with gRPC's client-side health checking as channels.py configures it.
HEALTH_CHECKED = (
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}})),
)


@pytest.fixture
async def running():
    server = await create_server("127.0.0.1", 0, -1, lambda srv: [SERVICE])
    yield server
    await server.shutdown(0)


def watch(channel: grpc.aio.Channel, service: str = "") -> grpc.aio.UnaryStreamCall:
    return health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=service))


async def next_status(call: grpc.aio.UnaryStreamCall) -> int:
    return (await asyncio.wait_for(call.read(), 3)).status


async def reaches_server(channel: grpc.aio.Channel) -> bool:
    """Whether a call on `channel` gets to the server: its load balancing has a healthy address."""
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="unknown"), timeout=1.5)
    except grpc.aio.AioRpcError as error:
        return error.code() == grpc.StatusCode.NOT_FOUND  # answered by the server, not by the channel
    return True


async def test_a_watch_that_ends_leaves_the_other_watchers_hearing_every_change(running: RunningServer) -> None:
    address = f"127.0.0.1:{running.port}"
    async with grpc.aio.insecure_channel(address) as b:
        watching_b = watch(b)
        assert await next_status(watching_b) == SERVING
        async with grpc.aio.insecure_channel(address) as a:
            watching_a = watch(a)
            assert await next_status(watching_a) == SERVING
        await asyncio.sleep(0.3)  # client A is gone (a pod restarted): its Watch has ended
        await running.set_serving(False)
        assert await next_status(watching_b) == NOT_SERVING
        await running.set_serving(True)
        assert await next_status(watching_b) == SERVING


async def test_client_side_health_checking_uses_a_replica_again_after_another_client_left(running: RunningServer) -> None:
    """watch_bug4: an adapter goes NOT_SERVING (its Triton is away), another gateway's channel
    closes meanwhile, the adapter comes back: this gateway's channel must call it again."""
    address = f"127.0.0.1:{running.port}"
    b = open_channel(address)
    a = grpc.aio.insecure_channel(address, options=HEALTH_CHECKED)
    try:
        assert await reaches_server(a) and await reaches_server(b)
        await running.set_serving(False)
        await asyncio.sleep(0.5)
        assert not await reaches_server(b)
        await a.close()
        await asyncio.sleep(0.3)
        await running.set_serving(True)
        await asyncio.sleep(0.5)
        assert await reaches_server(b)
    finally:
        await a.close()
        await b.close()


async def test_stop_with_a_watcher_connected_returns_without_waiting_the_grace(running: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        watching = watch(channel)
        assert await next_status(watching) == SERVING
        started = time.monotonic()
        await asyncio.wait_for(running.shutdown(10), 15)
        assert time.monotonic() - started < 2
        # NOT_SERVING first, then the stream ends: the client hears why before it goes.
        assert await next_status(watching) == NOT_SERVING
        assert await asyncio.wait_for(watching.read(), 3) is grpc.aio.EOF
        assert await watching.code() == grpc.StatusCode.OK


async def test_a_drain_with_watchers_takes_the_notice_not_the_grace() -> None:
    """A watcher that keeps its stream through the GOAWAY (a plain Watch call, as any client but
    gRPC's own health checking makes) held every drain for its whole grace; gRPC's health-checking
    clients, restarted at once by a Watch that ends after a response, must not loop meanwhile."""
    server = await create_server("127.0.0.1", 0, -1, lambda srv: [SERVICE])
    address = f"127.0.0.1:{server.port}"
    checked = [grpc.aio.insecure_channel(address, options=HEALTH_CHECKED) for _ in range(3)]
    plain = grpc.aio.insecure_channel(address)
    try:
        # Each reaches the server only once its health Watch said SERVING: their watches are open.
        assert all([await reaches_server(channel) for channel in checked])
        watching = watch(plain)
        assert await next_status(watching) == SERVING
        watches_before = _watch_calls()
        started = time.monotonic()
        await asyncio.wait_for(drain(server, grace_s=10, notice_s=0.5), 15)
        assert time.monotonic() - started < 2.5
        assert await next_status(watching) == NOT_SERVING
        assert _watch_calls() - watches_before < 4 * 3  # each watch's end and a retry or two, not hundreds
    finally:
        for channel in [*checked, plain]:
            await channel.close()


async def test_a_watch_started_while_shutting_down_is_refused_without_a_response(running: RunningServer) -> None:
    """A Watch that ended after a response is restarted at once by gRPC's health checking client:
    answered NOT_SERVING and ended, each client would call ~2,000 times a second until the port
    closed. Refused with no response, it retries after a backoff."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        checked = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}", options=HEALTH_CHECKED)
        try:
            assert await reaches_server(checked)
            await running.health.enter_graceful_shutdown()
            late = watch(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await asyncio.wait_for(late.read(), 3)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            watches_before = _watch_calls()
            await asyncio.sleep(0.5)  # the drain's notice: the port is still open
            assert _watch_calls() - watches_before < 5
        finally:
            await checked.close()


def _watch_calls() -> float:
    """Watch calls the servers of this process have finished (the interceptor's counter)."""
    from prometheus_client import REGISTRY

    method = "/grpc.health.v1.Health/Watch"
    return sum(REGISTRY.get_sample_value("sluice_rpc_requests_total", {"method": method, "code": code}) or 0.0 for code in ("OK", "UNAVAILABLE"))


async def test_upstream_semantics_check_watch_and_set(running: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.Check(health_pb2.HealthCheckRequest(service="other"))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watching = watch(channel, "other")
        assert await next_status(watching) == SERVICE_UNKNOWN
        await running.health.set("other", SERVING)
        assert await next_status(watching) == SERVING
        await running.health.set("other", SERVING)  # the same status again: not sent again
        await running.health.set("other", NOT_SERVING)
        assert await next_status(watching) == NOT_SERVING
        await running.health.enter_graceful_shutdown()
        await running.health.set("other", SERVING)  # ignored once shutting down
        assert (await stub.Check(health_pb2.HealthCheckRequest(service="other"))).status == NOT_SERVING
        assert (await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status == NOT_SERVING
        assert await asyncio.wait_for(watching.read(), 3) is grpc.aio.EOF
