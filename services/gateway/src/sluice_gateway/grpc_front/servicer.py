"""sluice.gateway.v1.GatewayService: authenticate, validate, stream from the adapter."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import structlog
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_common.errors import Unimplemented
from sluice_common.request_context import REQUEST_ID_KEY, current_request_id
from sluice_common.errors import clip
from sluice_common.validation import MAX_MODEL_NAME
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.jobs_port import JobsPort
from sluice_common.tenants import Tenant, TenantDirectory, authorization


def _gone(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """How a call that ended without a status ended: its deadline passed, or its client cancelled it."""
    remaining = context.time_remaining()
    return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        tenants: TenantDirectory,
        path: InferencePath,
        jobs: JobsPort | None = None,
    ) -> None:
        self._tenants = tenants
        self._models = path.models
        self._path = path
        self._jobs_api = jobs

    def _tenant(self, context: grpc.aio.ServicerContext) -> Tenant:
        return self._tenants.authenticate(authorization(context))

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        tenant = self._tenant(context)
        # Bound before the name is checked: a longer one is refused, and logged only in part.
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=clip(request.model, MAX_MODEL_NAME))
        request_id = current_request_id()

        # The CompletionEvent is published from the call's done-callback, only after the client's
        # stream has closed (issue 5); defaults, validation, admission and tracking are the path's.
        # grpc.aio records no status for a call its client cancelled or whose deadline passed: it
        # cancels this handler, or, when it was blocked sending a chunk (a client that does not
        # read), closes it at its yield (GeneratorExit), and that only after the done-callback ran.
        # `gone` says which it was, or the event would read as a failure; a call done while its
        # handler still runs ended so too (a finished handler has returned before its call is done).
        gone: list[grpc.StatusCode] = []
        running = [True]

        def when_closed(publish: Callable[[Any, bool], None]) -> None:
            def closed(done: grpc.aio.ServicerContext) -> None:
                code = done.code() or (gone[0] if gone else _gone(done) if running else None)
                publish(code, done.cancelled() or code == grpc.StatusCode.CANCELLED)

            context.add_done_callback(closed)

        try:
            async with self._path.generate(tenant, request, request_id, context.time_remaining(), when_closed=when_closed) as stream:
                await context.send_initial_metadata(((REQUEST_ID_KEY, request_id), *stream.ticket.metadata))
                async for chunk in stream:
                    yield gateway_pb2.GenerateResponse(
                        request_id=request_id,
                        text=chunk.text,
                        finish_reason=chunk.finish_reason,
                        usage=chunk.usage if chunk.HasField("usage") else None,
                        timings=chunk.timings if chunk.HasField("timings") else None,
                        model=request.model,
                        index=stream.index,
                        logprobs=chunk.logprobs,
                        tool_calls=stream.tool_calls(stream.index) if chunk.finish_reason else None,
                    )
        except (asyncio.CancelledError, GeneratorExit):
            gone.append(_gone(context))
            raise
        finally:
            running.clear()

    async def ListModels(self, request: gateway_pb2.ListModelsRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        self._tenant(context)
        return gateway_pb2.ListModelsResponse(models=self._models.models)

    async def Embed(self, request: gateway_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        tenant = self._tenant(context)
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=clip(request.model, MAX_MODEL_NAME))
        request_id = current_request_id()
        reply, ticket = await self._path.embed_with_ticket(tenant, request, request_id, context.time_remaining())
        await context.send_initial_metadata(((REQUEST_ID_KEY, request_id), *ticket.metadata))
        return reply

    def _jobs(self) -> JobsPort:
        if self._jobs_api is None:
            raise Unimplemented("bulk jobs are not configured on this gateway")
        return self._jobs_api

    async def SubmitJob(self, request: gateway_pb2.SubmitJobRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.SubmitJobResponse:
        tenant = self._tenant(context)
        return gateway_pb2.SubmitJobResponse(job=await self._jobs().submit(tenant, request.job))

    async def GetJob(self, request: gateway_pb2.GetJobRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.GetJobResponse:
        tenant = self._tenant(context)
        return gateway_pb2.GetJobResponse(job=await self._jobs().get(tenant, request.job_id))

    async def WatchJob(self, request: gateway_pb2.WatchJobRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[gateway_pb2.WatchJobResponse]:
        tenant = self._tenant(context)
        async for job in self._jobs().watch(tenant, request.job_id):
            yield gateway_pb2.WatchJobResponse(job=job)

    async def CancelJob(self, request: gateway_pb2.CancelJobRequest, context: grpc.aio.ServicerContext) -> gateway_pb2.CancelJobResponse:
        tenant = self._tenant(context)
        return gateway_pb2.CancelJobResponse(job=await self._jobs().cancel(tenant, request.job_id))

    async def ListJobResults(
        self, request: gateway_pb2.ListJobResultsRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.ListJobResultsResponse:
        tenant = self._tenant(context)  # before _jobs(): an unknown caller learns nothing of what is configured
        results, token = await self._jobs().list_results(tenant, request.job_id, request.page_size, request.page_token)
        return gateway_pb2.ListJobResultsResponse(results=results, next_page_token=token)
