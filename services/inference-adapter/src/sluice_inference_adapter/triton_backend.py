"""Triton over its KServe v2 gRPC API: the only module that imports tritonclient.

One `InferenceServerClient` per endpoint per process, shared by every call. Two kinds of
model are fed: step-protocol models (the adapter batches) and models behind Triton's vLLM
backend (the engine batches); `detect_protocol` tells them apart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

import numpy as np
import structlog
from tritonclient.grpc import InferInput, InferRequestedOutput
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import InferenceServerException

from sluice_common.errors import Unavailable
from sluice_common.logprobs import from_vllm
from sluice_common.sampling import Sampling, vllm_sampling_parameters
from sluice_inference_adapter import metrics
from sluice_inference_adapter.backend_errors import RequestRejected, engine_message, is_request_fault
from sluice_inference_adapter.embed_batcher import Embeddings
from sluice_inference_adapter.generated_chunk import GeneratedChunk
from sluice_inference_adapter.step_rows import FINISH_BUSY, Action, PromptSpec, StepOutcome, StepRow
from sluice_inference_adapter.step_timeout import StepTimeouts

Protocol = Literal["step", "generate"]

log = structlog.stdlib.get_logger("sluice.triton_backend")

# The vLLM backend's additional outputs the adapter reports usage and finish reasons from
# (triton-inference-server/vllm_backend docs/additional_outputs.md).
_RETURN_FLAGS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")
_STEP_INPUTS = {"ACTION", "SEQ_ID", "REQUEST"}
_VLLM_INPUTS = {"text_input", "sampling_parameters", "stream", "exclude_input_in_output", *_RETURN_FLAGS}
_STEP_OUTPUTS = ("ROW_SEQ_ID", "TOKEN_ID", "TEXT", "FINISH", "PROMPT_TOKENS", "COMPLETION_TOKENS", "ERROR", "ROUND_END")
# Prompt tokens a row's sequence took from the engine's prefix cache. Requested only from a model
# that declares it: Triton refuses a request for an output its model lacks, and a step model from
# before the prefix cache (an engine not yet upgraded, an operator's own) must keep serving; its
# sequences then report 0.
_CACHED_TOKENS = "CACHED_TOKENS"
# Each row's token log-probabilities (JSON, empty when its sequence asked for none). Requested only
# from a model that declares it, as CACHED_TOKENS; ListModels says which models report them.
_LOGPROBS = "LOGPROBS"
# Triton's vLLM backend's per-token log-probabilities (asked per request, only when the request wants them).
_VLLM_RETURN_LOGPROBS, _VLLM_LOGPROBS = "return_logprobs", "logprobs"
# How long a round's steps may wait to share one response; sent only to a model that declares it.
_STREAM_INTERVAL = "STREAM_INTERVAL_MS"
_FOLLOWS_ROUND = "FOLLOWS_ROUND"
_INTERRUPTIBLE = "INTERRUPTIBLE"
_PROBE_PROMPT = PromptSpec(prompt="ping")
# How long a fully answered round's stream may take to end on Triton's side before it is cancelled.
_STREAM_END_S = 2.0
_PROBE_REQUEST = _PROBE_PROMPT.to_json(Sampling(max_tokens=1))
# An embedding model's token counts per text: as processed (usage), and before its truncation.
_EMBED_TOKENS, _EMBED_UNTRUNCATED = "TOKENS", "UNTRUNCATED_TOKENS"


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
    return protocol_of(model, {tensor["name"] for tensor in metadata.get("inputs", [])})


async def reports_logprobs(url: str, model: str, protocol: Protocol) -> bool:
    """Whether the model reports token log-probabilities: a step model that declares LOGPROBS, or
    a model behind Triton's vLLM backend that declares its `logprobs` output (return_logprobs)."""
    client = InferenceServerClient(url)
    try:
        metadata = await client.get_model_metadata(model, as_json=True)
    finally:
        await client.close()
    outputs = {tensor["name"] for tensor in metadata.get("outputs", [])}
    if protocol == "step":
        return _LOGPROBS in outputs
    inputs = {tensor["name"] for tensor in metadata.get("inputs", [])}
    return _VLLM_LOGPROBS in outputs and _VLLM_RETURN_LOGPROBS in inputs


