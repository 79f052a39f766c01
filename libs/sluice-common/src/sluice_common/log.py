"""structlog set up once per process.

Every record, ours and the stdlib ones from grpc, aio-pika or tritonclient, goes
through one ProcessorFormatter: JSON lines when stderr is not a terminal (what log
shippers want), coloured key=value on a terminal. `merge_contextvars` runs first so
that the request id bound per call appears on every line logged during that call.
"""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.types import EventDict

from sluice_common.tracing import add_trace_ids

_configured = False

# The logger of the `ports_bound` lines (a service's ports, as bound): logged whatever the level,
# since a launcher that started a service on port 0 reads its ports there (sluice_stack).
PORTS_LOGGER = "sluice.ports"


def configure_logging(service: str, level: str = "INFO", json: bool | None = None) -> None:
    global _configured
    if _configured:
        return
    _configured = True
    render_json = (not sys.stderr.isatty()) if json is None else json
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        # trace_id/span_id of the current span (only while tracing is on).
        add_trace_ids,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer: structlog.types.Processor = structlog.processors.JSONRenderer() if render_json else structlog.dev.ConsoleRenderer(colors=True)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            _add_service(service),
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info if render_json else _identity,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger(PORTS_LOGGER).setLevel(logging.INFO)


def _add_service(service: str) -> structlog.types.Processor:
    def add(_logger: object, _name: str, event: EventDict) -> EventDict:
        event.setdefault("service", service)
        return event

    return add


def _identity(_logger: object, _name: str, event: EventDict) -> EventDict:
    return event


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    return structlog.stdlib.get_logger(name)
