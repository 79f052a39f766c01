"""The gateway's trace data: the GenAI generation span (the trace id `sluice logs` prints: cli/tests/test_output_lines.py)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common import tracing
from sluice_common.errors import InvalidArgument, ResourceExhausted, clip
from sluice_common.validation import MAX_MODEL_NAME
from sluice_gateway.path.generation_trace import UNKNOWN_MODEL, start_generation
from sluice_gateway.path.model_catalog import UnknownModel


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("sluice"))
    return exporter


def test_no_span_while_tracing_is_off() -> None:
    assert start_generation(gateway_pb2.GenerateRequest(model="m", prompt="p"), "demo") is None


def test_the_generation_span_has_the_genai_attributes(exported: InMemorySpanExporter) -> None:
    request = gateway_pb2.GenerateRequest(
        model="smollm2-135m-instruct",
        messages=[types_pb2.ChatMessage(role="user", content="hi")],
        sampling=types_pb2.SamplingParams(max_tokens=16, temperature=0.5),
    )
    generation = start_generation(request, "demo", ("job-1", "row-1"))
    assert generation is not None
    final = inference_pb2.GenerateResponse(
        finish_reason=types_pb2.FINISH_REASON_STOP, usage=types_pb2.Usage(prompt_tokens=9, completion_tokens=4, cached_tokens=8)
    )
    generation.finish(final)
    generation.end(None)
    (span,) = exported.get_finished_spans()
    assert span.name == "chat smollm2-135m-instruct"
    assert dict(span.attributes) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "smollm2-135m-instruct",
        "gen_ai.request.max_tokens": 16,
        "gen_ai.request.temperature": 0.5,
        "sluice.tenant": "demo",
        "sluice.priority_class": "PRIORITY_CLASS_INTERACTIVE",
        "sluice.job_id": "job-1",
        "sluice.custom_id": "row-1",
        "gen_ai.response.model": "smollm2-135m-instruct",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 9,
        "gen_ai.usage.output_tokens": 4,
        "gen_ai.usage.cache_read.input_tokens": 8,
    }


def test_a_failed_generation_ends_in_error(exported: InMemorySpanExporter) -> None:
    generation = start_generation(gateway_pb2.GenerateRequest(model="m", prompt="p"), "demo")
    assert generation is not None
    generation.end(RuntimeError("boom"))
    (span,) = exported.get_finished_spans()
    assert span.name == "text_completion m" and not span.status.is_ok
    assert span.attributes["error.type"] == "RuntimeError"


def test_a_model_not_known_to_be_the_catalogs_is_no_part_of_the_span_name(exported: InMemorySpanExporter) -> None:
    """The span starts before the request is checked: its name held whatever model the client sent
    (only clipped), a span name per made-up model. A call refused by the checks (an unknown model,
    or any InvalidArgument: it may come before the model is looked up) keeps the placeholder; a call
    that got past them (any other end) is named after its model. The client's name stays an attribute."""
    made_up = "x" * 300
    chat = [types_pb2.ChatMessage(role="user", content="hi")]
    for error in (UnknownModel("model", "unknown generation model"), InvalidArgument("tool_use.tools", "bad")):
        generation = start_generation(gateway_pb2.GenerateRequest(model=made_up, messages=chat), "demo")
        assert generation is not None
        generation.end(error)
    generation = start_generation(gateway_pb2.GenerateRequest(model="smollm2", messages=chat), "demo")
    assert generation is not None
    generation.end(ResourceExhausted("rate limit exceeded"))  # refused by rate-limit, after the checks
    names = [span.name for span in exported.get_finished_spans()]
    assert names == [f"chat {UNKNOWN_MODEL}", "chat _OTHER", "chat smollm2"]
    assert exported.get_finished_spans()[0].attributes["gen_ai.request.model"] == clip(made_up, MAX_MODEL_NAME)  # as before: clipped