def protocol_of(model: str, inputs: set[str]) -> Protocol:
    if _STEP_INPUTS <= inputs:
        return "step"
    if _VLLM_INPUTS <= inputs:
        return "generate"
    if "text_input" in inputs and "max_tokens" in inputs:
        raise SystemExit(
            f"Triton model {model} has TensorRT-LLM's interface (text_input, max_tokens): not supported. Its"
            " outputs (text_output, num_input_tokens, num_output_tokens, ...) report no finish reason, so whether"
            " a stream stopped or ran out of max_tokens could only be guessed"
        )
    if "text_input" in inputs:
        raise SystemExit(
            f"Triton model {model} looks like Triton's vLLM backend but lacks the inputs"
            f" {sorted(_VLLM_INPUTS - inputs)}: usage and finish reasons need the backend's additional"
            " outputs (return_finish_reason, return_num_input_tokens, return_num_output_tokens); use a newer"
            " vllm_backend"
        )
    raise SystemExit(
        f"Triton model {model} has inputs {sorted(inputs)}: neither the step protocol"
        f" ({', '.join(sorted(_STEP_INPUTS))}) nor Triton's vLLM backend ({', '.join(sorted(_VLLM_INPUTS))})"
    )


class _TritonEndpoint:
    """One model on one Triton server. Its series' `replica` label is its address plus
    `metrics_label`, as its pool's and scheduler's are ("#<model>" for an extra model): the main and
    an extra model on one replica would otherwise write one series, and the pool's removal of the
    replica (metrics.forget_replica) would leave it behind."""

    def __init__(self, url: str, model: str, metrics_label: str = "") -> None:
        self.url = url
        self.model = model
        self._replica = url + metrics_label
        self._client = InferenceServerClient(url)

    async def is_ready(self) -> bool:
        try:
            ready = await self._client.is_server_ready(client_timeout=2.0) and await self._client.is_model_ready(self.model, client_timeout=2.0)
        except InferenceServerException:
            ready = False
        metrics.BACKEND_READY.labels(replica=self._replica).set(1 if ready else 0)
        return bool(ready)

    async def close(self) -> None:
        await self._client.close()


