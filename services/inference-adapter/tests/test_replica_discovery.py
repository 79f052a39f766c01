"""Replicas behind a DNS name: parsing, resolution with an injected resolver, and what the pool does
when addresses appear, disappear and come back (issue 13).

conftest's `StepReplica` stands in for one Triton pod speaking the step protocol; it records every
row it is sent, so a test can tell which pod stepped which sequence. The real processes are in
tests/e2e/test_triton_discovery.py.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import pytest
from conftest import StepReplica, run_through
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from sluice_common.config import ConfigError, load_config
from sluice_common.errors import Unavailable
from sluice_common.sampling import Sampling
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.replica_discovery import (
    Discovery,
    Target,
    parse_target,
    replica_address,
    system_resolver,
)
from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.sequence import Finish, FinishEvent, GenerationRequest
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.step_rows import Action, PromptSpec


class Resolver:
    """An injected resolver: answers what `answer` holds now, or raises it when it is an error."""

    def __init__(self, answer: list[str] | OSError) -> None:
        self.answer = answer
        self.calls = 0

    async def __call__(self, name: str, port: int) -> list[str]:
        self.calls += 1
        if isinstance(self.answer, OSError):
            raise self.answer
        return list(self.answer)


def request(rid: str = "rid") -> GenerationRequest:
    return GenerationRequest(rid, "t", PromptSpec(prompt="p"), Sampling(max_tokens=8))


async def run(pool: ReplicaPool, rid: str = "rid") -> tuple[int, FinishEvent]:
    return await run_through(pool, request(rid))


def gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


async def until(condition: Callable[[], bool], timeout_s: float = 2.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


class Pods:
    """A pool fed by one dns:/// name, its pods created as the pool asks for backends."""

    def __init__(self, answer: list[str], port: int = 8001, tokens: int = 3, label: str = "") -> None:
        self.resolver = Resolver(answer)
        self.discovery = Discovery([parse_target(f"dns:///triton-pods:{port}")], self.resolver)
        self.tokens = tokens
        self.label = label  # an extra model's pool on the same pods (its metric series' suffix)
        self.made: dict[str, list[StepReplica]] = {}
        self.pool: ReplicaPool | None = None

    def make(self, url: str) -> StepReplica:
        pod = StepReplica(url, self.tokens, delay_s=0.001)
        self.made.setdefault(url, []).append(pod)
        return pod

    def pod(self, url: str) -> StepReplica:
        return self.made[url][-1]

    async def start(self) -> ReplicaPool:
        urls = sorted(await self.discovery.resolve())
        limits = SchedulerLimits(max_batch_size=4)
        self.pool = ReplicaPool(
            [self.make(url) for url in urls],
            lambda backend, on_step: Scheduler(backend, limits, on_step=on_step, replica=backend.url),  # type: ignore[arg-type]
            failure_threshold=2,
            probe_interval_s=0.05,
            make_backend=self.make,
            drain_poll_s=0.005,
            metrics_label=self.label,
        )
        await self.pool.probe_once()
        self.pool.start()
        return self.pool


# -- parsing ------------------------------------------------------------------------------


def test_entries_are_host_port_or_a_dns_name_and_port() -> None:
    assert parse_target("10.0.0.5:8001") == Target("10.0.0.5", 8001, dns=False)
    assert parse_target("[::1]:8001") == Target("[::1]", 8001, dns=False)
    assert parse_target("dns:///triton-headless.sluice.svc:8001") == Target("triton-headless.sluice.svc", 8001, dns=True)
    for bad in ("triton", "triton:", "triton:http", "dns:///:8001", "dns:///triton", "triton:70000", "dns:///[::1]:8001"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_a_replica_is_named_ip_port_and_ipv6_is_bracketed_as_a_grpc_target() -> None:
    assert replica_address("10.1.2.3", 8001) == "10.1.2.3:8001"
    assert replica_address("fd00::7", 8001) == "[fd00::7]:8001"


def test_config_takes_dns_entries_and_the_resolve_interval_and_refuses_a_bad_entry() -> None:
    config = load_config(
        AdapterConfig,
        ENV_PREFIX,
        {f"{ENV_PREFIX}TRITON_URLS": "dns:///triton-headless:8001,10.0.0.9:8001", f"{ENV_PREFIX}TRITON_RESOLVE_INTERVAL_S": "2.5"},
    )
    assert config.triton_urls == ("dns:///triton-headless:8001", "10.0.0.9:8001")
    assert config.triton_resolve_interval_s == 2.5
    assert AdapterConfig().triton_resolve_interval_s == 10.0
    with pytest.raises(ConfigError, match="TRITON_URLS"):
        load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}TRITON_URLS": "dns:///triton-headless"})


