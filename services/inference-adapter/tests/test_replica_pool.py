"""Routing, health and retry across replicas, with step models that stand in for Triton replicas.

conftest's `StepReplica` follows the step protocol and can be switched to fail, as a crashed
Triton does; the real two-replica path is tested in
tests/e2e/test_replicas.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest
import structlog
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from conftest import StepReplica, collect, run_through
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2

from sluice_common.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from sluice_common.config import ConfigError, load_config
from sluice_common.errors import Unavailable
from sluice_common.request_context import bind_request_id
from sluice_common.sampling import Sampling
from sluice_inference_adapter.__main__ import wait_for_a_healthy_replica
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.embed_batcher import Embeddings
from sluice_inference_adapter.prefix_routing import PrefixRouter
from sluice_inference_adapter.replica_pool import PooledEmbedBackend, ReplicaPool
from sluice_inference_adapter.sequence import Finish, FinishEvent, GenerationRequest
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.servicer import InferenceServicer
from sluice_inference_adapter.step_rows import FINISH_ERROR, Action, PromptSpec, StepOutcome, StepRow


def make_pool(*models: StepReplica, threshold: int = 2) -> ReplicaPool:
    limits = SchedulerLimits(max_batch_size=4)
    return ReplicaPool(list(models), lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), threshold, 0.05)


def request() -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(prompt="p"), Sampling(max_tokens=3))


async def run(pool: ReplicaPool) -> tuple[int, FinishEvent]:
    return await run_through(pool, request())


async def test_least_loaded_replica_gets_the_request() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = make_pool(a, b)
    await pool.probe_once()  # as the adapter does before it serves: no replica gets work unproven
    busy = [pool.replicas[0].scheduler.submit(request()) for _ in range(3)]  # queued on a, not started
    assert pool.pick(exclude=set()).name == "b"
    for handle in busy:
        handle.cancel()


async def test_a_failed_replica_is_skipped_and_the_request_retried_elsewhere() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = make_pool(a, b)
    await pool.probe_once()
    a.failing = True  # crashed after it had proved itself
    pool.start()
    try:
        results = await asyncio.gather(*(run(pool) for _ in range(6)))
    finally:
        await pool.stop()
    assert all(finish.finish is Finish.LENGTH and tokens == 3 for tokens, finish in results)
    assert b.prefills == 6


async def test_unhealthy_after_consecutive_failures_and_readmitted_after_a_good_probe() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = make_pool(a, b, threshold=2)
    replica_a = pool.replicas[0]
    await pool.probe_once()
    a.failing = True
    await asyncio.sleep(0.06)  # a probe proved it: not due again before the interval
    await pool.probe_once()
    assert replica_a.healthy  # one failure is not enough
    await asyncio.sleep(0.06)
    await pool.probe_once()
    assert not replica_a.healthy
    assert pool.pick(exclude=set()).name == "b"
    a.failing = False
    await pool.probe_once()
    assert replica_a.healthy


def token_interval_pool(*models: StepReplica) -> ReplicaPool:
    """Probes every 50 ms; a healthy replica's probe generates a token only after a minute without one."""
    limits = SchedulerLimits(max_batch_size=4)
    return ReplicaPool(list(models), lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 2, 0.05, probe_token_interval_s=60.0)


async def test_a_healthy_idle_replica_gets_ready_checks_and_a_token_only_once_the_token_interval_has_passed() -> None:
    a = StepReplica("a")
    pool = token_interval_pool(a)
    replica = pool.replicas[0]
    await pool.probe_once()  # a new replica proves itself with a token
    assert (a.token_probes, a.ready_checks) == (1, 0) and replica.healthy
    replica.last_success -= 1.0  # idle for a second: due, but within the token interval
    await pool.probe_once()
    await pool.probe_once()
    assert (a.token_probes, a.ready_checks) == (1, 2) and replica.healthy
    replica.last_success -= 60.0  # a minute without a token
    await pool.probe_once()
    assert (a.token_probes, a.ready_checks) == (2, 2)
    await pool.probe_once()  # that token counts as the proof: not due again yet
    assert (a.token_probes, a.ready_checks) == (2, 2)


async def test_failed_ready_checks_make_a_replica_unhealthy_and_only_a_token_readmits_it() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = token_interval_pool(a, b)
    await pool.probe_once()
    replica_a = pool.replicas[0]
    replica_a.last_success -= 1.0
    a.failing = True  # Triton down: its ready checks fail
    await pool.probe_once()
    assert replica_a.healthy and replica_a.consecutive_failures == 1
    replica_a.last_success -= 1.0
    await pool.probe_once()
    assert not replica_a.healthy and a.token_probes == 1  # ready checks alone took it out
    assert pool.pick(exclude=set()).name == "b"
    a.failing = False
    await pool.probe_once()  # unhealthy: probed with a token, readmitted on it
    assert replica_a.healthy and a.token_probes == 2


async def test_a_ready_check_proves_no_generation() -> None:
    """A replica that answers its ready checks but cannot generate: a passing ready check clears none
    of its failures, and the token probe once the interval has passed counts against it."""
    a = StepReplica("a")
    pool = token_interval_pool(a)
    replica = pool.replicas[0]
    await pool.probe_once()
    pool.record(replica, ok=False)  # a failed step
    replica.last_success -= 1.0
    await pool.probe_once()
    assert a.ready_checks == 1 and replica.consecutive_failures == 1
    a.probes_ok = False
    replica.last_success -= 60.0
    await pool.probe_once()
    assert a.token_probes == 2 and not replica.healthy


