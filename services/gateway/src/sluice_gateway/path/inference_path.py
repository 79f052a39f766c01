"""The one path every Generate and Embed takes, from any front: validate, admit, call, track.

The gRPC servicer (interactive streams), the job worker (bulk rows) and the OpenAI-compatible HTTP
front all go through here, so every request gets exactly the same defaults, validation, rate-limit
admission, adapter call and CompletionEvent; only its priority class and how its front reports
the end differ. No front wires those itself.

    async with path.generate(tenant, request, request_id, time_remaining, when_closed=...) as stream:
        stream.ticket.metadata          # x-ratelimit-* headers of the lease
        async for chunk in stream:      # sluice.inference.v1.GenerateResponse
            ...
    # the adapter call is cancelled and the lease settled on the way out, whatever happened

n > 1 (SamplingParams.n): the path opens n adapter calls of n = 1, choice i seeded seed + i
(sluice_common.sampling.choice_seed), sent at once so that the engine finds their identical prompts
in one step and prefills it once (its siblings copy the KV; a later one reuses the live prefix).
The stream yields the calls' chunks as they come, `stream.index` telling each one's choice; a
choice's final chunk carries its finish_reason, and only the last one's carries usage and timings,
for the whole request: the prompt once (the first choice's count and cached tokens, the fewest of
any choice) plus every choice's completion tokens, as OpenAI counts them. One lease covers all:
admission reserves the prompt plus n x max_tokens, settled when the last choice ends.

Several prompts (the OpenAI front's prompt lists): `generate` takes a list of requests, the same but
for their prompt, and answers them as one, as vLLM's OpenAI server does: prompt i's choice j is
adapter call and `stream.index` i x n + j (seeded seed + j, as for one prompt); one lease reserves
every prompt plus P x n x max_tokens; the usage counts each prompt once and every choice's
completion tokens. This is the one fan-out: gRPC's Generate takes one prompt.

    reply, ticket = await path.embed_with_ticket(tenant, request, request_id, time_remaining)

Each stream keeps one account of itself, a StreamRecord (stream_record.py) made at its arrival and
updated once per chunk: its timings (one clock), completion tokens, final usage, text and final chunk.
The lease's commit, the CompletionEvent and the default deadline's p99s all read it. The
CompletionEvent (when events are on) is built from it and published:
- `when_closed` given (gRPC): when the front reports that its client's stream has closed, with the
  status it closed with (the servicer passes the call context's done-callback);
- `row` given (a bulk row: job id, custom id): when the row's final chunk arrives; a failed attempt
  publishes nothing (the worker retries it, and a row's failure is reported in the job's results);
- neither (HTTP): when the `async with` ends, with the status of the exception that ended it.
A request refused before the stream (validation, admission) is published too, as an error.

Defaults, the same on every front: max_tokens omitted (0) becomes the model's remaining context
after the prompt, capped by SLUICE_GATEWAY_DEFAULT_MAX_TOKENS and the model's max_output_tokens
(the cap alone when the prompt could not be counted: the backend then decides, as below).

Embed takes a lease exactly as Generate does (one request, the inputs' estimated tokens) and
commits the reply's usage, or the estimate when the adapter call failed.

A prompt that cannot fit the model's context is refused (INVALID_ARGUMENT) before any lease is
taken: no wait can admit it, so it must not be answered RESOURCE_EXHAUSTED "retry after" nor be
retried as a job row. The estimate (bytes / 3) over-counts, so only a request whose estimate does
not fit is counted exactly, by the adapter's CountTokens; a model that cannot count (Triton's
vLLM backend) refuses it itself, which the adapter also reports as INVALID_ARGUMENT, and so does
any model when CountTokens failed (the estimate never refuses a prompt).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from prometheus_client import Counter, Gauge
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.channels import wait_for_replica
from sluice_common.errors import ContextLengthExceeded, DeadlineExceeded, InvalidArgument, SluiceError
from sluice_common.prompt_tokens import prompt_token_bound
from sluice_common.sampling import choice_seed
from sluice_common.sampling_proto import structured_outputs_to_proto
from sluice_common.request_context import outgoing_metadata
from sluice_common.validation import validate_embedding, validate_generation, validate_priority_class, validate_recorded
from sluice_gateway.path.admission import (
    Admission, Ticket, combined, embedding_reservation, generation_reservation, message_pairs,
)  # fmt: skip
from sluice_gateway.path.completion_events import CompletionEvents, CompletionTracker
from sluice_gateway.path.default_deadline import DefaultDeadline
from sluice_gateway.path.generation_trace import start_generation
from sluice_gateway.path.model_catalog import ModelCatalog
from sluice_gateway.path.stream_record import StreamRecord
from sluice_gateway.path.tool_calls import ToolCallParser, ToolPlan, check_chat, plan, render
from sluice_common.tenants import Tenant

# max_tokens when a request omits it and no configuration says otherwise (SLUICE_GATEWAY_DEFAULT_MAX_TOKENS).
DEFAULT_MAX_TOKENS = 1024
# The longest a call waits for an adapter replica to call (the channel reconnects within 2 s).
REPLICA_WAIT_S = 5.0

DEFAULT_DEADLINE = Gauge(
    "sluice_gateway_default_deadline_seconds",
    "The deadline last given to a request whose client set none, by kind (generate: it grows with max_tokens;"
    " embed): multiplier x the rolling p99s of sluice_gateway_default_deadline_p99_seconds, within floor and ceiling.",
    ["kind"],
)
DEADLINE_P99 = Gauge(
    "sluice_gateway_default_deadline_p99_seconds",
    "The rolling p99s default deadlines come from: ttft (arrival to first token), per_token (per output token after"
    " the first), embed (a whole Embed call); absent until observed.",
    ["part"],
)
DEFAULT_DEADLINES_EXCEEDED = Counter(
    "sluice_gateway_default_deadlines_exceeded_total",
    "Requests without a client deadline that the gateway's default deadline ended (DEADLINE_EXCEEDED), by kind.",
    ["kind"],
)

# How a front tells the path that its client's stream has closed: it is handed a callback
# `(status code or None, cancelled)` and calls it once, at the very end.
WhenClosed = Callable[[Callable[[Any, bool], None]], None]


def _unwrapped(exc: BaseException) -> BaseException:
    """The failure itself, out of a front's wrapper around a failure it has already answered."""
    if getattr(exc, "unwrap_cause", False) and exc.__cause__ is not None:
        return exc.__cause__
    return exc