async def test_the_system_resolver_answers_localhost() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 8001)


# -- resolution ---------------------------------------------------------------------------


async def test_a_name_becomes_one_replica_per_address_beside_fixed_entries() -> None:
    resolver = Resolver(["10.0.0.2", "10.0.0.1", "fd00::1", "10.0.0.1"])
    discovery = Discovery([parse_target("dns:///pods:8001"), parse_target("triton-fixed:9001")], resolver)
    assert discovery.dynamic
    assert await discovery.resolve() == {"10.0.0.1:8001", "10.0.0.2:8001", "[fd00::1]:8001", "triton-fixed:9001"}
    assert not Discovery([parse_target("triton-fixed:9001")], resolver).dynamic


async def test_a_failed_or_empty_lookup_keeps_the_addresses_and_logs_and_counts() -> None:
    resolver = Resolver(["10.0.0.1", "10.0.0.2"])
    discovery = Discovery([parse_target("dns:///pods:8001")], resolver)
    both = {"10.0.0.1:8001", "10.0.0.2:8001"}
    assert await discovery.resolve() == both
    errors_before = gauge("sluice_adapter_discovery_failures_total", target="dns:///pods:8001", reason="error") or 0
    empty_before = gauge("sluice_adapter_discovery_failures_total", target="dns:///pods:8001", reason="empty") or 0
    with capture_logs() as logs:
        resolver.answer = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        assert await discovery.resolve() == both
        resolver.answer = []
        assert await discovery.resolve() == both
    assert [e["event"] for e in logs] == ["discovery_failed", "discovery_empty"]
    assert all(e["log_level"] == "warning" for e in logs)
    assert gauge("sluice_adapter_discovery_failures_total", target="dns:///pods:8001", reason="error") == errors_before + 1
    assert gauge("sluice_adapter_discovery_failures_total", target="dns:///pods:8001", reason="empty") == empty_before + 1
    # A real answer still changes the set.
    resolver.answer = ["10.0.0.2"]
    assert await discovery.resolve() == {"10.0.0.2:8001"}


async def test_a_name_that_never_resolved_names_no_replica_yet() -> None:
    discovery = Discovery([parse_target("dns:///pods:8001")], Resolver(socket.gaierror(socket.EAI_AGAIN, "try again")))
    assert await discovery.resolve() == set()


# -- the pool following the addresses ------------------------------------------------------


async def test_a_new_address_becomes_a_replica_that_gets_work_only_after_its_probe() -> None:
    pods = Pods(["10.0.0.1"])
    pool = await pods.start()
    try:
        pods.resolver.answer = ["10.0.0.1", "10.0.0.2"]
        with capture_logs() as logs:
            changes = await pods.discovery.apply(pool)
        assert changes.add == ["10.0.0.2:8001"] and not changes.drain
        assert {"event": "replica_added", "replica": "10.0.0.2:8001", "log_level": "info"} in logs
        new = next(r for r in pool.replicas if r.name == "10.0.0.2:8001")
        # Its first probe runs at once; until it succeeds it takes nothing.
        assert not new.healthy
        with pytest.raises(Unavailable):
            pool.pick(exclude={"10.0.0.1:8001"})
        await until(lambda: new.healthy)
        assert gauge("sluice_adapter_replicas", state="serving") == 2
        results = await asyncio.gather(*(run(pool, f"r{i}") for i in range(8)))
        assert all(finish.finish is Finish.LENGTH and tokens == 3 for tokens, finish in results)
        assert pods.pod("10.0.0.2:8001").sequences  # the new pod took part of the load
    finally:
        await pool.stop()


