"""A sequence's spans: its life, its queue wait, an event per engine step, a span per round.

The SDK's in-memory exporter records what a real exporter would send; the scheduler runs as in
test_scheduler, against the recording step model."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from opentelemetry.trace import StatusCode

from conftest import StepReplica, collect
from sluice_common import tracing
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.sequence import Finish
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


async def test_a_round_that_failed_ends_its_span_in_error(exported: InMemorySpanExporter) -> None:
    """The round's CLIENT span ended OK while its request failed (or timed out) and ended every
    sequence in it: a trace showed a failed sequence under a round that had not failed."""
    model = StepReplica("triton-a:8001")
    model.failing = True
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4), replica="traced-failing")
    scheduler.start()
    try:
        with tracing.tracer().start_as_current_span("Generate"):
            _, finish = await collect(scheduler.submit(request(max_tokens=3)))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.ERROR
    (round_span,) = [s for s in exported.get_finished_spans() if s.name == "triton.step_round"]
    assert round_span.status.status_code is StatusCode.ERROR and "is down" in (round_span.status.description or "")
    (sequence,) = [s for s in exported.get_finished_spans() if s.name == "sluice.adapter.sequence"]
    assert sequence.status.status_code is StatusCode.ERROR  # its backend failed it: an error, retried or not


async def test_a_round_that_answered_ends_its_span_without_error(exported: InMemorySpanExporter) -> None:
    scheduler = Scheduler(RecordingStepModel(), SchedulerLimits(max_batch_size=4))
    scheduler.start()
    try:
        with tracing.tracer().start_as_current_span("Generate"):
            await collect(scheduler.submit(request(max_tokens=2)))
    finally:
        await scheduler.stop()
    rounds = [s for s in exported.get_finished_spans() if s.name == "triton.step_round"]
    assert rounds and all(r.status.status_code is StatusCode.UNSET for r in rounds)


async def test_a_sequence_handed_back_by_a_drain_ends_its_span_without_error(exported: InMemorySpanExporter) -> None:
    """A drain re-routes what waits on the replica: no failure, though the replica pool sees an
    ERROR finish it retries. The span said ERROR, counted among failed requests; the re-route is
    an event and an attribute instead."""
    scheduler = Scheduler(StepReplica("leaving"), SchedulerLimits(), replica="traced-leaving")
    scheduler.drain()
    with tracing.tracer().start_as_current_span("Generate"):
        handle = scheduler.submit(request())
    _, finish = await collect(handle)
    assert finish.finish is Finish.ERROR and handle.backend_failed  # the pool retries it elsewhere
    (sequence,) = [s for s in exported.get_finished_spans() if s.name == "sluice.adapter.sequence"]
    assert sequence.status.status_code is StatusCode.UNSET
    assert sequence.attributes["sluice.handed_back"] is True
    (event,) = [e for e in sequence.events if e.name == "sluice.handed_back"]
    assert "draining" in event.attributes["sluice.reason"]
    (wait,) = [s for s in exported.get_finished_spans() if s.name == "sluice.adapter.queue_wait"]
    assert wait.attributes["sluice.admitted"] is False
