"""sluice.inference.v1.InferenceService: thin; the scheduler does the work."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import aclosing

import grpc
import structlog
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.logprobs import token_logprob
from sluice_common.errors import Cancelled, DeadlineExceeded, InvalidArgument, NotFound, Unavailable, Unimplemented
from sluice_common.request_context import current_request_id
from sluice_common.sampling import split_field_error
from sluice_common.sampling_proto import from_proto
from sluice_common.validation import validate_generation
from sluice_inference_adapter import metrics
from sluice_inference_adapter.embedding_cache import TextEmbedder
from sluice_inference_adapter.replica_pool import Replica, ReplicaPool
from sluice_inference_adapter.sequence import Finish, FinishEvent, GenerationRequest
from sluice_inference_adapter.step_rows import Action, PromptSpec, StepBackend, StepOutcome, StepRow
from sluice_inference_adapter.step_timeout import StepTimeouts
from sluice_inference_adapter.priority import Priority

log = structlog.stdlib.get_logger("sluice.servicer")

_FINISH_REASONS = {
    Finish.STOP: types_pb2.FINISH_REASON_STOP,
    Finish.LENGTH: types_pb2.FINISH_REASON_LENGTH,
}


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        model: types_pb2.ModelInfo,
        embedding_model: types_pb2.ModelInfo | None,
        extra_models: list[types_pb2.ModelInfo] | None = None,
    ) -> None:
        self._model = model
        self._embedding_model = embedding_model
        # Generation models by name: the main one first, then SLUICE_ADAPTER_EXTRA_MODELS.
        self._models = {m.name: m for m in [model, *(extra_models or [])]}
        self._ready_pools: dict[str, ReplicaPool] = {}
        self._embedder: TextEmbedder | None = None
        self._step_timeouts: StepTimeouts | None = None
        # Set by attach: until then the models' capabilities (logprobs, token_prompts, logit_bias)
        # are not known, and ListModels answers UNAVAILABLE rather than a catalogue the gateway
        # would cache, refusing valid requests until its next refresh.
        self._attached = False

    def attach(
        self,
        pool: ReplicaPool,
        embedder: TextEmbedder | None,
        extra_pools: dict[str, ReplicaPool] | None = None,
        step_timeouts: StepTimeouts | None = None,
    ) -> None:
        """Called once Triton is ready; until then calls answer UNAVAILABLE. `embedder` is the
        cache in front of the micro-batcher (embedding_cache.CachedEmbedder); `extra_pools` serve
        the extra generation models, by name; `step_timeouts` bounds CountTokens (one step) as it
        bounds the scheduler's steps."""
        self._ready_pools = {self._model.name: pool, **(extra_pools or {})}
        self._embedder = embedder
        self._step_timeouts = step_timeouts
        self._attached = True

    def _pool_of(self, name: str) -> ReplicaPool:
        pool = self._ready_pools.get(name)
        if pool is None:
            raise Unavailable("the adapter is starting: Triton is not ready yet")
        return pool

    def _model_info(self, name: str) -> types_pb2.ModelInfo:
        model = self._models.get(name)
        if model is None:
            raise NotFound(f"unknown model {name!r}; this adapter serves {', '.join(repr(n) for n in self._models)}")
        return model

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        model = self._model_info(request.model)
        validate_generation(request.messages, request.prompt, request.sampling, model, request.prompt_token_ids)
        if request.sampling.n > 1:  # the gateway runs a request's n sequences as n calls
            raise InvalidArgument("sampling.n", f"the adapter runs one sequence per call, got n={request.sampling.n}")
        streamed = False
        async with aclosing(self._pool_of(request.model).generate(_generation_request(request, context.time_remaining()))) as events:
            async for event in events:
                if isinstance(event, FinishEvent):
                    if event.finish is Finish.ERROR and streamed:
                        # Tokens already reached the client: say so, then fail the call.
                        yield inference_pb2.GenerateResponse(finish_reason=types_pb2.FINISH_REASON_ERROR, usage=_usage(event))
                        raise Unavailable(f"the model backend failed mid-stream: {event.error}")
                    yield _final_response(event, input_field="messages" if request.messages else "prompt")  # token ids too
                    return
                streamed = True
                yield inference_pb2.GenerateResponse(
                    text=event.text, token_count=event.token_count, logprobs=[token_logprob(entry) for entry in event.logprobs]
                )

    async def ListModels(self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> inference_pb2.ListModelsResponse:
        """The models and what each supports, once Triton has said so (attach); UNAVAILABLE before."""
        if not self._attached:
            raise Unavailable("the adapter is starting: its models' capabilities are not known until Triton serves them")
        models = list(self._models.values()) + ([self._embedding_model] if self._embedding_model else [])
        return inference_pb2.ListModelsResponse(models=models)

    async def CountTokens(self, request: inference_pb2.CountTokensRequest, context: grpc.aio.ServicerContext) -> inference_pb2.CountTokensResponse:
        model = self._model_info(request.model)
        if request.prompt_token_ids:  # prefilled as given: their count is their length
            return inference_pb2.CountTokensResponse(prompt_tokens=len(request.prompt_token_ids), context_length=model.context_length)
        prompt = _prompt_spec(request.messages, request.prompt)
        pool = self._pool_of(model.name)
        replica = pool.pick(exclude=set())
        try:
            outcome = await self._count_on(pool, replica, prompt)
        except Unavailable as exc:
            # The replica failed (an error, a closed channel, the timeout): counted against it, as a
            # failed step is, and the count is asked once of another (counting is idempotent).
            pool.record(replica, ok=False)
            try:
                retry = pool.pick(exclude={replica.name})
            except Unavailable:
                raise exc from None  # no other healthy replica: the caller learns what this one did
            log.warning("count_tokens_retrying_on_another_replica", failed=replica.name, error=str(exc))
            try:
                outcome = await self._count_on(pool, retry, prompt)
            except Unavailable:
                pool.record(retry, ok=False)
                raise
        if outcome.error:
            raise InvalidArgument("messages" if request.messages else "prompt", outcome.error)
        return inference_pb2.CountTokensResponse(prompt_tokens=outcome.prompt_tokens, context_length=model.context_length)

    async def _count_on(self, pool: ReplicaPool, replica: Replica, prompt: PromptSpec) -> StepOutcome:
        """The prompt counted by one replica; UNAVAILABLE when it fails or exceeds the step timeout."""
        backend = replica.backend
        if not isinstance(backend, StepBackend):
            raise Unimplemented("CountTokens needs a step-protocol model; this one batches by itself")
        # Counting only tokenizes: a decode step's timeout bounds it.
        limit = self._step_timeouts.limit() if self._step_timeouts is not None else None
        try:
            with pool.borrowed(replica):
                async with asyncio.timeout(limit):
                    (outcome,) = await backend.step([StepRow(Action.COUNT, 0, prompt.to_json())])
        except TimeoutError:
            metrics.TIMEOUTS.labels(kind="count_tokens").inc()
            raise Unavailable(
                f"Triton replica {replica.name} did not count the prompt's tokens within the step timeout of {limit:.2f}s; retry"
            ) from None
        return outcome

    async def Embed(self, request: inference_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> inference_pb2.EmbedResponse:
        if self._embedding_model is None:
            raise Unimplemented("this adapter serves no embedding model (SLUICE_ADAPTER_TRITON_EMBEDDING_MODEL is empty)")
        if request.model != self._embedding_model.name:
            raise InvalidArgument("model", f"unknown embedding model {request.model!r}; available: {self._embedding_model.name}")
        if not request.inputs:
            raise InvalidArgument("inputs", "no texts to embed")
        truncate = _truncation(request, self._embedding_model)
        if self._embedder is None:
            raise Unavailable("the adapter is starting: Triton is not ready yet")
        # Repeated texts are computed once, cached ones never reach Triton; the vectors are the
        # caller's own copies (never views of the cache's arena), turned into protobuf here.
        result = await self._embedder.embed(list(request.inputs), _priority(request.priority_class), truncate)
        embeddings = [types_pb2.Embedding(values=row.tolist()) for row in result.vectors]
        if result.tokens is None:  # the model reports no token counts: no usage rather than a wrong one
            return inference_pb2.EmbedResponse(embeddings=embeddings)
        prompt_tokens = int(result.tokens.sum())
        usage = types_pb2.Usage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return inference_pb2.EmbedResponse(embeddings=embeddings, usage=usage)


def _prompt_spec(messages: Iterable[types_pb2.ChatMessage], prompt: str, token_ids: Iterable[int] = ()) -> PromptSpec:
    return PromptSpec(messages=tuple((m.role, m.content) for m in messages), prompt=prompt, prompt_token_ids=tuple(token_ids))


def _generation_request(request: inference_pb2.GenerateRequest, time_remaining: float | None) -> GenerationRequest:
    now = time.monotonic()  # the schedulers' clock: the call's arrival, kept across retries
    return GenerationRequest(
        request_id=request.request_id or current_request_id(),
        tenant=request.tenant,
        prompt=_prompt_spec(request.messages, request.prompt, request.prompt_token_ids),
        sampling=from_proto(request.sampling),
        priority=_priority(request.priority_class),
        deadline=None if time_remaining is None else now + time_remaining,
        arrived_at=now,
    )


def _truncation(request: inference_pb2.EmbedRequest, model: types_pb2.ModelInfo) -> bool:
    """Whether the caller asked for an input over the model's maximum to be embedded cut rather than
    refused: vLLM's truncate_prompt_tokens, of which the model can honour unset (refuse), -1 and its
    maximum input itself (cut there: the only place it cuts). Any other value is INVALID_ARGUMENT,
    one over the maximum in vLLM's words."""
    if not request.HasField("truncate_prompt_tokens"):
        return False
    value, limit = request.truncate_prompt_tokens, model.context_length
    if value == -1 or (limit > 0 and value == limit):
        return True
    field = "truncate_prompt_tokens"
    if value < -1:
        raise InvalidArgument(field, f"truncate_prompt_tokens must be -1 (the model's maximum input) or positive, got {value}")
    if limit > 0 and value > limit:
        raise InvalidArgument(
            field, f"truncate_prompt_tokens value ({value}) is greater than max_model_len ({limit}). Please, select a smaller truncation size."
        )
    maximum = f"its maximum input of {limit} tokens" if limit > 0 else "its maximum input"
    raise InvalidArgument(
        field,
        f"{model.name} can cut an input only at {maximum}, not at {value}: send -1 to have longer inputs embedded"
        " from their first tokens, or omit truncate_prompt_tokens to have them refused",
    )


def _priority(priority_class: int) -> Priority:
    """Bulk only when asked for: an unset class is a user waiting."""
    return Priority.BULK if priority_class == types_pb2.PRIORITY_CLASS_BULK else Priority.INTERACTIVE


def _final_response(event: FinishEvent, input_field: str) -> inference_pb2.GenerateResponse:
    """The last message of a stream, or the error that ends it."""
    if event.finish is Finish.INVALID:
        # The engine names the option it refused ("sampling.logit_bias: ..."); else the input is at fault.
        field_error = split_field_error(event.error)
        if field_error is not None:
            raise InvalidArgument(*field_error)
        raise InvalidArgument(input_field, event.error)
    if event.finish is Finish.DEADLINE:
        raise DeadlineExceeded(f"the deadline passed after {event.completion_tokens} generated tokens")
    if event.finish is Finish.ERROR:
        raise Unavailable(event.error or "the model backend failed")
    if event.finish is Finish.CANCELLED:
        raise Cancelled("the request was cancelled")
    t = event.timings
    timings = types_pb2.Timings(
        queue_time_ms=t.queue_s * 1000,
        time_to_first_token_ms=t.time_to_first_token_s * 1000,
        mean_inter_token_ms=t.mean_inter_token_s * 1000,
        total_time_ms=t.total_s * 1000,
    )
    return inference_pb2.GenerateResponse(finish_reason=_FINISH_REASONS[event.finish], usage=_usage(event), timings=timings)


def _usage(event: FinishEvent) -> types_pb2.Usage:
    return types_pb2.Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
        cached_tokens=event.cached_tokens,
    )
