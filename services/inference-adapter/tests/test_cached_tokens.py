"""Prompt tokens served from the engine's prefix cache, from Triton's CACHED_TOKENS output to the
usage of the adapter's GenerateResponse (issue 24, "Usage says what was reused").

The Triton client is replaced by a stand-in that answers model metadata and one step's tensors as
tritonclient's InferResult does (`as_numpy`, None for an output not in the response); the real
engine is covered in tests/e2e/test_prefix_cache_usage.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from conftest import StepReplica, collect
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.sampling import Sampling
from sluice_inference_adapter.generated_chunk import GeneratedChunk
from sluice_inference_adapter.passthrough import PassthroughLimits, PassthroughScheduler
from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.sequence import GenerationRequest
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.step_rows import Action, PromptSpec, StepRow
from sluice_inference_adapter.triton_backend import TritonStepBackend, _step_outcomes, step_output_names

VLLM_INTERFACE = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())


class StepResult:
    """One response of a round, as tritonclient's InferResult reads it."""

    def __init__(self, seq_ids: list[int], cached: list[int] | None, last: bool = True) -> None:
        n = len(seq_ids)
        self.columns: dict[str, np.ndarray] = {
            "ROW_SEQ_ID": np.array(seq_ids, dtype=np.int64),
            "TOKEN_ID": np.arange(n, dtype=np.int32),
            "TEXT": np.array([b"x"] * n, dtype=np.object_),
            "FINISH": np.array([b""] * n, dtype=np.object_),
            "PROMPT_TOKENS": np.full(n, 40, dtype=np.int32),
            "COMPLETION_TOKENS": np.ones(n, dtype=np.int32),
            "ERROR": np.array([b""] * n, dtype=np.object_),
            "ROUND_END": np.array([last]),
        }
        if cached is not None:
            self.columns["CACHED_TOKENS"] = np.array(cached, dtype=np.int32)

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.columns.get(name)


class TritonStandIn:
    """The parts of tritonclient.grpc.aio.InferenceServerClient a step backend uses."""

    def __init__(self, outputs: list[str], result: StepResult) -> None:
        self.outputs = outputs
        self.result = result
        self.metadata_calls = 0
        self.requested: list[list[str]] = []

    async def get_model_metadata(self, model: str, as_json: bool = False) -> dict[str, Any]:
        self.metadata_calls += 1
        return {"name": model, "outputs": [{"name": name} for name in self.outputs]}

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]], stream_timeout: float | None = None) -> Any:
        stand_in = self

        class Responses:
            def __aiter__(self) -> AsyncIterator[tuple[StepResult, None]]:
                return self._responses()

            async def _responses(self) -> AsyncIterator[tuple[StepResult, None]]:
                async for request in requests:
                    stand_in.requested.append([output.name() for output in request["outputs"]])
                    yield stand_in.result, None

            def cancel(self) -> None:
                pass

        return Responses()


def test_each_row_carries_its_sequences_cached_tokens() -> None:
    outcomes, last = _step_outcomes(StepResult([7, 8, 9], cached=[32, 0, 39]))
    assert last and [(o.seq_id, o.prompt_tokens, o.cached_tokens) for o in outcomes] == [(7, 40, 32), (8, 40, 0), (9, 40, 39)]


def test_a_response_without_cached_tokens_reports_none_cached() -> None:
    outcomes, _ = _step_outcomes(StepResult([7, 8], cached=None))
    assert [o.cached_tokens for o in outcomes] == [0, 0] and [o.prompt_tokens for o in outcomes] == [40, 40]


def test_cached_tokens_is_requested_only_from_a_model_that_declares_it() -> None:
    base = ["ROW_SEQ_ID", "TOKEN_ID", "TEXT", "FINISH", "PROMPT_TOKENS", "COMPLETION_TOKENS", "ERROR", "ROUND_END"]
    assert step_output_names({*base, "CACHED_TOKENS"}) == [*base, "CACHED_TOKENS"]
    # Triton refuses a request for an output its model lacks: an engine from before the prefix
    # cache would fail every step.
    assert step_output_names(set(base)) == base


