"""sluice.gateway.v1.GatewayService: authenticate, validate, stream from the adapter."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import structlog
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.errors import Unimplemented
from sluice_common.request_context import REQUEST_ID_KEY, current_request_id, outgoing_metadata
from sluice_common.validation import validate_generation
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
    ) -> None:
        self._tenants = tenants
        self._models = models
        self._adapter = adapter

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
        # The client's deadline bounds the adapter's work; cancelling this call stops it there.
        call = self._adapter.Generate(downstream, timeout=context.time_remaining(), metadata=outgoing_metadata())
        await context.send_initial_metadata(((REQUEST_ID_KEY, request_id),))
        try:
            async for chunk in call:
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

    async def ListModels(
        self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListModelsResponse:
        self._tenant(context)
        return gateway_pb2.ListModelsResponse(models=self._models.models)

    async def Embed(self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        self._tenant(context)
        raise Unimplemented("Embed is not served yet (issue #3)")

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
