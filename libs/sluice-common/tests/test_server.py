"""The server bootstrap and its interceptor, over real gRPC on a local port."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from sluice_common.errors import InvalidArgument, ResourceExhausted
from sluice_common.log import configure_logging
from sluice_common.request_context import current_request_id
from sluice_common.server import MAX_REQUEST_BYTES, create_server, drain, serve_until_signal

SERVICE = "test.Echo"


def _handlers(seen_request_ids: list[str]) -> grpc.GenericRpcHandler:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        seen_request_ids.append(current_request_id())
        if request == b"invalid":
            raise InvalidArgument("sampling.max_tokens", "must be > 0, got 0")
        if request == b"busy":
            raise ResourceExhausted(
                "queue full",
                retry_after_s=2.5,
                quota_subject="adapter.waiting_queue",
                metadata=(("x-ratelimit-limit-requests", "10"), ("x-ratelimit-remaining-requests", "0")),
            )
        if request == b"crash":
            raise RuntimeError("secret internals")
        return request

    async def stream(request: bytes, context: grpc.aio.ServicerContext):
        for index in range(3):
            yield b"%d" % index
        raise InvalidArgument("prompt", "too long")

    async def bidi(requests, context: grpc.aio.ServicerContext):
        async for request in requests:
            seen_request_ids.append(current_request_id())
            yield request

    async def size(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"%d" % len(request)

    identity = lambda b: b  # noqa: E731 - raw bytes on the wire
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary, identity, identity),
            "Size": grpc.unary_unary_rpc_method_handler(size, identity, identity),
            "Stream": grpc.unary_stream_rpc_method_handler(stream, identity, identity),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, identity, identity),
        },
    )


@pytest.fixture
async def server():
    seen: list[str] = []

    def register(srv: grpc.aio.Server) -> list[str]:
        srv.add_generic_rpc_handlers((_handlers(seen),))
        return [SERVICE]

    running = await create_server("127.0.0.1", 0, -1, register)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    yield running, channel, seen
    await channel.close()
    await running.shutdown(0)


async def test_invalid_argument_carries_field_violation(server) -> None:
    _, channel, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"invalid")
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    status = rpc_status.from_call(error)
    bad_request = error_details_pb2.BadRequest()
    status.details[0].Unpack(bad_request)
    assert bad_request.field_violations[0].field == "sampling.max_tokens"


async def test_resource_exhausted_carries_retry_info_and_quota_failure(server) -> None:
    _, channel, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"busy")
    status = rpc_status.from_call(caught.value)
    retry, quota = error_details_pb2.RetryInfo(), error_details_pb2.QuotaFailure()
    assert status.details[0].Unpack(retry) and status.details[1].Unpack(quota)
    assert retry.retry_delay.ToMilliseconds() == 2500
    assert quota.violations[0].subject == "adapter.waiting_queue"


async def test_resource_exhausted_sends_its_metadata_beside_the_status(server) -> None:
    _, channel, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"busy")
    trailing = dict(caught.value.trailing_metadata())
    assert trailing["x-ratelimit-limit-requests"] == "10" and trailing["x-ratelimit-remaining-requests"] == "0"
    assert "grpc-status-details-bin" in trailing


def test_exhaustion_that_no_retry_can_end_has_no_retry_info() -> None:
    from sluice_common.errors import ResourceExhausted
    from sluice_common.interceptor import status_for

    status = rpc_status.from_call(_Call(status_for(ResourceExhausted("too large", retry_after_s=None, quota_subject="t"))))
    kinds = [detail.TypeName() for detail in status.details]
    assert kinds == ["google.rpc.QuotaFailure"]


def test_unavailable_with_a_known_wait_sends_retry_info() -> None:
    from sluice_common.errors import Unavailable
    from sluice_common.interceptor import status_for

    status = rpc_status.from_call(_Call(status_for(Unavailable("fail-closed; retry after 2.5s", retry_after_s=2.5))))
    [detail] = status.details
    info = error_details_pb2.RetryInfo()
    assert detail.Unpack(info) and info.retry_delay.ToMilliseconds() == 2500
    assert rpc_status.from_call(_Call(status_for(Unavailable("no replica")))).details == []


def test_a_long_message_is_cut_to_what_grpcs_metadata_can_carry() -> None:
    """A status travels as trailing metadata, which grpc refuses beyond 16 KiB: a message quoting a
    client's 20,000 characters reached the client as RESOURCE_EXHAUSTED, not as its error."""
    from sluice_common.errors import InvalidArgument
    from sluice_common.interceptor import status_for

    grpc_status = status_for(InvalidArgument("f" * 20_000, "r" * 20_000))
    status = rpc_status.from_call(_Call(grpc_status))
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    violation = bad.field_violations[0]
    assert len(status.message) <= 513 and len(violation.field) <= 513 and len(violation.description) <= 513
    assert violation.field.startswith("f" * 100) and status.message.endswith("…")
    assert sum(len(value) for _key, value in grpc_status.trailing_metadata) < 8 * 1024