async def test_a_new_address_whose_probe_fails_gets_no_work() -> None:
    pods = Pods(["10.0.0.1"])
    pool = await pods.start()
    try:
        pods.resolver.answer = ["10.0.0.1", "10.0.0.2"]
        original_make = pods.make

        def make_unready(url: str) -> StepReplica:
            pod = original_make(url)
            pod.probes_ok = False
            return pod

        pool._make_backend = make_unready  # type: ignore[assignment]
        await pods.discovery.apply(pool)
        await asyncio.sleep(0.12)  # a first probe and two rounds of the probe loop
        results = await asyncio.gather(*(run(pool, f"r{i}") for i in range(4)))
        assert all(finish.finish is Finish.LENGTH for _, finish in results)
        assert not pods.pod("10.0.0.2:8001").rows
        assert gauge("sluice_adapter_replicas", state="unhealthy") == 1
    finally:
        await pool.stop()


async def test_a_vanished_address_is_drained_its_sequences_finish_there_then_it_is_removed() -> None:
    pods = Pods(["10.0.0.1", "10.0.0.2"], tokens=6)
    pool = await pods.start()
    gone, stays = "10.0.0.2:8001", "10.0.0.1:8001"
    try:
        leaving = pods.pod(gone)
        # Two sequences start on the pod that is about to go; it is held mid-stream.
        running = [asyncio.create_task(run(pool, f"early{i}")) for i in range(4)]
        await until(lambda: len(leaving.sequences) >= 2)
        leaving.hold.clear()
        on_leaving = set(leaving.sequences)
        pods.resolver.answer = ["10.0.0.1"]
        with capture_logs() as logs:
            changes = await pods.discovery.apply(pool)
            assert changes.drain == [gone]
            assert pool.is_draining(gone)
            assert gauge("sluice_adapter_replicas", state="draining") == 1
            # New sequences all go elsewhere while the drained pod still holds its own.
            later = await asyncio.gather(*(run(pool, f"late{i}") for i in range(4)))
            assert all(finish.finish is Finish.LENGTH and tokens == 6 for tokens, finish in later)
            assert leaving.sequences == on_leaving
            assert gone in pool.names and not leaving.closed
            leaving.hold.set()
            early = await asyncio.gather(*running)
            # Out of the pool first, then its scheduler stops and its channel closes: wait for the last.
            await until(lambda: leaving.closed)
        # Every sequence that started there finished there, whole.
        assert all(finish.finish is Finish.LENGTH and tokens == 6 for tokens, finish in early)
        assert all(leaving.generated[seq] == 6 for seq in on_leaving)
        assert leaving.closed
        events = [(e["event"], e.get("replica")) for e in logs if e["event"].startswith("replica_")]
        assert events == [("replica_draining", gone), ("replica_removed", gone)]
        assert gauge("sluice_adapter_replicas", state="draining") == 0
        assert gauge("sluice_adapter_replicas", state="serving") == 1
        # Its per-replica series are gone with it; the staying replica's remain.
        assert gauge("sluice_adapter_replica_healthy", replica=gone) is None
        assert gauge("sluice_adapter_kv_slots_in_use", replica=gone) is None
        assert gauge("sluice_adapter_replica_healthy", replica=stays) == 1
    finally:
        await pool.stop()


async def test_an_address_that_comes_back_before_removal_is_undrained() -> None:
    pods = Pods(["10.0.0.1", "10.0.0.2"], tokens=4)
    pool = await pods.start()
    back = "10.0.0.2:8001"
    try:
        pod = pods.pod(back)
        first = asyncio.create_task(run(pool, "held"))
        second = asyncio.create_task(run(pool, "held2"))
        await until(lambda: bool(pod.sequences))
        pod.hold.clear()
        pods.resolver.answer = ["10.0.0.1"]
        await pods.discovery.apply(pool)
        assert pool.is_draining(back)
        pods.resolver.answer = ["10.0.0.1", "10.0.0.2"]
        with capture_logs() as logs:
            changes = await pods.discovery.apply(pool)
        assert changes.undrain == [back] and not changes.add
        assert [e["event"] for e in logs] == ["replica_undrained"]
        pod.hold.set()
        await asyncio.gather(first, second)
        await asyncio.sleep(0.05)
        # The same replica (same backend, not a new one) stays and takes work again.
        assert back in pool.names and not pool.is_draining(back) and len(pods.made[back]) == 1
        assert not pod.closed
        assert pool.pick(exclude={"10.0.0.1:8001"}).name == back
    finally:
        await pool.stop()