async def test_no_healthy_replica_is_unavailable() -> None:
    a = StepReplica("a")
    pool = make_pool(a, threshold=1)
    a.failing = True
    await pool.probe_once()
    with pytest.raises(Unavailable, match="no healthy Triton replica"):
        pool.pick(exclude=set())


async def test_a_replica_is_proven_only_after_it_answered() -> None:
    a = StepReplica("a")
    pool = make_pool(a)
    assert not pool.any_healthy and not pool.any_proven  # no work until a probe has proved it
    await pool.probe_once()
    assert pool.any_proven
    a.failing = True
    for _ in range(2):
        await asyncio.sleep(0.06)
        await pool.probe_once()
    assert not pool.any_healthy and not pool.any_proven


async def test_a_replica_known_at_start_up_gets_no_work_until_it_has_answered_a_probe() -> None:
    """Start-up waits for one proven replica (wait_for_a_healthy_replica); another one, listed but
    not ready, was taken as healthy until two probes failed, and least-loaded routing picked it."""
    a, b = StepReplica("a"), StepReplica("b")
    b.probes_ok = False  # listed, its model still loading
    pool = make_pool(a, b)
    assert not pool.any_healthy
    await asyncio.wait_for(wait_for_a_healthy_replica(pool, timeout_s=5.0), 1.0)  # serves once a answered
    assert [r.healthy for r in pool.replicas] == [True, False]
    assert {pool.pick(exclude=set()).name for _ in range(50)} == {"a"}
    b.probes_ok = True
    await pool.probe_once()
    assert pool.replicas[1].healthy