class _Call:
    """The two things rpc_status.from_call reads from a finished call."""

    def __init__(self, status: grpc.Status) -> None:
        self._status = status

    def code(self) -> grpc.StatusCode:
        return self._status.code

    def details(self) -> str:
        return self._status.details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._status.trailing_metadata


async def test_a_request_over_grpcs_default_4_mib_reaches_the_servicer(server) -> None:
    """gRPC's own 4 MiB limit answered RESOURCE_EXHAUSTED before the service's own bounds (a SubmitJob
    up to SLUICE_GATEWAY_JOBS_MAX_MESSAGE_BYTES, 8 MiB) could; MAX_REQUEST_BYTES is the port's bound."""
    _, channel, _ = server
    size = channel.unary_unary(f"/{SERVICE}/Size")
    assert await size(b"x" * (5 * 1024 * 1024), timeout=10) == b"5242880"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await size(b"x" * (MAX_REQUEST_BYTES + 1), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_unexpected_error_is_internal_without_internals(server) -> None:
    _, channel, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"crash")
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in caught.value.details() and "request_id=" in caught.value.details()


async def test_stream_error_after_messages(server) -> None:
    _, channel, _ = server
    call = channel.unary_stream(f"/{SERVICE}/Stream")(b"")
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for message in call:
            received.append(message)
    assert received == [b"0", b"1", b"2"]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_request_id_from_metadata_or_generated(server) -> None:
    _, channel, seen = server
    await channel.unary_unary(f"/{SERVICE}/Unary")(b"ok", metadata=(("x-request-id", "rid-1"),))
    await channel.unary_unary(f"/{SERVICE}/Unary")(b"ok")
    assert seen[0] == "rid-1"
    assert len(seen[1]) == 32 and seen[1] != "rid-1"
    # A caller's 4 KB id (gRPC takes up to 8 KB of metadata) would ride on every log line, call and record.
    await channel.unary_unary(f"/{SERVICE}/Unary")(b"ok", metadata=(("x-request-id", "r" * 4000),))
    assert seen[2] == "r" * 64


async def test_health_serving_then_not_serving_on_shutdown(server) -> None:
    running, channel, _ = server
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    await running.health.enter_graceful_shutdown()
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE))
    assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_summary_line_is_json_with_request_id(server, capsys) -> None:
    configure_logging("test", "INFO", json=True)
    logging.getLogger().handlers[0].stream = sys.stderr  # capsys swapped stderr after setup
    _, channel, _ = server
    await channel.unary_unary(f"/{SERVICE}/Unary")(b"ok", metadata=(("x-request-id", "rid-json"),))
    await asyncio.sleep(0)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    summary = next(line for line in lines if line.get("event") == "rpc" and line.get("request_id") == "rid-json")
    assert summary["code"] == "OK" and summary["rpc"] == f"/{SERVICE}/Unary" and summary["service"] == "test"


