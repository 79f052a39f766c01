"""Routing, health and retry across replicas, with step models that stand in for Triton replicas.

conftest's `StepReplica` follows the step protocol and can be switched to fail, as a crashed
Triton does; the real two-replica path is tested in
tests/e2e/test_replicas.py.
"""

from __future__ import annotations

import asyncio

import pytest
from conftest import StepReplica, run_through

from sluice_common.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from sluice_common.errors import Unavailable
from sluice_inference_adapter.embed_batcher import Embeddings
from sluice_inference_adapter.replica_pool import PooledEmbedBackend, ReplicaPool
from sluice_inference_adapter.scheduler import Finish, FinishEvent, GenerationRequest, Scheduler, SchedulerLimits
from sluice_inference_adapter.step_rows import PromptSpec, SamplingSpec


def make_pool(*models: StepReplica, threshold: int = 2) -> ReplicaPool:
    limits = SchedulerLimits(max_batch_size=4)
    return ReplicaPool(list(models), lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), threshold, 0.05)


def request() -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(prompt="p"), SamplingSpec(max_tokens=3))


async def run(pool: ReplicaPool) -> tuple[int, FinishEvent]:
    return await run_through(pool, request())


async def test_least_loaded_replica_gets_the_request() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    pool = make_pool(a, b)
    busy = [pool.replicas[0].scheduler.submit(request()) for _ in range(3)]  # queued on a, not started
    assert pool.pick(exclude=set()).name == "b"
    for handle in busy:
        handle.cancel()


async def test_a_failed_replica_is_skipped_and_the_request_retried_elsewhere() -> None:
    a, b = StepReplica("a"), StepReplica("b")
    a.failing = True
    pool = make_pool(a, b)
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
    a.failing = True
    await pool.probe_once()
    assert replica_a.healthy  # one failure is not enough
    await asyncio.sleep(0.06)
    await pool.probe_once()
    assert not replica_a.healthy
    assert pool.pick(exclude=set()).name == "b"
    a.failing = False
    await pool.probe_once()
    assert replica_a.healthy


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
    assert pool.any_healthy and not pool.any_proven  # healthy until shown otherwise, not yet proven
    await pool.probe_once()
    assert pool.any_proven
    a.failing = True
    for _ in range(2):
        await asyncio.sleep(0.06)
        await pool.probe_once()
    assert not pool.any_healthy and not pool.any_proven


def test_an_extra_models_pool_on_the_same_replica_keeps_its_own_health_series() -> None:
    """Two pools on one address (the main model and an extra one): each reports its own view;
    one series written by both would say 'healthy' while the main model still thought otherwise."""
    from prometheus_client import REGISTRY

    def healthy(replica: str) -> float | None:
        return REGISTRY.get_sample_value("sluice_adapter_replica_healthy", {"replica": replica})

    main_backend, extra_backend = StepReplica("10.9.9.9:8001"), StepReplica("10.9.9.9:8001")
    limits = SchedulerLimits(max_batch_size=4)
    main = ReplicaPool([main_backend], lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 1, 0.05)
    extra = ReplicaPool(
        [extra_backend], lambda backend, on_step: Scheduler(backend, limits, on_step=on_step), 1, 0.05, metrics_label="#m-q4"
    )
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
    backend = PooledEmbedBackend(pool, lambda url: FailingEmbedder(), timeout)
    for _ in range(2):
        with pytest.raises(Unavailable, match="failed to embed"):
            await backend.embed(["x"])
    assert not pool.replicas[0].healthy
    with pytest.raises(Unavailable, match="no healthy Triton replica"):
        await backend.embed(["x"])
