"""The request id that follows a request across services and across RabbitMQ.

It travels as the `x-request-id` gRPC metadata key (and as an AMQP header) and is
bound into structlog's context for the duration of each call.
"""

from __future__ import annotations

import contextvars
import itertools
import os
import secrets

import structlog

REQUEST_ID_KEY = "x-request-id"
# A caller's own id is kept to this many characters (ours are 32): it goes into every log line,
# every downstream call, the AMQP headers and the evaluation records.
MAX_REQUEST_ID = 64

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("sluice_request_id", default="")


# 64 random bits per process, then a counter: as unique as a uuid4 across processes and half its
# cost (no os.urandom per call), which a server minting an id for every RPC pays thousands of times
# a second. Same form as before: 32 hex digits.
_PROCESS_PART = secrets.token_hex(8)
_sequence = itertools.count(secrets.randbits(48))


def _new_process_part() -> None:
    """A forked child (a worker pool) would repeat its parent's ids: it draws its own prefix."""
    global _PROCESS_PART, _sequence
    _PROCESS_PART = secrets.token_hex(8)
    _sequence = itertools.count(secrets.randbits(48))


os.register_at_fork(after_in_child=_new_process_part)


def new_unique_id() -> str:
    """32 hex digits, unique across processes and restarts: request ids, rate-limit lease ids."""
    return f"{_PROCESS_PART}{next(_sequence) & 0xFFFFFFFFFFFFFFFF:016x}"


new_request_id = new_unique_id


def current_request_id() -> str:
    return _request_id.get()


def bind_request_id(request_id: str, **also: str) -> None:
    """Binds the request id (and `also`, more log context, in the same call) for this context."""
    _request_id.set(request_id)
    structlog.contextvars.bind_contextvars(request_id=request_id, **also)


def outgoing_metadata(*extra: tuple[str, str]) -> tuple[tuple[str, str], ...]:
    """Metadata for a downstream call made while serving the current request."""
    request_id = current_request_id()
    pairs = ((REQUEST_ID_KEY, request_id),) if request_id else ()
    return pairs + tuple(extra)


def is_metadata_text(value: str) -> bool:
    """Whether `value` may be sent as a gRPC metadata value, where a request id goes (every
    downstream call's x-request-id): printable ASCII, space to tilde. grpc refuses anything else
    when it sends the call (a unary call: ExecuteBatchError, no status; a stream: INTERNAL "Invalid
    metadata"). A request id taken from elsewhere (an HTTP header, an AMQP header) must pass it."""
    return value.isascii() and value.isprintable()


def request_id_from_metadata(metadata: object) -> str:
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == REQUEST_ID_KEY and value:
            return str(value)[:MAX_REQUEST_ID]
    return ""
