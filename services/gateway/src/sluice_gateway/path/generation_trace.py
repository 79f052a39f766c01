"""The gateway's spans of one generation, named after OpenTelemetry's GenAI conventions.

`start_generation` opens the "{gen_ai.operation.name} {gen_ai.request.model}" span (e.g. "chat
smollm2-135m-instruct") around everything the path does for one Generate: the rate-limit Acquire
and Commit and the adapter call are its children (the gRPC instrumentation's CLIENT spans). The
stream's end sets the usage and the finish reason on it. It is None while tracing is off, so the
path pays one test per hook.

The span starts before the request is checked, so its name holds no model the client chose: it is
"chat _OTHER" (UNKNOWN_MODEL) until the model is known to be one of the catalog's, then "chat <model>".
Known: the adapter's final chunk came, or the call ended past the path's checks: without an error, or
with one that is not a refusal of the request (InvalidArgument, which UnknownModel is; only such a
refusal can end the call before the model is looked up in the catalog). A refused request keeps the
placeholder, its model known or not: span names stay a bounded set, the catalog's, as tracing
backends group by them. The client's name, clipped, is still `gen_ai.request.model`.
"""

from __future__ import annotations

from typing import Any

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from sluice_common import tracing
from sluice_common.errors import InvalidArgument, clip
from sluice_common.finish_reasons import finish_reason_name
from sluice_common.validation import MAX_MODEL_NAME


# OpenTelemetry's placeholder for a value outside the known set (as http.request.method's _OTHER).
UNKNOWN_MODEL = "_OTHER"


class GenerationTrace:
    __slots__ = ("_attached", "_model", "_operation", "_named")

    def __init__(self, request: gateway_pb2.GenerateRequest, tenant: str, row: tuple[str, str] | None) -> None:
        operation = "chat" if request.messages else "text_completion"
        sampling = request.sampling
        model = clip(request.model, MAX_MODEL_NAME)  # the span starts before the name is checked
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model,
            "sluice.tenant": tenant,
            # The span starts before validation: a value outside the enum is recorded as its number.
            "sluice.priority_class": _enum_name(types_pb2.PriorityClass, request.priority_class or types_pb2.PRIORITY_CLASS_INTERACTIVE),
        }
        if sampling.max_tokens:
            attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
        if sampling.HasField("temperature"):
            attributes["gen_ai.request.temperature"] = sampling.temperature
        if sampling.HasField("top_p"):
            attributes["gen_ai.request.top_p"] = sampling.top_p
        if row is not None:
            attributes["sluice.job_id"], attributes["sluice.custom_id"] = row
        self._model = model
        self._operation = operation
        self._named = False
        self._attached = tracing.AttachedSpan(f"{operation} {UNKNOWN_MODEL}", attributes)

    def model_known(self, name: str) -> None:
        """The request's model is the catalog's `name`: the span is named after it."""
        if not self._named and name == self._model:
            self._attached.span.update_name(f"{self._operation} {name}")
            self._named = True

    def finish(self, chunk: Any) -> None:
        """The adapter's final chunk: usage and finish reason."""
        self.model_known(self._model)  # the adapter served it
        span = self._attached.span
        span.set_attribute("gen_ai.response.model", self._model)
        span.set_attribute("gen_ai.response.finish_reasons", [finish_reason_name(chunk.finish_reason) if chunk.finish_reason else ""])
        if chunk.HasField("usage"):
            span.set_attribute("gen_ai.usage.input_tokens", chunk.usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", chunk.usage.completion_tokens)
            if chunk.usage.cached_tokens:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", chunk.usage.cached_tokens)
        if chunk.HasField("timings") and chunk.timings.time_to_first_token_ms:
            span.set_attribute("sluice.time_to_first_token_ms", chunk.timings.time_to_first_token_ms)

    def end(self, error: BaseException | None) -> None:
        if error is None or not isinstance(_unwrapped(error), InvalidArgument):
            self.model_known(self._model)  # past the path's checks: the catalog's model
        self._attached.end(error)


def start_generation(request: gateway_pb2.GenerateRequest, tenant: str, row: tuple[str, str] | None = None) -> GenerationTrace | None:
    return GenerationTrace(request, tenant, row) if tracing.enabled() else None


def instrument_http_front() -> None:
    """The aiohttp-server instrumentation on the HTTP front (a SERVER span per request, the client's
    `traceparent` header honoured), while tracing is on. Its documented use: `instrument()` before
    the web.Application is made (it adds its middleware to every Application made after)."""
    if not tracing.enabled():
        return
    from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

    instrumentor = AioHttpServerInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


def _unwrapped(error: BaseException) -> BaseException:
    """The failure itself, out of a front's wrapper (an HTTP stream's StreamAnswered: unwrap_cause)."""
    if getattr(error, "unwrap_cause", False) and error.__cause__ is not None:
        return error.__cause__
    return error


def _enum_name(enum: Any, value: int) -> str:
    return enum.Name(value) if value in enum.values() else str(value)