class HangingProbeReplica(StepReplica):
    """A replica whose token probe never answers while `probe_hangs` (an engine wedged mid-forward
    whose Triton still answers its ready checks); it answers its probes once that is cleared."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.probe_hangs = True

    async def probe(self) -> bool:
        self.token_probes += 1
        if self.probe_hangs:
            await asyncio.Event().wait()
        return self.probes_ok and not self.failing


def hanging_pool(*models: StepReplica, probe_timeout_s: float | None = None) -> ReplicaPool:
    """Probes every 50 ms, each within `probe_timeout_s` (None: the default, longer than any test)."""
    limits = SchedulerLimits(max_batch_size=4)
    bound = {} if probe_timeout_s is None else {"probe_timeout_s": probe_timeout_s}
    return ReplicaPool(list(models), lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 2, 0.05, **bound)  # type: ignore[arg-type]


async def test_a_replica_whose_probe_hangs_holds_up_no_other_replicas_readmission() -> None:
    """Every replica's probes were awaited together, without a bound: one hung probe stalled every
    round for ever, and a healthy replica that had a blip was never readmitted."""
    hung, good = HangingProbeReplica("hung"), StepReplica("good")
    pool = hanging_pool(hung, good)
    hung_replica, good_replica = pool.replicas
    pool.start()
    try:
        await _soon(lambda: good_replica.healthy, within_s=2.0)
        for _ in range(2):
            pool.record(good_replica, ok=False)  # a blip: two failed steps took it out
        assert not good_replica.healthy
        await _soon(lambda: good_replica.healthy, within_s=2.0)  # readmitted by its own probe
        assert good.token_probes >= 2
        assert hung.token_probes == 1 and not hung_replica.healthy  # one probe in flight, not one per round
    finally:
        await pool.stop()


async def test_a_probe_that_never_answers_fails_within_the_probe_timeout() -> None:
    from prometheus_client import REGISTRY

    def probe_timeouts() -> float:
        return REGISTRY.get_sample_value("sluice_adapter_timeouts_total", {"kind": "probe"}) or 0.0

    hung, good = HangingProbeReplica("hung"), StepReplica("good")
    pool = hanging_pool(hung, good, probe_timeout_s=0.1)
    hung_replica, good_replica = pool.replicas
    before = probe_timeouts()
    await asyncio.wait_for(pool.probe_once(), 1.0)
    assert good_replica.healthy and not hung_replica.healthy
    assert hung_replica.consecutive_failures == 1 and probe_timeouts() == before + 1
    await asyncio.wait_for(pool.probe_once(), 1.0)  # probed again: its last probe timed out
    assert hung.token_probes == 2 and hung_replica.consecutive_failures == 2
    hung.probe_hangs = False
    await asyncio.wait_for(pool.probe_once(), 1.0)
    assert hung_replica.healthy


async def test_start_up_waits_for_no_probe_that_hangs() -> None:
    """wait_for_a_healthy_replica waited for every replica's probe: one hung replica kept the adapter
    from serving beside a healthy one, and with no healthy one BACKEND_WAIT_S never fired."""
    hung, good = HangingProbeReplica("hung"), StepReplica("good")
    pool = hanging_pool(hung, good)
    try:
        await asyncio.wait_for(wait_for_a_healthy_replica(pool, timeout_s=5.0), 2.0)
        assert [r.healthy for r in pool.replicas] == [False, True]
    finally:
        await pool.stop()
    alone = hanging_pool(HangingProbeReplica("hung"))
    try:
        with pytest.raises(SystemExit, match="no Triton replica generated a token within"):
            async with asyncio.timeout(3.0):  # in this task: SystemExit out of another would stop the loop
                await wait_for_a_healthy_replica(alone, timeout_s=0.3)
    finally:
        await alone.stop()


def test_an_extra_models_pool_on_the_same_replica_keeps_its_own_health_series() -> None:
    """Two pools on one address (the main model and an extra one): each reports its own view;
    one series written by both would say 'healthy' while the main model still thought otherwise."""
    from prometheus_client import REGISTRY

    def healthy(replica: str) -> float | None:
        return REGISTRY.get_sample_value("sluice_adapter_replica_healthy", {"replica": replica})

    main_backend, extra_backend = StepReplica("10.9.9.9:8001"), StepReplica("10.9.9.9:8001")
    limits = SchedulerLimits(max_batch_size=4)
    main = ReplicaPool([main_backend], lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 1, 0.05)
    extra = ReplicaPool([extra_backend], lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 1, 0.05, metrics_label="#m-q4")
    main.record(main.replicas[0], ok=False)
    extra.record(extra.replicas[0], ok=True)
    assert healthy("10.9.9.9:8001") == 0 and healthy("10.9.9.9:8001#m-q4") == 1


class FailingEmbedder:
    """An embedding replica that answers UNAVAILABLE, as TritonEmbedBackend does for a failed request."""

    async def embed(self, texts: list[str]) -> Embeddings:
        raise Unavailable("Triton at a failed to embed with minilm_embed: model is unavailable")

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("timeout", [None, AdaptiveTimeout(TimeoutPolicy(floor_s=0.5, ceiling_s=30.0, min_samples=10))], ids=["fixed", "adaptive"])
async def test_embedding_failures_count_against_the_replica_as_step_failures_do(timeout: AdaptiveTimeout | None) -> None:
    """Issue 22: only a batch cut off by the adaptive timeout counted; a replica answering UNAVAILABLE
    to every batch stayed healthy and kept getting them."""
    a = StepReplica("a")
    pool = make_pool(a, threshold=2)
    await pool.probe_once()
    backend = PooledEmbedBackend(pool, lambda url: FailingEmbedder(), timeout)
    for _ in range(2):
        with pytest.raises(Unavailable, match="failed to embed"):
            await backend.embed(["x"])
    assert not pool.replicas[0].healthy
    with pytest.raises(Unavailable, match="no healthy Triton replica"):
        await backend.embed(["x"])


class AnsweringEmbedder:
    """A healthy embedding replica: ones, `width` wide."""

    def __init__(self, width: int = 3) -> None:
        self.width = width
        self.batches: list[list[str]] = []

    async def embed(self, texts: list[str]) -> Embeddings:
        self.batches.append(list(texts))
        return Embeddings(vectors=np.ones((len(texts), self.width), dtype=np.float32), tokens=None)

    async def close(self) -> None:
        pass


class StuckEmbedder(AnsweringEmbedder):
    """A replica that takes every batch and never answers (a wedged pod)."""

    async def embed(self, texts: list[str]) -> Embeddings:
        self.batches.append(list(texts))
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def _a_picked_first(*backends: StepReplica) -> tuple[ReplicaPool, list]:
    """A pool whose least-loaded pick is "a" (the others hold queued sequences); its handles."""
    pool = make_pool(*backends)
    await pool.probe_once()
    busy = [r.scheduler.submit(request()) for r in pool.replicas if r.name != "a"]  # queued, not started
    return pool, busy


async def test_a_failed_embedding_batch_is_retried_once_on_another_replica() -> None:
    """A batch failing on one replica failed all its callers (of unrelated requests) although
    embedding is idempotent and a healthy replica was there."""
    pool, busy = await _a_picked_first(StepReplica("a"), StepReplica("b"))
    healthy = AnsweringEmbedder()
    backend = PooledEmbedBackend(pool, lambda url: FailingEmbedder() if url == "a" else healthy)
    result = await backend.embed(["x", "y"])
    assert result.vectors.shape == (2, 3) and healthy.batches == [["x", "y"]]
    a, b = pool.replicas
    assert (a.consecutive_failures, b.consecutive_failures) == (1, 0)  # the failure still counts against a
    for handle in busy:
        handle.cancel()


async def test_an_embedding_batch_answered_in_another_width_counts_against_its_replica_and_moves() -> None:
    """A replica serving another embedding model answered vectors the batcher could not hand out."""
    pool, busy = await _a_picked_first(StepReplica("a"), StepReplica("b"))
    other_model, healthy = AnsweringEmbedder(width=8), AnsweringEmbedder(width=3)
    backend = PooledEmbedBackend(pool, lambda url: other_model if url == "a" else healthy, dim=3)
    result = await backend.embed(["x"])
    assert result.vectors.shape == (1, 3) and other_model.batches == healthy.batches == [["x"]]
    assert pool.replicas[0].consecutive_failures == 1
    pool.replicas[1].healthy = False  # nowhere else to go: the callers learn what a answered
    with pytest.raises(Unavailable, match="replica a answered vectors of width 8; the model's dimension is 3"):
        await backend.embed(["x"])
    for handle in busy:
        handle.cancel()


async def test_a_batch_cut_off_by_the_timeout_is_retried_within_the_timeout_budget() -> None:
    """The retry gets the learned limit, and both tries together stay within the ceiling (the
    most a batch was ever allowed): a batch that used the whole ceiling is not tried again."""
    pool, busy = await _a_picked_first(StepReplica("a"), StepReplica("b"))
    timeout = AdaptiveTimeout(TimeoutPolicy(floor_s=0.05, ceiling_s=0.4, min_samples=3))
    stuck, healthy = StuckEmbedder(), AnsweringEmbedder()
    backend = PooledEmbedBackend(pool, lambda url: stuck if url == "a" else healthy, timeout)
    for _ in range(3):
        timeout.observe(0.01)  # learned: the limit is the 0.05 s floor
    started = asyncio.get_running_loop().time()
    result = await asyncio.wait_for(backend.embed(["x"]), 2.0)
    assert result.vectors.shape == (1, 3) and healthy.batches == [["x"]]
    assert asyncio.get_running_loop().time() - started < 0.3
    assert pool.replicas[0].consecutive_failures == 1

    cold = AdaptiveTimeout(TimeoutPolicy(floor_s=0.05, ceiling_s=0.2, min_samples=100))  # not warmed up: the ceiling
    backend = PooledEmbedBackend(pool, lambda url: stuck if url == "a" else healthy, cold)
    with pytest.raises(Unavailable, match="replica a did not embed"):
        await asyncio.wait_for(backend.embed(["y"]), 2.0)
    assert healthy.batches == [["x"]]  # the ceiling was spent on a: no second try
    for handle in busy:
        handle.cancel()


async def test_an_embedding_batch_stuck_on_a_replica_holds_up_no_later_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter built its batcher with one batch in flight: a batch stuck on a wedged replica held
    every later Embed caller until the embedding timeout (30 s cold) cut it off, though another
    replica was idle."""
    from sluice_common.supervision import Supervisor
    from sluice_inference_adapter import __main__ as adapter_main

    pool, busy = await _a_picked_first(StepReplica("a"), StepReplica("b"))  # the first batch goes to a
    stuck, healthy = StuckEmbedder(width=384), AnsweringEmbedder(width=384)
    monkeypatch.setattr(adapter_main, "TritonEmbedBackend", lambda url, model: stuck if url == "a" else healthy)
    config = AdapterConfig(embed_max_delay_s=0.0, embed_cache_bytes=0)  # EMBED_MAX_IN_FLIGHT as the adapter's default
    built = adapter_main.build_embedder(config, pool, Supervisor())
    assert built is not None
    batcher, backends, front = built
    first = asyncio.create_task(front.embed(["x"]))
    try:
        await _soon(lambda: stuck.batches == [["x"]])
        second = await asyncio.wait_for(front.embed(["y"]), 2.0)
        assert second.vectors.shape == (1, 384) and healthy.batches == [["y"]]
        assert not first.done()  # still on a, within its timeout
    finally:
        first.cancel()
        await batcher.stop()
        await backends.close()
        for handle in busy:
            handle.cancel()


