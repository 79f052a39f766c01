"""A stand-in for a model behind Triton's vLLM backend, on the step engine (no GPU here).

It declares exactly the interface the upstream backend declares (vllm_backend's
`auto_complete_config`: its inputs, outputs, types, shapes, max_batch_size 0 and the decoupled
transaction policy; kept as tests/fixtures/upstream/vllm_backend_interface.json and checked in
tests), and answers as the backend does:

  - `sampling_parameters` JSON with vLLM's SamplingParams names and defaults (max_tokens 16,
    temperature 1.0; top_p, top_k, min_p, presence_penalty, frequency_penalty,
    repetition_penalty, logit_bias, seed, stop: Sluice's Sampling has the same names);
    `stream`; `exclude_input_in_output` (streaming with it false is refused,
    as upstream refuses it);
  - the additional outputs on every response when asked: finish_reason (str(None) while
    running, then "stop" or "length"), num_input_tokens, num_output_tokens (tokens since the
    previous response), logprobs (vLLM's per-token {id: {logprob, rank, decoded_token}} JSON,
    null unless sampling_parameters asked for logprobs);
  - a prompt longer than the model's context is refused with vLLM's own message, wrapped as
    the backend wraps every error ("Error generating stream: ..."); max_tokens past the context
    is cut there, ending with "length", as vLLM's scheduler does.

Like vLLM it batches internally: one thread owns the running set and steps every active
sequence in one engine call; requests join and leave between steps. It shares the engine with
the step model, so its prefills carry an owner (the model's name) as the adapters' do: a prefill
turned away for want of a slot is first in line for the next one freed, and keeps asking
(every _FULL_RETRY_S) until it has it, running sequences or not.

A limit of this stand-in: PyTriton 0.7 does not pass Triton's request cancellation to
Python callables, so a sequence whose client closed the stream runs on to its end here;
the vLLM backend aborts it (`response_sender.is_cancelled()`). The adapter's side, closing
the stream, is the same for both.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sluice_common.sampling import Sampling
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult, TokenLogprob
from sluice_triton_local.shared_engine import SharedEngine

OnResult = Callable[[RowResult], object]
# Standard logging: Triton's image runs this module without structlog (triton-local renders it).
log = logging.getLogger("sluice.triton_local.generate")
_FULL_RETRY_S = 0.05


@dataclass
class _Job:
    seq_id: int
    prompt: str
    params: Sampling
    on_result: OnResult


class SelfBatchingGenerator:
    """Continuous batching inside the model server, as an engine like vLLM does it."""

    def __init__(self, engine: SharedEngine, max_running: int = 8, owner: str = "generate") -> None:
        self.engine = engine
        self._max_running = max_running
        self._owner = owner
        # Negative ids: they can never collide with the adapter's step-protocol ids (positive).
        self._ids = itertools.count(-1, -1)
        self._incoming: queue.Queue[_Job] = queue.Queue()
        self._cancelled: set[int] = set()
        self._cancel_lock = threading.Lock()
        self._running: dict[int, _Job] = {}
        self._waiting: list[_Job] = []
        # Sequences a failed step left in the engine's hands, or not: released at the next step.
        self._abandoned: set[int] = set()
        self._wake = threading.Event()
        # When a prefill last found the engine full (None: it did not): the next try waits
        # _FULL_RETRY_S, or a sequence of ours ending.
        self._full_at: float | None = None
        threading.Thread(target=self._loop, name="generate-model-batcher", daemon=True).start()

    def submit(self, prompt: str, params: Sampling, on_result: OnResult) -> int:
        job = _Job(next(self._ids), prompt, params, on_result)
        self._incoming.put(job)
        self._wake.set()
        return job.seq_id

    def cancel(self, seq_id: int) -> None:
        with self._cancel_lock:
            self._cancelled.add(seq_id)
        self._wake.set()

    def _loop(self) -> None:
        while True:
            if not self._running and not self._waiting and self._incoming.empty():
                self._wake.wait()
            elif self._full_at is not None and not self._running:
                # Others' sequences fill the shared engine: try again shortly, not in a busy loop.
                self._wake.wait(_FULL_RETRY_S)
            self._wake.clear()
            rows = self._plan()
            if rows:
                self._step(rows)

    def _step(self, rows: list[PrefillRow | DecodeRow | ReleaseRow]) -> None:
        """One engine step for the running sequences. A fault answers every one of them with an error
        (the thread goes on: every later request waits on it)."""
        jobs = {**self._running}
        try:
            results = self.engine.step(rows)
        except Exception as exc:
            log.exception("generate_step_failed: %d sequences answered with the error", len(jobs))
            self._fail(jobs, f"engine step failed: {exc!r}")
            return
        for row, result in zip(rows, results):
            job = jobs.get(row.seq_id)
            if job is None or isinstance(row, ReleaseRow):
                continue
            if result.finish_reason in ("busy", "stale"):  # the shared engine is full: wait for a slot
                del self._running[row.seq_id]
                self._waiting.insert(0, job)
                self._full_at = time.monotonic()
                continue
            if isinstance(row, PrefillRow):
                self._full_at = None  # it found a slot
            _answer(job, result)
            if result.finish_reason:
                del self._running[row.seq_id]
                self._full_at = None

    def _fail(self, jobs: dict[int, _Job], message: str) -> None:
        """Ends these jobs with an error; whatever of their sequences the engine holds is released
        at the next step."""
        for seq_id, job in jobs.items():
            self._running.pop(seq_id, None)
            self._abandoned.add(seq_id)
            _answer(job, RowResult(seq_id, -1, "", "error", 0, 0, error=message))
        self._wake.set()  # the releases go now, not with the next request

    def _plan(self) -> list[PrefillRow | DecodeRow | ReleaseRow]:
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get_nowait())
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        rows: list[PrefillRow | DecodeRow | ReleaseRow] = [ReleaseRow(seq_id) for seq_id in self._abandoned]
        self._abandoned.clear()
        for seq_id in cancelled & set(self._running):
            del self._running[seq_id]
            rows.append(ReleaseRow(seq_id))
        self._waiting = [job for job in self._waiting if job.seq_id not in cancelled]
        rows.extend(DecodeRow(seq_id) for seq_id in self._running)
        while self._waiting and len(self._running) < self._max_running and self._may_prefill():
            job = self._waiting.pop(0)
            self._running[job.seq_id] = job
            rows.append(PrefillRow(job.seq_id, job.prompt, job.params, owner=self._owner))
        return rows

    def _may_prefill(self) -> bool:
        """Not while the engine was full moments ago; but ask again soon, even while sequences of
        ours run: an owner that stops asking loses its place in the engine's line for slots."""
        return self._full_at is None or time.monotonic() - self._full_at >= _FULL_RETRY_S


