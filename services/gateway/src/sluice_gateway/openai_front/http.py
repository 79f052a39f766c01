"""The OpenAI-compatible HTTP API: a second listener of the gateway, on the gRPC server's event loop.

    POST /v1/chat/completions   stream (server-sent events ending in `data: [DONE]`,
                                stream_options.include_usage) or not
    POST /v1/completions        the same, for a raw prompt
    POST /v1/embeddings         encoding_format float or base64
    GET  /v1/models, /v1/models/{id}
    /v1/files, /v1/batches          OpenAI's Files and Batch APIs over bulk jobs (batch_http)

Why aiohttp's server: it runs on the asyncio loop it is started from (AppRunner + TCPSite, no
thread, no process, no signal handlers of its own, unlike uvicorn's Server), so the HTTP handlers
share the gRPC servicer's InferencePath, admission, adapter channel and CompletionEvent
publisher object for object; it streams with StreamResponse, refuses oversized bodies with 413
(client_max_size) before reading them, and with `handler_cancellation` cancels a handler whose
client went away, which cancels the adapter call (the generation stops there) and publishes the
event as CANCELLED.

A thin front: every request goes through the same InferencePath as gRPC and the job worker
(defaults, validation, rate-limit admission, usage commit, CompletionEvent); this module only
translates OpenAI's JSON to Sluice's requests and Sluice's errors to OpenAI's: 401 bad key,
400 invalid_request_error naming the param, 404 unknown model, 429 with Retry-After and the lease's
x-ratelimit-* headers (the same figures gRPC sends as metadata), 503 when no replica can serve.
A stream that fails after its first chunk ends with an error event (`data: {"error": ...}`),
never a silent cut and never `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import structlog
from prometheus_client import Histogram
from aiohttp import web
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2

from sluice_common.finish_reasons import finish_reason_enum_name
from sluice_common.errors import ContextLengthExceeded, InvalidArgument, ResourceExhausted, SluiceError, Unauthenticated, Unavailable
from sluice_common.config import ServerTLS
from sluice_common.log import PORTS_LOGGER
from sluice_common.request_context import MAX_REQUEST_ID, REQUEST_ID_KEY, bind_request_id, current_request_id, is_metadata_text, new_request_id
from sluice_common.tls import server_ssl_context
from sluice_gateway.path.generation_trace import instrument_http_front
from sluice_gateway.path.inference_path import InferencePath
from sluice_gateway.path.model_catalog import UnknownModel
from sluice_gateway.openai_front.choices import ChoiceState, chat_logprobs
from sluice_gateway.openai_front.errors import OpenAIError, generation_failed, status_error
from sluice_gateway.openai_front.replies import Completion, check_dimensions, embeddings_reply, finish_reason, model_object
from sluice_gateway.openai_front.requests import GenerationCall, parse_chat, parse_completion, parse_embeddings
from sluice_common.tenants import Tenant, TenantDirectory
from sluice_gateway.openai_front.http_input import authenticate, json_body
from sluice_common.utf8 import is_valid_text
from sluice_common.validation import MAX_CLIENT_REQUEST_ID

if TYPE_CHECKING:
    from sluice_gateway.openai_front.batch_http import BatchFront

log = structlog.stdlib.get_logger("sluice.gateway.http")

# OpenTelemetry's http.server.request.duration as its Prometheus exporter names it (seconds, its
# attributes as labels), so that the HTTP front counts in the gateway's error ratio and dashboards
# beside gRPC's sluice_rpc_*. Its default buckets, and longer ones for streamed completions.
#
# error_type is OpenTelemetry's error.type, set when the request ended with an error: the status
# for a 5xx answer; for a stream that failed after its 200 and its first chunk were sent, the status
# its failure would have been answered with before the first chunk ("503" beside a 200), so that
# the error ratio (sluice:gateway_rpc_errors:ratio_rate5m) counts it as gRPC counts its own.
# Empty (no label, to Prometheus) otherwise.
HTTP_DURATION = Histogram(
    "http_server_request_duration_seconds",
    "Duration of HTTP server requests, by method, route (the route's template), status code sent and error type.",
    ["http_request_method", "http_route", "http_response_status_code", "error_type"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 30, 60, 120, 300),
)
_HTTP_METHODS = frozenset(("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"))


def _route(request: web.Request) -> str:
    """The matched route's template ("/v1/files/{file_id}"), never the path itself: a label value
    per unknown path would grow without bound."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