async def test_a_lookup_failure_while_running_drops_no_replica() -> None:
    pods = Pods(["10.0.0.1", "10.0.0.2"])
    pool = await pods.start()
    try:
        for answer in (socket.gaierror(socket.EAI_NONAME, "NXDOMAIN"), OSError("resolver down"), []):
            pods.resolver.answer = answer
            assert not await pods.discovery.apply(pool)
            assert pool.names == {"10.0.0.1:8001", "10.0.0.2:8001"}
            assert not any(r.draining for r in pool.replicas)
    finally:
        await pool.stop()


async def test_the_discovery_loop_re_resolves_every_interval() -> None:
    pods = Pods(["10.0.0.1"])
    pool = await pods.start()
    loop = asyncio.create_task(pods.discovery.run([pool], interval_s=0.01))
    try:
        pods.resolver.answer = ["10.0.0.3"]
        await until(lambda: pool.names == {"10.0.0.3:8001"})
        assert pods.pod("10.0.0.1:8001").closed
        assert pods.resolver.calls >= 2
    finally:
        loop.cancel()
        await pool.stop()


async def test_one_discovery_adds_and_drains_the_replicas_of_every_model_pool() -> None:
    """The main model's pool and an extra model's (the same pods, another Triton model) follow one name."""
    main, extra = Pods(["10.0.0.1"]), Pods(["10.0.0.1"], label="#variant")
    main_pool, extra_pool = await main.start(), await extra.start()
    pools = (main_pool, extra_pool)
    loop = asyncio.create_task(main.discovery.run(list(pools), interval_s=0.01))
    try:
        main.resolver.answer = ["10.0.0.1", "10.0.0.2"]
        both = {"10.0.0.1:8001", "10.0.0.2:8001"}
        await until(lambda: all(p.names == both and all(r.healthy for r in p.replicas) for p in pools))
        main.resolver.answer = ["10.0.0.2"]
        await until(lambda: all(p.names == {"10.0.0.2:8001"} for p in pools))
        await until(lambda: main.pod("10.0.0.1:8001").closed and extra.pod("10.0.0.1:8001").closed)
        results = await asyncio.gather(run(main_pool, "m"), run(extra_pool, "e"))
        assert all(finish.finish is Finish.LENGTH and tokens == 3 for tokens, finish in results)
        assert main.pod("10.0.0.2:8001").sequences and extra.pod("10.0.0.2:8001").sequences
    finally:
        loop.cancel()
        await main_pool.stop()
        await extra_pool.stop()


async def test_sequences_are_sticky_every_row_of_a_sequence_goes_to_the_replica_that_prefilled_it() -> None:
    pods = Pods(["10.0.0.1", "10.0.0.2", "10.0.0.3"], tokens=5)
    pool = await pods.start()
    try:
        results = await asyncio.gather(*(run(pool, f"r{i}") for i in range(24)))
        assert all(tokens == 5 for tokens, _ in results)
        models = [pods.pod(url) for url in sorted(pool.names)]
        assert all(m.sequences for m in models)  # the load was spread
        for model in models:
            for seq_id in model.sequences:
                # Prefill, then decodes, all at this pod, and no other pod ever saw the sequence.
                actions = [action for action, s in model.rows if s == seq_id]
                assert actions[0] is Action.PREFILL and set(actions[1:]) <= {Action.DECODE, Action.RELEASE}
                assert all(seq_id not in other.sequences for other in models if other is not model)
    finally:
        await pool.stop()
