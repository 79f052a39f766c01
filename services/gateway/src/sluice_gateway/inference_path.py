"""The one path every Generate and Embed takes, interactive or bulk: validate, admit, call the adapter.

The gRPC servicer (interactive streams) and the job worker (bulk rows) both go through here, so a
bulk row gets exactly the validation, rate-limit admission and adapter call an interactive request
gets; only its priority class differs.

    async with path.generate(tenant, request, request_id, time_remaining) as stream:
        stream.ticket.metadata          # x-ratelimit-* headers of the lease
        async for chunk in stream:      # sluice.inference.v1.GenerateResponse
            ...
    # the adapter call is cancelled and the lease settled on the way out, whatever happened

    reply, ticket = await path.embed_with_ticket(tenant, request, request_id, time_remaining)

Embed takes a lease exactly as Generate does (one request, the inputs' estimated tokens) and
commits the reply's usage, or the estimate when the adapter call failed.

A prompt that cannot fit the model's context is refused (INVALID_ARGUMENT) before any lease is
taken: no wait can admit it, so it must not be answered RESOURCE_EXHAUSTED "retry after" nor be
retried as a job row. The estimate (bytes / 3) over-counts, so only a request whose estimate does
not fit is counted exactly, by the adapter's CountTokens; a model that cannot count (Triton's
vLLM backend) refuses it itself, which the adapter also reports as INVALID_ARGUMENT.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.errors import InvalidArgument
from sluice_common.request_context import outgoing_metadata
from sluice_common.validation import validate_embedding, validate_generation
from sluice_gateway.admission import Admission, Ticket, embedding_reservation, estimate_prompt_tokens, generation_reservation
from sluice_gateway.model_catalog import ModelCatalog


@dataclass
class GenerateStream:
    """An admitted adapter stream; iterating it records each chunk's usage on the ticket."""

    ticket: Ticket
    call: Any

    async def __aiter__(self) -> AsyncIterator[inference_pb2.GenerateResponse]:
        async for chunk in self.call:
            self.ticket.observe(chunk)
            yield chunk


class InferencePath:
    def __init__(self, adapter: inference_pb2_grpc.InferenceServiceStub, models: ModelCatalog, admission: Admission) -> None:
        self.adapter = adapter
        self.models = models
        self.admission = admission

    def validate_generate(self, request: gateway_pb2.GenerateRequest) -> None:
        validate_generation(request.messages, request.prompt, request.sampling, self.models.get(request.model))

    @contextlib.asynccontextmanager
    async def generate(
        self, tenant: str, request: gateway_pb2.GenerateRequest, request_id: str, time_remaining: float | None
    ) -> AsyncIterator[GenerateStream]:
        """Validates, takes a lease (or raises RESOURCE_EXHAUSTED / UNAVAILABLE), opens the adapter stream."""
        self.validate_generate(request)
        await self.check_context(request, time_remaining)
        downstream = inference_pb2.GenerateRequest(
            request_id=request_id,
            tenant=tenant,
            model=request.model,
            messages=request.messages,
            prompt=request.prompt,
            sampling=request.sampling,
            priority_class=request.priority_class,
        )
        # A lease from rate-limit (or RESOURCE_EXHAUSTED / UNAVAILABLE); settled in `finally`.
        ticket = await self.admission.admit(tenant, generation_reservation(request), time_remaining)
        # The caller's deadline bounds the adapter's work; cancelling this call stops it there.
        call = self.adapter.Generate(downstream, timeout=time_remaining, metadata=outgoing_metadata())
        try:
            yield GenerateStream(ticket, call)
        finally:
            call.cancel()
            ticket.settle()

    async def check_context(self, request: gateway_pb2.GenerateRequest, time_remaining: float | None) -> None:
        """INVALID_ARGUMENT when the prompt plus max_tokens cannot fit the model's context."""
        context_length = self.models.get(request.model).context_length
        max_tokens = request.sampling.max_tokens
        if not context_length or estimate_prompt_tokens(request) + max_tokens <= context_length:
            return
        count = inference_pb2.CountTokensRequest(model=request.model, messages=request.messages, prompt=request.prompt)
        try:
            reply = await self.adapter.CountTokens(count, timeout=time_remaining, metadata=outgoing_metadata())
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument("messages" if request.messages else "prompt", exc.details() or "") from exc
            return  # the model cannot count (or the adapter failed): the generation call decides
        if reply.prompt_tokens + max_tokens > reply.context_length:
            raise InvalidArgument(
                "messages" if request.messages else "prompt",
                f"the prompt is {reply.prompt_tokens} tokens and max_tokens is {max_tokens}; together they exceed"
                f" the model's context of {reply.context_length} tokens",
            )

    async def embed_with_ticket(
        self, tenant: str, request: gateway_pb2.EmbedRequest, request_id: str, time_remaining: float | None
    ) -> tuple[gateway_pb2.EmbedResponse, Ticket]:
        """Validates, takes a lease (or raises RESOURCE_EXHAUSTED / UNAVAILABLE), calls the adapter;
        the ticket carries the lease's x-ratelimit-* headers and requests-per-minute limit."""
        self.models.get(request.model, types_pb2.MODEL_KIND_EMBEDDING)
        validate_embedding(request.inputs)
        downstream = inference_pb2.EmbedRequest(
            request_id=request_id,
            tenant=tenant,
            model=request.model,
            inputs=request.inputs,
            priority_class=request.priority_class,
        )
        ticket = await self.admission.admit(tenant, embedding_reservation(request), time_remaining)
        try:
            reply = await self.adapter.Embed(downstream, timeout=time_remaining, metadata=outgoing_metadata())
            if reply.HasField("usage"):
                ticket.record(reply.usage)
        finally:
            # The real usage refunds the rest of the reservation; a failed call commits the estimate.
            ticket.settle()
        response = gateway_pb2.EmbedResponse(request_id=request_id, model=request.model, embeddings=reply.embeddings, usage=reply.usage)
        return response, ticket
