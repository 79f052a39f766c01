"""What a gRPC stream's CompletionEvent says when its client cancels it or its deadline passes,
through a real gRPC server: grpc.aio records no status for either (it cancels the handler), and
the event read them as failures (FINISH_REASON_ERROR, error_code UNKNOWN)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2

from test_grpc_bad_input import served_gateway
from test_openai_http import KEY, _Adapter, _Call, _Publisher


class _Stalls(_Call):
    """One token, then nothing: the client cancels, or its deadline passes."""

    def __aiter__(self):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            yield inference_pb2.GenerateResponse(text="Hello", token_count=1)
            await asyncio.sleep(30)

        return run()


async def publisher_told(publisher: _Publisher, within_s: float) -> None:
    """Waits for the call's event: published from its done-callback, once the server has closed it."""
    for _ in range(int(within_s / 0.02)):
        if publisher.bodies:
            return
        await asyncio.sleep(0.02)


@pytest.mark.parametrize(("how", "error_code"), [("cancel", ""), ("deadline", "DEADLINE_EXCEEDED")])
async def test_a_stream_its_client_left_is_recorded_cancelled_not_failed(tmp_path: Any, how: str, error_code: str) -> None:
    adapter = _Adapter()
    adapter.Generate = lambda request, timeout=None, metadata=None: _Stalls([])  # type: ignore[method-assign]
    publisher = _Publisher()
    async with served_gateway(adapter, publisher, tmp_path) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(model="g", prompt="hi", sampling=types_pb2.SamplingParams(max_tokens=5))
        call = stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=0.5 if how == "deadline" else None)
        async for _chunk in call:
            break  # the first token
        if how == "cancel":
            call.cancel()
        else:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async for _ in call:
                    pass
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await publisher_told(publisher, within_s=2.0)
    (body,) = publisher.bodies
    event = events_pb2.CompletionEvent.FromString(body)
    assert (event.finish_reason, event.error_code) == (types_pb2.FINISH_REASON_CANCELLED, error_code)
    assert event.usage.completion_tokens == 1  # the token it had


class _Floods(_Call):
    """Chunks of a megabyte, more than a client's flow-control window holds: grpc blocks sending."""

    def __aiter__(self):  # type: ignore[no-untyped-def]
        async def run():  # type: ignore[no-untyped-def]
            for _ in range(50):
                yield inference_pb2.GenerateResponse(text="x" * 1_000_000, token_count=1)
            usage = types_pb2.Usage(prompt_tokens=1, completion_tokens=50, total_tokens=51)
            yield inference_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_STOP, usage=usage)

        return run()


@pytest.mark.parametrize(("how", "error_code"), [("cancel", ""), ("deadline", "DEADLINE_EXCEEDED")])
async def test_a_client_that_stops_reading_and_leaves_is_recorded_cancelled_not_failed(tmp_path: Any, how: str, error_code: str) -> None:
    """grpc blocked sending (the client reads no more) does not cancel the handler when the client
    cancels or its deadline passes: it closes it at its yield (GeneratorExit), after the call's
    done-callback ran. The event read FINISH_REASON_ERROR "UNKNOWN", the RPC CANCELLED even past its deadline."""
    from prometheus_client import REGISTRY

    method = "/sluice.gateway.v1.GatewayService/Generate"
    rpc_code = "CANCELLED" if how == "cancel" else "DEADLINE_EXCEEDED"

    def counted() -> float:
        return REGISTRY.get_sample_value("sluice_rpc_requests_total", {"method": method, "code": rpc_code}) or 0.0

    before = counted()
    adapter = _Adapter()
    adapter.Generate = lambda request, timeout=None, metadata=None: _Floods([])  # type: ignore[method-assign]
    publisher = _Publisher()
    async with served_gateway(adapter, publisher, tmp_path) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = gateway_pb2.GenerateRequest(model="g", prompt="hi", sampling=types_pb2.SamplingParams(max_tokens=5))
        call = stub.Generate(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=1.0)
        await call.read()  # one chunk, then no more: grpc fills the window and blocks
        if how == "cancel":
            await asyncio.sleep(0.3)
            call.cancel()
        await publisher_told(publisher, within_s=3.0)
    (body,) = publisher.bodies
    event = events_pb2.CompletionEvent.FromString(body)
    assert (event.finish_reason, event.error_code) == (types_pb2.FINISH_REASON_CANCELLED, error_code)
    assert counted() == before + 1  # the RPC's own record: DEADLINE_EXCEEDED once the deadline passed