def test_embed_max_in_flight_is_checked_when_the_adapter_starts() -> None:
    assert load_config(AdapterConfig, ENV_PREFIX, {}).embed_max_in_flight == 2
    assert load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}EMBED_MAX_IN_FLIGHT": "3"}).embed_max_in_flight == 3
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}EMBED_MAX_IN_FLIGHT must be >= 1"):
        load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}EMBED_MAX_IN_FLIGHT": "0"})


class HeldCalls:
    """Calls that wait to be let go, and a close that cancels those in flight, as closing a gRPC
    channel does (recording how many there were)."""

    def __init__(self) -> None:
        self.let_go = asyncio.Event()
        self.calls: set[asyncio.Future[bool]] = set()
        self.closed_with: list[int] = []  # calls still in flight when it was closed

    async def held(self) -> None:
        call = asyncio.ensure_future(self.let_go.wait())
        self.calls.add(call)
        try:
            await call
        finally:
            self.calls.discard(call)

    def cut(self) -> None:
        self.closed_with.append(len(self.calls))
        for call in self.calls:
            call.cancel()


class HeldEmbedder(HeldCalls):
    """An embedding replica whose batches wait to be let go."""

    async def embed(self, texts: list[str]) -> Embeddings:
        await self.held()
        return Embeddings(vectors=np.ones((len(texts), 3), dtype=np.float32), tokens=None)

    async def close(self) -> None:
        self.cut()


async def test_a_drained_replica_closes_its_embedding_channel_after_the_batch_on_its_way() -> None:
    """A replica with no generation load was removed at once when drained, and closing its channel
    cancelled the embedding batch in flight: every caller in it got UNAVAILABLE."""
    a = StepReplica("a")
    pool = make_pool(a)
    await pool.probe_once()
    embedder = HeldEmbedder()
    backend = PooledEmbedBackend(pool, lambda url: embedder)
    batch = asyncio.create_task(backend.embed(["x", "y"]))
    await asyncio.sleep(0.01)
    pool.drain("a")  # its address left DNS; the pod still answers
    await _soon(lambda: pool.replicas == [])
    await asyncio.sleep(0.05)
    assert embedder.closed_with == []  # out of the pool, its channel still open
    embedder.let_go.set()
    vectors = await asyncio.wait_for(batch, 5)
    assert vectors.vectors.shape == (2, 3)
    await _soon(lambda: embedder.closed_with != [])
    assert embedder.closed_with == [0]  # closed once nothing was on its way


