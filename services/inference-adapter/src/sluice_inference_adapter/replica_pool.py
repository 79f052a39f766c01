"""Several Triton replicas behind one model: least-loaded routing, health, and retry.

Routing picks the healthy replica with the fewest waiting plus running sequences (not
round robin: a replica stuck on long prompts should get less, not the same); with a
PrefixRouter (prefix_routing.py), a generation request goes instead to the replica that was
sent the longest prefix of its prompt, as long as that replica's load stays within a bound of
the least loaded one's, so that its engine's prefix cache is hit. A replica
is marked unhealthy after `failure_threshold` consecutive failures, counting both
failed steps and failed probes, and readmitted after one successful probe; every replica, those
listed at start-up too, starts unhealthy and gets work once a probe has proved it. Each replica's
probe runs on its own, bounded by `probe_timeout_s` (a probe that times out has failed), and is
recorded as soon as it answers: a replica whose probe hangs holds up no other replica's probes, and
is not probed again until its own has answered or timed out. A request
whose replica failed before it produced a token is moved to another replica; one that
already streamed tokens cannot be resumed elsewhere and ends with an error.

Replicas come and go while the adapter runs (replica_discovery.py: the pods behind a DNS name).
A new one is probed at once. One that disappears is drained: it gets no new
sequence and starts none of those waiting there (they are retried on another replica, as after a
failure before their first token: the pod stops at the end of its preStop, and one started late
would be cut there mid-stream), those it runs finish there (a sequence lives in one replica's
scheduler from prefill to its end: its KV cache is in that replica) and the token counts on their
way are answered, then its scheduler stops and its channel closes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import random
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from sluice_common.adaptive_timeout import AdaptiveTimeout
from sluice_common.errors import SluiceError, Unavailable
from sluice_common.supervision import Supervisor, stop_tasks
from sluice_inference_adapter import metrics
from sluice_inference_adapter.embed_batcher import EmbedBackend, Embeddings
from sluice_inference_adapter.prefix_routing import Candidate, PrefixRouter
from sluice_inference_adapter.sequence import Event, Finish, FinishEvent, GenerationRequest, SequenceHandle, TokenEvent
from sluice_inference_adapter.step_rows import PromptSpec
from sluice_inference_adapter.priority import Priority

log = structlog.stdlib.get_logger("sluice.replicas")

# Without an embedding timeout: the longest a removed replica's channel stays open for the batches
# still on their way to it.
EMBED_DRAIN_S = 30.0
# A probe's bound beyond its backend's own (the step timeout's ceiling, which bounds the probe's
# token): Triton's two ready checks before it (2 s each) and a margin. The pool's bound holds
# whatever a backend does; the backend's own, when it fires first, says more.
PROBE_MARGIN_S = 5.0
DEFAULT_PROBE_TIMEOUT_S = 60.0 + PROBE_MARGIN_S


class ReplicaBackend(Protocol):
    """One Triton endpoint, whatever protocol it speaks, with a health probe."""

    @property
    def url(self) -> str: ...

    async def is_ready(self) -> bool:
        """Triton's server and model ready checks alone: no forward pass."""
        ...

    async def probe(self) -> bool:
        """Ready checks plus a one-token generation; True when the replica can serve."""
        ...

    async def close(self) -> None:
        """Closes the channel; called once the replica has left the pool."""
        ...


class BatchOwner(Protocol):
    """What owns a replica's work: the step scheduler, or the passthrough scheduler."""

    @property
    def load(self) -> int: ...

    def submit(self, request: GenerationRequest) -> SequenceHandle: ...

    def start(self, supervisor: Supervisor | None = None) -> None: ...

    async def stop(self) -> None: ...

    def drain(self) -> int:
        """Starts no new sequence; hands back those waiting (as failed before their first token)."""
        ...

    def undrain(self) -> None: ...


# Builds a replica's BatchOwner; the callback reports whether each step or stream reached the backend.
SchedulerFactory = Callable[[ReplicaBackend, Callable[[bool], None]], BatchOwner]
# Builds the backend of a replica found while the adapter runs, from its address.
BackendFactory = Callable[[str], ReplicaBackend]


