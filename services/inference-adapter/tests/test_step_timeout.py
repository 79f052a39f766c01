"""Adaptive step and embed timeouts: a stalled call is cut off at about twice the observed p99
(not at the fixed ceiling), its callers get a clear error, and its replica counts as failing.

conftest's `StepReplica` can be told to stall, as a wedged Triton does: the call never returns.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest
from conftest import StepReplica, collect, run_through
from prometheus_client import REGISTRY

from sluice_common.adaptive_timeout import AdaptiveTimeout, TimeoutPolicy
from sluice_common.config import ConfigError, load_config
from sluice_common.errors import Unavailable
from sluice_common.sampling import Sampling
from sluice_inference_adapter.config import ENV_PREFIX, AdapterConfig
from sluice_inference_adapter.embed_batcher import Embeddings
from sluice_inference_adapter.generated_chunk import GeneratedChunk
from sluice_inference_adapter.passthrough import PassthroughLimits, PassthroughScheduler
from sluice_inference_adapter.replica_pool import PooledEmbedBackend, ReplicaPool
from sluice_inference_adapter.sequence import Event, Finish, FinishEvent, GenerationRequest, TokenEvent
from sluice_inference_adapter.priority import Priority
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.step_rows import Action, PromptSpec, StepOutcome, StepRow
from sluice_inference_adapter.step_timeout import StepTimeouts

CEILING_S = 30.0


def policy(floor_s: float = 0.01, min_samples: int = 10) -> TimeoutPolicy:
    return TimeoutPolicy(multiplier=2.0, floor_s=floor_s, ceiling_s=CEILING_S, window=200, min_samples=min_samples)


def request(max_tokens: int = 20) -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(prompt="p"), Sampling(max_tokens=max_tokens), Priority.INTERACTIVE)


async def _last(events: AsyncIterator[Event]) -> FinishEvent:
    async for event in events:
        if isinstance(event, FinishEvent):
            return event
    raise AssertionError("no finish event")


def sample(name: str, labels: dict[str, str]) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_decode_steps_get_twice_their_p99_and_prefills_more_by_their_tokens() -> None:
    timeouts = StepTimeouts(policy(min_samples=5))
    assert timeouts.limit() == CEILING_S and timeouts.limit(100) == CEILING_S  # warming up
    for _ in range(10):
        timeouts.observe(0.05)
    assert timeouts.limit() == pytest.approx(0.1)
    assert timeouts.limit(100) == CEILING_S  # no prefill seen yet: no per-token figure
    for _ in range(10):
        timeouts.observe(0.5, prefill_tokens=100)  # 5 ms per prompt token
    assert timeouts.limit(100) == pytest.approx(2 * (0.05 + 100 * 0.005))
    assert timeouts.limit(2000) == pytest.approx(2 * (0.05 + 2000 * 0.005))  # a long prompt is not cut off
    timeouts.observe_timeout(0.1)
    assert timeouts.decode_p99 == pytest.approx(0.1)  # the censored sample counts at its limit


async def test_a_stalled_step_times_out_at_twice_the_p99_and_fails_the_replica() -> None:
    model = StepReplica("triton-a:8001", delay_s=0.02)
    timeouts = StepTimeouts(policy(), model="m")
    reports: list[bool] = []
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4), on_step=reports.append, replica=model.url, timeouts=timeouts)
    scheduler.start()
    fired_before = sample("sluice_adapter_timeouts_total", {"kind": "step"})
    try:
        text, finish = await collect(scheduler.submit(request()))  # 20 steps of ~20 ms: warmed up
        assert finish.finish is Finish.LENGTH and len(text) == 20
        limit = timeouts.limit()
        assert 0.04 <= limit < 0.2  # about twice a ~20-40 ms step on a busy test machine
        assert sample("sluice_adapter_step_timeout_seconds", {"model": "m"}) == pytest.approx(limit)
        # A decode step stalls (this model's one prefill so far is too few for a prefill p99:
        # a prefill step would still get the ceiling).
        handle = scheduler.submit(request())
        events = handle.events()
        first = await anext(events)
        assert isinstance(first, TokenEvent)
        model.stalled = True
        started = time.monotonic()
        finish = await asyncio.wait_for(_last(events), 5)
        waited = time.monotonic() - started
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.ERROR
    match = re.fullmatch(
        r"Triton replica triton-a:8001 did not answer a step within its timeout of ([0-9.]+)s \(2x the p99 of recent"
        r" steps \(([0-9.]+)s\), within \[0.01s, 30s\]\); the replica is counted as failing, retry",
        finish.error,
    )
    assert match is not None, finish.error
    fired_at, p99 = float(match[1]), float(match[2])
    assert fired_at == pytest.approx(2 * p99, abs=0.01)
    assert fired_at - 0.01 <= waited < 1.0  # about 2x p99, nowhere near the 30 s ceiling
    assert reports[-1] is False and all(reports[:-1])
    assert sample("sluice_adapter_timeouts_total", {"kind": "step"}) == fired_before + 1


class DeferringReplica(StepReplica):
    """As triton-local over its per-step prefill budget: with `defer` set, a prefill answers no token
    and so does the sequence's next step (the budget went to earlier prompts again); the step after
    computes its prompt (`prompt_s` longer than a decode) and answers its first token. The prefill's
    round is one step (an interactive prefill's always is), so that step is the next round's second."""

    def __init__(self, url: str, prompt_s: float) -> None:
        super().__init__(url, delay_s=0.02)
        self.prompt_s = prompt_s
        self.defer = False
        self.steps_to_wait: dict[int, int] = {}

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        waiting = {row.seq_id for row in rows if row.action is Action.DECODE and row.seq_id in self.steps_to_wait}
        for seq_id in waiting:
            self.steps_to_wait[seq_id] -= 1
        computing = {seq_id for seq_id in waiting if self.steps_to_wait[seq_id] == 0}
        if computing:
            await asyncio.sleep(self.prompt_s)
        outcomes = await super().step(rows)
        for index, row in enumerate(rows):
            if (row.action is Action.PREFILL and self.defer) or row.seq_id in waiting - computing:
                self.steps_to_wait.setdefault(row.seq_id, 2)
                self.generated[row.seq_id] = 0
                outcomes[index] = StepOutcome(-1, "", "", 2, 0)
        for seq_id in computing:
            del self.steps_to_wait[seq_id]
        return outcomes


async def test_a_later_step_of_a_round_that_computes_a_deferred_prompt_is_timed_as_a_prefill() -> None:
    model = DeferringReplica("triton-a:8001", prompt_s=0.5)
    timeouts = StepTimeouts(policy(), model="m")
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4, max_round_steps=8), replica=model.url, timeouts=timeouts)
    scheduler.start()
    try:
        _, finish = await collect(scheduler.submit(request()))  # 20 steps of ~20 ms: decodes get ~0.04-0.2 s
        assert finish.finish is Finish.LENGTH and timeouts.limit() < 0.25
        model.defer = True
        handle = scheduler.submit(request())
        text, finish = await collect(handle)
    finally:
        await scheduler.stop()
    # Its prefill's round, then the round whose second step computed the prompt.
    assert model.rounds.steps_of(handle.seq_id)[1] > 1, "the prompt's step must be a later step of a round"
    # The step computing the prompt took 0.5 s: as a decode it would have been cut off at ~0.1 s.
    assert finish.finish is Finish.LENGTH and len(text) == 20, finish.error


async def test_the_ceiling_bounds_steps_until_enough_are_seen() -> None:
    timeouts = StepTimeouts(policy(min_samples=10))
    model = StepReplica("triton-a:8001", delay_s=0.0)
    scheduler = Scheduler(model, SchedulerLimits(), replica=model.url, timeouts=timeouts)
    scheduler.start()
    try:
        _, finish = await collect(scheduler.submit(request(max_tokens=3)))
        assert finish.finish is Finish.LENGTH
        assert timeouts.limit() == CEILING_S  # 3 steps are not enough to trust a p99
    finally:
        await scheduler.stop()


async def test_a_replica_whose_steps_stall_is_ejected_and_its_requests_go_elsewhere() -> None:
    """The limit is the pool's: the stalled replica cannot raise its own limit while it slows."""
    a, b = StepReplica("a", delay_s=0.01), StepReplica("b", delay_s=0.01)
    # Three prefills are enough here: the requests that meet the stall are in their prefill step.
    # A 0.1 s floor: the healthy replica's 0.01 s steps learn a limit of ~0.03 s, which one step
    # slowed by a busy machine exceeded (failing a stream on b that had its tokens already).
    timeouts = StepTimeouts(policy(floor_s=0.1, min_samples=3), model="m")
    limits = SchedulerLimits(max_batch_size=4)
    pool = ReplicaPool(
        [a, b],
        lambda backend, on_step: Scheduler(backend, limits, on_step=on_step, replica=backend.url, timeouts=timeouts),
        failure_threshold=2,
        probe_interval_s=60.0,
    )
    await pool.probe_once()  # proven, as the adapter's replicas are before it serves
    pool.start()
    try:
        for _ in range(2):  # warm up on both replicas
            results = await asyncio.gather(*(run_through(pool, request()) for _ in range(2)))
            assert all(finish.finish is Finish.LENGTH for _, finish in results)
        # Learned, far below the 30 s ceiling (the prompt "p" is estimated at 33 tokens). Both are
        # twice the slowest of a few samples: one step slowed by a busy machine (0.135 s and 0.27 s
        # seen) doubles them; the stall below is still cut off within `elapsed`.
        assert timeouts.limit() < 1.0 and timeouts.limit(33) < 1.0
        a.stalled = True
        started = time.monotonic()
        # Each request that lands on a fails its first step (no token yet) and is retried on b.
        results = []
        for _ in range(2):  # two waves: two timed-out steps in a row
            results += await asyncio.wait_for(asyncio.gather(*(run_through(pool, request()) for _ in range(4))), 10)
        elapsed = time.monotonic() - started
    finally:
        await pool.stop()
    assert all(finish.finish is Finish.LENGTH and tokens == 20 for tokens, finish in results), [
        (t, f.finish, f.completion_tokens, f.error) for t, f in results
    ]
    replica_a = next(r for r in pool.replicas if r.name == "a")
    assert not replica_a.healthy  # two timed-out steps in a row: out of the rotation
    assert elapsed < 5.0


class StallableEmbedder:
    def __init__(self) -> None:
        self.stalled = False

    async def embed(self, texts: list[str]) -> Embeddings:
        if self.stalled:
            await asyncio.Event().wait()
        await asyncio.sleep(0.005)
        return Embeddings(np.zeros((len(texts), 4), dtype=np.float32), None)

    async def close(self) -> None:
        pass


async def test_a_stalled_embedding_batch_is_cut_off_and_counts_against_its_replica() -> None:
    a = StepReplica("a", delay_s=0.02)
    pool = ReplicaPool([a], lambda backend, on_step: Scheduler(backend, SchedulerLimits(), on_step=on_step), 1, 60.0)
    await pool.probe_once()
    embedder = StallableEmbedder()
    timeout = AdaptiveTimeout(policy(min_samples=5))
    backend = PooledEmbedBackend(pool, lambda url: embedder, timeout)
    for _ in range(10):
        await backend.embed(["x"])
    limit = timeout.current()
    assert limit < 0.2
    assert sample("sluice_adapter_request_timeout_seconds", {"kind": "embed_batch"}) == pytest.approx(limit)
    embedder.stalled = True
    started = time.monotonic()
    with pytest.raises(Unavailable, match=r"replica a did not embed a batch of 1 texts within its timeout"):
        await backend.embed(["x"])
    assert time.monotonic() - started < 1.0
    assert not pool.replicas[0].healthy  # threshold 1


class StallableEngine:
    """A self-batching engine's stream: one token per response every 10 ms; while `stall_after` is
    set, a stream stops answering after that many responses (the stream stays open)."""

    def __init__(self) -> None:
        self.stall_after: int | None = None

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        for made in range(1, sampling.max_tokens + 1):
            if self.stall_after is not None and made > self.stall_after:
                await asyncio.Event().wait()
            await asyncio.sleep(0.01)
            yield GeneratedChunk("x", 1, 3, "length" if made == sampling.max_tokens else None)


async def test_a_passthrough_stream_whose_engine_stops_answering_is_cut_off_and_fails_the_replica() -> None:
    engine = StallableEngine()
    # A 0.1 s floor: the engine's few-millisecond gaps learn a limit of ~0.02 s, which one gap
    # slowed by a busy machine exceeded before the stall (failing the warm-up's stream).
    timeouts = StepTimeouts(policy(floor_s=0.1, min_samples=5), model="m")
    reports: list[bool] = []
    scheduler = PassthroughScheduler(
        engine,
        PassthroughLimits(),
        lambda prompt: prompt.prompt,
        on_step=reports.append,
        replica="vllm-a",
        timeouts=timeouts,  # type: ignore[arg-type]
    )
    scheduler.start()
    fired_before = sample("sluice_adapter_timeouts_total", {"kind": "stream_gap"})
    try:
        for _ in range(6):  # six first responses, thirty gaps
            _, finish = await collect(scheduler.submit(request(max_tokens=6)))
            assert finish.finish is Finish.LENGTH
        limit = timeouts.limit()
        assert 0.1 <= limit < 1.0  # learned (at the floor, or twice a slow gap's p99), not the 30 s ceiling
        engine.stall_after = 2
        started = time.monotonic()
        text, finish = await asyncio.wait_for(collect(scheduler.submit(request(max_tokens=6))), 5)
        waited = time.monotonic() - started
    finally:
        await scheduler.stop()
    assert text == "xx" and finish.finish is Finish.ERROR
    assert re.search(r"Triton replica vllm-a did not send a stream's next response within its timeout of [0-9.]+s", finish.error)
    assert waited < 2.0  # two responses and the learned limit, not the 30 s ceiling
    assert reports[-1] is False and all(reports[:-1])
    assert sample("sluice_adapter_timeouts_total", {"kind": "stream_gap"}) == fired_before + 1


def test_the_settings_are_validated_naming_the_variable() -> None:
    config = load_config(AdapterConfig, ENV_PREFIX, {})
    assert config.step_timeout_policy() == TimeoutPolicy(2.0, 5.0, 60.0, 1000, 50)
    assert config.embed_timeout_policy() == TimeoutPolicy(2.0, 2.0, 30.0, 1000, 50)
    for name, value in (
        ("TIMEOUT_MULTIPLIER", "0.9"),
        ("STEP_TIMEOUT_FLOOR_S", "61"),
        ("EMBED_TIMEOUT_FLOOR_S", "0"),
        ("TIMEOUT_MIN_SAMPLES", "0"),
        ("TIMEOUT_WINDOW", "10"),  # below the default MIN_SAMPLES
    ):
        with pytest.raises(ConfigError, match=f"{ENV_PREFIX}{name}|{ENV_PREFIX}TIMEOUT_MIN_SAMPLES"):
            load_config(AdapterConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value})