class TritonStepBackend(_TritonEndpoint):
    """The step protocol: one Triton request per scheduler step."""

    def __init__(
        self,
        url: str,
        model: str,
        step_timeout_s: float = 60.0,
        timeouts: StepTimeouts | None = None,
        stream_interval_s: float = 0.0,
        metrics_label: str = "",
    ) -> None:
        super().__init__(url, model, metrics_label)
        # The fixed bound of every call (the adaptive timeout's ceiling); the scheduler cuts a step
        # off sooner by the adaptive one (step_timeout.py), which bounds the probes here too.
        self._timeout_s = step_timeout_s
        self._timeouts = timeouts
        # How long a round's steps may wait to share a response (step_protocol's STREAM_INTERVAL_MS).
        self._stream_interval_ms = round(stream_interval_s * 1000)
        # Read from the model's metadata on the first round (whether it declares CACHED_TOKENS, and
        # STREAM_INTERVAL_MS: Triton refuses an input its model lacks, and an older step model keeps
        # answering one response per step).
        self._outputs: list[InferRequestedOutput] | None = None
        self._takes_interval = False
        self._takes_follows = False
        self._takes_interruptible = False

    async def _requested_outputs(self) -> list[InferRequestedOutput]:
        if self._outputs is None:
            metadata = await self._client.get_model_metadata(self.model, as_json=True)
            declared = {tensor["name"] for tensor in metadata.get("outputs", [])}
            inputs = {tensor["name"] for tensor in metadata.get("inputs", [])}
            self._takes_interval, self._takes_follows = _STREAM_INTERVAL in inputs, _FOLLOWS_ROUND in inputs
            self._takes_interruptible = _INTERRUPTIBLE in inputs
            if self._stream_interval_ms and not self._takes_interval:
                log.warning(
                    "stream_interval_not_supported",
                    replica=self.url,
                    model=self.model,
                    hint=f"the model does not declare {_STREAM_INTERVAL}: it answers one response per engine step (upgrade the step model)",
                )
            self._outputs = [InferRequestedOutput(name) for name in step_output_names(declared)]
        return self._outputs

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        """A round of one step: one outcome per row, in order."""
        async with aclosing(self.round(rows, 1)) as steps:
            async for outcomes in steps:
                return outcomes
        raise Unavailable(f"Triton at {self.url} closed a step of {self.model} without an answer")

    @property
    def follows_rounds(self) -> bool:
        """Whether a round may be sent while another runs, to follow it (step_protocol's
        FOLLOWS_ROUND): known once a round has read the model's metadata; an older step model
        would end the round in flight instead."""
        return self._takes_follows

    @property
    def interrupts(self) -> bool:
        """Whether rounds may be sent INTERRUPTIBLE, and stopped midway by an INTERRUPT row: known
        once a round has read the model's metadata (an older step model lacks the input)."""
        return self._takes_interruptible

    async def round(
        self, rows: list[StepRow], steps: int, follows: bool = False, interruptible: bool = False
    ) -> AsyncGenerator[list[StepOutcome], None]:
        """Up to `steps` engine steps (a multi-step round), each step's outcomes as they are made:
        the first answers `rows` in order, a later one the sequences still running (step_protocol).
        A round that `follows` waits for the round in flight to end (`follows_rounds` only); an
        `interruptible` one may be stopped midway by an INTERRUPT row (`interrupts` only)."""
        inputs = [
            _tensor("ACTION", np.array([int(r.action) for r in rows], dtype=np.int32), "INT32"),
            _tensor("SEQ_ID", np.array([r.seq_id for r in rows], dtype=np.int64), "INT64"),
            _tensor("REQUEST", np.array([r.request for r in rows], dtype=np.object_), "BYTES"),
            _tensor("STEPS", np.array([steps], dtype=np.int32), "INT32"),
        ]

        try:
            outputs = await self._requested_outputs()
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} did not describe {self.model}: {exc.message()}") from exc
        if steps > 1 and self._stream_interval_ms and self._takes_interval:
            inputs.append(_tensor(_STREAM_INTERVAL, np.array([self._stream_interval_ms], dtype=np.int32), "INT32"))
        if follows and self._takes_follows:
            inputs.append(_tensor(_FOLLOWS_ROUND, np.array([1], dtype=np.int32), "INT32"))
        if interruptible and self._takes_interruptible:
            inputs.append(_tensor(_INTERRUPTIBLE, np.array([1], dtype=np.int32), "INT32"))

        async def requests() -> AsyncIterator[dict[str, object]]:
            yield {"model_name": self.model, "inputs": inputs, "outputs": outputs}

        # The fixed bound is per step (the scheduler cuts a stuck step off sooner by the adaptive one).
        # Step times are the scheduler's to take (sluice_adapter_step_seconds): a round sent ahead
        # starts here at once, and its first answer waits for the round before it.
        responses = self._client.stream_infer(requests(), stream_timeout=self._timeout_s * steps)
        answered = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise Unavailable(f"Triton at {self.url} failed a step of {self.model}: {error.message()}")
                outcomes, answered = _step_outcomes(result)
                yield outcomes
                if answered:
                    return
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed a step of {self.model}: {exc.message()}") from exc
        finally:
            await _end_stream(responses, answered)

    async def probe(self) -> bool:
        """Ready checks, then one real token: a model that loads but cannot generate is not healthy."""
        if not await self.is_ready():
            return False
        # A stuck replica must not hold its probe for ever (the pool would not probe it again meanwhile).
        limit = self._timeouts.limit(_PROBE_PROMPT.estimated_tokens()) if self._timeouts is not None else None
        try:
            async with asyncio.timeout(limit):
                # A random id: other adapters probe the same engine, maybe at the same moment.
                (outcome,) = await self.step([StepRow(Action.PREFILL, random.getrandbits(62) + 1, _PROBE_REQUEST)])
        except Unavailable:
            return False
        except TimeoutError:
            metrics.TIMEOUTS.labels(kind="probe").inc()
            raise TimeoutError(f"the probe's step did not answer within its timeout of {limit:.2f}s") from None
        # "busy": every slot is taken (shared with other adapters), which a serving engine may be;
        # not "stale": every slot is held by sequences nobody steps, and nothing can be served.
        return (outcome.token_id >= 0 and not outcome.error) or outcome.finish == FINISH_BUSY