class HeldCountReplica(StepReplica):
    """A replica whose token counts wait to be let go (its `held`)."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.held = HeldCalls()

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if rows[0].action is not Action.COUNT:
            return await super().step(rows)
        await self.held.held()
        return [StepOutcome(-1, "", "", 7, 0)]

    async def close(self) -> None:
        self.held.cut()
        await super().close()


class NoDeadline:
    def time_remaining(self) -> float | None:
        return None


async def test_a_drained_replica_closes_its_channel_after_the_token_count_on_its_way() -> None:
    """A token count is no sequence of the replica's scheduler: a drained replica with none was
    removed at once, and closing its channel cancelled the count (the gateway fell back to an estimate)."""
    a = HeldCountReplica("a")
    pool = make_pool(a)
    await pool.probe_once()
    servicer = InferenceServicer(types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048), None)
    servicer.attach(pool, None)
    count = asyncio.create_task(servicer.CountTokens(inference_pb2.CountTokensRequest(model="gen", prompt="p"), NoDeadline()))  # type: ignore[arg-type]
    await _soon(lambda: bool(a.held.calls))
    pool.drain("a")  # its address left DNS; the pod still answers
    await asyncio.sleep(0.3)  # three drain polls
    assert a.held.closed_with == [] and pool.replicas != [], "removed and closed while the count was on its way"
    a.held.let_go.set()
    response = await asyncio.wait_for(count, 5)
    assert response.prompt_tokens == 7
    await _soon(lambda: pool.replicas == [] and a.held.closed_with != [])
    assert a.held.closed_with == [0]  # closed once nothing was on its way


class CountReplica(StepReplica):
    """A replica that counts every prompt as 7 tokens, or, `count_fails`, answers UNAVAILABLE as
    TritonStepBackend does when Triton fails the step or its channel is closed."""

    def __init__(self, url: str, count_fails: bool = False) -> None:
        super().__init__(url)
        self.count_fails = count_fails
        self.counts = 0

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if rows[0].action is not Action.COUNT:
            return await super().step(rows)
        self.counts += 1
        if self.count_fails:
            raise Unavailable(f"Triton at {self.url} failed a step of smollm2_step: Socket closed")
        return [StepOutcome(-1, "", "", 7, 0)]


async def test_a_token_count_a_replica_fails_counts_against_it_and_is_asked_of_another() -> None:
    """An UNAVAILABLE from the replica went straight to the caller (the gateway then estimated),
    neither counted against the replica nor tried on another, though counting is idempotent."""
    a, b = CountReplica("a", count_fails=True), CountReplica("b")
    pool, busy = await _a_picked_first(a, b)
    servicer = InferenceServicer(types_pb2.ModelInfo(name="gen", kind=types_pb2.MODEL_KIND_GENERATION, context_length=2048), None)
    servicer.attach(pool, None)
    count = inference_pb2.CountTokensRequest(model="gen", prompt="p")
    response = await servicer.CountTokens(count, NoDeadline())  # type: ignore[arg-type]
    assert response.prompt_tokens == 7 and (a.counts, b.counts) == (1, 1)
    replica_a, replica_b = pool.replicas
    assert (replica_a.consecutive_failures, replica_b.consecutive_failures) == (1, 0)
    replica_b.healthy = False  # no other replica to ask: the caller learns what a answered
    with pytest.raises(Unavailable, match="Socket closed"):
        await servicer.CountTokens(count, NoDeadline())  # type: ignore[arg-type]
    assert replica_a.consecutive_failures == 2 and not replica_a.healthy and b.counts == 1
    for handle in busy:
        handle.cancel()


async def _soon(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


# -- drain: the replica starts nothing more, and hands back what waits there ------------


def one_slot_pool(*models: StepReplica) -> ReplicaPool:
    """One sequence runs per replica at a time: the next ones wait in its queue."""
    limits = SchedulerLimits(max_batch_size=1)
    return ReplicaPool(list(models), lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 2, 0.05, drain_poll_s=0.005)


async def test_a_draining_replica_starts_no_waiting_sequence_and_hands_them_to_another() -> None:
    """A draining Triton pod stops at the end of its preStop: its scheduler kept starting the
    sequences waiting there all along, and one started late was cut at SIGTERM mid-stream (no
    retry then). Now the waiting ones move at the drain, before their first token, as after a
    failure; the running one finishes where its KV cache is."""
    leaving, staying = StepReplica("leaving", tokens=3), StepReplica("staying", tokens=3)
    staying.probes_ok = False  # not serving yet: everything queues on `leaving`
    pool = one_slot_pool(leaving, staying)
    await pool.probe_once()
    pool.start()
    try:
        leaving.hold.clear()  # its first sequence's round is on its way; the others wait behind it
        requests = [asyncio.create_task(run(pool)) for _ in range(3)]
        await _soon(lambda: leaving.steps >= 1 and pool.replicas[0].scheduler.waiting_count == 2)
        staying.probes_ok = True
        await pool.probe_once()
        pool.drain("leaving")
        assert pool.replicas[0].scheduler.load == 1, "only the running sequence stays"
        leaving.hold.set()
        results = await asyncio.wait_for(asyncio.gather(*requests), 5.0)
        await _soon(lambda: leaving.closed)  # removed once its running sequence finished
    finally:
        await pool.stop()
    assert all(finish.finish is Finish.LENGTH and tokens == 3 for tokens, finish in results)
    assert (leaving.prefills, staying.prefills) == (1, 2)


async def test_a_replica_drained_then_undrained_starts_sequences_again() -> None:
    (replica,) = replicas = [StepReplica("back", tokens=2)]
    pool = one_slot_pool(*replicas)
    await pool.probe_once()
    pool.start()
    try:
        pool.drain("back")
        pool.undrain("back")
        tokens, finish = await asyncio.wait_for(run(pool), 5.0)
    finally:
        await pool.stop()
    assert (tokens, finish.finish) == (2, Finish.LENGTH) and replica.prefills == 1


async def test_a_prefill_answered_busy_while_draining_is_handed_back_not_queued_again() -> None:
    """The engine had no slot (another adapter holds it): the sequence never started here, and a
    draining replica would keep trying it until the pod stopped."""
    full = StepReplica("full", slots=1)
    full.held.add(999)  # another adapter's sequence
    scheduler = Scheduler(full, SchedulerLimits(max_batch_size=2))
    scheduler.start()
    try:
        full.hold.clear()
        handle = scheduler.submit(request())
        await _soon(lambda: full.steps >= 1)  # its prefill is on its way
        assert scheduler.drain() == 0  # nothing waits: it is in the round
        full.hold.set()
        text, finish = await asyncio.wait_for(collect(handle), 5.0)
    finally:
        await scheduler.stop()
    assert (text, finish.finish) == ("", Finish.ERROR) and handle.backend_failed
    assert "draining" in finish.error and scheduler.load == 0


async def test_a_sequence_submitted_to_a_draining_replica_is_handed_back_at_once() -> None:
    """A caller that picked the replica just before its drain: routed on, not started here."""
    scheduler = Scheduler(StepReplica("gone"), SchedulerLimits(), replica="gone")
    scheduler.drain()
    handle = scheduler.submit(request())
    text, finish = await asyncio.wait_for(collect(handle), 1.0)
    assert (finish.finish, handle.backend_failed, scheduler.load) == (Finish.ERROR, True, 0)
    assert finish.error == "Triton replica gone is draining; retry"


# -- a retry is the same request: its timings count from its arrival ---------------------


def labelled_pool(*models: StepReplica) -> ReplicaPool:
    """As one_slot_pool, each scheduler's series labelled with its replica's name."""
    limits = SchedulerLimits(max_batch_size=1)
    make = lambda backend, on_step: Scheduler(backend, limits, on_step=on_step, replica=backend.url)  # noqa: E731
    return ReplicaPool(list(models), make, 2, 0.05, drain_poll_s=0.005)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_retried_sequences_time_to_first_token_counts_from_its_first_attempt() -> None:
    """The time spent on a replica that failed before the first token is the request's: the time to
    first token (the histogram behind vllm:time_to_first_token_seconds, the p99 alert and the TTFT
    SLO, and the timings the gateway reports) restarted at the retry and left it out. The queue
    histogram is per replica: the one that served it observes its own queue's wait, once."""
    failing, serving = StepReplica("ttft-failing", delay_s=0.3), StepReplica("ttft-serving")
    serving.probes_ok = False  # not serving yet: the request goes to `failing`
    pool = labelled_pool(failing, serving)
    await pool.probe_once()
    failing.failing = True  # its step fails after 0.3 s, before any token
    ttft_sum, ttft_count = _sample("sluice_adapter_time_to_first_token_seconds_sum"), _sample("sluice_adapter_time_to_first_token_seconds_count")
    pool.start()
    try:
        steps = failing.steps
        running = asyncio.create_task(run(pool))
        await _soon(lambda: failing.steps > steps)  # its round is on its way to `failing`
        serving.probes_ok = True
        await pool.probe_once()
        tokens, finish = await asyncio.wait_for(running, 5.0)
    finally:
        await pool.stop()
    assert (tokens, finish.finish, serving.prefills) == (3, Finish.LENGTH, 1)
    assert finish.timings.time_to_first_token_s >= 0.3 and finish.timings.queue_s >= 0.3, finish.timings
    assert _sample("sluice_adapter_time_to_first_token_seconds_count") == ttft_count + 1
    assert _sample("sluice_adapter_time_to_first_token_seconds_sum") - ttft_sum >= 0.3
    # Its wait in `serving`'s queue alone; `failing` never took its prefill.
    assert _sample("sluice_adapter_queue_seconds_count", replica="ttft-serving") == 1
    assert _sample("sluice_adapter_queue_seconds_sum", replica="ttft-serving") < 0.3
    assert _sample("sluice_adapter_queue_seconds_count", replica="ttft-failing") == 0