def _answer(job: _Job, result: RowResult) -> None:
    """Hands a result to its request; a request that cannot take it (its event loop closed) is its
    own loss, not the batcher's."""
    try:
        job.on_result(result)
    except Exception:
        log.exception("generate_result_undelivered: seq_id %d", job.seq_id)


def _scalar(inputs: dict[str, np.ndarray], name: str, default: Any) -> Any:
    value = inputs.get(name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0]


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    params: Sampling
    stream: bool
    prepend_input: bool
    # The additional outputs asked for (return_finish_reason -> "finish_reason", ...).
    outputs: frozenset[str]


_RETURN_FLAGS = {
    "return_finish_reason": "finish_reason",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
    "return_logprobs": "logprobs",
}


def parse_request(inputs: dict[str, np.ndarray]) -> GenerateRequest:
    """The backend's reading of a request; raises ValueError with vLLM's words where it refuses one."""
    prompt = bytes(_scalar(inputs, "text_input", b"")).decode()
    sampling = json.loads(bytes(_scalar(inputs, "sampling_parameters", b"{}")) or b"{}")
    # As the backend, None values are dropped so that vLLM's defaults apply to them.
    params = Sampling.from_json({**VLLM_DEFAULTS, **{k: v for k, v in sampling.items() if v is not None}})
    _verify(params)
    stream = bool(_scalar(inputs, "stream", False))
    exclude = inputs.get("exclude_input_in_output")
    prepend_input = not bool(_scalar(inputs, "exclude_input_in_output", False)) if exclude is not None else not stream
    if prepend_input and stream:
        raise ValueError("When streaming, `exclude_input_in_output` = False is not allowed.")
    outputs = frozenset(out for flag, out in _RETURN_FLAGS.items() if bool(_scalar(inputs, flag, False)))
    return GenerateRequest(prompt, params, stream, prepend_input, outputs)


