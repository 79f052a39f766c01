"""sluice.gateway.v1.GatewayService: authenticate, validate, stream from the adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.errors import Unimplemented
from sluice_common.request_context import REQUEST_ID_KEY, current_request_id, outgoing_metadata
from sluice_common.validation import validate_embedding, validate_generation
from sluice_gateway.admission import Admission
from sluice_gateway.completion_events import CompletionEvents
from sluice_gateway.model_catalog import ModelCatalog
from sluice_gateway.tenants import Tenant, TenantDirectory


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return None


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        tenants: TenantDirectory,
        models: ModelCatalog,
        adapter: inference_pb2_grpc.InferenceServiceStub,
        completion_events: CompletionEvents | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._tenants = tenants
        self._models = models
        self._adapter = adapter
        self._completion_events = completion_events
        self._admission = admission or Admission(None)

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self._tenants.authenticate(_authorization(context))

    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=request.model)
        validate_generation(request.messages, request.prompt, request.sampling, self._models.get(request.model))
        request_id = current_request_id()
        downstream = inference_pb2.GenerateRequest(
            request_id=request_id,
            tenant=tenant.name,
            model=request.model,
            messages=request.messages,
            prompt=request.prompt,
            sampling=request.sampling,
            priority_class=request.priority_class,
        )
        # Published from a done-callback, only after the client's stream has closed (issue 5).
        tracker = self._completion_events.track(tenant, request, request_id, context) if self._completion_events else None
        # The client's deadline bounds the adapter's work; cancelling this call stops it there.
        # A lease from rate-limit (or RESOURCE_EXHAUSTED / UNAVAILABLE); settled in `finally`.
        ticket = await self._admission.admit(tenant.name, request, context.time_remaining())
        call = self._adapter.Generate(downstream, timeout=context.time_remaining(), metadata=outgoing_metadata())
        try:
            await context.send_initial_metadata(((REQUEST_ID_KEY, request_id), *ticket.metadata))
            async for chunk in call:
                ticket.observe(chunk)
                if tracker is not None:
                    tracker.add(chunk)
                yield gateway_pb2.GenerateResponse(
                    request_id=request_id,
                    text=chunk.text,
                    finish_reason=chunk.finish_reason,
                    usage=chunk.usage if chunk.HasField("usage") else None,
                    timings=chunk.timings if chunk.HasField("timings") else None,
                    model=request.model,
                )
        finally:
            call.cancel()
            ticket.settle()

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        self._tenant(context)
        return gateway_pb2.ListModelsResponse(models=self._models.models)

    async def Embed(self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        tenant = self._tenant(context)
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=request.model)
        self._models.get(request.model, types_pb2.MODEL_KIND_EMBEDDING)
        validate_embedding(request.inputs)
        request_id = current_request_id()
        downstream = inference_pb2.EmbedRequest(
            request_id=request_id,
            tenant=tenant.name,
            model=request.model,
            inputs=request.inputs,
            priority_class=request.priority_class,
        )
        reply = await self._adapter.Embed(downstream, timeout=context.time_remaining(), metadata=outgoing_metadata())
        return gateway_pb2.EmbedResponse(
            request_id=request_id, model=request.model, embeddings=reply.embeddings, usage=reply.usage
        )

    async def SubmitJob(self, request, context):  # type: ignore[no-untyped-def]
        self._tenant(context)
        raise Unimplemented("bulk jobs are not served yet (issue #6)")

    async def GetJob(self, request, context):  # type: ignore[no-untyped-def]
        self._tenant(context)
        raise Unimplemented("bulk jobs are not served yet (issue #6)")

    async def WatchJob(self, request, context):  # type: ignore[no-untyped-def]
        self._tenant(context)
        raise Unimplemented("bulk jobs are not served yet (issue #6)")
        yield  # pragma: no cover - makes this a server-streaming handler

    async def CancelJob(self, request, context):  # type: ignore[no-untyped-def]
        self._tenant(context)
        raise Unimplemented("bulk jobs are not served yet (issue #6)")

    async def ListJobResults(self, request, context):  # type: ignore[no-untyped-def]
        self._tenant(context)
        raise Unimplemented("bulk jobs are not served yet (issue #6)")
