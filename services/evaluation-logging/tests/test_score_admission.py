"""ScoreCompletions' per-tenant bound on calls in flight, through the real servicer on real gRPC."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc

from conftest import make_event
from sluice_common.server import create_server
from sluice_common.tenants import TenantDirectory, hash_api_key
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.queries import EvalLogQueries
from sluice_evaluation_logging.scoring import SCORE_RETRY_AFTER_S, ScoreSlots
from sluice_evaluation_logging.servicer import EvalLogServicer
from sluice_evaluation_logging.store import SqliteStore

KEYS = {"acme": "sk-acme", "globex": "sk-globex"}


class HeldEmbeddings:
    """Letter counts, answered only once `release` is set: the calls stay in flight until then."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        await self.release.wait()
        return [[float(t.lower().count(c)) for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[evallog_pb2_grpc.EvalLogServiceStub, ScoreSlots, HeldEmbeddings]]:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text("".join(f'[[tenants]]\nname = "{name}"\napi_key_sha256 = "{hash_api_key(key)}"\n' for name, key in KEYS.items()))
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    embedder, slots = HeldEmbeddings(), ScoreSlots(per_tenant=2)
    servicer = EvalLogServicer(TenantDirectory.from_file(tenants_file), EvalLogQueries(store), EvalContext(EvalSettings(), embedder), slots)

    def register(server: grpc.aio.Server) -> list[str]:
        evallog_pb2_grpc.add_EvalLogServiceServicer_to_server(servicer, server)
        return [evallog_pb2.DESCRIPTOR.services_by_name["EvalLogService"].full_name]

    running = await create_server("127.0.0.1", 0, -1, register)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{running.port}")
    try:
        yield evallog_pb2_grpc.EvalLogServiceStub(channel), slots, embedder
    finally:
        embedder.release.set()
        await channel.close()
        await running.shutdown(0)
        await store.close()


def _score(stub: evallog_pb2_grpc.EvalLogServiceStub, tenant: str) -> grpc.aio.UnaryUnaryCall:
    items = [evallog_pb2.ScoreItem(event=make_event(tenant=tenant), reference="Paris")]
    return stub.ScoreCompletions(
        evallog_pb2.ScoreCompletionsRequest(items=items), metadata=(("authorization", f"Bearer {KEYS[tenant]}"),), timeout=10
    )


async def _until(condition, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_tenant_over_its_calls_in_flight_is_refused_with_retry_info_and_others_are_not(served) -> None:  # type: ignore[no-untyped-def]
    stub, slots, embedder = served
    held = [asyncio.ensure_future(_score(stub, "acme")) for _ in range(2)]
    await _until(lambda: slots.in_flight("acme") == 2)

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await _score(stub, "acme")
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "at most 2" in (refused.value.details() or "")
    status = rpc_status.from_call(refused.value)
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert any(detail.Unpack(retry) for detail in status.details)
    assert retry.retry_delay.ToNanoseconds() == int(SCORE_RETRY_AFTER_S * 1e9)

    # Another tenant's call is admitted meanwhile (it waits on the same held embedder).
    other = asyncio.ensure_future(_score(stub, "globex"))
    await _until(lambda: slots.in_flight("globex") == 1)

    embedder.release.set()
    replies = await asyncio.gather(*held, other)
    assert all(len(reply.items) == 1 and reply.items[0].scores for reply in replies)
    assert slots.in_flight("acme") == slots.in_flight("globex") == 0
    # Its calls ended: the tenant is admitted again.
    assert len((await _score(stub, "acme")).items) == 1


async def test_a_call_cancelled_by_its_client_gives_its_slot_back(served) -> None:  # type: ignore[no-untyped-def]
    stub, slots, embedder = served
    call = _score(stub, "acme")
    await _until(lambda: slots.in_flight("acme") == 1)
    call.cancel()
    await _until(lambda: slots.in_flight("acme") == 0)


async def test_a_refused_or_failed_call_holds_no_slot(served) -> None:  # type: ignore[no-untyped-def]
    stub, slots, embedder = served
    embedder.release.set()
    bad = evallog_pb2.ScoreCompletionsRequest(items=[])  # INVALID_ARGUMENT inside the admitted call
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.ScoreCompletions(bad, metadata=(("authorization", f"Bearer {KEYS['acme']}"),), timeout=10)
        assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert slots.in_flight("acme") == 0