async def test_a_step_backend_reads_the_models_outputs_once_and_reports_cached_tokens() -> None:
    backend = TritonStepBackend("127.0.0.1:1", "smollm2_step")
    stand_in = TritonStandIn(step_output_names({"CACHED_TOKENS"}), StepResult([5], cached=[31]))
    backend._client = stand_in  # type: ignore[assignment]
    row = StepRow(Action.PREFILL, 5, PromptSpec(prompt="p").to_json(Sampling(max_tokens=1)))
    (first,) = await backend.step([row])
    (second,) = await backend.step([row])
    assert first.cached_tokens == second.cached_tokens == 31
    assert stand_in.metadata_calls == 1
    assert all(requested[-1] == "CACHED_TOKENS" for requested in stand_in.requested) and len(stand_in.requested) == 2

    older = TritonStepBackend("127.0.0.1:1", "smollm2_step")
    older._client = TritonStandIn(step_output_names(set()), StepResult([5], cached=None))  # type: ignore[assignment]
    (outcome,) = await older.step([row])
    assert outcome.cached_tokens == 0 and "CACHED_TOKENS" not in older._client.requested[0]  # type: ignore[attr-defined]


class Context:
    def time_remaining(self) -> float | None:
        return None


async def generate(servicer: InferenceServicer, content: str) -> inference_pb2.GenerateResponse:
    request = inference_pb2.GenerateRequest(
        model="gen",
        tenant="t",
        messages=[types_pb2.ChatMessage(role="system", content=content), types_pb2.ChatMessage(role="user", content="hi")],
        sampling=types_pb2.SamplingParams(max_tokens=3),
    )
    responses = [response async for response in servicer.Generate(request, Context())]  # type: ignore[arg-type]
    return responses[-1]


async def test_the_generate_usage_says_how_many_prompt_tokens_the_engine_took_from_its_cache() -> None:
    replica = StepReplica("a")
    pool = ReplicaPool([replica], lambda backend, on_step: Scheduler(backend, SchedulerLimits(), on_step=on_step), 2, 0.05)
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048, max_output_tokens=512)
    servicer = InferenceServicer(model, None)
    servicer.attach(pool, None)
    await pool.probe_once()  # proven, as the adapter's replicas are before it serves
    pool.start()
    try:
        first = await generate(servicer, "a long system prompt")
        again = await generate(servicer, "a long system prompt")
        other = await generate(servicer, "another system prompt")
    finally:
        await pool.stop()
    assert first.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert (first.usage.prompt_tokens, first.usage.cached_tokens, first.usage.total_tokens) == (2, 0, 5)
    # The same prompt again: all but its last token from the engine's prefix cache, still counted
    # as prompt tokens.
    assert (again.usage.prompt_tokens, again.usage.cached_tokens, again.usage.total_tokens) == (2, 1, 5)
    assert other.usage.cached_tokens == 0


def test_the_vllm_backend_reports_no_cached_tokens() -> None:
    """Why the passthrough reports 0: upstream's additional outputs have no cached-token count. When a
    newer fixture has one, read it in triton_backend._generated_chunk and change this test."""
    outputs = {tensor["name"] for tensor in VLLM_INTERFACE["outputs"]}
    assert outputs == {"text_output", "finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens", "num_output_tokens"}


async def test_the_passthrough_reports_no_cached_tokens() -> None:
    class Engine:
        async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
            await asyncio.sleep(0)
            yield GeneratedChunk("a", 1, 9, "length")

    scheduler = PassthroughScheduler(Engine(), PassthroughLimits(), lambda prompt: prompt.prompt)  # type: ignore[arg-type]
    scheduler.start()
    try:
        for _ in range(2):  # the same prompt twice: vLLM may have cached it, but does not say
            _, finish = await collect(scheduler.submit(GenerationRequest("r", "t", PromptSpec(prompt="p"), Sampling(max_tokens=1))))
            assert (finish.prompt_tokens, finish.cached_tokens) == (9, 0)
    finally:
        await scheduler.stop()