async def test_quiet_methods_log_their_successes_at_debug_only(capsys) -> None:
    configure_logging("test", "INFO", json=True)
    logging.getLogger().handlers[0].stream = sys.stderr

    def register(srv: grpc.aio.Server) -> list[str]:
        srv.add_generic_rpc_handlers((_handlers([]),))
        return [SERVICE]

    running = await create_server("127.0.0.1", 0, -1, register, quiet_methods=[f"/{SERVICE}/Unary"])
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            unary = channel.unary_unary(f"/{SERVICE}/Unary")
            for _ in range(2):  # the second call takes the cached wrapped handler
                await unary(b"ok", metadata=(("x-request-id", "rid-quiet"),))
            with pytest.raises(grpc.aio.AioRpcError):
                await unary(b"invalid", metadata=(("x-request-id", "rid-quiet-error"),))
            stream = channel.unary_stream(f"/{SERVICE}/Stream")
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in stream(b"", metadata=(("x-request-id", "rid-loud"),)):
                    pass
        await asyncio.sleep(0)
    finally:
        await running.shutdown(0)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    logged = {line.get("request_id") for line in lines if line.get("event") == "rpc"}
    # A quiet method's success is not logged at INFO, its failure is; other methods are as before.
    assert "rid-quiet" not in logged
    assert {"rid-quiet-error", "rid-loud"} <= logged


async def test_a_bidirectional_stream_gets_one_summary_line_and_survives_a_cancel(server, capsys) -> None:
    configure_logging("test", "INFO", json=True)
    logging.getLogger().handlers[0].stream = sys.stderr
    _, channel, seen = server
    bidi = channel.stream_stream(f"/{SERVICE}/Bidi")
    call = bidi(metadata=(("x-request-id", "rid-bidi"),))
    for payload in (b"a", b"b"):
        await call.write(payload)
        assert await call.read() == payload
    call.cancel()  # the caller goes away mid-stream: the server must log it, not crash reading its peer
    await asyncio.sleep(0.1)
    call = bidi(metadata=(("x-request-id", "rid-bidi-2"),))
    await call.write(b"c")
    assert await call.read() == b"c"
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    await asyncio.sleep(0.05)
    assert seen == ["rid-bidi", "rid-bidi", "rid-bidi-2"]
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    summaries = {line["request_id"]: line for line in lines if line.get("event") == "rpc"}
    # grpc.aio ends a cancelled call's request iterator like a finished one: the handler returns and
    # its line may say OK; what matters is that the line is there, with the peer read at the start.
    assert summaries["rid-bidi"]["code"] in ("OK", "CANCELLED") and summaries["rid-bidi"]["peer"].startswith("ipv4:")
    assert summaries["rid-bidi-2"]["code"] == "OK"


async def test_health_is_serving_only_while_no_source_reports_a_problem(server) -> None:
    running, channel, _ = server
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )

    async def status(service: str = "") -> int:
        return (await check(health_pb2.HealthCheckRequest(service=service))).status

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert await status("liveness") == serving
    await running.report("task:scheduler", False)
    await running.report("replicas", False)
    assert (await status(), await status("liveness")) == (not_serving, not_serving)
    await running.report("task:scheduler", True)
    # No replica to serve with: not ready, but alive (a restart would not bring Triton back).
    assert (await status(), await status("liveness")) == (not_serving, serving)
    await running.set_serving(False)  # draining: not ready, alive
    assert (await status(), await status("liveness")) == (not_serving, serving)
    await running.set_serving(True)
    await running.report("replicas", True)
    assert (await status(), await status("liveness")) == (serving, serving)


