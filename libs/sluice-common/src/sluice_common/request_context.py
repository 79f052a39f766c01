"""The request id that follows a request across services and across RabbitMQ.

It travels as the `x-request-id` gRPC metadata key (and as an AMQP header) and is
bound into structlog's context for the duration of each call.
"""

from __future__ import annotations

import contextvars
import uuid

import structlog

REQUEST_ID_KEY = "x-request-id"

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_request_id", default="")


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str:
    return _request_id.get()


def bind_request_id(request_id: str) -> None:
    _request_id.set(request_id)
    structlog.contextvars.bind_contextvars(request_id=request_id)


def outgoing_metadata(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Metadata for a downstream call made while serving the current request."""
    request_id = current_request_id()
    pairs = ((REQUEST_ID_KEY, request_id),) if request_id else ()
    return pairs + tuple(extra)


def request_id_from_metadata(metadata: object) -> str:
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == REQUEST_ID_KEY and value:
            return str(value)
    return ""