# vLLM's SamplingParams defaults where they differ from Sluice's (vllm/sampling_params.py).
VLLM_DEFAULTS = {"max_tokens": 16, "temperature": 1.0}


def _verify(params: Sampling) -> None:
    """vLLM's SamplingParams checks, in its words (SamplingParams._verify_args)."""
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}.")
    if params.temperature < 0.0:
        raise ValueError(f"temperature must be non-negative, got {params.temperature}.")
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}.")
    if params.top_k < 0:
        raise ValueError(f"top_k must be 0 (disable), or at least 1, got {params.top_k}.")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}.")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}.")
    if params.repetition_penalty <= 0.0:
        raise ValueError(f"repetition_penalty must be greater than zero, got {params.repetition_penalty}.")


def verify_vocabulary(params: Sampling, vocab_size: int) -> None:
    """vLLM's check of logit_bias's ids (vllm/v1/engine/processor.py, Processor._validate_logit_bias)."""
    invalid = [token for token, _ in params.logit_bias if token < 0 or token >= vocab_size]
    if invalid:
        raise ValueError(f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}")


def fit_to_context(request: GenerateRequest, prompt_tokens: int, context_length: int) -> Sampling:
    """vLLM refuses a prompt longer than the context and stops a sequence at its end."""
    if prompt_tokens == 0:
        raise ValueError("The decoder prompt cannot be empty")
    if prompt_tokens > context_length:
        raise ValueError(
            f"The decoder prompt (length {prompt_tokens}) is longer than the maximum model length of"
            f" {context_length}. Make sure that `max_model_len` is no smaller than the number of text tokens."
        )
    return replace(request.params, max_tokens=min(request.params.max_tokens, context_length - prompt_tokens))


@dataclass
class _Progress:
    """What the responses so far have told the client."""

    prompt_tokens: int
    reported_tokens: int = 0


def vllm_logprobs(entries: list[TokenLogprob] | None) -> bytes:
    """The backend's `logprobs` output for the tokens of one response (vllm_backend
    src/utils/request.py): JSON null when the request asked for none, else one object per token,
    {"<token id>": {"logprob", "rank", "decoded_token"}}, holding the sampled token and the most
    likely ones (vLLM's Logprob objects of that position)."""
    if entries is None:
        return b"null"
    positions = []
    for entry in entries:
        position = {
            str(top.token_id): {"logprob": top.logprob, "rank": rank, "decoded_token": top.token} for rank, top in enumerate(entry.top_logprobs, 1)
        }
        position.setdefault(str(entry.token_id), {"logprob": entry.logprob, "rank": entry.rank, "decoded_token": entry.token})
        positions.append(position)
    return json.dumps(positions).encode()


def _response(
    text: str, result: RowResult, progress: _Progress, outputs: frozenset[str], logprobs: list[TokenLogprob] | None = None
) -> dict[str, np.ndarray]:
    response = {"text_output": np.array([text.encode()], dtype=np.object_)}
    if "logprobs" in outputs:
        response["logprobs"] = np.array([vllm_logprobs(logprobs)], dtype=np.object_)
    if "finish_reason" in outputs:
        response["finish_reason"] = np.array([str(result.finish_reason or None).encode()], dtype=np.object_)
    if "num_input_tokens" in outputs:
        response["num_input_tokens"] = np.array([progress.prompt_tokens], dtype=np.uint32)
    if "num_output_tokens" in outputs:
        response["num_output_tokens"] = np.array([result.completion_tokens - progress.reported_tokens], dtype=np.uint32)
    progress.reported_tokens = result.completion_tokens
    return response