async def test_a_sequence_handed_back_by_a_drain_keeps_its_time_waited_there() -> None:
    """A hand-back moves a waiting sequence before its first token: its time to first token counts
    the wait in the draining replica's queue (it restarted at the hand-back)."""
    leaving, staying = StepReplica("ttft-leaving", tokens=2), StepReplica("ttft-staying", tokens=2)
    staying.probes_ok = False  # not serving yet: everything queues on `leaving`
    pool = labelled_pool(leaving, staying)
    await pool.probe_once()
    pool.start()
    try:
        leaving.hold.clear()  # its first sequence's round waits; the second waits behind it
        requests = [asyncio.create_task(run(pool)) for _ in range(2)]
        await _soon(lambda: pool.replicas[0].scheduler.waiting_count == 1)
        await asyncio.sleep(0.3)
        staying.probes_ok = True
        await pool.probe_once()
        pool.drain("ttft-leaving")
        leaving.hold.set()
        results = await asyncio.wait_for(asyncio.gather(*requests), 5.0)
    finally:
        await pool.stop()
    assert (leaving.prefills, staying.prefills) == (1, 1)
    assert all(finish.finish is Finish.LENGTH and finish.timings.time_to_first_token_s >= 0.3 for _, finish in results), results


async def test_a_calls_log_context_names_its_sequence_and_a_retry_the_one_it_left() -> None:
    """Triton's lines and the scheduler's failure lines name seq_ids; the call's own lines (its
    summary line among them) carry the request id: each attempt binds its seq_id and replica into the
    call's log context, and the retry's line names the seq_id it leaves."""
    failing, serving = StepReplica("ctx-failing", delay_s=0.2), StepReplica("ctx-serving")
    serving.probes_ok = False
    pool = labelled_pool(failing, serving)
    await pool.probe_once()
    failing.failing = True

    async def call() -> dict[str, object]:
        structlog.contextvars.clear_contextvars()
        bind_request_id("req-ctx")
        await run_through(pool, GenerationRequest("req-ctx", "t", PromptSpec(prompt="p"), Sampling(max_tokens=2)))
        return structlog.contextvars.get_contextvars()

    pool.start()
    try:
        with capture_logs() as logs:
            steps = failing.steps
            running = asyncio.create_task(call())
            await _soon(lambda: failing.steps > steps)
            serving.probes_ok = True
            await pool.probe_once()
            context = await asyncio.wait_for(running, 5.0)
    finally:
        await pool.stop()
    (served,) = serving.sequences
    assert context == {"request_id": "req-ctx", "seq_id": served, "replica": "ctx-serving"}
    (retry,) = [line for line in logs if line["event"] == "retrying_on_another_replica"]
    assert retry["failed"] == "ctx-failing" and isinstance(retry["failed_seq_id"], int) and retry["failed_seq_id"] != served


