"""The step backend over Triton's KServe v2 gRPC API: the only module that imports tritonclient.

One `InferenceServerClient` per process (per endpoint), shared by every call.
"""

from __future__ import annotations

import time

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from sluice_common.errors import Unavailable
from sluice_inference_adapter import metrics
from sluice_inference_adapter.step_rows import Action, PromptSpec, SamplingSpec, StepOutcome, StepRow

_PROBE_SEQ_ID = 1  # the probe's sequence finishes within its one step, so one id serves every probe
_PROBE_REQUEST = PromptSpec(prompt="ping").to_json(SamplingSpec(max_tokens=1))

_OUTPUTS = ("TOKEN_ID", "TEXT", "FINISH", "PROMPT_TOKENS", "COMPLETION_TOKENS", "ERROR")


class TritonStepBackend:
    def __init__(self, url: str, model: str, step_timeout_s: float = 60.0) -> None:
        self.url = url
        self.model = model
        self._timeout_s = step_timeout_s
        self._client = InferenceServerClient(url)
        self._outputs = [InferRequestedOutput(name) for name in _OUTPUTS]

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        inputs = [
            _tensor("ACTION", np.array([int(r.action) for r in rows], dtype=np.int32), "INT32"),
            _tensor("SEQ_ID", np.array([r.seq_id for r in rows], dtype=np.int64), "INT64"),
            _tensor("REQUEST", np.array([r.request for r in rows], dtype=np.object_), "BYTES"),
        ]
        started = time.perf_counter()
        try:
            result = await self._client.infer(
                self.model, inputs, outputs=self._outputs, client_timeout=self._timeout_s
            )
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed a step of {self.model}: {exc.message()}") from exc
        finally:
            metrics.STEP_SECONDS.observe(time.perf_counter() - started)
        columns = {name: result.as_numpy(name) for name in _OUTPUTS}
        return [
            StepOutcome(
                token_id=int(columns["TOKEN_ID"][i]),
                text=bytes(columns["TEXT"][i]).decode("utf-8", errors="replace"),
                finish=bytes(columns["FINISH"][i]).decode(),
                prompt_tokens=int(columns["PROMPT_TOKENS"][i]),
                completion_tokens=int(columns["COMPLETION_TOKENS"][i]),
                error=bytes(columns["ERROR"][i]).decode("utf-8", errors="replace"),
            )
            for i in range(len(rows))
        ]

    async def is_ready(self) -> bool:
        try:
            ready = await self._client.is_server_ready(client_timeout=2.0) and await self._client.is_model_ready(
                self.model, client_timeout=2.0
            )
        except InferenceServerException:
            ready = False
        metrics.BACKEND_READY.labels(endpoint=self.url).set(1 if ready else 0)
        return bool(ready)

    async def probe(self) -> bool:
        """Ready checks, then one real token: a model that loads but cannot generate is not healthy."""
        if not await self.is_ready():
            return False
        try:
            (outcome,) = await self.step([StepRow(Action.PREFILL, _PROBE_SEQ_ID, _PROBE_REQUEST)])
        except Unavailable:
            return False
        return outcome.token_id >= 0 and not outcome.error

    async def close(self) -> None:
        await self._client.close()


def _tensor(name: str, values: np.ndarray, datatype: str) -> InferInput:
    tensor = InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor
