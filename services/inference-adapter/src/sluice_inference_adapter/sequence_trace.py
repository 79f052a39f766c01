"""A sequence's life in the scheduler as trace data, without a span per token.

Per sampled sequence: a "sluice.adapter.sequence" span from its arrival in the waiting queue to its
end (child of the adapter's Generate server span), a "sluice.adapter.queue_wait" child span until
the engine took its prefill, and an "engine.step" event on the sequence span for every engine step
it took part in. Per round of steps (one Triton request): a "triton.step_round" CLIENT span, in the
trace of the round's first sampled sequence and linked to the others, since one request serves
sequences of many traces.

Only sequences whose request is sampled carry a trace (`start` answers None otherwise, and while
tracing is off), so the scheduler's loop pays one `is None` test per hook for the rest.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind

from sluice_common import tracing

T = TypeVar("T")


class SequenceTrace:
    __slots__ = ("span", "_queue_span")

    def __init__(self, request: Any) -> None:
        tracer = tracing.tracer()
        self.span = tracer.start_span(
            "sluice.adapter.sequence",
            attributes={
                "sluice.request_id": request.request_id,
                "sluice.tenant": request.tenant,
                "sluice.priority_class": request.priority.name.lower(),
                "gen_ai.request.max_tokens": request.sampling.max_tokens,
            },
        )
        self._queue_span: Span | None = tracer.start_span("sluice.adapter.queue_wait", context=trace.set_span_in_context(self.span))

    def admitted(self) -> None:
        """The engine took its prefill: the queue wait is over."""
        if self._queue_span is not None:
            self._queue_span.end()
            self._queue_span = None

    def step(self, batch_size: int, completion_tokens: int, finish: str) -> None:
        attributes: dict[str, Any] = {"sluice.step.batch_size": batch_size, "sluice.step.completion_tokens": completion_tokens}
        if finish:
            attributes["sluice.step.finish"] = finish
        self.span.add_event("engine.step", attributes)

    def finish(self, finish: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int, error: str) -> None:
        if self._queue_span is not None:  # it never got a slot (cancelled or expired while waiting)
            self._queue_span.set_attribute("sluice.admitted", False)
            self.admitted()
        self.span.set_attribute("gen_ai.response.finish_reasons", [finish])
        self.span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
        self.span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
        if cached_tokens:
            self.span.set_attribute("gen_ai.usage.cache_read.input_tokens", cached_tokens)
        if error:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error[:200]))
        self.span.end()

    def handed_back(self, reason: str) -> None:
        """It never started on this replica and goes to another (a drain): the span ends without an
        error status, the re-route kept as an event and an attribute (the retry's own sequence span
        follows under the same Generate span)."""
        if self._queue_span is not None:
            self._queue_span.set_attribute("sluice.admitted", False)
            self.admitted()
        self.span.set_attribute("sluice.handed_back", True)
        self.span.add_event("sluice.handed_back", {"sluice.reason": reason[:200]})
        self.span.end()


def start(request: Any) -> SequenceTrace | None:
    """A trace for a sequence submitted now (from its Generate call's task), when it is sampled."""
    if not tracing.enabled() or not trace.get_current_span().is_recording():
        return None
    return SequenceTrace(request)


def start_round(traces: Iterable[SequenceTrace | None], rows: int, steps: int, replica: str) -> Span | None:
    """The span of one Triton request (a round of `steps` engine steps), or None when no sequence
    in it is sampled."""
    sampled = [t for t in traces if t is not None]
    if not sampled:
        return None
    return tracing.tracer().start_span(
        "triton.step_round",
        context=trace.set_span_in_context(sampled[0].span),
        kind=SpanKind.CLIENT,
        links=[Link(t.span.get_span_context()) for t in sampled[1:]],
        attributes={"sluice.round.rows": rows, "sluice.round.steps": steps, "sluice.replica": replica, "rpc.system": "grpc"},
    )


def end_round(span: Span | None, error: str = "") -> None:
    """Ends a round's span; `error`: the round failed or timed out (its sequences ended with it)."""
    if span is not None:
        if error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, error[:200]))
        span.end()


async def traced_request(sequence: SequenceTrace | None, request: Awaitable[T], backend: Any) -> T:
    """Awaits one sequence's own request to a self-batching backend (passthrough: Triton's vLLM
    backend) inside a "triton.generate" CLIENT span under the sequence's span."""
    if sequence is None:
        return await request
    span = tracing.tracer().start_span(
        "triton.generate", context=trace.set_span_in_context(sequence.span), kind=SpanKind.CLIENT,
        attributes={"rpc.system": "grpc", "sluice.triton_model": str(getattr(backend, "model", ""))},
    )  # fmt: skip
    try:
        return await request
    except BaseException as error:
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
        raise
    finally:
        span.end()
