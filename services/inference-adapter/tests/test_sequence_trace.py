"""A sequence's spans: its life, its queue wait, an event per engine step, a span per round.

The SDK's in-memory exporter records what a real exporter would send; the scheduler runs as in
test_scheduler, against the recording step model."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import collect
from sluice_common import tracing
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from test_scheduler import RecordingStepModel, request


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("sluice"))
    return exporter


async def test_a_sampled_sequence_has_its_queue_wait_steps_and_rounds(exported: InMemorySpanExporter) -> None:
    scheduler = Scheduler(RecordingStepModel(), SchedulerLimits(max_batch_size=4))
    scheduler.start()
    try:
        with tracing.tracer().start_as_current_span("Generate") as parent:
            _, finish = await collect(scheduler.submit(request(max_tokens=3)))
        # Submitted outside any sampled span: no trace at all.
        await collect(scheduler.submit(request(max_tokens=2)))
    finally:
        await scheduler.stop()
    spans = {s.name: s for s in exported.get_finished_spans() if s.name != "triton.step_round"}
    rounds = [s for s in exported.get_finished_spans() if s.name == "triton.step_round"]
    sequence = spans["sluice.adapter.sequence"]
    assert sequence.parent is not None and sequence.parent.span_id == parent.get_span_context().span_id
    assert spans["sluice.adapter.queue_wait"].parent.span_id == sequence.context.span_id
    steps = [e for e in sequence.events if e.name == "engine.step"]
    assert [e.attributes["sluice.step.completion_tokens"] for e in steps] == [1, 2, 3]
    assert steps[-1].attributes["sluice.step.finish"] == "length"
    assert sequence.attributes["gen_ai.usage.output_tokens"] == finish.completion_tokens == 3
    assert sequence.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert rounds and all(r.parent.span_id == sequence.context.span_id for r in rounds)
    assert sum(r.attributes["sluice.round.steps"] for r in rounds) >= 3
    # Only the sampled sequence made spans: one sequence, one wait.
    assert [s.name for s in exported.get_finished_spans()].count("sluice.adapter.sequence") == 1
