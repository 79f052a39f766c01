"""Several Triton replicas behind one model: least-loaded routing, health, and retry.

Routing picks the healthy replica with the fewest waiting plus running sequences (not
round robin: a replica stuck on long prompts should get less, not the same). A replica
is marked unhealthy after `failure_threshold` consecutive failures, counting both
failed steps and failed probes, and readmitted after one successful probe. A request
whose replica failed before it produced a token is moved to another replica; one that
already streamed tokens cannot be resumed elsewhere and ends with an error.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from sluice_common.errors import Unavailable
from sluice_common.supervision import Supervisor
from sluice_inference_adapter import metrics
from sluice_inference_adapter.embed_batcher import EmbedBackend, Embeddings
from sluice_inference_adapter.scheduler import (
    Event,
    Finish,
    FinishEvent,
    GenerationRequest,
    SequenceHandle,
    TokenEvent,
)

log = structlog.stdlib.get_logger("sluice.replicas")


class ReplicaBackend(Protocol):
    """One Triton endpoint, whatever protocol it speaks, with a health probe."""

    @property
    def url(self) -> str: ...

    async def probe(self) -> bool:
        """Ready checks plus a one-token generation; True when the replica can serve."""
        ...


class BatchOwner(Protocol):
    """What owns a replica's work: the step scheduler, or the passthrough scheduler."""

    @property
    def load(self) -> int: ...

    def submit(self, request: GenerationRequest) -> SequenceHandle: ...

    def start(self, supervisor: Supervisor | None = None) -> None: ...

    async def stop(self) -> None: ...


# Builds a replica's BatchOwner; the callback reports whether each step or stream reached the backend.
SchedulerFactory = Callable[[ReplicaBackend, Callable[[bool], None]], BatchOwner]


@dataclass(eq=False)
class Replica:
    backend: ReplicaBackend
    scheduler: BatchOwner = field(init=False)
    healthy: bool = True
    consecutive_failures: int = 0
    # -inf: a new replica is probed at once; it has not proved itself yet.
    last_success: float = float("-inf")


    @property
    def name(self) -> str:
        return self.backend.url


class ReplicaPool:
    def __init__(
        self,
        backends: list[ReplicaBackend],
        make_scheduler: SchedulerFactory,
        failure_threshold: int = 2,
        probe_interval_s: float = 2.0,
    ) -> None:
        if not backends:
            raise ValueError("a replica pool needs at least one replica")
        self.replicas = [Replica(backend) for backend in backends]
        for replica in self.replicas:
            # Each replica has its own batch (its own KV slots); its steps report its health.
            replica.scheduler = make_scheduler(replica.backend, functools.partial(self.record, replica))
        self._failure_threshold = failure_threshold
        self._probe_interval_s = probe_interval_s
        self._probe_task: asyncio.Task[None] | None = None
        for replica in self.replicas:
            metrics.REPLICA_HEALTHY.labels(replica=replica.name).set(1)

    # -- health ----------------------------------------------------------------------

    def record(self, replica: Replica, ok: bool) -> None:
        if ok:
            replica.consecutive_failures = 0
            replica.last_success = time.monotonic()
            if not replica.healthy:
                replica.healthy = True
                log.info("replica_readmitted", replica=replica.name)
        else:
            replica.consecutive_failures += 1
            if replica.healthy and replica.consecutive_failures >= self._failure_threshold:
                replica.healthy = False
                log.warning("replica_unhealthy", replica=replica.name, failures=replica.consecutive_failures)
        metrics.REPLICA_HEALTHY.labels(replica=replica.name).set(1 if replica.healthy else 0)

    async def probe_once(self) -> None:
        """Probes every replica that has not proved itself by a successful step since the last round."""
        now = time.monotonic()
        due = [r for r in self.replicas if not r.healthy or now - r.last_success >= self._probe_interval_s]
        results = await asyncio.gather(*(r.backend.probe() for r in due), return_exceptions=True)
        for replica, result in zip(due, results):
            if result is not True:
                reason = str(result) if isinstance(result, BaseException) else "not ready or no token"
                log.warning("probe_failed", replica=replica.name, reason=reason)
            self.record(replica, result is True)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            await self.probe_once()

    @property
    def any_healthy(self) -> bool:
        return any(r.healthy for r in self.replicas)

    @property
    def any_proven(self) -> bool:
        """Some healthy replica has answered a step or a probe since the adapter started."""
        return any(r.healthy and r.last_success > float("-inf") for r in self.replicas)

    # -- lifecycle -------------------------------------------------------------------

    def start(self, supervisor: Supervisor | None = None) -> None:
        supervisor = supervisor or Supervisor()
        for replica in self.replicas:
            replica.scheduler.start(supervisor)
        self._probe_task = supervisor.start("replica-probes", self._probe_forever)

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            await asyncio.gather(self._probe_task, return_exceptions=True)
        for replica in self.replicas:
            await replica.scheduler.stop()

    # -- routing ---------------------------------------------------------------------

    def pick(self, exclude: set[str]) -> Replica:
        candidates = [r for r in self.replicas if r.healthy and r.name not in exclude]
        if not candidates:
            tried = f" (tried {', '.join(sorted(exclude))})" if exclude else ""
            raise Unavailable(f"no healthy Triton replica can take this request{tried}; retry shortly")
        for replica in self.replicas:
            metrics.REPLICA_LOAD.labels(replica=replica.name).set(replica.scheduler.load)
        return min(candidates, key=lambda r: r.scheduler.load)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """The request's events from the first replica that serves it."""
        tried: set[str] = set()
        while True:
            replica = self.pick(exclude=tried)
            handle = replica.scheduler.submit(request)
            streamed = False
            retry = False
            try:
                async for event in handle.events():
                    if isinstance(event, FinishEvent) and event.finish is Finish.ERROR and handle.backend_failed and not streamed:
                        retry = True
                        break
                    streamed |= isinstance(event, TokenEvent)
                    yield event
            finally:
                handle.cancel()
            if not retry:
                return
            tried.add(replica.name)
            metrics.RETRIES.inc()
            log.warning("retrying_on_another_replica", failed=replica.name)


class PooledEmbedBackend:
    """Sends each embedding micro-batch to the least-loaded healthy replica."""

    def __init__(self, pool: ReplicaPool, by_url: dict[str, EmbedBackend]) -> None:
        self._pool = pool
        self._by_url = by_url

    async def embed(self, texts: list[str]) -> Embeddings:
        return await self._by_url[self._pool.pick(exclude=set()).name].embed(texts)