def status_of(exc: BaseException | None) -> tuple[Any, bool]:
    """(gRPC status code, cancelled) of the exception that ended a stream; (None, False) when none."""
    if exc is None:
        return None, False
    exc = _unwrapped(exc)
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED, True
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.code() == grpc.StatusCode.CANCELLED
    if isinstance(exc, SluiceError):
        return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.UNKNOWN), False
    return grpc.StatusCode.UNKNOWN, False


@dataclass
class GenerateStream:
    """An admitted adapter stream (n of them merged for n > 1); iterating it updates the stream's
    record with each chunk (stream_record.py), which the lease's commit, the CompletionEvent
    (choice 0's text, the request's usage) and the default deadline read."""

    ticket: Ticket
    call: Any
    # The one account of the stream: its timings, tokens, text and final chunk (the ticket's too).
    record: StreamRecord
    # Called once, when the request's final chunk has come (a bulk row publishes its event then).
    on_end: Callable[[], None] | None = None
    # Every adapter call of the request (choice i is calls[i]); empty: `call` alone.
    calls: list[Any] = field(default_factory=list)
    # The choice (0..n-1; with several prompts, prompt i's choice j is i x n + j) of the chunk the
    # iteration yielded last.
    index: int = 0
    # n: the calls are consecutive groups of n choices, one group per prompt.
    choices_per_prompt: int = 0
    finished: bool = False
    trace: Any = None  # generation_trace.GenerationTrace while tracing is on
    # The request's tools: each choice's text parsed for calls (the client sees the calls, the
    # CompletionEvent the text the model wrote).
    tools: ToolPlan | None = None
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)

    def tool_calls(self, index: int) -> list[types_pb2.ToolCall]:
        """The calls choice `index` made, once its last chunk has been yielded."""
        parser = self._parsers.get(index)
        return [] if parser is None else parser.calls

    def _for_client(self, index: int, chunk: Any) -> Any:
        if self.tools is None:
            return chunk
        parser = self._parsers.setdefault(index, self.tools.parser())
        shown = type(chunk)()
        shown.CopyFrom(chunk)
        shown.text = parser.feed(chunk.text)
        if chunk.finish_reason:
            rest, shown.finish_reason = parser.finish(chunk.finish_reason)
            shown.text += rest
        return shown

    def timing(self, cut: bool = False) -> tuple[float | None, int, float]:
        """The record's (first token, tokens, total) seconds from arrival: StreamRecord.timing."""
        return self.record.timing(cut)

    async def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateResponse]:
        choices = _Choices(len(self.calls), self.choices_per_prompt or len(self.calls)) if len(self.calls) > 1 else None
        async for index, chunk in _merge(self.calls) if choices is not None else _single(self.call):
            if choices is not None:
                chunk = choices.final(index, chunk) if chunk.finish_reason else chunk
            done = bool(chunk.finish_reason) and (choices is None or choices.left == 0)
            # The event records choice 0's text, all of it (its final chunk's too, whichever choice ends the request).
            self.record.observe(chunk, text=chunk.text if index == 0 else "", done=done)
            self.finished |= done
            if done and self.trace is not None:
                self.trace.finish(chunk)
            self.index = index
            if done:
                # Committed, and answered, before the client hears the end (Ticket.settle_before_end).
                await self.ticket.settle_before_end()
                if self.on_end is not None:
                    self.on_end()
            yield self._for_client(index, chunk)


