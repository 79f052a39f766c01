"""Start-up waits for Triton (__main__.wait_for_a_ready_replica, wait_for_a_healthy_replica): for ever
by default (BACKEND_WAIT_S=0), saying what they wait for, and bounded only where an operator asks."""

from __future__ import annotations

import asyncio

import pytest
from conftest import StepReplica
from structlog.testing import capture_logs

from sluice_common.config import ConfigError, load_config
from sluice_inference_adapter import __main__ as adapter_main
from sluice_inference_adapter.__main__ import wait_for_a_healthy_replica, wait_for_a_ready_replica
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.replica_discovery import Discovery, parse_target
from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits


@pytest.fixture(autouse=True)
def quick_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_main, "WAIT_RETRY_S", 0.01, raising=False)
    monkeypatch.setattr(adapter_main, "WAIT_LOG_INTERVAL_S", 0.05, raising=False)


class LateTriton:
    """Stands in for TritonStepBackend's ready checks: a Triton whose model is ready after `not_ready_for` checks."""

    not_ready_for = 0
    checks = 0

    def __init__(self, url: str, model: str, metrics_label: str = "") -> None:
        self.url = url

    async def is_ready(self) -> bool:
        LateTriton.checks += 1
        return LateTriton.checks > LateTriton.not_ready_for

    async def close(self) -> None:
        pass


async def test_with_no_bound_start_up_waits_for_triton_to_be_ready_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pod started during a Triton outage (a cold GPU deploy, a scale-out) exited after
    BACKEND_WAIT_S and crash-looped; with 0 it exited at once."""
    monkeypatch.setattr(adapter_main, "TritonStepBackend", LateTriton)
    monkeypatch.setattr(LateTriton, "not_ready_for", 20)
    monkeypatch.setattr(LateTriton, "checks", 0)
    config = AdapterConfig(triton_urls=("10.0.0.1:8001",), backend_wait_s=0)
    with capture_logs() as logs:
        urls, ready = await asyncio.wait_for(wait_for_a_ready_replica(config, Discovery([parse_target("10.0.0.1:8001")])), 5.0)
    assert urls == [ready] == ["10.0.0.1:8001"] and LateTriton.checks == 21
    waits = [e for e in logs if e["event"] == "waiting_for_triton"]
    assert waits and waits[0]["log_level"] == "warning"
    assert waits[0]["waiting_for"] == f"a Triton replica to report {config.triton_model} ready"
    assert waits[0]["resolved"] == ["10.0.0.1:8001"] and waits[0]["limit"] == f"none ({ENV_PREFIX}BACKEND_WAIT_S=0)"


async def test_with_no_bound_start_up_waits_for_a_first_token_and_says_so() -> None:
    loading = StepReplica("loading")
    loading.probes_ok = False  # ready, but its model answers no token yet
    pool = ReplicaPool([loading], lambda backend, on_step: Scheduler(backend, SchedulerLimits(), on_step=on_step), 2, 0.05)
    try:
        with capture_logs() as logs:
            waiting = asyncio.create_task(wait_for_a_healthy_replica(pool, timeout_s=0))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            loading.probes_ok = True
            await asyncio.wait_for(waiting, 5.0)
    finally:
        await pool.stop()
    waits = [e for e in logs if e["event"] == "waiting_for_triton"]
    assert waits and waits[0]["waiting_for"] == "a Triton replica to generate a probe token" and waits[0]["replicas"] == ["loading"]


async def test_an_operators_bound_still_ends_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter_main, "TritonStepBackend", LateTriton)
    monkeypatch.setattr(LateTriton, "not_ready_for", 10**6)
    config = AdapterConfig(triton_urls=("10.0.0.1:8001",), backend_wait_s=0.1)
    with pytest.raises(SystemExit, match=r"ready within 0.1s .*BACKEND_WAIT_S; 0 waits for ever"):
        async with asyncio.timeout(5.0):  # in this task: SystemExit out of another would stop the loop
            await wait_for_a_ready_replica(config, Discovery([parse_target("10.0.0.1:8001")]))


def test_the_wait_is_unbounded_by_default_and_a_negative_bound_is_refused() -> None:
    assert AdapterConfig().backend_wait_s == 0
    with pytest.raises(ConfigError, match="BACKEND_WAIT_S must be >= 0"):
        load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}BACKEND_WAIT_S": "-1"})
