"""The default deadline of a request whose client set none: derived from the rolling p99s of time to
first token and time per token (and of Embed calls), propagated to the adapter as the call's
deadline, and reported as DEADLINE_EXCEEDED when it passes. A client's own deadline is untouched.

The adapter here is a real gRPC server in this process (a stand-in that streams tokens at a set
pace and can stall), so deadlines travel and fire as they do between the real services.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import adapter_stub

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_common.config import ConfigError, load_config
from sluice_common.errors import DeadlineExceeded
from sluice_common.tenants import Tenant
from sluice_gateway.path.admission import Admission
from sluice_gateway.config import ENV_PREFIX, GatewayConfig
from sluice_gateway.path.default_deadline import DefaultDeadline
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import ModelCatalog

MODEL = types_pb2.ModelInfo(name="m", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048, max_output_tokens=1024)
EMBEDDING = types_pb2.ModelInfo(name="e", kind=types_pb2.MODEL_KIND_EMBEDDING)
CEILING_S = 60.0


def policy(min_samples: int = 5) -> TimeoutPolicy:
    return TimeoutPolicy(multiplier=2.0, floor_s=0.05, ceiling_s=CEILING_S, window=100, min_samples=min_samples)


def test_the_formula_the_warm_up_and_the_censored_first_token() -> None:
    deadline = DefaultDeadline(policy(min_samples=3))
    assert deadline.for_generate(100) == CEILING_S and deadline.for_embed() == CEILING_S
    for _ in range(3):
        deadline.observe_stream(first_token_s=0.5, tokens=11, total_s=1.5)  # 0.1 s per token after the first
        deadline.observe_embed(0.2)
    assert deadline.for_generate(100) == pytest.approx(2 * (0.5 + 100 * 0.1))
    assert deadline.for_generate(10_000) == CEILING_S
    assert deadline.for_embed() == pytest.approx(0.4)
    # A stream cut off before its first token waited at least that long: the p99 rises to it.
    deadline.observe_stream(first_token_s=None, tokens=0, total_s=30.0)
    assert deadline.p99s()["ttft"] == 30.0


class StandInAdapter(inference_pb2_grpc.InferenceServiceServicer):
    """Streams `max_tokens` tokens, one per `token_s`; records the deadline each call arrived with."""

    def __init__(self, token_s: float = 0.005) -> None:
        self.token_s = token_s
        self.stalled = False
        self.deadlines: list[float | None] = []

    async def ListModels(self, request, context):  # noqa: N802 - the service's name
        return inference_pb2.ListModelsResponse(models=[MODEL, EMBEDDING])

    async def Generate(self, request, context):  # noqa: N802
        self.deadlines.append(context.time_remaining())
        if self.stalled:
            await asyncio.Event().wait()
        tokens = request.sampling.max_tokens
        for i in range(tokens):
            await asyncio.sleep(self.token_s)
            last = i == tokens - 1
            yield inference_pb2.GenerateResponse(
                text="x",
                token_count=1,
                finish_reason=types_pb2.FINISH_REASON_LENGTH if last else types_pb2.FINISH_REASON_UNSPECIFIED,
                usage=types_pb2.Usage(completion_tokens=tokens) if last else None,
            )

    async def Embed(self, request, context):  # noqa: N802
        self.deadlines.append(context.time_remaining())
        if self.stalled:
            await asyncio.Event().wait()
        await asyncio.sleep(0.01)
        return inference_pb2.EmbedResponse(embeddings=[types_pb2.Embedding(values=[1.0]) for _ in request.inputs])


@pytest.fixture
async def stand_in():
    adapter = StandInAdapter()
    async with adapter_stub(adapter) as stub:
        catalog = ModelCatalog(stub)
        await catalog.refresh()
        path = InferencePath(stub, catalog, Admission(None, "closed"), default_deadline=DefaultDeadline(policy()))
        yield adapter, path


def request(max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(model="m", prompt="hi", sampling=types_pb2.SamplingParams(max_tokens=max_tokens))


async def stream(path: InferencePath, max_tokens: int, time_remaining: float | None) -> int:
    tokens = 0
    async with path.generate(Tenant("t"), request(max_tokens), "rid", time_remaining) as chunks:
        async for chunk in chunks:
            tokens += chunk.token_count
    return tokens


def sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def test_no_client_deadline_gets_twice_the_p99s_and_a_stall_ends_there(stand_in) -> None:
    adapter, path = stand_in
    assert path.default_deadline is not None
    # Warming up: no deadline yet from the client, so the ceiling goes to the adapter.
    assert await stream(path, 10, None) == 10
    assert adapter.deadlines[-1] == pytest.approx(CEILING_S, abs=1.0)
    for _ in range(5):
        assert await stream(path, 10, 30.0) == 10  # client deadlines' streams feed the p99s too
    expected = path.default_deadline.for_generate(20)
    assert 0.05 <= expected < 2.0  # 2 x (a few ms to the first token + 20 x ~5 ms)
    p99 = path.default_deadline.p99s()
    assert sample("sluice_gateway_default_deadline_p99_seconds", {"part": "per_token"}) == pytest.approx(p99["per_token"])
    # A client's own deadline travels (less the few ms admission took).
    assert adapter.deadlines[-1] == pytest.approx(30.0, abs=0.5)

    adapter.stalled = True
    fired_before = sample("sluice_gateway_default_deadlines_exceeded_total", {"kind": "generate"})
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as raised:
        await stream(path, 20, None)
    waited = time.monotonic() - started
    # The adapter was told the default as the call's deadline, and the call ended there.
    assert adapter.deadlines[-1] == pytest.approx(expected, abs=0.05)
    assert expected * 0.9 <= waited < expected + 1.0
    assert re.match(r"the request set no deadline and ran past the gateway's default of [0-9.]+s \(2x \(the p99", str(raised.value))
    assert "after 0 tokens" in str(raised.value)
    assert sample("sluice_gateway_default_deadline_seconds", {"kind": "generate"}) == pytest.approx(expected)
    assert sample("sluice_gateway_default_deadlines_exceeded_total", {"kind": "generate"}) == fired_before + 1
    # The cut stream counts at the deadline it waited for its first token: the next deadline grows.
    assert path.default_deadline.p99s()["ttft"] >= expected * 0.9


async def test_a_stream_a_front_answered_itself_is_still_counted_at_its_default_deadline(stand_in) -> None:
    """The HTTP front answers a stream cut after it started with an error event of its own and
    hands the path a wrapper (unwrap_cause): such cuts went uncounted, and the next default did
    not grow with them."""
    import grpc

    class Answered(Exception):
        unwrap_cause = True

    adapter, path = stand_in
    assert path.default_deadline is not None
    for _ in range(5):
        assert await stream(path, 10, 30.0) == 10
    expected = path.default_deadline.for_generate(20)
    adapter.stalled = True
    fired_before = sample("sluice_gateway_default_deadlines_exceeded_total", {"kind": "generate"})
    with pytest.raises(Answered):
        async with path.generate(Tenant("t"), request(20), "rid", None) as chunks:
            try:
                [chunk async for chunk in chunks]
            except grpc.aio.AioRpcError as exc:
                raise Answered() from exc
    assert sample("sluice_gateway_default_deadlines_exceeded_total", {"kind": "generate"}) == fired_before + 1
    assert path.default_deadline.p99s()["ttft"] >= expected * 0.9


async def test_an_embed_without_a_deadline_gets_twice_the_p99_of_embeds(stand_in) -> None:
    adapter, path = stand_in
    embed = gateway_pb2.EmbedRequest(model="e", inputs=["a"])
    for _ in range(5):
        await path.embed_with_ticket(Tenant("t"), embed, "rid", None)
    expected = path.default_deadline.for_embed()
    assert 0.05 <= expected < 1.0
    adapter.stalled = True
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="set a deadline"):
        await path.embed_with_ticket(Tenant("t"), embed, "rid", None)
    assert time.monotonic() - started < expected + 1.0
    assert adapter.deadlines[-1] == pytest.approx(expected, abs=0.05)
    # With a client deadline a stall is the client's to end: the client's status, not ours.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await path.embed_with_ticket(Tenant("t"), embed, "rid", 0.2)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_settings_are_validated_naming_the_variable() -> None:
    tenants = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
    config = load_config(GatewayConfig, ENV_PREFIX, {f"{ENV_PREFIX}TENANTS_FILE": tenants})
    assert config.shared.default_deadline_policy() == TimeoutPolicy(2.0, 30.0, 3600.0, 1000, 50)
    for name, value in (("MULTIPLIER", "0.5"), ("FLOOR_S", "7200"), ("MIN_SAMPLES", "5000"), ("WINDOW", "0")):
        with pytest.raises(ConfigError, match=f"{ENV_PREFIX}DEFAULT_DEADLINE_{name}"):
            load_config(GatewayConfig, ENV_PREFIX, {f"{ENV_PREFIX}TENANTS_FILE": tenants, f"{ENV_PREFIX}DEFAULT_DEADLINE_{name}": value})
