"""The gateway's (and job worker's) start-up wait for the adapter's model list (ModelCatalog.wait_first_load)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2
from structlog.testing import capture_logs

from sluice_common.config import ConfigError, load_config
from sluice_gateway.config import ENV_PREFIX, GatewayConfig
from sluice_gateway.path import model_catalog
from sluice_gateway.path.model_catalog import ModelCatalog
from test_config import environ


class DownAdapter:
    """An adapter that answers ListModels UNAVAILABLE `down_for` times (Triton not serving yet), then lists one model."""

    def __init__(self, down_for: int) -> None:
        self.down_for = down_for
        self.calls = 0

    async def ListModels(self, request: inference_pb2.ListModelsRequest, timeout: float) -> inference_pb2.ListModelsResponse:  # noqa: N802
        self.calls += 1
        if self.calls <= self.down_for:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details="no Triton replica is ready")
        return inference_pb2.ListModelsResponse(models=[types_pb2.ModelInfo(name="m", kind=types_pb2.MODEL_KIND_GENERATION)])


@pytest.fixture(autouse=True)
def quick_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_catalog, "WAIT_RETRY_S", 0.01)
    monkeypatch.setattr(model_catalog, "WAIT_LOG_INTERVAL_S", 0.05)


async def test_with_no_bound_start_up_waits_for_the_adapter_and_says_what_it_waits_for() -> None:
    """ADAPTER_WAIT_S=0 (the default) waits for ever: a pod started during an adapter or Triton
    outage stays up, not ready, instead of exiting into a crash loop (it exited at once with 0)."""
    adapter = DownAdapter(down_for=20)
    catalog = ModelCatalog(adapter)  # type: ignore[arg-type]
    with capture_logs() as logs:
        await asyncio.wait_for(catalog.wait_first_load(0), 5.0)
    assert [m.name for m in catalog.models] == ["m"] and adapter.calls == 21
    waits = [e for e in logs if e["event"] == "waiting_for_adapter"]
    assert waits and all(e["log_level"] == "warning" for e in waits)
    assert "ListModels" in waits[0]["waiting_for"] and waits[0]["details"] == "no Triton replica is ready"
    assert waits[0]["limit"] == f"none ({ENV_PREFIX}ADAPTER_WAIT_S=0)"


async def test_an_operators_bound_still_ends_the_wait() -> None:
    catalog = ModelCatalog(DownAdapter(down_for=10**6))  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="did not list its models within 0.1s"):
        async with asyncio.timeout(5.0):
            await catalog.wait_first_load(0.1)


def test_the_wait_is_unbounded_by_default_and_a_negative_bound_is_refused() -> None:
    assert load_config(GatewayConfig, ENV_PREFIX, environ()).shared.adapter_wait_s == 0
    with pytest.raises(ConfigError, match="ADAPTER_WAIT_S must be >= 0"):
        load_config(GatewayConfig, ENV_PREFIX, environ(ADAPTER_WAIT_S="-1"))
