"""The models the gateway can route to, as the adapter lists them, refreshed in the background."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.errors import InvalidArgument
from sluice_common.errors import clip
from sluice_common.supervision import Supervisor, stop_tasks
from sluice_common.validation import MAX_MODEL_NAME
from sluice_gateway.config import ENV_PREFIX

log = structlog.stdlib.get_logger("sluice.gateway.models")

# How often the start-up wait for the adapter says what it is waiting for (as a warning: an outage).
WAIT_LOG_INTERVAL_S = 30.0
# Between two ListModels tries during the start-up wait.
WAIT_RETRY_S = 0.5


class UnknownModel(InvalidArgument):
    """No model of that name and kind: INVALID_ARGUMENT on gRPC (as ever), 404 model_not_found on HTTP."""


class ModelCatalog:
    def __init__(self, adapter: inference_pb2_grpc.InferenceServiceStub) -> None:
        self._adapter = adapter
        self._models: dict[str, types_pb2.ModelInfo] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def models(self) -> list[types_pb2.ModelInfo]:
        return list(self._models.values())

    def get(self, name: str, kind: int = types_pb2.MODEL_KIND_GENERATION) -> types_pb2.ModelInfo:
        """The named model of that kind (generation or embedding), or INVALID_ARGUMENT naming the choices."""
        if len(name) > MAX_MODEL_NAME:
            raise InvalidArgument("model", f"must be at most {MAX_MODEL_NAME} characters, got {len(name)}")
        model = self._models.get(name)
        if model is None or model.kind != kind:
            known = ", ".join(sorted(n for n, m in self._models.items() if m.kind == kind)) or "none yet"
            what = types_pb2.ModelKind.Name(kind).removeprefix("MODEL_KIND_").lower()
            raise UnknownModel("model", f"unknown {what} model {clip(name)!r}; available: {known}")
        return model

    async def refresh(self) -> None:
        response = await self._adapter.ListModels(inference_pb2.ListModelsRequest(), timeout=5.0)
        self._models = {model.name: model for model in response.models}

    async def wait_first_load(self, timeout_s: float) -> None:
        """Until the adapter lists its models (it answers UNAVAILABLE until Triton serves them), at
        most `timeout_s` (ADAPTER_WAIT_S), then the process exits; 0: for ever. Unbounded by default:
        a gateway or job worker started during an adapter or Triton outage waits NOT_SERVING on
        readiness and SERVING on liveness, and serves once the adapter does; exiting made it
        crash-loop, its restart back-off delaying it past the adapter's return. Says every
        WAIT_LOG_INTERVAL_S what it waits for."""
        started = told = time.monotonic()
        while True:
            try:
                await self.refresh()
                return
            except grpc.aio.AioRpcError as exc:
                now = time.monotonic()
                if timeout_s > 0 and now - started > timeout_s:
                    raise SystemExit(
                        f"the adapter did not list its models within {timeout_s:g}s ({ENV_PREFIX}ADAPTER_WAIT_S; 0 waits for ever): {exc.details()}"
                    ) from None
                if now - told >= WAIT_LOG_INTERVAL_S:
                    told = now
                    log.warning(
                        "waiting_for_adapter",
                        waiting_for="the inference adapter to list its models (ListModels)",
                        waited_s=round(now - started),
                        limit=f"{timeout_s:g}s" if timeout_s > 0 else f"none ({ENV_PREFIX}ADAPTER_WAIT_S=0)",
                        code=exc.code().name,
                        details=exc.details(),
                    )
                await asyncio.sleep(WAIT_RETRY_S)

    def start_refreshing(self, every_s: float, supervisor: Supervisor | None = None) -> None:
        self._task = (supervisor or Supervisor()).start("model-catalog-refresh", lambda: self._refresh_forever(every_s))

    async def _refresh_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.refresh()
            except grpc.aio.AioRpcError as exc:
                log.warning("model_refresh_failed", code=exc.code().name, details=exc.details())

    async def stop(self) -> None:
        if self._task is not None:
            await stop_tasks(self._task)