async def test_a_probe_task_that_failed_logs_its_traceback() -> None:
    """An exception the probe did not expect (here its recording) was logged by its repr alone."""
    replica = StepReplica("probe-raises")
    pool = make_pool(replica)

    def broken(_replica: object, ok: bool) -> None:
        raise RuntimeError("recording failed")

    pool.record = broken  # type: ignore[method-assign]
    with capture_logs() as logs:
        await pool.probe_once()
        await asyncio.sleep(0)  # the task's done callback
    (line,) = [line for line in logs if line["event"] == "probe_task_failed"]
    assert isinstance(line["exc_info"], RuntimeError) and str(line["exc_info"]) == "recording failed"


# -- prefix-aware routing (prefix_routing.py) ---------------------------------------------

SYSTEM = "You answer questions about the river trips of a kayak shop, plainly and briefly. " * 8


def chat_request(system: str, question: str, max_tokens: int = 3) -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(messages=(("system", system), ("user", question))), Sampling(max_tokens=max_tokens))


def routed_pool(*models: StepReplica, load_bound: int = 2, slots: int = 4, threshold: int = 2) -> ReplicaPool:
    limits = SchedulerLimits(max_batch_size=slots)
    return ReplicaPool(
        list(models),
        lambda backend, on_step: Scheduler(backend, limits, on_step=on_step),
        threshold,
        0.05,
        make_backend=lambda url: StepReplica(url),
        drain_poll_s=0.005,
        router=PrefixRouter(slots=slots, load_bound=load_bound),
        model="m-routing",
    )


def decisions(reason: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("sluice_adapter_routing_decisions_total", {"model": "m-routing", "reason": reason}) or 0.0


async def test_requests_sharing_a_system_prompt_go_to_the_replica_that_has_it() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = routed_pool(a, b)
    await pool.probe_once()
    pool.start()
    prefix_before = decisions("prefix")
    try:
        # The system prompt is first sent to b (a is busy then): b, not the first in the list, has it.
        other, first = pool.replicas
        held = [other.scheduler.submit(request())]
        assert pool.pick(exclude=set(), prompt=chat_request(SYSTEM, "warm-up").prompt) is first
        for handle in held:
            handle.cancel()
        results = []
        for i in range(5):
            results.append(await run_through(pool, chat_request(SYSTEM, f"Question {i}: when does the trip {i} leave?")))
        # Both idle between requests: least-loaded alone takes the first in the list each time, which need
        # not be `first`; prefix routing kept every one on the replica the system prompt was sent to.
        assert first.backend.prefills == 5 and other.backend.prefills == 0  # type: ignore[attr-defined]
        assert decisions("prefix") - prefix_before == 5
        # Requests under another, cold prefix are not forced there: with `first` busier, they go to the other.
        held = [first.scheduler.submit(chat_request(SYSTEM, f"held {i}", max_tokens=50)) for i in range(2)]
        await asyncio.sleep(0.02)
        _, finish = await run_through(pool, chat_request("An unrelated system prompt about bicycles. " * 8, "q"))
        assert other.backend.prefills == 1  # type: ignore[attr-defined]
        for handle in held:
            handle.cancel()
    finally:
        await pool.stop()
    assert all(f.finish is Finish.LENGTH for _, f in results)


async def test_the_load_bound_sends_a_hot_prefix_elsewhere() -> None:
    a, b = StepReplica("a", delay_s=0.02), StepReplica("b", delay_s=0.02)
    pool = routed_pool(a, b, load_bound=2, slots=32)
    await pool.probe_once()
    pool.start()
    before = {reason: decisions(reason) for reason in ("load", "load_bound", "prefix")}
    try:
        # Ten at once, all with the same system prompt: the first replica takes them until it holds
        # more than `load_bound` beyond the other; the overflow goes to the other, not into a pile.
        results = await asyncio.gather(*(run_through(pool, chat_request(SYSTEM, f"Question {i}?", max_tokens=20)) for i in range(10)))
    finally:
        await pool.stop()
    assert all(f.finish is Finish.LENGTH for _, f in results)
    counts = sorted((a.prefills, b.prefills))
    assert counts[0] >= 3 and counts[1] - counts[0] <= 3, (a.prefills, b.prefills)
    # The first was cold (load), the fourth found the first replica beyond the bound (load_bound);
    # from then on both had been sent the system prompt and its match, then the load, decided.
    assert {reason: decisions(reason) - before[reason] for reason in before} == {"load": 1, "load_bound": 1, "prefix": 8}


async def test_a_full_replica_does_not_queue_a_match_while_another_has_a_free_slot() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = routed_pool(a, b, load_bound=100, slots=2)
    await pool.probe_once()
    prompt = chat_request(SYSTEM, "q").prompt
    first = pool.pick(exclude=set(), prompt=prompt)
    held = [first.scheduler.submit(request()) for _ in range(2)]  # its batch is full (queued, not started)
    assert pool.pick(exclude=set(), prompt=prompt) is not first
    for handle in held:
        handle.cancel()


async def test_a_retry_excludes_the_failed_replica_and_forgets_what_it_held() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = routed_pool(a, b, threshold=5)
    await pool.probe_once()
    pool.start()
    try:
        await run_through(pool, chat_request(SYSTEM, "warm-up"))
        first = next(r for r in pool.replicas if r.backend.prefills == 1)  # type: ignore[attr-defined]
        other = next(r for r in pool.replicas if r is not first)
        key = pool._router.key(*(lambda p: (p.messages, p.prompt))(chat_request(SYSTEM, "x").prompt))  # type: ignore[union-attr]
        assert pool._router.match(first.name, key) > 0  # type: ignore[union-attr]
        first.backend.failing = True  # type: ignore[attr-defined]
        tokens, finish = await run_through(pool, chat_request(SYSTEM, "after the crash"))
        assert finish.finish is Finish.LENGTH and tokens == 3
        assert other.backend.prefills == 1  # type: ignore[attr-defined]
        assert first.healthy  # one failure is under the threshold: healthy, but its record is gone
        assert pool._router.match(first.name, key) == 0  # type: ignore[union-attr]
        # The prompt is now remembered where it was served, so the next one goes there.
        first.backend.failing = False  # type: ignore[attr-defined]
        await run_through(pool, chat_request(SYSTEM, "next"))
        assert other.backend.prefills == 2  # type: ignore[attr-defined]
    finally:
        await pool.stop()


async def test_a_failed_probe_a_removed_and_a_re_added_replica_start_empty() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = routed_pool(a, b)
    router = pool._router
    assert router is not None
    prompt = chat_request(SYSTEM, "q").prompt
    key = router.key(prompt.messages, prompt.prompt)
    for replica in pool.replicas:
        router.record(replica.name, key)
    a.failing = True
    await pool.probe_once()
    assert router.match("a", key) == 0 and router.match("b", key) > 0
    pool.start()
    try:
        pool.drain("b")
        await asyncio.sleep(0.05)
        assert "b" not in pool.names and router.match("b", key) == 0
        router.record("b", key)  # as if a stale entry had survived
        pool.add("b")
        assert router.match("b", key) == 0
    finally:
        await pool.stop()


async def test_engine_reported_cache_hits_are_counted_per_replica() -> None:
    from prometheus_client import REGISTRY

    a = StepReplica("hits-a")
    pool = routed_pool(a)
    await pool.probe_once()
    pool.start()
    generated = 0
    try:
        for _ in range(2):
            _, finish = await run_through(pool, chat_request(SYSTEM, "same question"))
            generated += finish.completion_tokens
    finally:
        await pool.stop()
    assert REGISTRY.get_sample_value("sluice_adapter_prompt_tokens_total", {"replica": "hits-a"}) == 4
    assert generated > 0
    assert REGISTRY.get_sample_value("sluice_adapter_generation_tokens_total", {"replica": "hits-a"}) == generated
    assert REGISTRY.get_sample_value("sluice_adapter_cached_prompt_tokens_total", {"replica": "hits-a"}) == 1
    assert REGISTRY.get_sample_value("sluice_adapter_routed_requests_total", {"replica": "hits-a"}) == 2
    assert decisions("only_replica") >= 2


def test_the_probe_intervals_are_checked_when_the_adapter_starts() -> None:
    config = load_config(AdapterConfig, ENV_PREFIX, {})
    assert (config.probe_interval_s, config.probe_token_interval_s) == (2.0, 30.0)
    assert load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}PROBE_TOKEN_INTERVAL_S": "0"}).probe_token_interval_s == 0.0
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}PROBE_TOKEN_INTERVAL_S must be >= 0"):
        load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}PROBE_TOKEN_INTERVAL_S": "-1"})
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}PROBE_INTERVAL_S must be > 0"):
        load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}PROBE_INTERVAL_S": "0"})