class TritonGenerateBackend(_TritonEndpoint):
    """A model behind Triton's vLLM backend (decoupled), streamed over stream_infer.

    Every request asks for the backend's additional outputs (finish_reason, num_input_tokens,
    num_output_tokens), so usage and finish reasons are what the engine reports, not estimates.
    A stream's waits are bounded by its passthrough scheduler (passthrough.py); the probe, which
    no scheduler runs, bounds its own token by `timeouts` (the pool's adaptive limit, as a step
    backend's probe), else by `probe_timeout_s`.
    """

    def __init__(
        self,
        url: str,
        model: str,
        probe_timeout_s: float = 60.0,
        timeouts: StepTimeouts | None = None,
        metrics_label: str = "",
    ) -> None:
        super().__init__(url, model, metrics_label)
        self._probe_timeout_s = probe_timeout_s
        self._timeouts = timeouts

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncGenerator[GeneratedChunk, None]:
        """The engine's responses for one sequence. `request_id` is sent as the inference request's
        id (KServe v2's `id`), which Triton names the request by in its own log and trace lines."""
        inputs = [
            _tensor("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
            _tensor("sampling_parameters", np.array([json.dumps(vllm_sampling_parameters(sampling)).encode()], dtype=np.object_), "BYTES"),
            *(_tensor(name, np.array([True]), "BOOL") for name in ("stream", "exclude_input_in_output", *_RETURN_FLAGS)),
        ]
        if sampling.logprobs is not None:
            inputs.append(_tensor(_VLLM_RETURN_LOGPROBS, np.array([True]), "BOOL"))

        async def requests() -> AsyncIterator[dict[str, object]]:
            # tritonclient's aio stream_infer has no enable_empty_final_response (and "triton_"
            # parameters are reserved): the backend's finish_reason marks the last response.
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        responses = self._client.stream_infer(requests())
        # Answered: the backend sent its last response (an error response is its last too).
        answered = False
        try:
            async for result, error in responses:
                if error is not None:
                    answered = True
                    raise _stream_error(self.url, self.model, error.message())
                chunk = _generated_chunk(result, sampling.logprobs)
                answered = chunk.finish_reason is not None or _is_final(result)
                yield chunk
                if answered:
                    return
        except InferenceServerException as exc:
            raise _stream_error(self.url, self.model, exc.message()) from exc
        finally:
            # A stream left unanswered (a cancelled caller, a failure) is cancelled, and the vLLM
            # backend aborts the request; an answered one ends as Triton ends it (_end_stream).
            await _end_stream(responses, answered)

    async def probe(self) -> bool:
        """Ready checks, then one real token, within the probe's timeout: a stuck replica must not
        hold its probe (nor the pool's readmission of it) for ever; one that times out has failed it."""
        if not await self.is_ready():
            return False
        limit = self._timeouts.limit(_PROBE_PROMPT.estimated_tokens()) if self._timeouts is not None else self._probe_timeout_s
        try:
            async with asyncio.timeout(limit), aclosing(self.stream(_PROBE_PROMPT.prompt, Sampling(max_tokens=1))) as chunks:
                return sum([chunk.output_tokens async for chunk in chunks]) >= 1
        except (Unavailable, RequestRejected):
            return False
        except TimeoutError:
            # The stream was cancelled on its way out (stream's finally), so the engine aborts it.
            metrics.TIMEOUTS.labels(kind="probe").inc()
            raise TimeoutError(f"the probe's token did not arrive within its timeout of {limit:.2f}s") from None


async def _end_stream(responses: Any, answered: bool) -> None:
    """A stream that was answered in full is let end as Triton ends it (the request was sent whole
    and the model's last response is out): cancelling such a stream races tritonserver's own
    completion of it, which aborted tritonserver once in a test run of each path (a step round:
    "double free or corruption"; the vLLM interface, right after a finished stream: signal 11).
    Only a stream left unanswered (a timeout, a failure, a caller gone) is cancelled."""
    if answered:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_STREAM_END_S):
                async for _ in responses:
                    pass
                return
    responses.cancel()


def step_output_names(declared: set[str]) -> list[str]:
    """The outputs to request from a step model whose metadata declares `declared`."""
    return [*_STEP_OUTPUTS, *(name for name in (_CACHED_TOKENS, _LOGPROBS) if name in declared)]


def _step_outcomes(result: object) -> tuple[list[StepOutcome], bool]:
    """One step's outcomes from one response of a round, and whether it was the round's last."""
    columns = {name: result.as_numpy(name) for name in _STEP_OUTPUTS}  # type: ignore[attr-defined]
    cached = result.as_numpy(_CACHED_TOKENS)  # type: ignore[attr-defined]  # None: not requested
    logprobs = result.as_numpy(_LOGPROBS)  # type: ignore[attr-defined]  # None: not requested
    outcomes = [
        StepOutcome(
            token_id=int(columns["TOKEN_ID"][i]),
            text=_text(columns["TEXT"][i]),
            finish=_text(columns["FINISH"][i]),
            prompt_tokens=int(columns["PROMPT_TOKENS"][i]),
            completion_tokens=int(columns["COMPLETION_TOKENS"][i]),
            error=_text(columns["ERROR"][i]),
            seq_id=int(columns["ROW_SEQ_ID"][i]),
            cached_tokens=0 if cached is None else int(cached[i]),
            logprobs=None if logprobs is None else _logprob(logprobs[i]),
        )
        for i in range(len(columns["ROW_SEQ_ID"]))
    ]
    return outcomes, bool(columns["ROUND_END"].reshape(-1)[0])