@dataclass(eq=False)
class Replica:
    backend: ReplicaBackend
    scheduler: BatchOwner = field(init=False)
    # No work until a probe or step succeeds: a replica listed at start-up may still be loading its
    # model, and least-loaded routing would send it requests until two probes had failed.
    healthy: bool = False
    consecutive_failures: int = 0
    # -inf: a new replica is probed at once; it has not proved itself yet.
    last_success: float = float("-inf")
    # Its address left discovery: no new sequences; removed once it holds none.
    draining: bool = False
    removed: bool = False
    # Calls made on its backend outside its scheduler (token counts) still on their way: not in its
    # load, yet closing its channel would cancel them, so a drained replica waits for them too.
    borrowed: int = 0

    @property
    def name(self) -> str:
        return self.backend.url


def least_loaded(candidates: list[Replica]) -> Replica:
    """The replica with the fewest waiting and running sequences, ties broken at random: the first in
    the list on every tie would take nearly every request of a light load (and that replica's cache
    would look like an affinity that least-loaded routing does not have)."""
    least = min(r.scheduler.load for r in candidates)
    return random.choice([r for r in candidates if r.scheduler.load == least])


class ReplicaPool:
    def __init__(
        self,
        backends: list[ReplicaBackend],
        make_scheduler: SchedulerFactory,
        failure_threshold: int = 2,
        probe_interval_s: float = 2.0,
        make_backend: BackendFactory | None = None,
        drain_poll_s: float = 0.1,
        metrics_label: str = "",
        router: PrefixRouter | None = None,
        model: str = "",
        probe_token_interval_s: float = 0.0,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
    ) -> None:
        if not backends:
            raise ValueError("a replica pool needs at least one replica")
        self._make_scheduler = make_scheduler
        self._make_backend = make_backend
        self._failure_threshold = failure_threshold
        self._probe_interval_s = probe_interval_s
        self._probe_token_interval_s = probe_token_interval_s
        self._probe_timeout_s = probe_timeout_s
        self._drain_poll_s = drain_poll_s
        # An extra model's pool on the same replicas: its per-replica series are named
        # "<address><label>" (as its schedulers' are), and the replica-state counts stay the
        # main model's; one series written by two pools would report whichever wrote last.
        self._metrics_label = metrics_label
        # Prefix-aware routing of generation requests (None: least-loaded alone); `model` labels
        # the routing decisions.
        self._router = router
        self._model = model
        self._probe_task: asyncio.Task[None] | None = None
        self._supervisor: Supervisor | None = None
        # Started on drain, cancelled on undrain; each removes its replica once it holds nothing.
        self._drains: dict[str, asyncio.Task[None]] = {}
        # Each replica's probe in flight, at most one (held so it is not garbage-collected mid-flight).
        self._probes: dict[Replica, asyncio.Task[None]] = {}
        # Told the name of each replica that left the pool (the embedder closes its own channel).
        self.on_removed: list[Callable[[str], Awaitable[None]]] = []
        self.replicas: list[Replica] = []
        for backend in backends:
            self._admit(Replica(backend))
        self._publish_states()

    def _admit(self, replica: Replica) -> None:
        # Each replica has its own batch (its own KV slots); its steps report its health.
        replica.scheduler = self._make_scheduler(replica.backend, functools.partial(self.record, replica))
        self.replicas.append(replica)
        metrics.REPLICA_HEALTHY.labels(replica=replica.name + self._metrics_label).set(1 if replica.healthy else 0)
        # Read when scraped: set as requests were routed, it kept its last value once they stopped.
        metrics.REPLICA_LOAD.labels(replica=replica.name + self._metrics_label).set_function(lambda: replica.scheduler.load)

    # -- membership (replica_discovery.PoolControl) ------------------------------------

    @property
    def names(self) -> set[str]:
        return {r.name for r in self.replicas}

    def _find(self, name: str) -> Replica:
        return next(r for r in self.replicas if r.name == name)

    def is_draining(self, name: str) -> bool:
        return self._find(name).draining

    def add(self, url: str) -> None:
        """A replica found while running: unhealthy (no work) until its first probe succeeds."""
        if self._make_backend is None:
            raise RuntimeError("this pool was built without a backend factory: it cannot add replicas")
        replica = Replica(self._make_backend(url))
        self._forget_prefixes(replica)  # an address seen before: whatever it held is gone
        self._admit(replica)
        log.info("replica_added", replica=replica.name)
        if self._supervisor is not None:
            replica.scheduler.start(self._supervisor)
            # Probed now, not at the next round: a new pod should take work as soon as it can.
            self._start_probe(replica, token=True)
        self._publish_states()

    def drain(self, name: str) -> None:
        """No new sequences go to the replica, nor start there: those waiting there are retried on
        another replica (as after a failure before their first token); it is removed once its
        running sequences have finished."""
        replica = self._find(name)
        if replica.draining:
            return
        replica.draining = True  # first: the retries of those handed back must not pick it
        handed_back = replica.scheduler.drain()
        log.info("replica_draining", replica=name, load=replica.scheduler.load, handed_back=handed_back)
        self._drains[name] = asyncio.get_running_loop().create_task(self._remove_when_idle(replica), name=f"drain@{name}")
        self._publish_states()

    def undrain(self, name: str) -> None:
        """Its address came back before it was removed: it takes new sequences again."""
        replica = self._find(name)
        if not replica.draining:
            return
        replica.draining = False
        replica.scheduler.undrain()
        task = self._drains.pop(name, None)
        if task is not None:
            task.cancel()
        log.info("replica_undrained", replica=name)
        self._publish_states()

    async def _remove_when_idle(self, replica: Replica) -> None:
        # Its load is the sequences running here now: those waiting were handed back by the drain.
        while replica.scheduler.load or replica.borrowed:
            await asyncio.sleep(self._drain_poll_s)
        await self._remove(replica)

    @contextlib.contextmanager
    def borrowed(self, replica: Replica) -> Iterator[None]:
        """Around a call of the caller's own on the replica's backend (a token count): counted while
        it runs, so that a drain does not close the channel under it."""
        replica.borrowed += 1
        try:
            yield
        finally:
            replica.borrowed -= 1

    async def _remove(self, replica: Replica) -> None:
        # Out of the pool first, so no probe or pick sees it while it stops.
        self.replicas.remove(replica)
        self._drains.pop(replica.name, None)
        replica.removed = True
        probe = self._probes.pop(replica, None)
        if probe is not None:
            probe.cancel()  # its channel closes below: its answer would be recorded nowhere
        if self._router is not None:
            self._router.forget(replica.name)
        await replica.scheduler.stop()
        await replica.backend.close()
        for listener in self.on_removed:
            await listener(replica.name)
        metrics.forget_replica(replica.name + self._metrics_label, [p.name.lower() for p in Priority])
        log.info("replica_removed", replica=replica.name)
        self._publish_states()

    def _publish_states(self) -> None:
        if self._metrics_label:
            return
        counts = {"serving": 0, "unhealthy": 0, "draining": 0}
        for replica in self.replicas:
            counts["draining" if replica.draining else "serving" if replica.healthy else "unhealthy"] += 1
        for state, count in counts.items():
            metrics.REPLICAS.labels(state=state).set(count)

    # -- health ----------------------------------------------------------------------

    def record(self, replica: Replica, ok: bool) -> None:
        if replica.removed:
            return  # a last step or probe that ended after removal: no series to bring back
        if ok:
            replica.consecutive_failures = 0
            replica.last_success = time.monotonic()
            if not replica.healthy:
                replica.healthy = True
                log.info("replica_readmitted", replica=replica.name)
        else:
            # A failed step or probe may be a restarted engine: assume its prefix cache is empty.
            self._forget_prefixes(replica)
            replica.consecutive_failures += 1
            if replica.healthy and replica.consecutive_failures >= self._failure_threshold:
                replica.healthy = False
                log.warning("replica_unhealthy", replica=replica.name, failures=replica.consecutive_failures)
        metrics.REPLICA_HEALTHY.labels(replica=replica.name + self._metrics_label).set(1 if replica.healthy else 0)
        self._publish_states()

    async def probe_once(self, within_s: float | None = None) -> None:
        """Starts the probes that are due (`start_probes`), then waits for every probe in flight to
        answer or time out, at most `within_s` (None: until each has; each is bounded by the probe
        timeout). A probe left running when the wait ends goes on, and is recorded when it ends."""
        self.start_probes()
        pending = [task for task in self._probes.values() if not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=within_s)

    def start_probes(self) -> None:
        """Probes every replica that has not proved itself by a successful step since the last round
        and has no probe in flight: with a token when it is unhealthy or has generated none for the
        token interval, else with Triton's ready checks alone, which only a failure counts (they prove
        no generation). Each probe runs on its own: none waits for another."""
        now = time.monotonic()
        for replica in self.replicas:
            running = self._probes.get(replica)
            if running is not None and not running.done():
                continue  # a stuck replica is probed again once its probe has answered or timed out
            if replica.healthy and now - replica.last_success < self._probe_interval_s:
                continue
            self._start_probe(replica, token=not replica.healthy or now - replica.last_success >= self._probe_token_interval_s)

    def _start_probe(self, replica: Replica, token: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._probe(replica, token), name=f"probe@{replica.name}{self._metrics_label}")
        self._probes[replica] = task

        def done(finished: asyncio.Task[None]) -> None:
            if self._probes.get(replica) is finished:
                del self._probes[replica]
            if not finished.cancelled() and finished.exception() is not None:
                log.error("probe_task_failed", replica=replica.name, error=repr(finished.exception()), exc_info=finished.exception())

        task.add_done_callback(done)

    async def _probe(self, replica: Replica, token: bool) -> None:
        """One replica's probe, within the probe timeout whatever its backend does (one that times
        out has failed). A token probe's outcome is recorded; of ready checks alone, only a failure."""
        result: object
        bound = asyncio.timeout(self._probe_timeout_s)
        try:
            async with bound:
                result = await (replica.backend.probe() if token else replica.backend.is_ready())
        except TimeoutError as exc:
            result = exc  # the backend's own timeout, which says which
            if bound.expired():
                metrics.TIMEOUTS.labels(kind="probe").inc()
                result = TimeoutError(f"the probe did not answer within its timeout of {self._probe_timeout_s:g}s")
        except Exception as exc:  # noqa: BLE001 - whatever the backend raised fails its probe
            result = exc
        if result is not True:
            reason = str(result) if isinstance(result, BaseException) else "not ready or no token" if token else "not ready"
            log.warning("probe_failed", replica=replica.name, reason=reason)
        if token or result is not True:
            self.record(replica, result is True)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            self.start_probes()  # not awaited: a round waits for no replica's probe

    @property
    def any_healthy(self) -> bool:
        """Some replica can take a new request (a draining one cannot)."""
        return any(r.healthy and not r.draining for r in self.replicas)

    @property
    def any_proven(self) -> bool:
        """Some healthy replica has answered a step or a probe since the adapter started."""
        return any(r.healthy and not r.draining and r.last_success > float("-inf") for r in self.replicas)

    # -- lifecycle -------------------------------------------------------------------

    def start(self, supervisor: Supervisor | None = None) -> None:
        self._supervisor = supervisor or Supervisor()
        for replica in self.replicas:
            replica.scheduler.start(self._supervisor)
        self._probe_task = self._supervisor.start("replica-probes", self._probe_forever)

    async def stop(self) -> None:
        """Stops every replica's work and closes every channel."""
        tasks = [t for t in (self._probe_task, *self._drains.values(), *self._probes.values()) if t is not None]
        await stop_tasks(*tasks)
        self._drains.clear()
        for replica in self.replicas:
            await replica.scheduler.stop()
        await asyncio.gather(*(r.backend.close() for r in self.replicas), return_exceptions=True)

    # -- routing ---------------------------------------------------------------------

    def _forget_prefixes(self, replica: Replica) -> None:
        if self._router is not None:
            self._router.forget(replica.name)
            metrics.PREFIX_RECORD_PROMPTS.labels(replica=replica.name + self._metrics_label).set(0)

    def pick(self, exclude: set[str], prompt: PromptSpec | None = None) -> Replica:
        """A healthy, undrained replica not in `exclude`: the least loaded, or, for a generation
        request's `prompt` with prefix routing on, the one its PrefixRouter chooses (which then
        remembers the prompt as sent there). Without `prompt` (token counts, embeddings) nothing
        is remembered or counted as a routing decision."""
        candidates = [r for r in self.replicas if r.healthy and not r.draining and r.name not in exclude]
        if not candidates:
            tried = f" (tried {', '.join(sorted(exclude))})" if exclude else ""
            raise Unavailable(f"no healthy Triton replica can take this request{tried}; retry shortly")
        if prompt is None:
            return least_loaded(candidates)
        if self._router is None:
            chosen = least_loaded(candidates)
            metrics.ROUTING_DECISIONS.labels(model=self._model, reason="only_replica" if len(candidates) == 1 else "load").inc()
            metrics.ROUTED_REQUESTS.labels(replica=chosen.name + self._metrics_label).inc()
            return chosen
        key = self._router.key(prompt.messages, prompt.routing_text())
        choice = self._router.choose([Candidate(r.name, r.scheduler.load) for r in candidates], key)
        chosen = next(r for r in candidates if r.name == choice.name)
        self._router.record(chosen.name, key)
        metrics.ROUTING_DECISIONS.labels(model=self._model, reason=choice.reason).inc()
        metrics.ROUTED_REQUESTS.labels(replica=chosen.name + self._metrics_label).inc()
        metrics.ROUTED_PROMPT_CHARS.labels(model=self._model).inc(key.chars)
        metrics.ROUTED_MATCHED_CHARS.labels(model=self._model).inc(choice.matched_blocks * self._router.block_chars)
        metrics.PREFIX_RECORD_PROMPTS.labels(replica=chosen.name + self._metrics_label).set(self._router.remembered(chosen.name))
        return chosen

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[Event, None]:
        """The request's events from the first replica that serves it. Each attempt is one sequence
        at one replica: its seq_id (what Triton's lines and the scheduler's failure lines name) and
        replica are bound into the call's log context, so the call's lines (its summary line among
        them) join the request id to them; a retry's line names the seq_id it leaves."""
        tried: set[str] = set()
        while True:
            replica = self.pick(exclude=tried, prompt=request.prompt)
            handle = replica.scheduler.submit(request)
            structlog.contextvars.bind_contextvars(seq_id=handle.seq_id, replica=replica.name)
            if request.arrived_at is None:  # a retry's timings count from this first submit
                request = dataclasses.replace(request, arrived_at=handle.submitted_at)
            streamed = False
            retry = False
            try:
                async for event in handle.events():
                    if isinstance(event, FinishEvent) and event.finish is Finish.ERROR and handle.backend_failed and not streamed:
                        retry = True
                        break
                    streamed |= isinstance(event, TokenEvent)
                    if isinstance(event, FinishEvent) and event.prompt_tokens and not replica.removed:
                        label = replica.name + self._metrics_label
                        metrics.PROMPT_TOKENS.labels(replica=label).inc(event.prompt_tokens)
                        metrics.GENERATION_TOKENS.labels(replica=label).inc(event.completion_tokens)
                        metrics.CACHED_PROMPT_TOKENS.labels(replica=label).inc(event.cached_tokens)
                    yield event
            finally:
                handle.cancel()
            if not retry:
                return
            tried.add(replica.name)
            metrics.RETRIES.inc()
            log.warning("retrying_on_another_replica", failed=replica.name, failed_seq_id=handle.seq_id)