async def test_under_a_full_batch_one_timed_out_step_leaves_the_next_request_served_at_once() -> None:
    """Issue 22's acceptance, on the fake: a step that timed out dropped its sequences without
    releasing them, and with the batch bound equal to the replica's slots every later prefill was
    answered "busy" until the engine's slot lease (30 s and 16 more steps on triton-local; never
    here, the fake has no lease). The dropped sequences' release rides with the next step now.

    Measured from the moment the timeout ended the batch's streams, the next request costs at most
    the release step's bound (0.2 s: the replica is still wedged while it runs) plus a prefill and two
    decode steps of 10 ms: about 0.25 s. 2 s leaves eight times that for a loaded box."""
    model = StepReplica("triton-a:8001", delay_s=0.01, slots=2)
    timeouts = StepTimeouts(policy(floor_s=0.2, min_samples=5), model="m")
    limits = SchedulerLimits(max_batch_size=2, release_timeout_s=0.2)
    scheduler = Scheduler(model, limits, replica=model.url, timeouts=timeouts)
    scheduler.start()
    try:
        await collect(scheduler.submit(request()))  # 20 steps: decode steps get the adaptive limit
        handles = [scheduler.submit(request(max_tokens=1_000)) for _ in range(2)]
        streams = [handle.events() for handle in handles]
        for stream in streams:
            assert isinstance(await anext(stream), TokenEvent)
        assert model.held == {handle.seq_id for handle in handles}  # the batch fills the replica
        model.stalled = True  # a decode step hangs until its timeout
        finishes = await asyncio.wait_for(asyncio.gather(*(_last(stream) for stream in streams)), 5)
        timed_out_at = time.monotonic()
        assert all(f.finish is Finish.ERROR and "did not answer a step within its timeout" in f.error for f in finishes)
        model.stalled = False  # the replica answers again (the hung step never will)
        text, finish = await asyncio.wait_for(collect(scheduler.submit(request(max_tokens=3))), 10)
        served_in = time.monotonic() - timed_out_at
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH and text == "xxx"
    assert served_in < 2.0, served_in
    released = {seq_id for action, seq_id in model.rows if action is Action.RELEASE}
    assert {handle.seq_id for handle in handles} <= released and model.held == set()