def _logprob(value: object) -> dict[str, Any] | None:
    raw = bytes(value)  # type: ignore[call-overload]
    return json.loads(raw) if raw else None


def _stream_error(url: str, model: str, message: str) -> Exception:
    if is_request_fault(message):
        return RequestRejected(engine_message(message))
    return Unavailable(f"Triton at {url} failed a stream of {model}: {message}")


def _first(result: object, name: str) -> object | None:
    values = result.as_numpy(name)  # type: ignore[attr-defined]
    return None if values is None or values.size == 0 else values.reshape(-1)[0]


def _generated_chunk(result: object, top_logprobs: int | None = None) -> GeneratedChunk:
    text = result.as_numpy("text_output")  # type: ignore[attr-defined]
    finish = _first(result, "finish_reason")
    finish_reason = None if finish is None else _text(finish)
    input_tokens = _first(result, "num_input_tokens")
    output_tokens = result.as_numpy("num_output_tokens")  # type: ignore[attr-defined]
    joined = "" if text is None else "".join(_text(x) for x in text.reshape(-1))
    logprobs: tuple[dict[str, Any], ...] = ()
    raw = _first(result, _VLLM_LOGPROBS) if top_logprobs is not None else None
    if raw is not None:
        positions = json.loads(_text(raw))
        logprobs = tuple(from_vllm(positions, joined, top_logprobs or 0)) if positions else ()
    return GeneratedChunk(
        text=joined,
        output_tokens=0 if output_tokens is None else int(output_tokens.sum()),
        input_tokens=None if input_tokens is None else int(input_tokens),  # type: ignore[call-overload]
        # vLLM sends str(None) while the sequence runs.
        finish_reason=None if finish_reason in (None, "", "None") else finish_reason,
        logprobs=logprobs,
    )


def _is_final(result: object) -> bool:
    parameters = result.get_response().parameters  # type: ignore[attr-defined]
    return "triton_final_response" in parameters and parameters["triton_final_response"].bool_param


class TritonEmbedBackend(_TritonEndpoint):
    """A tensor model: TEXT [n] BYTES in, EMBEDDING [n, d] FP32 out, and optionally TOKENS [n]
    INT32 (tokens per text, reported as usage) and, with it, UNTRUNCATED_TOKENS [n] INT32 (tokens
    per text before the model's truncation: a text with more than its TOKENS is refused, see
    embed_batcher.InputTooLong); one request per micro-batch. A model that declares neither (an
    operator's own) is called as it is: no usage, and no text refused for its length."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(url, model)
        # Read from the model's metadata on the first call: an operator's model may lack TOKENS.
        self._outputs: list[str] | None = None

    async def _output_names(self) -> list[str]:
        if self._outputs is None:
            metadata = await self._client.get_model_metadata(self.model, as_json=True)
            names = {tensor["name"] for tensor in metadata.get("outputs", [])}
            counts = [name for name in (_EMBED_TOKENS, _EMBED_UNTRUNCATED) if name in names]
            self._outputs = ["EMBEDDING", *(counts if _EMBED_TOKENS in names else [])]
        return self._outputs

    async def embed(self, texts: list[str]) -> Embeddings:
        inputs = [_tensor("TEXT", np.array([t.encode() for t in texts], dtype=np.object_), "BYTES")]
        try:
            names = await self._output_names()
            result = await self._client.infer(self.model, inputs, outputs=[InferRequestedOutput(n) for n in names])
        except InferenceServerException as exc:
            raise Unavailable(f"Triton at {self.url} failed to embed with {self.model}: {exc.message()}") from exc
        tokens = result.as_numpy(_EMBED_TOKENS) if _EMBED_TOKENS in names else None
        untruncated = result.as_numpy(_EMBED_UNTRUNCATED) if _EMBED_UNTRUNCATED in names else None
        return Embeddings(np.asarray(result.as_numpy("EMBEDDING"), dtype=np.float32), tokens, untruncated)
