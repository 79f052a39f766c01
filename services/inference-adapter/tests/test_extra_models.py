"""SLUICE_ADAPTER_EXTRA_MODELS: more generation models on the same replicas, each with its own pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from conftest import collect
from prometheus_client import REGISTRY
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2
from test_cached_tokens import StepResult, TritonStandIn

from sluice_common.errors import NotFound, Unavailable
from sluice_common.sampling import Sampling
from sluice_inference_adapter import metrics
from sluice_inference_adapter.__main__ import build_backends, extra_model_config, model_info
from sluice_inference_adapter.config import AdapterConfig
from sluice_inference_adapter.extra_models import ExtraModel, parse_extra_model
from sluice_inference_adapter.sequence import Finish, GenerationRequest
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.step_rows import PromptSpec
from sluice_inference_adapter.triton_backend import step_output_names


def test_entries_name_a_triton_model_and_optionally_a_batch_bound() -> None:
    assert parse_extra_model("m-q4=smollm2_q4_step:4", 32) == ExtraModel("m-q4", "smollm2_q4_step", 4, bounded=True)
    assert parse_extra_model(" m2 = other_step ", 32) == ExtraModel("m2", "other_step", 32)
    for bad in ("m-q4", "=x", "m=", "m=x:many", "m=x:0"):
        with pytest.raises(ValueError):
            parse_extra_model(bad, 32)


def test_bad_or_clashing_entries_stop_the_adapter_at_start() -> None:
    with pytest.raises(ValueError, match="EXTRA_MODELS"):
        AdapterConfig(extra_models=("m=x:zero",))
    with pytest.raises(ValueError, match="used twice"):
        AdapterConfig(extra_models=("smollm2-135m-instruct=smollm2_q4_step",))
    with pytest.raises(ValueError, match="used twice"):
        AdapterConfig(extra_models=("a=x", "a=y"))


def test_an_extra_model_runs_with_its_own_triton_model_and_bounds() -> None:
    config = AdapterConfig(max_batch_size=32, interactive_reserved_slots=1, extra_models=("m-q4=q4_step:1",))
    (extra,) = config.extra_model_list()
    own = extra_model_config(config, extra)
    assert (own.model_name, own.triton_model, own.max_batch_size) == ("m-q4", "q4_step", 1)
    # A batch of one leaves no slot to reserve for interactive traffic.
    assert own.interactive_reserved_slots == 0 and own.extra_models == ()
    assert own.context_length == config.context_length and own.triton_urls == config.triton_urls


def test_an_extra_models_bound_bounds_a_passthrough_models_streams_too() -> None:
    """On Triton's vLLM backend a model runs streams, not a batch of slots: the entry's ":N" was
    ignored there and the pool ran the main model's MAX_IN_FLIGHT streams."""
    config = AdapterConfig(max_in_flight=64, extra_models=("llama=llama_vllm:8", "other=other_vllm"))
    bounded, unbounded = (extra_model_config(config, e) for e in config.extra_model_list())
    assert bounded.max_in_flight == 8 and unbounded.max_in_flight == 64


async def test_models_are_listed_and_routed_by_name() -> None:
    config = AdapterConfig(extra_models=("m-q4=q4_step:4",))
    extra = [model_info(extra_model_config(config, e)) for e in config.extra_model_list()]
    servicer = InferenceServicer(model_info(config), None, extra)
    with pytest.raises(NotFound, match="'smollm2-135m-instruct', 'm-q4'"):
        servicer._model_info("nope")
    with pytest.raises(Unavailable, match="starting"):
        servicer._pool_of("m-q4")  # before attach: not ready yet
    servicer.attach(None, None, {"m-q4": None})  # type: ignore[arg-type, dict-item]  # listing needs no pool
    listed = await servicer.ListModels(inference_pb2.ListModelsRequest(), None)  # type: ignore[arg-type]
    assert [(m.name, m.kind) for m in listed.models] == [
        ("smollm2-135m-instruct", types_pb2.MODEL_KIND_GENERATION), ("m-q4", types_pb2.MODEL_KIND_GENERATION),
    ]  # fmt: skip