class GenerateModel:
    """PyTriton's decoupled inference callable: one async generator per request."""

    def __init__(self, generator: SelfBatchingGenerator) -> None:
        self._generator = generator
        self._engine = generator.engine

    async def __call__(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        # Without dynamic batching Triton hands a decoupled model one request per call.
        (request,) = requests
        try:
            parsed = parse_request(request.data)
            verify_vocabulary(parsed.params, self._engine.vocab_size)
            prompt_tokens = self._engine.count_tokens(parsed.prompt)
            params = fit_to_context(parsed, prompt_tokens, self._engine.context_length)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"Error generating stream: {exc}") from None
        progress = _Progress(prompt_tokens)
        if params.max_tokens == 0:  # the prompt fills the context: nothing can be generated
            yield [_response("", RowResult(0, -1, "", "length", prompt_tokens, 0), progress, parsed.outputs)]
            return
        async for response in self._generate(parsed, params, progress):
            yield [response]

    async def _generate(self, request: GenerateRequest, params: Sampling, progress: _Progress) -> AsyncIterator[dict[str, np.ndarray]]:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[RowResult] = asyncio.Queue()
        seq_id = self._generator.submit(request.prompt, params, lambda r: loop.call_soon_threadsafe(results.put_nowait, r))
        text = request.prompt if request.prepend_input else ""
        # The tokens' log-probabilities since the last response; None when the request asked none.
        logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        try:
            while True:
                result = await results.get()
                if result.finish_reason in ("error", "invalid"):
                    raise ValueError(f"Error generating stream: {result.error}")
                text += result.text
                if logprobs is not None and result.logprobs is not None:
                    logprobs.append(result.logprobs)
                if request.stream and (text or result.finish_reason):
                    yield _response(text, result, progress, request.outputs, logprobs)
                    text, logprobs = "", None if logprobs is None else []
                if result.finish_reason:
                    break
            if not request.stream:
                yield _response(text, result, progress, request.outputs, logprobs)
        finally:
            # Reached when PyTriton closes this generator (shutdown, errors).
            self._generator.cancel(seq_id)


# The upstream backend's interface (vllm_backend src/model.py, _auto_complete_inputs_and_outputs).
VLLM_INPUTS: tuple[tuple[str, type, tuple[int, ...]], ...] = (
    ("text_input", bytes, (1,)),
    ("image", bytes, (-1,)),
    ("stream", np.bool_, (1,)),
    ("sampling_parameters", bytes, (1,)),
    ("exclude_input_in_output", np.bool_, (1,)),
    ("return_finish_reason", np.bool_, (1,)),
    ("return_cumulative_logprob", np.bool_, (1,)),
    ("return_logprobs", np.bool_, (1,)),
    ("return_num_input_tokens", np.bool_, (1,)),
    ("return_num_output_tokens", np.bool_, (1,)),
    ("embedding_request", bytes, (1,)),
)
VLLM_OUTPUTS: tuple[tuple[str, type, tuple[int, ...]], ...] = (
    ("text_output", bytes, (-1,)),
    ("finish_reason", bytes, (-1,)),
    ("cumulative_logprob", np.float32, (-1,)),
    ("logprobs", bytes, (-1,)),
    ("num_input_tokens", np.uint32, (1,)),
    ("num_output_tokens", np.uint32, (-1,)),
)


def bind_generate_model(triton: Any, name: str, generator: SelfBatchingGenerator) -> None:
    from pytriton.model_config import ModelConfig, Tensor

    triton.bind(
        model_name=name,
        infer_func=GenerateModel(generator),
        # Every input but text_input is optional upstream.
        inputs=[Tensor(name=n, dtype=t, shape=s, optional=n != "text_input") for n, t, s in VLLM_INPUTS],
        outputs=[Tensor(name=n, dtype=t, shape=s) for n, t, s in VLLM_OUTPUTS],
        config=ModelConfig(batching=False, max_batch_size=0, decoupled=True),
        strict=True,
    )
