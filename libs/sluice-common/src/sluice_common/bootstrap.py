"""The `__main__` of every service: config from the environment, logging, run, clean exit.

Also what ties a service to the launcher that started it (sluice_stack): its lifeline. The launcher
holds the write end of a pipe for as long as it lives and hands each service the read end
(SLUICE_LIFELINE_FD). When the launcher dies, however it dies (SIGKILL, a CI timeout, a closed
terminal), the pipe reads end-of-file: the service sends itself SIGTERM and drains as on any stop,
and is killed, with its process group, if it is still there SLUICE_LIFELINE_KILL_AFTER_S later.
Without the variable (a service started by hand, a container) nothing watches anything.

`python -m sluice_common.bootstrap MODULE [ARGS]` runs MODULE as `python -m MODULE` would, with its
lifeline watched from the start: how the launcher starts every service, those whose `__main__` does
not go through `run_service` (triton-local) included.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, MutableMapping
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from sluice_common.config import ServiceConfig

# Set by sluice_stack.launcher (its copies of these names): the descriptor of the lifeline's read
# end, and how long after the lifeline closes a service still there is SIGKILLed (its drain grace
# and the launcher's stop margin: what the launcher's own stop would give it).
LIFELINE_FD_ENV = "SLUICE_LIFELINE_FD"
LIFELINE_KILL_AFTER_ENV = "SLUICE_LIFELINE_KILL_AFTER_S"
# The kill bound when the launcher sets none: the default drain grace (60 s) and the stop margin (15 s).
DEFAULT_LIFELINE_KILL_AFTER_S = 75.0

C = TypeVar("C", bound="ServiceConfig")


def watch_lifeline(environ: MutableMapping[str, str] = os.environ) -> threading.Thread | None:
    """Starts the thread that stops this process when its launcher's lifeline closes (see the
    module's doc); None, and nothing started, without SLUICE_LIFELINE_FD. The variables are taken
    out of `environ`: the service's own children do not have the descriptor, and a second call (the
    runner's, then run_service's) watches nothing twice."""
    raw_fd = environ.pop(LIFELINE_FD_ENV, None)
    raw_kill_after = environ.pop(LIFELINE_KILL_AFTER_ENV, None)
    if not raw_fd:
        return None
    try:
        fd = int(raw_fd)
        os.set_inheritable(fd, False)  # nor does anything this process execs
    except (ValueError, OSError) as exc:
        print(f"{LIFELINE_FD_ENV}={raw_fd!r} names no open descriptor ({exc}): not watching the launcher", file=sys.stderr)
        return None
    try:
        kill_after_s = float(raw_kill_after) if raw_kill_after else DEFAULT_LIFELINE_KILL_AFTER_S
    except ValueError:
        kill_after_s = DEFAULT_LIFELINE_KILL_AFTER_S
    thread = threading.Thread(target=_watch, args=(fd, kill_after_s), name="lifeline", daemon=True)
    thread.start()
    return thread


def _watch(fd: int, kill_after_s: float) -> None:
    while True:
        try:
            if not os.read(fd, 512):
                break  # end-of-file: every write end is closed, the launcher is gone
        except OSError as exc:  # the descriptor was closed under us: nothing left to watch
            _log("lifeline_lost", error=str(exc))
            return
    _log("lifeline_closed", action="SIGTERM: draining as on any stop", kill_after_s=kill_after_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(kill_after_s)  # a daemon thread: a drain that ends ends the process, and this with it
    _log("lifeline_kill", reason=f"still running {kill_after_s:g} s after the lifeline closed")
    sys.stdout.flush()
    sys.stderr.flush()
    # The whole group when this process leads one (as the launcher starts services): what it started
    # goes too, as with the launcher's own SIGKILL; alone when started inside another's group.
    if os.getpgid(0) == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _log(event: str, **fields: object) -> None:
    try:
        from sluice_common.log import get_logger

        get_logger("sluice_common.bootstrap").warning(event, **fields)
    except Exception:  # noqa: BLE001 - whatever logging does, the lifeline still acts
        print(f"{event} {fields}", file=sys.stderr, flush=True)


def run_service(service: str, config_cls: type[C], prefix: str, main: Callable[[C], Coroutine[object, object, None]]) -> None:
    """Loads config (exit 2 with a clear message when it is wrong), sets up logging, runs `main`;
    stops with the launcher that started it when that one dies (watch_lifeline)."""
    import asyncio

    from sluice_common.config import ConfigError, ServerConfig, load_config
    from sluice_common.log import configure_logging
    from sluice_common.tracing import TracingConfigError, configure_tracing

    watch_lifeline()
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


def _run_module(argv: list[str]) -> None:
    """`python -m sluice_common.bootstrap MODULE [ARGS]`: MODULE as `python -m MODULE [ARGS]`."""
    import runpy

    if len(argv) < 2:
        print("usage: python -m sluice_common.bootstrap MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    watch_lifeline()
    del argv[0]  # MODULE's argv[0] becomes its file, as under -m
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _run_module(sys.argv)
