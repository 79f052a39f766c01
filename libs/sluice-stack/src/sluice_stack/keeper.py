"""Keeps the local stack serving like a cluster would: a service that exits is reported and
started again; the others go on serving meanwhile.

A service that keeps dying young (within `min_uptime_s` of its start) waits longer before each
new start, doubling up to `max_backoff_s`, as a crash-looping pod does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from sluice_stack.launcher import ServiceProcess


class ServiceKeeper:
    def __init__(
        self,
        services: Iterable[ServiceProcess],
        say: Callable[[str], None],
        min_uptime_s: float = 30.0,
        first_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
    ) -> None:
        self._services = list(services)
        self._say = say
        self._min_uptime_s = min_uptime_s
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._started_at = {s.name: time.monotonic() for s in self._services}
        # When each exited service is due to start again.
        self._restart_at: dict[str, float] = {}
        self._starting: set[str] = set()
        self._backoff = {s.name: first_backoff_s for s in self._services}
        self.restarted: dict[str, int] = {s.name: 0 for s in self._services}

    def poll(self, now: float | None = None) -> None:
        """One look at every service: reports exits, starts what is due, reports it ready."""
        now = time.monotonic() if now is None else now
        for service in self._services:
            if service.name in self._restart_at:
                self._start_when_due(service, now)
            elif service.process is not None and service.process.poll() is not None:
                self._schedule(service, now)
            elif service.name in self._starting and service.is_ready():
                self._starting.discard(service.name)
                self._say(f"{service.name} is serving again")

    def _schedule(self, service: ServiceProcess, now: float) -> None:
        young = now - self._started_at[service.name] < self._min_uptime_s
        backoff = min(self._backoff[service.name] * 2, self._max_backoff_s) if young else self._first_backoff_s
        self._backoff[service.name] = backoff
        self._restart_at[service.name] = now + backoff
        self._starting.discard(service.name)
        code = service.process.returncode if service.process is not None else None
        self._say(f"{service.name} exited with code {code}; starting it again in {backoff:.0f} s (log: {service.log_path})")

    def _start_when_due(self, service: ServiceProcess, now: float) -> None:
        if now < self._restart_at[service.name]:
            return
        del self._restart_at[service.name]
        service.start()
        self._started_at[service.name] = now
        self._starting.add(service.name)
        self.restarted[service.name] += 1
