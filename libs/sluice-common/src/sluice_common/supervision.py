"""Owner tasks (a scheduler, a batcher, a consumer, a probe loop), supervised in one place.

Each service has a few long-lived tasks that own some work: callers queue on them and wait. A
bare `asyncio.create_task` that dies leaves those callers waiting for ever and health saying
SERVING. Started through a `Supervisor` instead, a task that dies (raises) is

  - logged with its exception (`owner_task_died`) and counted (sluice_owner_task_deaths_total),
  - reported unhealthy (the service turns NOT_SERVING while any owner task is down),
  - handed to its `on_death`, which fails the callers waiting on it at once (UNAVAILABLE),
  - restarted after `restart_delay_s` when `restart` is set (the owner starts over from an empty
    state its on_death left), after which health comes back.

Cancelling the task returned by `start` (an owner's `stop`) is not a death, nor is a loop that
returns (an owner that drains and ends on its own stop).

Failure tests need a real process's owner task to die on cue: with SLUICE_FAULT_INJECTION set to
task-name prefixes ("step-scheduler,embed-batcher"), `inject_faults` (SIGUSR1, see server.py)
fails the running tasks it names with `InjectedFault`, which then goes through the path above.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from prometheus_client import Counter

log = structlog.stdlib.get_logger("sluice.supervision")

TASK_DEATHS = Counter("sluice_owner_task_deaths_total", "Owner tasks that died (and were restarted if safe).", ["task"])

# Told (source, ok) when a task goes down or comes back; RunningServer.report fits.
HealthReport = Callable[[str, bool], Awaitable[None]]


FAULT_INJECTION_ENV = "SLUICE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """The death a failure test asked for (SIGUSR1 with SLUICE_FAULT_INJECTION set)."""


def fault_injection_from_env() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get(FAULT_INJECTION_ENV, "").split(",") if p.strip())


class Supervisor:
    def __init__(self, report: HealthReport | None = None, restart_delay_s: float = 1.0, fault_injection: tuple[str, ...] = ()) -> None:
        self._report = report
        self._restart_delay_s = restart_delay_s
        self._down: set[str] = set()
        # Task-name prefixes `inject_faults` fails; empty (the default) turns injection off.
        self.fault_injection = fault_injection
        self._running: dict[asyncio.Future[None], str] = {}
        self._injected: set[asyncio.Future[None]] = set()

    @property
    def healthy(self) -> bool:
        """No supervised task is down now."""
        return not self._down

    def start(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        on_death: Callable[[BaseException], None] | None = None,
        restart: bool = True,
    ) -> asyncio.Task[None]:
        """Runs `run()` under supervision; cancel the returned task to stop it."""
        return asyncio.create_task(self._watch(name, run, on_death, restart), name=name)

    async def _watch(self, name: str, run: Callable[[], Awaitable[None]], on_death: Callable[[BaseException], None] | None, restart: bool) -> None:
        while True:
            try:
                await self._run_once(name, run)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any death is logged, reported and handled alike
                await self._died(name, exc, on_death, restart)
            if not restart:
                return
            await asyncio.sleep(self._restart_delay_s)
            log.info("owner_task_restarted", task=name)
            await self._set(name, up=True)

    async def _run_once(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        if not self.fault_injection:
            await run()
            return
        attempt: asyncio.Future[None] = asyncio.ensure_future(run())
        self._running[attempt] = name
        try:
            await attempt
        except asyncio.CancelledError:
            if attempt in self._injected and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise InjectedFault(f"fault injected into {name}") from None
            raise
        finally:
            self._running.pop(attempt, None)
            self._injected.discard(attempt)

    def inject_faults(self) -> None:
        """Fails every running task whose name starts with a SLUICE_FAULT_INJECTION prefix."""
        for attempt, name in list(self._running.items()):
            if name.startswith(self.fault_injection):
                log.warning("fault_injected", task=name)
                self._injected.add(attempt)
                attempt.cancel()

    async def _died(self, name: str, error: BaseException, on_death: Callable[[BaseException], None] | None, restart: bool) -> None:
        log.error("owner_task_died", task=name, error=repr(error), restart=restart, exc_info=error)
        TASK_DEATHS.labels(task=name).inc()
        await self._set(name, up=False)
        if on_death is not None:
            try:
                on_death(error)
            except Exception as exc:  # noqa: BLE001 - failing the waiters must not stop the restart
                log.error("owner_task_on_death_failed", task=name, error=repr(exc), exc_info=exc)

    async def _set(self, name: str, up: bool) -> None:
        if up:
            self._down.discard(name)
        else:
            self._down.add(name)
        if self._report is not None:
            await self._report(f"task:{name}", up)


async def stop_tasks(*tasks: asyncio.Future[Any] | None, retry_s: float = 1.0) -> None:
    """Cancels the tasks and waits until each has ended, cancelling again every `retry_s`: on
    Python 3.11 a cancel that lands as `asyncio.wait_for` times out can be swallowed, and a loop
    that only a cancel ends would then run on and hang its service's shutdown."""
    pending = {task for task in tasks if task is not None}
    while pending := {task for task in pending if not task.done()}:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=retry_s)