async def test_models_are_not_listed_before_their_capabilities_are_known() -> None:
    """ListModels answered as soon as the gRPC server started, before serve() had read from Triton
    whether each model reports logprobs, takes token prompts or applies logit_bias: the gateway
    cached all three as False and refused valid requests with INVALID_ARGUMENT until its next refresh."""
    config = AdapterConfig(extra_models=("m-q4=q4_step:4",))
    model = model_info(config)
    extra = [model_info(extra_model_config(config, e)) for e in config.extra_model_list()]
    servicer = InferenceServicer(model, types_pb2.ModelInfo(name="emb", kind=types_pb2.MODEL_KIND_EMBEDDING), extra)
    with pytest.raises(Unavailable, match="the adapter is starting"):
        await servicer.ListModels(inference_pb2.ListModelsRequest(), None)  # type: ignore[arg-type]
    for info in (model, *extra):  # what serve() and start_extra_pool() set once Triton answered
        info.logprobs = info.token_prompts = info.logit_bias = True
    servicer.attach(None, None, {"m-q4": None})  # type: ignore[arg-type, dict-item]
    listed = await servicer.ListModels(inference_pb2.ListModelsRequest(), None)  # type: ignore[arg-type]
    assert [m.name for m in listed.models] == ["smollm2-135m-instruct", "m-q4", "emb"]
    assert all(m.logprobs and m.token_prompts and m.logit_bias for m in listed.models[:2])


class ReadyTriton(TritonStandIn):
    """A Triton stand-in that also answers the ready checks."""

    async def is_server_ready(self, client_timeout: float | None = None) -> bool:
        return True

    async def is_model_ready(self, model: str, client_timeout: float | None = None) -> bool:
        return True


class AnsweringTriton(ReadyTriton):
    """As ReadyTriton, and each round's rows are answered at once by their own SEQ_IDs, each sequence
    finishing ("length") with its first token."""

    def stream_infer(self, requests: AsyncIterator[dict[str, Any]], stream_timeout: float | None = None) -> Any:
        class Responses:
            def __aiter__(self) -> AsyncIterator[tuple[StepResult, None]]:
                return self._responses()

            async def _responses(self) -> AsyncIterator[tuple[StepResult, None]]:
                async for request in requests:
                    (seq_ids,) = [np.frombuffer(i._get_content(), dtype=np.int64) for i in request["inputs"] if i.name() == "SEQ_ID"]
                    result = StepResult([int(seq_id) for seq_id in seq_ids], cached=None)
                    result.columns["FINISH"] = np.array([b"length"] * len(seq_ids), dtype=np.object_)
                    yield result, None

            def cancel(self) -> None:
                pass

        return Responses()


async def test_an_extra_models_backends_write_the_same_replica_series_as_its_pool() -> None:
    """Labelled with the bare address, the main and an extra model's backends on one replica wrote
    one readiness and one step-time series, and the pool's removal of "<address>#<model>" left them.
    Step times are taken by the replica's scheduler (the one place that knows which steps to time)."""
    address, label = "10.7.7.7:8001", "#m-q4"
    (backend,), make_scheduler, make_backend = build_backends(AdapterConfig(), "step", [address], label)
    for each in (backend, make_backend(address)):  # a replica listed at start-up, and one found later
        each._client = AnsweringTriton(step_output_names(set()), StepResult([5], cached=None))  # type: ignore[assignment]
        assert await each.is_ready()
        scheduler = make_scheduler(each, lambda ok: None)
        scheduler.start()
        try:
            _, finish = await asyncio.wait_for(
                collect(scheduler.submit(GenerationRequest("r", "t", PromptSpec(prompt="p"), Sampling(max_tokens=1)))), 5
            )
        finally:
            await scheduler.stop()
        assert finish.finish is Finish.LENGTH

    def sample(name: str, replica: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"replica": replica})

    assert sample("sluice_adapter_backend_ready", address + label) == 1
    assert sample("sluice_adapter_step_seconds_count", address + label) == 2
    assert sample("sluice_adapter_backend_ready", address) is None and sample("sluice_adapter_step_seconds_count", address) is None
    metrics.forget_replica(address + label, [])  # as ReplicaPool._remove does
    assert sample("sluice_adapter_backend_ready", address + label) is None
    assert sample("sluice_adapter_step_seconds_count", address + label) is None
