"""Triton over its KServe v2 gRPC API: the only module that imports tritonclient.

One `InferenceServerClient` per endpoint per process, shared by every call. Two kinds of
model are fed: step-protocol models (the adapter batches) and generate models with the
vLLM / TensorRT-LLM interface (the engine batches); `detect_protocol` tells them apart.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Literal

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from sluice_common.errors import Unavailable
from sluice_inference_adapter import metrics
from sluice_inference_adapter.embed_batcher import Embeddings
from sluice_inference_adapter.step_rows import Action, PromptSpec, SamplingSpec, StepOutcome, StepRow

Protocol = Literal["step", "generate"]

_STEP_OUTPUTS = ("TOKEN_ID", "TEXT", "FINISH", "PROMPT_TOKENS", "COMPLETION_TOKENS", "ERROR")
_PROBE_SEQ_ID = 1  # the probe's sequence finishes within its one step, so one id serves every probe
_PROBE_REQUEST = PromptSpec(prompt="ping").to_json(SamplingSpec(max_tokens=1))


def _tensor(name: str, values: np.ndarray, datatype: str) -> InferInput:
    tensor = InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor


def _text(value: object) -> str:
    return bytes(value).decode("utf-8", errors="replace")  # type: ignore[call-overload]


async def detect_protocol(url: str, model: str) -> Protocol:
    """Which way the adapter feeds this Triton model, read from the model's inputs."""
    client = InferenceServerClient(url)
    try:
        metadata = await client.get_model_metadata(model, as_json=True)
    finally:
        await client.close()
    inputs = {tensor["name"] for tensor in metadata.get("inputs", [])}
    if {"ACTION", "SEQ_ID", "REQUEST"} <= inputs:
        return "step"
    if "text_input" in inputs:
        return "generate"
    raise SystemExit(
        f"Triton model {model} at {url} has inputs {sorted(inputs)}: neither the step protocol"
        " (ACTION, SEQ_ID, REQUEST) nor the generate interface (text_input)"
    )


class _TritonEndpoint:
    """One model on one Triton server."""

    def __init__(self, url: str, model: str) -> None:
        self.url = url
        self.model = model
        self._client = InferenceServerClient(url)

    async def is_ready(self) -> bool:
        try:
            ready = await self._client.is_server_ready(client_timeout=2.0) and await self._client.is_model_ready(
                self.model, client_timeout=2.0
            )
        except InferenceServerException:
            ready = False
        metrics.BACKEND_READY.labels(endpoint=self.url).set(1 if ready else 0)
        return bool(ready)

    async def close(self) -> None:
        await self._client.close()


class TritonStepBackend(_TritonEndpoint):
    """The step protocol: one Triton request per scheduler step."""

    def __init__(self, url: str, model: str, step_timeout_s: float = 60.0) -> None:
        super().__init__(url, model)
        self._timeout_s = step_timeout_s
        self._outputs = [InferRequestedOutput(name) for name in _STEP_OUTPUTS]

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        inputs = [
            _tensor("ACTION", np.array([int(r.action) for r in rows], dtype=np.int32), "INT32"),
            _tensor("SEQ_ID", np.array([r.seq_id for r in rows], dtype=np.int64), "INT64"),
            _tensor("REQUEST", np.array([r.request for r in rows], dtype=np.object_), "BYTES"),
        ]
        started = time.perf_counter()
        try:
            result = await self._client.infer(self.model, inputs, outputs=self._outputs, client_timeout=self._timeout_s)
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed a step of {self.model}: {exc.message()}") from exc
        finally:
            metrics.STEP_SECONDS.observe(time.perf_counter() - started)
        columns = {name: result.as_numpy(name) for name in _STEP_OUTPUTS}
        return [
            StepOutcome(
                token_id=int(columns["TOKEN_ID"][i]),
                text=_text(columns["TEXT"][i]),
                finish=_text(columns["FINISH"][i]),
                prompt_tokens=int(columns["PROMPT_TOKENS"][i]),
                completion_tokens=int(columns["COMPLETION_TOKENS"][i]),
                error=_text(columns["ERROR"][i]),
            )
            for i in range(len(rows))
        ]

    async def probe(self) -> bool:
        """Ready checks, then one real token: a model that loads but cannot generate is not healthy."""
        if not await self.is_ready():
            return False
        try:
            (outcome,) = await self.step([StepRow(Action.PREFILL, _PROBE_SEQ_ID, _PROBE_REQUEST)])
        except Unavailable:
            return False
        return outcome.token_id >= 0 and not outcome.error


class TritonGenerateBackend(_TritonEndpoint):
    """A decoupled model with the vLLM / TensorRT-LLM interface, streamed over stream_infer."""

    async def stream(self, text: str, sampling: SamplingSpec) -> AsyncIterator[str]:
        parameters: dict[str, object] = {
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stop": list(sampling.stop),
        }
        if sampling.seed is not None:
            parameters["seed"] = sampling.seed
        inputs = [
            _tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
            _tensor("sampling_parameters", np.array([json.dumps(parameters).encode()], dtype=np.object_), "BYTES"),
            _tensor("stream", np.array([True]), "BOOL"),
            _tensor("exclude_input_in_output", np.array([True]), "BOOL"),
        ]

        async def requests() -> AsyncIterator[dict[str, object]]:
            yield {"model_name": self.model, "inputs": inputs, "enable_empty_final_response": True}

        responses = self._client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    raise Unavailable(f"Triton at {self.url} failed a stream of {self.model}: {error}")
                output = result.as_numpy("text_output")
                if output is not None and output.size:
                    yield "".join(_text(x) for x in output.reshape(-1))
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed a stream of {self.model}: {exc.message()}") from exc
        finally:
            # Closing the stream is how the engine learns that the client went away.
            responses.cancel()

    async def probe(self) -> bool:
        """Ready checks, then one real token."""
        if not await self.is_ready():
            return False
        try:
            async with aclosing(self.stream("ping", SamplingSpec(max_tokens=1))) as chunks:
                return [chunk async for chunk in chunks] != []
        except Unavailable:
            return False


class TritonEmbedBackend(_TritonEndpoint):
    """A tensor model: TEXT [n] BYTES in, EMBEDDING [n, d] FP32 out, and optionally TOKENS [n]
    INT32 (tokens per text, reported as usage); one request per micro-batch."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model)
        # Read from the model's metadata on the first call: an operator's model may lack TOKENS.
        self._outputs: list[str] | None = None

    async def _output_names(self) -> list[str]:
        if self._outputs is None:
            metadata = await self._client.get_model_metadata(self.model, as_json=True)
            names = {tensor["name"] for tensor in metadata.get("outputs", [])}
            self._outputs = ["EMBEDDING", *(["TOKENS"] if "TOKENS" in names else [])]
        return self._outputs

    async def embed(self, texts: list[str]) -> Embeddings:
        inputs = [_tensor("TEXT", np.array([t.encode() for t in texts], dtype=np.object_), "BYTES")]
        try:
            names = await self._output_names()
            result = await self._client.infer(self.model, inputs, outputs=[InferRequestedOutput(n) for n in names])
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed to embed with {self.model}: {exc.message()}") from exc
        tokens = result.as_numpy("TOKENS") if "TOKENS" in names else None
        return Embeddings(np.asarray(result.as_numpy("EMBEDDING"), dtype=np.float32), tokens)
