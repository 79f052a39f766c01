"""Token log-probabilities from the step model's LOGPROBS output to the adapter's GenerateResponse,
requested only from a model that declares it; n > 1 is the gateway's, refused here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.logprobs import token_logprob
from sluice_common.sampling import Sampling
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.step_rows import Action, PromptSpec, StepRow
from sluice_inference_adapter.triton_backend import TritonStepBackend, _step_outcomes, step_output_names
from test_cached_tokens import StepResult, TritonStandIn

ENTRY = {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris"), "top_logprobs": [
    {"token": " Paris", "logprob": -0.25, "bytes": list(b" Paris")}, {"token": " Lyon", "logprob": -2.5, "bytes": list(b" Lyon")},
]}  # fmt: skip


def with_logprobs(result: StepResult, entries: list[dict | None]) -> StepResult:
    result.columns["LOGPROBS"] = np.array([json.dumps(e).encode() if e else b"" for e in entries], dtype=np.object_)
    return result


def test_each_row_carries_its_tokens_logprobs_or_none() -> None:
    outcomes, _ = _step_outcomes(with_logprobs(StepResult([1, 2], cached=None), [ENTRY, None]))
    assert outcomes[0].logprobs == ENTRY and outcomes[1].logprobs is None
    outcomes, _ = _step_outcomes(StepResult([1], cached=None))  # not requested: none
    assert outcomes[0].logprobs is None


def test_logprobs_is_requested_only_from_a_model_that_declares_it() -> None:
    base = step_output_names(set())
    assert step_output_names({"LOGPROBS"}) == [*base, "LOGPROBS"]
    assert step_output_names({"CACHED_TOKENS", "LOGPROBS"}) == [*base, "CACHED_TOKENS", "LOGPROBS"]


async def test_a_step_backend_reports_logprobs_when_declared() -> None:
    backend = TritonStepBackend("127.0.0.1:1", "smollm2_step")
    stand_in = TritonStandIn(step_output_names({"LOGPROBS"}), with_logprobs(StepResult([5], cached=None), [ENTRY]))
    backend._client = stand_in  # type: ignore[assignment]
    (outcome,) = await backend.step([StepRow(Action.PREFILL, 5, PromptSpec(prompt="p").to_json(Sampling(max_tokens=1, logprobs=1)))])
    assert outcome.logprobs == ENTRY and stand_in.requested[0][-1] == "LOGPROBS"


def test_the_entry_becomes_the_proto() -> None:
    message = token_logprob(ENTRY)
    assert (message.token, message.logprob, message.bytes) == (" Paris", -0.25, b" Paris")
    assert [(t.token, t.logprob, t.bytes) for t in message.top_logprobs] == [(" Paris", -0.25, b" Paris"), (" Lyon", -2.5, b" Lyon")]


class Context:
    def time_remaining(self) -> float | None:
        return None


async def test_n_above_one_is_refused_naming_it() -> None:
    model = types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048, max_output_tokens=512, logprobs=True)
    servicer = InferenceServicer(model, None)
    request = inference_pb2.GenerateRequest(model="gen", prompt="x", sampling=types_pb2.SamplingParams(max_tokens=3, n=2))
    with pytest.raises(InvalidArgument) as caught:
        [r async for r in servicer.Generate(request, Context())]  # type: ignore[arg-type]
    assert caught.value.field_name == "sampling.n"