async def _single(call: Any) -> AsyncIterator[tuple[int, Any]]:
    async for chunk in call:
        yield 0, chunk


async def _merge(calls: list[Any]) -> AsyncIterator[tuple[int, Any]]:
    """The calls' chunks as they arrive, tagged with their call's index; the first failure ends it."""
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, call: Any) -> None:
        try:
            async for chunk in call:
                queue.put_nowait((index, chunk, None))
        except BaseException as exc:  # noqa: BLE001  # handed to the reader, which raises it
            queue.put_nowait((index, None, exc))
            return
        queue.put_nowait((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, call)) for i, call in enumerate(calls)]
    running = len(tasks)
    try:
        while running:
            index, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
                continue
            yield index, chunk
    finally:
        for task in tasks:
            task.cancel()


class _Choices:
    """The choices' final chunks: usage and timings only on the last, counting the request (each
    prompt once: choices `per_prompt` at a time share one)."""

    def __init__(self, count: int, per_prompt: int) -> None:
        self.left = count
        self._per_prompt = per_prompt
        self._usages: dict[int, types_pb2.Usage] = {}

    def final(self, index: int, chunk: Any) -> Any:
        self.left -= 1
        if chunk.HasField("usage"):
            self._usages[index] = chunk.usage
        merged = type(chunk)()
        merged.CopyFrom(chunk)
        merged.ClearField("usage")
        if self.left:
            merged.ClearField("timings")
            return merged
        if self._usages:
            prompts: dict[int, list[types_pb2.Usage]] = {}
            for index, usage in self._usages.items():
                prompts.setdefault(index // self._per_prompt, []).append(usage)
            # A prompt's choices prefill it alike: its count once, and the fewest cached of any.
            prompt = sum(group[0].prompt_tokens for group in prompts.values())
            cached = sum(min(u.cached_tokens for u in group) for group in prompts.values())
            completion = sum(u.completion_tokens for u in self._usages.values())
            merged.usage.CopyFrom(types_pb2.Usage(
                prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion, cached_tokens=cached,
            ))  # fmt: skip
        return merged


class InferencePath:
    def __init__(
        self,
        adapter: inference_pb2_grpc.InferenceServiceStub,
        models: ModelCatalog,
        admission: Admission,
        completion_events: CompletionEvents | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        default_deadline: DefaultDeadline | None = None,
        adapter_channel: grpc.aio.Channel | None = None,
    ) -> None:
        self.adapter = adapter
        # The stub's channel: a call waits (briefly) for a replica to call instead of failing at once.
        self.adapter_channel = adapter_channel
        self.models = models
        self.admission = admission
        self.completion_events = completion_events
        self.default_max_tokens = default_max_tokens
        # The deadline of a request whose client set none (None: such a request has no deadline).
        self.default_deadline = default_deadline

    async def _adapter_replica(self, time_remaining: float | None) -> None:
        """Between one adapter's restart and the next, the channel may have no replica to call for
        up to its reconnect backoff: the call waits that out (within its deadline) rather than fail."""
        if self.adapter_channel is not None:
            await wait_for_replica(self.adapter_channel, min(REPLICA_WAIT_S, time_remaining or REPLICA_WAIT_S))

    def validate_generate(self, request: gateway_pb2.GenerateRequest) -> None:
        validate_generation(request.messages, request.prompt, request.sampling, self.models.get(request.model), request.prompt_token_ids)
        validate_priority_class(request.priority_class)
        validate_recorded(request.user, request.metadata, request.client_request_id)

    @contextlib.asynccontextmanager
    async def generate(
        self,
        tenant: Tenant,
        request: gateway_pb2.GenerateRequest | list[gateway_pb2.GenerateRequest],
        request_id: str,
        time_remaining: float | None,
        *,
        when_closed: WhenClosed | None = None,
        row: tuple[str, str] | None = None,
    ) -> AsyncIterator[GenerateStream]:
        """Defaults, validates, takes a lease (or raises RESOURCE_EXHAUSTED / UNAVAILABLE), opens the
        adapter stream, and tracks the CompletionEvent (see the module's docstring). A list: several
        prompts answered as one (the first stands for the request in the event and the trace)."""
        requests = request if isinstance(request, list) else [request]
        request = requests[0]
        span = start_generation(request, tenant.name, row)  # first: the tracker keeps its context
        events = self.completion_events if self.completion_events is not None and self.completion_events.enabled else None
        # The stream's one account, from its arrival: the commit, the event and the deadlines read it.
        record = StreamRecord(keep_text=events is not None and tenant.text_logging)
        arrived_at = record.arrived_at
        tracker = None if events is None else CompletionTracker(events, tenant, request, request_id, record)
        on_end = None
        if events is not None and tracker is not None and row is not None:
            tracker.job_id, tracker.custom_id = row

            def on_end() -> None:
                events.submit(tracker.build(None))

        elif tracker is not None and when_closed is not None:
            when_closed(lambda code, cancelled: tracker.publish(code, cancelled))
        ended: BaseException | None = None
        default_s: float | None = None
        if time_remaining is None and self.default_deadline is not None:
            # max_tokens omitted: the most the defaults below can give it (a longer deadline, not a shorter one).
            default_s = time_remaining = self.default_deadline.for_generate(request.sampling.max_tokens or self.default_max_tokens)
            DEFAULT_DEADLINE.labels(kind="generate").set(default_s)
        given_s = time_remaining  # the whole call's, from its arrival
        try:
            tools = use_tools(request)  # chats only: a prompt list is a completion's
            reservations = []
            for one in requests:
                counted = await self.apply_defaults(one, time_remaining)
                self.validate_generate(one)
                if span is not None:  # the catalog knows it: the span may be named after it
                    span.model_known(one.model)
                counted = await self.check_context(one, time_remaining, counted)
                reservations.append(generation_reservation(one, counted))
            n = max(1, request.sampling.n)
            downstream = [
                inference_pb2.GenerateRequest(
                    request_id=request_id,
                    tenant=tenant.name,
                    model=one.model,
                    messages=one.messages,
                    prompt=one.prompt,
                    prompt_token_ids=one.prompt_token_ids,
                    sampling=_choice_sampling(one.sampling, index),
                    priority_class=one.priority_class,
                )
                for one in requests
                for index in range(n)
            ]
            # A lease from rate-limit (or RESOURCE_EXHAUSTED / UNAVAILABLE); settled in `finally`,
            # also when the call is cancelled (a deadline, a client gone) while it waits for a replica.
            ticket = await self.admission.admit(tenant.name, combined(reservations), _left(arrived_at, given_s), record)
            calls: list[Any] = []
            try:
                # The caller's deadline bounds the adapter's work; cancelling this call stops it there.
                await self._adapter_replica(_left(arrived_at, given_s))
                time_remaining = _left(arrived_at, given_s)  # counting, admission and the wait are spent
                calls = [self.adapter.Generate(d, timeout=time_remaining, metadata=outgoing_metadata()) for d in downstream]
                stream = GenerateStream(ticket, calls[0], record, on_end, calls=calls, trace=span, tools=tools, choices_per_prompt=n)
                yield stream
            except Exception as exc:
                failure = _unwrapped(exc)
                if default_s is None or not isinstance(failure, grpc.aio.AioRpcError) or failure.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                self._observe_stream(stream, cut=True)
                DEFAULT_DEADLINES_EXCEEDED.labels(kind="generate").inc()
                if failure is not exc:
                    raise  # a front that has answered it already (an HTTP stream's error event)
                raise DeadlineExceeded(
                    f"the request set no deadline and ran past the gateway's default of {default_s:.1f}s"
                    f" ({self._basis('generate', request.sampling.max_tokens)}) after {record.tokens} tokens;"
                    " set a deadline (gRPC timeout) to choose your own"
                ) from exc
            else:
                if stream.finished:
                    self._observe_stream(stream, cut=False)
            finally:
                for call in calls:
                    call.cancel()
                ticket.settle()
        except BaseException as exc:
            ended = exc
            raise
        finally:
            if tracker is not None and row is None and when_closed is None:
                tracker.publish(*status_of(ended))
            if span is not None:
                span.end(ended)

    def _observe_stream(self, stream: GenerateStream, cut: bool) -> None:
        if self.default_deadline is None:
            return
        self.default_deadline.observe_stream(*stream.record.timing(cut))
        self._publish_p99s()

    def _publish_p99s(self) -> None:
        assert self.default_deadline is not None
        for part, value in self.default_deadline.p99s().items():
            if value is not None:
                DEADLINE_P99.labels(part=part).set(value)

    def _basis(self, kind: str, max_tokens: int = 0) -> str:
        assert self.default_deadline is not None
        policy = self.default_deadline.policy
        p99 = self.default_deadline.p99s()
        if kind == "generate":
            if p99["ttft"] is None or p99["per_token"] is None:
                return f"the ceiling, until {policy.min_samples} requests have been seen"
            figure = f"the p99 time to first token {p99['ttft']:.2f}s + {max_tokens} max tokens x the p99 per token {p99['per_token']:.3f}s"
        else:
            if p99["embed"] is None:
                return f"the ceiling, until {policy.min_samples} requests have been seen"
            figure = f"the p99 Embed time {p99['embed']:.2f}s"
        return f"{policy.multiplier:g}x ({figure}), within [{policy.floor_s:g}s, {policy.ceiling_s:g}s]"

    async def apply_defaults(self, request: gateway_pb2.GenerateRequest, time_remaining: float | None) -> int | None:
        """max_tokens omitted (0): the model's remaining context after the prompt, capped by the
        configured default and the model's max_output_tokens. The prompt is counted exactly (the
        adapter's CountTokens) only when its bound (prompt_token_bound) says the cap may not fit;
        that count is returned (None when there was none) for check_context to reuse. Without a
        count (the model cannot count, or counting failed) it is the cap. A request that
        asks for a JSON object (response_format) and sets no constraint of its own is constrained to
        one: enforced while decoding, on every front, not only scored afterwards."""
        if request.response_format == types_pb2.RESPONSE_FORMAT_JSON_OBJECT and not request.sampling.HasField("structured_outputs"):
            request.sampling.structured_outputs.json_object = True
        if request.sampling.max_tokens != 0:
            return None
        model = self.models.get(request.model)
        cap = min(self.default_max_tokens, model.max_output_tokens or self.default_max_tokens)
        context_length = model.context_length
        if not context_length or _bound(request) + cap <= context_length:
            request.sampling.max_tokens = cap
            return None
        counted = await self._count(request, time_remaining)
        if counted is None:
            # No count (a model that cannot count, or CountTokens failed, transiently too): nothing is
            # known of the prompt, so nothing is refused or cut on a guess. The estimate (bytes / 3)
            # is no token count: it refused prompts that fit, quoting itself as their length, and cut
            # max_tokens short. The cap it is, and the backend decides, as check_context lets it.
            request.sampling.max_tokens = cap
            return None
        remaining = context_length - counted
        if remaining <= 0:
            raise ContextLengthExceeded("messages" if request.messages else "prompt", context_length, counted, None)
        request.sampling.max_tokens = min(cap, remaining)
        return counted

    async def _count(self, request: gateway_pb2.GenerateRequest, time_remaining: float | None) -> int | None:
        """The prompt's exact length by the adapter's CountTokens; None when the model cannot count."""
        count = inference_pb2.CountTokensRequest(
            model=request.model, messages=request.messages, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids
        )
        try:
            await self._adapter_replica(time_remaining)
            reply = await self.adapter.CountTokens(count, timeout=time_remaining, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument("messages" if request.messages else "prompt", exc.details() or "") from exc
            return None
        return int(reply.prompt_tokens)

    async def check_context(self, request: gateway_pb2.GenerateRequest, time_remaining: float | None, prompt_tokens: int | None = None) -> int | None:
        """INVALID_ARGUMENT when the prompt plus max_tokens cannot fit the model's context.
        `prompt_tokens`: the prompt's exact length when already counted (no second CountTokens).
        Returns the exact count when there is one (None when the bound fits: nothing was counted)."""
        context_length = self.models.get(request.model).context_length
        max_tokens = request.sampling.max_tokens
        if not context_length or _bound(request) + max_tokens <= context_length:
            return prompt_tokens
        if prompt_tokens is None:
            prompt_tokens = await self._count(request, time_remaining)
        if prompt_tokens is None:
            return None  # the model cannot count (or the adapter failed): the generation call decides
        if prompt_tokens + max_tokens > context_length:
            raise ContextLengthExceeded("messages" if request.messages else "prompt", context_length, prompt_tokens, max_tokens)
        return prompt_tokens

    async def embed_with_ticket(
        self, tenant: Tenant, request: gateway_pb2.EmbedRequest, request_id: str, time_remaining: float | None
    ) -> tuple[gateway_pb2.EmbedResponse, Ticket]:
        """Validates, takes a lease (or raises RESOURCE_EXHAUSTED / UNAVAILABLE), calls the adapter;
        the ticket carries the lease's x-ratelimit-* headers and requests-per-minute limit."""
        self.models.get(request.model, types_pb2.MODEL_KIND_EMBEDDING)
        validate_embedding(request.inputs)
        validate_priority_class(request.priority_class)
        validate_recorded("", {}, request.client_request_id)
        downstream = inference_pb2.EmbedRequest(
            request_id=request_id,
            tenant=tenant.name,
            model=request.model,
            inputs=request.inputs,
            priority_class=request.priority_class,
            # vLLM's opt-in to truncation, as the client set it (or not): the adapter knows the
            # model's maximum input and refuses a value it cannot honour.
            truncate_prompt_tokens=request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
        )
        arrived_at = time.monotonic()
        default_s: float | None = None
        if time_remaining is None and self.default_deadline is not None:
            default_s = time_remaining = self.default_deadline.for_embed()
            DEFAULT_DEADLINE.labels(kind="embed").set(default_s)
        given_s = time_remaining  # the whole call's, from its arrival
        ticket = await self.admission.admit(tenant.name, embedding_reservation(request), time_remaining)
        try:
            try:
                await self._adapter_replica(_left(arrived_at, given_s))
                reply = await self.adapter.Embed(downstream, timeout=_left(arrived_at, given_s), metadata=outgoing_metadata())
            except grpc.aio.AioRpcError as exc:
                if default_s is None or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED or self.default_deadline is None:
                    raise
                self.default_deadline.observe_embed(default_s)  # it took at least that long
                DEFAULT_DEADLINES_EXCEEDED.labels(kind="embed").inc()
                raise DeadlineExceeded(
                    f"the request set no deadline and ran past the gateway's default of {default_s:.1f}s"
                    f" ({self._basis('embed')}); set a deadline (gRPC timeout) to choose your own"
                ) from exc
            if self.default_deadline is not None:
                self.default_deadline.observe_embed(time.monotonic() - arrived_at)
                self._publish_p99s()
            if reply.HasField("usage"):
                ticket.record(reply.usage)
        finally:
            # The real usage refunds the rest of the reservation; a failed call commits the estimate.
            ticket.settle()
        # usage only when the model counted: the unset field handed over would read as 0 tokens.
        usage = reply.usage if reply.HasField("usage") else None
        response = gateway_pb2.EmbedResponse(request_id=request_id, model=request.model, embeddings=reply.embeddings, usage=usage)
        return response, ticket


def _left(arrived_at: float, given_s: float | None) -> float | None:
    """What is left of a call's deadline (None: it has none) for its next hop."""
    return None if given_s is None else max(0.001, arrived_at + given_s - time.monotonic())


def use_tools(request: gateway_pb2.GenerateRequest) -> ToolPlan | None:
    """Renders the chat's tools and tool turns into the turns the engine takes (tool_calls.py) and
    constrains decoding to the calls tool_choice asks for; the plan parses the answer back."""
    tool_plan = plan(request.tool_use, request.sampling) if request.HasField("tool_use") else None
    if tool_plan is not None or any(m.role == "tool" or m.tool_calls for m in request.messages):
        check_chat(request.messages)
        rendered = render(request.messages, tool_plan)
        del request.messages[:]
        request.messages.extend(rendered)
    constraint = tool_plan.constraint() if tool_plan is not None else None
    if constraint is not None:
        request.sampling.structured_outputs.CopyFrom(structured_outputs_to_proto(constraint))
    return tool_plan


def _choice_sampling(sampling: types_pb2.SamplingParams, index: int) -> types_pb2.SamplingParams:
    """Choice `index`'s options: n = 1 (the adapter runs one sequence per call), seed + index."""
    if not sampling.HasField("n"):
        return sampling
    choice = types_pb2.SamplingParams()
    choice.CopyFrom(sampling)
    choice.ClearField("n")
    if sampling.HasField("seed"):
        choice.seed = choice_seed(sampling.seed, index)  # type: ignore[assignment]
    return choice


def _bound(request: gateway_pb2.GenerateRequest) -> int:
    return prompt_token_bound(message_pairs(request), request.prompt, request.prompt_token_ids)