class FaultyEngine(StepReplica):
    """A replica whose engine fails every forward pass: triton-local answers the rows FINISH "error"."""

    def _answer(self, row: StepRow) -> StepOutcome:
        if row.action in (Action.PREFILL, Action.DECODE):
            self.rows.append((row.action, row.seq_id))
            return StepOutcome(-1, "", FINISH_ERROR, 2, 0, "forward pass failed: RuntimeError('CUDA error: out of memory')")
        return super()._answer(row)


async def test_a_request_whose_prefill_the_engine_failed_is_retried_on_another_replica() -> None:
    """The engine answered, so no step failed: the request ended with the error, and least-loaded
    routing kept sending work to the replica that drains fastest because it serves nothing."""
    a, b = FaultyEngine("a"), StepReplica("b")
    pool = make_pool(a, b)
    await pool.probe_once()
    pool.start()
    try:
        # Started together: least-loaded routing sends every other one to a.
        results = await asyncio.gather(*(run(pool) for _ in range(6)))
    finally:
        await pool.stop()
    assert any(action is Action.PREFILL for action, _ in a.rows), "a was tried"
    assert all(finish.finish is Finish.LENGTH and tokens == 3 for tokens, finish in results)
    assert b.prefills == 6


async def test_the_replica_load_gauge_follows_the_replica_after_routing_stops() -> None:
    """Set only as requests were routed (to the load seen before each), it read 1 with two requests
    on the replica and kept that once they had finished."""
    from prometheus_client import REGISTRY

    replica = StepReplica("load-gauge:8001")
    pool = make_pool(replica)

    def load() -> float | None:
        return REGISTRY.get_sample_value("sluice_adapter_replica_load", {"replica": "load-gauge:8001"})

    await pool.probe_once()
    pool.start()
    try:
        replica.hold.clear()  # its steps wait: both requests stay on it
        runs = [asyncio.create_task(run(pool)) for _ in range(2)]
        while pool.replicas[0].scheduler.load < 2:
            await asyncio.sleep(0.005)
        assert load() == 2
        replica.hold.set()
        await asyncio.gather(*runs)
        assert load() == 0
    finally:
        await pool.stop()