async def test_drain_turns_not_serving_refuses_new_calls_finishes_accepted_streams_then_flushes() -> None:
    release = asyncio.Event()
    order: list[str] = []

    async def slow(request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        await release.wait()
        yield b"last"
        order.append("stream finished")

    identity = lambda b: b  # noqa: E731
    handlers = grpc.method_handlers_generic_handler(SERVICE, {"Slow": grpc.unary_stream_rpc_method_handler(slow, identity, identity)})

    def register(srv: grpc.aio.Server) -> list[str]:
        srv.add_generic_rpc_handlers((handlers,))
        return [SERVICE]

    async def on_stop() -> None:
        order.append("flushed")

    async def other_listener() -> None:  # drained beside the gRPC port, not after it
        order.append("other listener draining")

    running = await create_server("127.0.0.1", 0, -1, register)
    address = f"127.0.0.1:{running.port}"
    async with grpc.aio.insecure_channel(address) as channel:
        accepted = channel.unary_stream(f"/{SERVICE}/Slow")(b"")
        assert await accepted.read() == b"first"
        draining = asyncio.create_task(drain(running, grace_s=10, on_stop=on_stop, notice_s=0.2, also_drain=other_listener))
        await asyncio.sleep(0.05)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.sleep(0.3)  # past the notice: the port takes no new calls
        async with grpc.aio.insecure_channel(address) as late:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await late.unary_stream(f"/{SERVICE}/Slow")(b"").read()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not draining.done()
        release.set()
        assert await accepted.read() == b"last"
        assert await accepted.code() == grpc.StatusCode.OK
        await asyncio.wait_for(draining, 5)
    assert order == ["other listener draining", "stream finished", "flushed"]


async def test_drain_cancels_what_outlives_the_grace() -> None:
    async def endless(request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        await asyncio.Event().wait()

    identity = lambda b: b  # noqa: E731
    handlers = grpc.method_handlers_generic_handler(SERVICE, {"Endless": grpc.unary_stream_rpc_method_handler(endless, identity, identity)})

    def register(srv: grpc.aio.Server) -> list[str]:
        srv.add_generic_rpc_handlers((handlers,))
        return [SERVICE]

    running = await create_server("127.0.0.1", 0, -1, register)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        call = channel.unary_stream(f"/{SERVICE}/Endless")(b"")
        assert await call.read() == b"first"
        await asyncio.wait_for(drain(running, grace_s=0.3, notice_s=0), 5)
        assert await call.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_ports_a_server_bound_are_logged_at_any_level(capsys) -> None:
    """A launcher that started a service on port 0 reads its ports from this line (sluice_stack),
    also when the service logs warnings only."""
    configure_logging("test", "INFO", json=True)  # once per process: as the other tests have it
    root = logging.getLogger()
    root.handlers[0].stream = sys.stderr  # capsys swapped stderr after setup
    level = root.level
    root.setLevel("WARNING")  # what LOG_LEVEL=WARNING configures
    try:
        running = await create_server("127.0.0.1", 0, 0, lambda srv: [])
        await running.shutdown(0)
    finally:
        root.setLevel(level)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    (bound,) = [line for line in lines if line.get("event") == "ports_bound"]
    assert bound["grpc"] == running.port > 0 and bound["metrics"] == running.metrics_port > 0
    assert not any(line.get("event") == "server_started" for line in lines)  # an INFO line


async def test_a_second_signal_cuts_the_other_listener_as_it_cuts_grpc() -> None:
    class HeldListener:
        """Another listener (as the gateway's HTTP front) with a request that never ends by itself."""

        def __init__(self) -> None:
            self.draining, self.cut = asyncio.Event(), asyncio.Event()

        async def stop(self) -> None:
            self.draining.set()
            await self.cut.wait()

        async def stop_now(self) -> None:
            self.cut.set()

    running = await create_server("127.0.0.1", 0, -1, lambda srv: [])
    listener = HeldListener()
    serving = asyncio.create_task(serve_until_signal(running, 60.0, also=listener))
    await asyncio.sleep(0.1)  # its signal handlers are in place
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(listener.draining.wait(), 5)
    await asyncio.sleep(0.1)
    assert not serving.done()  # the listener drains (its request is in flight)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(serving, 5)  # cut at once, not at the end of the 60 s grace
    assert listener.cut.is_set()


def _in_flight(method: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sluice_rpc_in_flight", {"method": f"/{SERVICE}/{method}"}) or 0.0


async def test_in_flight_counts_a_stream_until_it_ends_and_a_failed_call_not_at_all(server) -> None:
    _, channel, _ = server
    before = _in_flight("Bidi")
    call = channel.stream_stream(f"/{SERVICE}/Bidi")()
    await call.write(b"a")
    assert await call.read() == b"a"
    # Open streams are what sluice diagnose reads as a hop's L: held while the stream lives.
    assert _in_flight("Bidi") == before + 1
    call.cancel()
    for _ in range(100):
        if _in_flight("Bidi") == before:
            break
        await asyncio.sleep(0.01)
    assert _in_flight("Bidi") == before
    with pytest.raises(grpc.aio.AioRpcError):
        await channel.unary_unary(f"/{SERVICE}/Unary")(b"crash")
    assert _in_flight("Unary") == 0