class ClosableEmbedBackend(EmbedBackend, Protocol):
    async def close(self) -> None: ...


class PooledEmbedBackend:
    """Sends each embedding micro-batch to the least-loaded healthy replica (one without a batch on
    its way first), through a channel of its own per replica, opened on first use and closed when
    the replica leaves the pool.

    With `timeout`, a batch is cut off after the adaptive timeout (multiplier x the rolling p99
    of batch round trips across the pool): its callers get UNAVAILABLE naming the replica. With
    `dim`, vectors of another width are the replica's failure too (it serves another model). A
    batch cut off or failed by its replica (UNAVAILABLE) counts against the replica as a failed
    step does, and is sent once more to another healthy replica: embedding is idempotent, and a
    batch carries the texts of up to max_batch unrelated requests. Both tries together stay within
    the timeout's ceiling, the most one batch was ever allowed (callers whose deadline passes
    meanwhile leave the batcher on their own)."""

    def __init__(
        self,
        pool: ReplicaPool,
        make_backend: Callable[[str], ClosableEmbedBackend],
        timeout: AdaptiveTimeout | None = None,
        dim: int | None = None,
    ) -> None:
        self._pool = pool
        self._make_backend = make_backend
        self._by_url: dict[str, ClosableEmbedBackend] = {}
        self._timeout = timeout
        self._dim = dim
        # Batches on their way per replica: a removed replica's channel closes after them, since
        # closing a gRPC channel cancels its calls (every caller of such a batch got UNAVAILABLE).
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._landed = asyncio.Condition()
        pool.on_removed.append(self._forget)

    async def embed(self, texts: list[str]) -> Embeddings:
        started = time.perf_counter()
        first = self._pick()
        try:
            return await self._embed_on(first, texts, None if self._timeout is None else self._timeout.current())
        except Exception as exc:
            retry = self._retry_plan(first, time.perf_counter() - started) if _replica_failed(exc) else None
            if retry is None:
                raise
            log.warning("embed_retrying_on_another_replica", failed=first.name, error=str(exc), texts=len(texts))
        second, limit = retry
        return await self._embed_on(second, texts, limit)

    def _pick(self) -> Replica:
        """A healthy replica with no batch of this model on its way, the least loaded of them; else the
        least loaded: a batch stuck on a wedged replica then holds up no later batch while another
        replica is idle (the batcher sends several at once, EMBED_MAX_IN_FLIGHT)."""
        busy = {name for name, batches in self._in_flight.items() if batches > 0}
        if busy:
            try:
                return self._pool.pick(exclude=busy)
            except Unavailable:
                pass  # every healthy replica has a batch on its way
        return self._pool.pick(exclude=set())

    def _retry_plan(self, failed: Replica, elapsed_s: float) -> tuple[Replica, float | None] | None:
        """Another replica for a batch `failed` failed, and the retry's limit; None when there is
        none, or when what is left of the ceiling is under the floor (it would cut even a healthy batch)."""
        limit = None
        if self._timeout is not None:
            left = self._timeout.policy.ceiling_s - elapsed_s
            if left < self._timeout.policy.floor_s:
                return None
            limit = min(self._timeout.current(), left)
        try:
            return self._pool.pick(exclude={failed.name}), limit
        except Unavailable:
            return None  # no other healthy replica: the callers learn what the first one did

    async def _embed_on(self, replica: Replica, texts: list[str], limit: float | None) -> Embeddings:
        name = replica.name
        if name not in self._by_url:
            self._by_url[name] = self._make_backend(name)
        backend = self._by_url[name]
        self._in_flight[name] += 1
        try:
            if limit is None:
                embeddings = await backend.embed(texts)
            else:
                embeddings = await self._embed_within(backend, name, texts, limit)
            self._check_width(name, embeddings)
            return embeddings
        except Exception as exc:
            if _replica_failed(exc):
                self._pool.record(replica, ok=False)
            raise
        finally:
            self._in_flight[name] -= 1
            async with self._landed:
                self._landed.notify_all()

    def _check_width(self, name: str, embeddings: Embeddings) -> None:
        """Vectors of another width than the model's: this replica serves another model, and the
        batcher could not put its rows beside a caller's other rows."""
        shape = np.shape(embeddings.vectors)
        if self._dim is not None and len(shape) == 2 and shape[1] != self._dim:
            raise Unavailable(f"Triton replica {name} answered vectors of width {shape[1]}; the model's dimension is {self._dim}")

    async def _embed_within(self, backend: ClosableEmbedBackend, name: str, texts: list[str], limit: float) -> Embeddings:
        assert self._timeout is not None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(limit):
                embeddings = await backend.embed(texts)
        except TimeoutError:
            self._timeout.observe_timeout(limit)
            metrics.TIMEOUTS.labels(kind="embed_batch").inc()
            metrics.REQUEST_TIMEOUT.labels(kind="embed_batch").set(self._timeout.current())
            log.warning("embed_batch_timed_out", replica=name, timeout_s=round(limit, 3), texts=len(texts))
            raise Unavailable(
                f"Triton replica {name} did not embed a batch of {len(texts)} texts within its timeout of {limit:.2f}s"
                f" ({self._timeout.policy.multiplier:g}x the p99 of recent batches, within"
                f" [{self._timeout.policy.floor_s:g}s, {self._timeout.policy.ceiling_s:g}s]); retry"
            ) from None
        self._timeout.observe(time.perf_counter() - started)
        metrics.REQUEST_TIMEOUT.labels(kind="embed_batch").set(self._timeout.current())
        return embeddings

    async def _forget(self, name: str) -> None:
        """A removed replica: no new batch goes to it; its channel closes once the batches on their
        way have landed (within the embedding timeout's ceiling, EMBED_DRAIN_S without one)."""
        backend = self._by_url.pop(name, None)
        if backend is None:
            return
        within_s = self._timeout.policy.ceiling_s if self._timeout is not None else EMBED_DRAIN_S
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s), self._landed:
                await self._landed.wait_for(lambda: self._in_flight[name] <= 0)
        self._in_flight.pop(name, None)
        await backend.close()

    async def close(self) -> None:
        backends, self._by_url = list(self._by_url.values()), {}
        await asyncio.gather(*(b.close() for b in backends), return_exceptions=True)


def _replica_failed(exc: Exception) -> bool:
    """UNAVAILABLE (the replica failed, cut off or misanswered the batch) or a transport error is the
    replica's failure, counted as a failed step is; another SluiceError is about the request."""
    return isinstance(exc, Unavailable) or not isinstance(exc, SluiceError)