async def test_a_replica_that_answers_again_gets_the_timed_out_batch_released_without_new_work() -> None:
    """The release goes in a step of its own right after the failure, not only with the next request."""
    model = StepReplica("triton-a:8001", delay_s=0.01, slots=4)
    timeouts = StepTimeouts(policy(floor_s=0.2, min_samples=5), model="m")
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4, release_timeout_s=5.0), replica=model.url, timeouts=timeouts)
    scheduler.start()
    try:
        await collect(scheduler.submit(request()))
        handles = [scheduler.submit(request(max_tokens=1_000)) for _ in range(3)]
        streams = [handle.events() for handle in handles]
        for stream in streams:
            assert isinstance(await anext(stream), TokenEvent)
        model.hold.clear()  # a pod paused mid-step: the step times out, the release waits for the pod
        await asyncio.wait_for(asyncio.gather(*(_last(stream) for stream in streams)), 5)
        model.hold.set()
        deadline = time.monotonic() + 5
        while model.held and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert model.held == set() and scheduler.running_count == 0 and scheduler.waiting_count == 0
    finally:
        await scheduler.stop()


async def test_a_wedged_replica_holds_up_the_release_for_its_bound_only() -> None:
    """Best effort, bounded: the release of a replica that stays wedged gives up after
    release_timeout_s and the scheduler serves what comes next (here on a replica that answers)."""
    model = StepReplica("triton-a:8001", delay_s=0.01)
    timeouts = StepTimeouts(policy(floor_s=0.2, min_samples=5), model="m")
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=2, release_timeout_s=0.3), replica=model.url, timeouts=timeouts)
    scheduler.start()
    try:
        await collect(scheduler.submit(request()))
        handle = scheduler.submit(request(max_tokens=1_000))
        stream = handle.events()
        assert isinstance(await anext(stream), TokenEvent)
        model.stalled = True
        await asyncio.wait_for(_last(stream), 5)  # the timeout ended it; the release step starts now
        started = time.monotonic()
        next_request = asyncio.create_task(collect(scheduler.submit(request(max_tokens=2))))
        await asyncio.sleep(0.1)
        model.stalled = False  # the release step still hangs; the next one will be answered
        _, finish = await asyncio.wait_for(next_request, 5)
        waited = time.monotonic() - started
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    # The release was tried (and waited for up to its bound), and did not hold the loop longer.
    assert 0.25 <= waited < 3.0, waited
    # The release that hung rode again with the request's prefill.
    assert (Action.RELEASE, handle.seq_id) in model.rows
