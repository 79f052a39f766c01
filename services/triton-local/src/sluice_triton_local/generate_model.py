"""A decoupled "generate" model with the vLLM / TensorRT-LLM backend interface.

It stands for the Triton models that batch by themselves, so that the adapter's
passthrough path is tested against a real Triton:

  inputs   text_input               BYTES [1]  the prompt, already templated
           max_tokens               INT32 [1]  optional (TensorRT-LLM style)
           sampling_parameters      BYTES [1]  optional JSON: max_tokens, temperature, top_p, seed, stop (vLLM style)
           stream                   BOOL  [1]  optional; false sends one response with the whole text
           exclude_input_in_output  BOOL  [1]  optional; false prefixes the prompt, as vLLM does
  output   text_output              BYTES [1]  a text delta per response when streaming

Like vLLM it batches internally: one thread owns the running set and steps every active
sequence in one engine call; requests join and leave between steps.

A limit of this stand-in: PyTriton 0.7 does not pass Triton's request cancellation to
Python callables, so a sequence whose client closed the stream runs on to its end here;
a real vLLM backend stops it (`response_sender.is_cancelled()`). The adapter's side, closing
the stream, is the same for both.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sluice_triton_local.engine.step_engine import DecodeRow, PrefillRow, ReleaseRow, RowResult, SamplingParams
from sluice_triton_local.shared_engine import SharedEngine

OnResult = Callable[[RowResult], None]


@dataclass
class _Job:
    seq_id: int
    prompt: str
    params: SamplingParams
    on_result: OnResult


class SelfBatchingGenerator:
    """Continuous batching inside the model server, as an engine like vLLM does it."""

    def __init__(self, engine: SharedEngine, max_running: int = 8) -> None:
        self._engine = engine
        self._max_running = max_running
        # Negative ids: they can never collide with the adapter's step-protocol ids (positive).
        self._ids = itertools.count(-1, -1)
        self._incoming: queue.Queue[_Job] = queue.Queue()
        self._cancelled: set[int] = set()
        self._cancel_lock = threading.Lock()
        self._running: dict[int, _Job] = {}
        self._waiting: list[_Job] = []
        self._wake = threading.Event()
        threading.Thread(target=self._loop, name="generate-model-batcher", daemon=True).start()

    def submit(self, prompt: str, params: SamplingParams, on_result: OnResult) -> int:
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
            self._wake.clear()
            rows = self._plan()
            if not rows:
                continue
            jobs = {**self._running}
            for row, result in zip(rows, self._engine.step(rows)):
                job = jobs.get(row.seq_id)
                if job is None or isinstance(row, ReleaseRow):
                    continue
                job.on_result(result)
                if result.finish_reason:
                    del self._running[row.seq_id]

    def _plan(self) -> list[PrefillRow | DecodeRow | ReleaseRow]:
        while not self._incoming.empty():
            self._waiting.append(self._incoming.get_nowait())
        with self._cancel_lock:
            cancelled, self._cancelled = self._cancelled, set()
        rows: list[PrefillRow | DecodeRow | ReleaseRow] = []
        for seq_id in cancelled & set(self._running):
            del self._running[seq_id]
            rows.append(ReleaseRow(seq_id))
        self._waiting = [job for job in self._waiting if job.seq_id not in cancelled]
        rows.extend(DecodeRow(seq_id) for seq_id in self._running)
        while self._waiting and len(self._running) < self._max_running:
            job = self._waiting.pop(0)
            self._running[job.seq_id] = job
            rows.append(PrefillRow(job.seq_id, job.prompt, job.params))
        return rows


def _scalar(inputs: dict[str, np.ndarray], name: str, default: Any) -> Any:
    value = inputs.get(name)
    return default if value is None or value.size == 0 else value.reshape(-1)[0]


def parse_request(inputs: dict[str, np.ndarray]) -> tuple[str, SamplingParams, bool, bool]:
    prompt = bytes(_scalar(inputs, "text_input", b"")).decode()
    sampling = json.loads(bytes(_scalar(inputs, "sampling_parameters", b"{}")) or b"{}")
    seed = sampling.get("seed")
    params = SamplingParams(
        max_tokens=int(_scalar(inputs, "max_tokens", sampling.get("max_tokens", 16))),
        temperature=float(sampling.get("temperature", 0.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        seed=None if seed is None else int(seed),
        stop=tuple(sampling.get("stop", ())),
    )
    stream = bool(_scalar(inputs, "stream", False))
    exclude_input = bool(_scalar(inputs, "exclude_input_in_output", False))
    return prompt, params, stream, exclude_input


def _response(text: str) -> list[dict[str, np.ndarray]]:
    return [{"text_output": np.array([text.encode()], dtype=np.object_)}]


class GenerateModel:
    """PyTriton's decoupled inference callable: one async generator per request."""

    def __init__(self, generator: SelfBatchingGenerator) -> None:
        self._generator = generator

    async def __call__(self, requests: list[Any]) -> AsyncIterator[list[dict[str, np.ndarray]]]:
        # Without dynamic batching Triton hands a decoupled model one request per call.
        (request,) = requests
        prompt, params, stream, exclude_input = parse_request(request.data)
        loop = asyncio.get_running_loop()
        results: asyncio.Queue[RowResult] = asyncio.Queue()
        seq_id = self._generator.submit(prompt, params, lambda r: loop.call_soon_threadsafe(results.put_nowait, r))
        text = "" if exclude_input else prompt
        try:
            while True:
                result = await results.get()
                if result.finish_reason == "error":
                    raise ValueError(result.error)
                text += result.text
                if stream and text:
                    yield _response(text)
                    text = ""
                if result.finish_reason:
                    break
            if not stream:
                yield _response(text)
        finally:
            # Reached when PyTriton closes this generator (shutdown, errors).
            self._generator.cancel(seq_id)


def bind_generate_model(triton: Any, name: str, generator: SelfBatchingGenerator) -> None:
    from pytriton.model_config import ModelConfig, Tensor

    triton.bind(
        model_name=name,
        infer_func=GenerateModel(generator),
        inputs=[
            Tensor(name="text_input", dtype=bytes, shape=(1,)),
            Tensor(name="max_tokens", dtype=np.int32, shape=(1,), optional=True),
            Tensor(name="sampling_parameters", dtype=bytes, shape=(1,), optional=True),
            Tensor(name="stream", dtype=np.bool_, shape=(1,), optional=True),
            Tensor(name="exclude_input_in_output", dtype=np.bool_, shape=(1,), optional=True),
        ],
        outputs=[Tensor(name="text_output", dtype=bytes, shape=(1,))],
        config=ModelConfig(batching=False, max_batch_size=0, decoupled=True),
        strict=True,
    )
