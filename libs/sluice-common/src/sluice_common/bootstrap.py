"""The `__main__` of every service: config from the environment, logging, run, clean exit."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import TypeVar

from sluice_common.config import ConfigError, ServerConfig, ServiceConfig, load_config
from sluice_common.log import configure_logging
from sluice_common.tracing import TracingConfigError, configure_tracing

C = TypeVar("C", bound=ServiceConfig)


def run_service(service: str, config_cls: type[C], prefix: str, main: Callable[[C], Coroutine[object, object, None]]) -> None:
    """Loads config (exit 2 with a clear message when it is wrong), sets up logging, runs `main`."""
    try:
        config = load_config(config_cls, prefix)
        if isinstance(config, ServerConfig):
            config.server_tls(prefix)  # TLS files that do not fit stop the start here, with the rest
        configure_tracing(service)  # OTEL_* (off unless OTEL_TRACES_EXPORTER names an exporter)
    except (ConfigError, TracingConfigError) as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging(service, config.log_level, config.log_json)
    asyncio.run(main(config))