CLIENT_REQUEST_ID_HEADER = "X-Client-Request-Id"
# The status a stream that failed after its first chunk would have been answered with (in aiohttp's
# per-request storage): the middleware records it as the request's error.type.
_STREAM_FAILED = web.RequestKey("sluice_stream_failed_status", int)


# Sluice's field paths -> OpenAI's param names.
_PARAMS = {"sampling.": "", "inputs": "input", "tool_use.choice": "tool_choice", "tool_use.": ""}
_TOOL_FIELD = re.compile(r"^tools\[(\d+)\]\.(name|parameters)$")


def _param(field_name: str) -> str:
    for sluice, openai in _PARAMS.items():
        if field_name.startswith(sluice):
            field_name = openai + field_name[len(sluice) :]
            break
    if field_name.startswith("tool_choice"):
        return "tool_choice"
    # A tool's fields sit under its function in OpenAI's shape.
    return _TOOL_FIELD.sub(r"tools[\1].function.\2", field_name)


def openai_error(exc: BaseException) -> OpenAIError:
    """What OpenAI would answer for an error the path raised (Sluice's own, or the adapter's status)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, UnknownModel):
        return OpenAIError(404, exc.reason, param="model", code="model_not_found")
    if isinstance(exc, ContextLengthExceeded):
        return OpenAIError(400, exc.reason, param=_param(exc.field_name), code="context_length_exceeded")
    if isinstance(exc, InvalidArgument):
        # Named as OpenAI's param in the message too, not as Sluice's field ("sampling.stop[0]").
        param = _param(exc.field_name)
        return OpenAIError(400, f"{param}: {exc.reason}", param=param, code="invalid_value")
    if isinstance(exc, Unauthenticated):
        return OpenAIError(401, f"Incorrect API key provided: {exc.message}", code="invalid_api_key")
    if isinstance(exc, ResourceExhausted):
        headers = dict(exc.metadata)
        # OpenAI's type names the limit hit: "tokens" for a token budget, "requests" for the others.
        type_ = "tokens" if "tokens" in exc.quota_subject.rsplit("/", 1)[-1] else "requests"
        if exc.retry_after_s is None:
            # Larger than the whole allowance: no wait admits it, and OpenAI's clients must not retry.
            headers["x-should-retry"] = "false"
            return OpenAIError(429, exc.message, type_, code="rate_limit_exceeded", headers=headers)
        headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(exc.retry_after_s * 1000)))
        return OpenAIError(429, exc.message, type_, code="rate_limit_exceeded", headers=headers)
    if isinstance(exc, SluiceError):
        error = status_error(exc.code, exc.message)
        if isinstance(exc, Unavailable):  # as the adapter's UNAVAILABLE below: worth a retry, after this
            error.headers["retry-after"] = str(max(1, math.ceil(exc.retry_after_s or 1)))
        return error
    if isinstance(exc, grpc.aio.AioRpcError):
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            # Refused downstream (a logit_bias id outside the vocabulary, which only the engine knows).
            field = _field_violation(exc)
            return OpenAIError(400, exc.details() or "invalid argument", param=_param(field) if field else None, code="invalid_value")
        error = status_error(exc.code().name, exc.details() or exc.code().name)
        if error.status in (429, 503):
            error.headers["retry-after"] = "1"
        return error
    log.error("http_internal_error", error=repr(exc), exc_info=exc)
    return OpenAIError(500, "The server had an error while processing your request.", "server_error", code="internal_error")


def _field_violation(error: grpc.aio.AioRpcError) -> str | None:
    """The field of the google.rpc.BadRequest an INVALID_ARGUMENT carries (the adapter's, passed on)."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        return None
    for detail in status.details if status is not None else ():
        bad = error_details_pb2.BadRequest()
        if detail.Unpack(bad) and bad.field_violations:
            return bad.field_violations[0].field
    return None


def _json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json", headers=headers)


def _sse(body: Any) -> bytes:
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class StreamAnswered(Exception):
    """A stream that failed after it started and has been answered (its error event sent); its
    __cause__ is the failure, which the InferencePath records (see inference_path.status_of)."""

    unwrap_cause = True

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("the stream failed after its first chunk")
        self.response = response


@dataclass
class OpenAIFront:
    """The handlers; each authenticates, parses, and hands the request to the one InferencePath."""

    tenants: TenantDirectory
    path: InferencePath

    def _tenant(self, request: web.Request) -> Tenant:
        return authenticate(self.tenants, request)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return await json_body(request)

    def _client_request_id(self, request: web.Request) -> str:
        value = request.headers.get(CLIENT_REQUEST_ID_HEADER, "")[:MAX_CLIENT_REQUEST_ID]
        if not is_valid_text(value):
            raise OpenAIError(400, f"The {CLIENT_REQUEST_ID_HEADER} header is not UTF-8 text.", param=CLIENT_REQUEST_ID_HEADER, code="invalid_value")
        return value

    def _headers(self, request_id: str, metadata: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
        return {REQUEST_ID_KEY: request_id, **dict(metadata)}

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, parse_completion)

    async def _generate(self, request: web.Request, parse: Callable[[dict[str, Any]], GenerationCall]) -> web.StreamResponse:
        tenant = self._tenant(request)
        call = parse(await self._body(request))
        call.request.client_request_id = self._client_request_id(request)
        request_id = current_request_id()
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=call.request.model)
        answer = Completion(call, request_id)
        try:
            async with self.path.generate(tenant, call.requests(), request_id, None) as stream:
                headers = self._headers(request_id, stream.ticket.metadata)
                if call.options.stream:
                    return await self._stream(request, stream, answer, headers)
                return await self._whole(stream, answer, headers)
        except InvalidArgument as exc:  # refused by the path (the model's limits): named as the client sent it
            error = openai_error(exc)
            sent = call.sent_as.get(error.param or "")
            if sent is not None:
                error.param, error.message = sent, f"{sent}: {exc.reason}"
            raise error from exc

    async def _whole(self, stream: Any, answer: Completion, headers: dict[str, str]) -> web.Response:
        """The whole answer, once every choice has finished."""
        states = [ChoiceState(i) for i in range(answer.call.choice_count())]
        final = None
        # A failed finish (the adapter's ERROR) is followed by the call's status, which says why:
        # the loop goes on to it, and it is answered as it is (UNAVAILABLE: a 503 with Retry-After).
        async for chunk in stream:
            state = states[stream.index]
            state.parts.append(chunk.text)
            _record_logprobs(answer, state, chunk)
            if chunk.finish_reason:
                state.finish_reason = finish_reason(answer.call, chunk.finish_reason)
                state.tool_calls = stream.tool_calls(stream.index)
                final = chunk
        if final is None or any(state.finish_reason is None for state in states):
            raise generation_failed("The generation failed before it finished; retry the request.")
        usage = final.usage if final.HasField("usage") else None
        return _json_response(answer.whole(states, None, usage), headers=headers)

    async def _stream(self, request: web.Request, stream: Any, answer: Completion, headers: dict[str, str]) -> web.StreamResponse:
        """Server-sent events. The response starts at the first chunk, so that an error before it
        (the adapter refusing, no replica) is still answered with its own status and JSON body."""
        response: web.StreamResponse | None = None
        final = failed = None
        states = [ChoiceState(i) for i in range(answer.call.choice_count())]
        try:
            # A failed finish (the adapter's ERROR) is followed by the call's status, which says why:
            # the loop goes on to it, and the except below answers it (UNAVAILABLE: service_unavailable).
            async for chunk in stream:
                if response is None:
                    response = web.StreamResponse(headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                    await response.prepare(request)
                state = states[stream.index]
                logprobs = _record_logprobs(answer, state, chunk)
                if not state.started or chunk.text or logprobs is not None:
                    await response.write(_sse(answer.chunk(chunk.text, first=not state.started, index=state.index, logprobs=logprobs)))
                    state.started = True
                if chunk.finish_reason:
                    # Each choice ends with its own chunk; the request's usage comes on the last one.
                    final = chunk
                    state.finish_reason = finish_reason(answer.call, chunk.finish_reason)
                    if state.finish_reason is None:
                        failed = chunk
                        continue
                    calls = stream.tool_calls(stream.index)
                    if calls and answer.call.chat:
                        await response.write(_sse(answer.tool_calls_chunk(state.index, calls)))
                    if len(states) > 1 and any(s.finish_reason is None for s in states):
                        await response.write(_sse(answer.chunk(None, state.finish_reason, index=state.index)))
        except Exception as exc:  # noqa: BLE001 - after the first chunk every failure ends as an error event
            if response is None:
                raise
            await self._fail_stream(request, response, openai_error(exc))
            # Out through the path with the cause, so that the CompletionEvent records the failure.
            raise StreamAnswered(response) from exc
        if response is None:
            raise generation_failed("The generation ended without any output.")
        if final is None or any(state.finish_reason is None for state in states):
            reason = finish_reason_enum_name(failed.finish_reason) if failed is not None else "no final chunk"
            await self._fail_stream(request, response, generation_failed(f"The generation failed after it started ({reason})."))
            return response
        await response.write(_sse(answer.chunk(None, finish_reason(answer.call, final.finish_reason), index=stream.index)))
        if answer.call.options.include_usage:
            await response.write(_sse(answer.usage_chunk(final.usage if final.HasField("usage") else None)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _fail_stream(self, request: web.Request, response: web.StreamResponse, error: OpenAIError) -> None:
        """A stream that fails after its first chunk ends with an error event, never a silent cut;
        its 200 is recorded with the failure's status as its error type (see HTTP_DURATION)."""
        request[_STREAM_FAILED] = error.status
        log.warning("http_stream_failed", status=error.status, error=error.message)
        await response.write(b"event: error\n" + _sse(error.body()))
        await response.write_eof()

    async def embeddings(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        call = parse_embeddings(await self._body(request))
        call.request.client_request_id = self._client_request_id(request)
        structlog.contextvars.bind_contextvars(tenant=tenant.name, model=call.request.model)
        if call.dimensions is not None:
            check_dimensions(call, self.path.models.get(call.request.model, types_pb2.MODEL_KIND_EMBEDDING))
        request_id = current_request_id()
        reply, ticket = await self.path.embed_with_ticket(tenant, call.request, request_id, None)
        return _json_response(embeddings_reply(call, reply), headers=self._headers(request_id, ticket.metadata))

    async def models(self, request: web.Request) -> web.Response:
        self._tenant(request)
        return _json_response({"object": "list", "data": [model_object(m) for m in self.path.models.models]})

    async def model(self, request: web.Request) -> web.Response:
        self._tenant(request)
        name = request.match_info["model"]
        for model in self.path.models.models:
            if model.name == name:
                return _json_response(model_object(model))
        raise OpenAIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def _record_logprobs(answer: Completion, state: ChoiceState, chunk: Any) -> dict[str, Any] | None:
    """Adds a chunk's token logprobs to its choice; returns them in the endpoint's shape for a
    stream chunk (None when the request asked for none)."""
    if not answer.call.request.sampling.HasField("logprobs"):
        return None
    entries = list(chunk.logprobs)
    if answer.call.chat:
        state.chat_entries += entries
        return chat_logprobs(entries)
    if not state.completion.tokens and answer.call.echo:
        state.completion.offset = len(answer.call.prompt_text(state.index))
    return state.completion.add(entries)


@web.middleware
async def _errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """A request id per request, one summary log line, and every error in OpenAI's JSON shape."""
    supplied = request.headers.get(REQUEST_ID_KEY, "")[:MAX_REQUEST_ID]
    # The id goes into every downstream call's gRPC metadata: anything grpc would refuse there (not
    # printable ASCII; undecodable bytes arrive surrogate-escaped by aiohttp) is refused, under an
    # id of our own, which the refusal's log line and x-request-id header then carry.
    request_id = supplied if supplied and is_metadata_text(supplied) else new_request_id()
    bind_request_id(request_id)
    started = time.perf_counter()
    status = 500
    try:
        if supplied and request_id != supplied:
            raise OpenAIError(
                400, f"The {REQUEST_ID_KEY} header must be printable ASCII text (space to ~).", param=REQUEST_ID_KEY, code="invalid_value"
            )
        response = await handler(request)
        status = response.status
        return response
    except asyncio.CancelledError:
        status = 499  # the client went away; the path has cancelled the generation
        raise
    except web.HTTPException as exc:
        if exc.status == 413:
            error = OpenAIError(413, "The request body is too large.", code="request_too_large")
        elif exc.status == 405:
            error = OpenAIError(405, f"{request.method} is not allowed on {request.path}.", code="method_not_allowed")
        elif exc.status == 404:
            error = OpenAIError(404, f"Unknown path {request.path}.", code="unknown_url")
        else:
            error = OpenAIError(exc.status, exc.reason, code=None)
        status = error.status
        return _json_response(error.body(), error.status, {REQUEST_ID_KEY: request_id})
    except StreamAnswered as exc:
        status = exc.response.status
        return exc.response
    except Exception as exc:  # noqa: BLE001 - every error is answered in OpenAI's shape
        error = openai_error(exc)
        status = error.status
        return _json_response(error.body(), error.status, {REQUEST_ID_KEY: request_id, **error.headers})
    finally:
        elapsed = time.perf_counter() - started
        method = request.method if request.method in _HTTP_METHODS else "_OTHER"
        error_type = _error_type(status, request.get(_STREAM_FAILED))
        HTTP_DURATION.labels(method, _route(request), str(status), error_type).observe(elapsed)
        also = {"error_type": error_type} if error_type else {}
        log.info("http_request", method=request.method, path=request.path, status=status, ms=round(elapsed * 1000, 1), **also)
        structlog.contextvars.clear_contextvars()


def _error_type(status: int, stream_failed: int | None) -> str:
    """OpenTelemetry's error.type of a request answered with `status`: the status of a server error
    (5xx; a 4xx is the client's, not an error of the server's, as OpenTelemetry's HTTP server spans
    count it); for a stream that failed after it started, the status its failure had (`stream_failed`,
    whatever it is: the stream was cut). "" for none."""
    if stream_failed is not None:
        return str(stream_failed)
    return str(status) if status >= 500 else ""


def build_app(front: OpenAIFront, max_body_bytes: int, batches: BatchFront | None = None) -> web.Application:
    instrument_http_front()
    app = web.Application(middlewares=[_errors], client_max_size=max_body_bytes)
    app.router.add_post("/v1/chat/completions", front.chat_completions)
    app.router.add_post("/v1/completions", front.completions)
    app.router.add_post("/v1/embeddings", front.embeddings)
    app.router.add_get("/v1/models", front.models)
    app.router.add_get("/v1/models/{model}", front.model)
    if batches is not None:
        # Uploads are read part by part up to SLUICE_GATEWAY_FILES_MAX_BYTES (not client_max_size,
        # which bounds the JSON bodies read whole).
        app.router.add_post("/v1/files", batches.create_file)
        app.router.add_get("/v1/files", batches.list_files)
        app.router.add_get("/v1/files/{file_id}", batches.get_file)
        app.router.add_delete("/v1/files/{file_id}", batches.delete_file)
        app.router.add_get("/v1/files/{file_id}/content", batches.file_content)
        app.router.add_post("/v1/batches", batches.create_batch)
        app.router.add_get("/v1/batches", batches.list_batches)
        app.router.add_get("/v1/batches/{batch_id}", batches.get_batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", batches.cancel_batch)
    return app


@dataclass
class RunningHttp:
    runner: web.AppRunner
    port: int
    grace_s: float

    async def stop(self) -> None:
        """Stops accepting, lets in-flight requests finish within the grace, then cuts them.

        The runner's own shutdown timeout alone is not the grace: aiohttp waits that long for a
        handler, then as long again for it to end by itself before it cancels it."""
        cleanup = asyncio.ensure_future(self.runner.cleanup())
        done, _ = await asyncio.wait({cleanup}, timeout=self.grace_s)
        if not done:
            await self.stop_now()
        await cleanup

    async def stop_now(self) -> None:
        """Cuts every open connection, so their handlers are cancelled now (handler_cancellation):
        a `stop` under way then ends without waiting out its timeout (a second SIGTERM)."""
        server = self.runner.server
        for connection in server.connections if server is not None else ():
            connection.force_close()


async def start_http(
    front: OpenAIFront,
    host: str,
    port: int,
    max_body_bytes: int,
    grace_s: float,
    batches: BatchFront | None = None,
    tls: ServerTLS | None = None,
) -> RunningHttp:
    """Starts the HTTP listener on the running loop; port 0 binds a free one (tests).

    With `tls` (the gateway's SLUICE_GATEWAY_TLS_*, the gRPC port's) it speaks HTTPS only, with the
    same certificate, and requires a client certificate signed by the client CA when one is set."""
    runner = web.AppRunner(build_app(front, max_body_bytes, batches), handler_cancellation=True, shutdown_timeout=grace_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=server_ssl_context(tls) if tls is not None else None)
    await site.start()
    bound = port or runner.addresses[0][1]
    log.info("http_listening", host=host, port=bound, tls="off" if tls is None else ("mutual" if tls.client_ca_file else "server"))
    structlog.stdlib.get_logger(PORTS_LOGGER).info("ports_bound", http=bound)
    return RunningHttp(runner, bound, grace_s)
