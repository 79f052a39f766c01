"""The scheduler's decisions, step by step.

`RecordingStepModel` stands in for Triton's step model so that each test can see
exactly which rows every step carried; it follows the step protocol's semantics
(prefill returns the first token, decode the next, a sequence ends at max_tokens).
The real Triton path is covered end to end in tests/e2e.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from conftest import PrefixCache, RoundsOfSteps, StepReplica, collect

from sluice_common.errors import ResourceExhausted
from sluice_common.sampling import Sampling
from sluice_inference_adapter import metrics
from sluice_inference_adapter.scheduler import BULK_MAX_WAIT_S, INTERACTIVE_RECENT_S, Scheduler, SchedulerLimits
from sluice_inference_adapter.sequence import Finish, GenerationRequest, Sequence
from sluice_inference_adapter.priority import Priority
from sluice_inference_adapter.step_rows import FINISH_ERROR, FINISH_INVALID, Action, PromptSpec, StepOutcome, StepRow


class RecordingStepModel:
    def __init__(self, step_delay_s: float = 0.001, interrupts: bool = False) -> None:
        self.steps: list[list[StepRow]] = []
        self.max_tokens: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        # Chunked prefill: (prompt tokens not yet cached, chunk); a raw prompt's characters are its tokens.
        self.uncached: dict[int, tuple[int, int]] = {}
        self.rounds = RoundsOfSteps()
        self.prefix_cache = PrefixCache()
        self.started_at: list[float] = []  # when each of `steps` began
        self.end_asks = 0
        self.delay = step_delay_s
        self.interrupts = interrupts
        self.interrupt_asks = 0
        self.interrupted: list[list[StepRow]] = []  # the rows of each step an interrupt stopped

    follows_rounds = True

    def round(self, rows: list[StepRow], steps: int, follows: bool = False, interruptible: bool = False):  # type: ignore[no-untyped-def]
        return self.rounds.round(self.step, rows, steps, follows, interruptible)

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        self.rounds.note(rows)
        if all(row.action in (Action.END_ROUND, Action.INTERRUPT) for row in rows):  # no engine step: counted apart
            self.end_asks += sum(row.action is Action.END_ROUND for row in rows)
            self.interrupt_asks += sum(row.action is Action.INTERRUPT for row in rows)
            return [self._answer(row) for row in rows]
        self.steps.append(rows)
        self.started_at.append(time.monotonic())
        await asyncio.sleep(self.delay)
        if self.rounds.interrupted():
            self.interrupted.append(rows)
            return [self._interrupted(row) for row in rows]
        return [self._answer(row) for row in rows]

    def _interrupted(self, row: StepRow) -> StepOutcome:
        """A row of a step stopped midway: no token; a release applies, a prefill is admitted with
        none of its prompt cached (its next decode caches it), a decode changes nothing."""
        if row.action is Action.RELEASE:
            return self._answer(row)
        if row.action is Action.PREFILL:
            self._admit(row)
        return StepOutcome(-1, "", "", 3, self.generated.get(row.seq_id, 0))

    def _admit(self, row: StepRow) -> None:
        body = json.loads(row.request)
        self.max_tokens[row.seq_id] = body["max_tokens"]
        self.generated[row.seq_id] = 0
        prompt_tokens = len(body.get("prompt", "")) or 1
        self.uncached[row.seq_id] = (prompt_tokens, body.get("prefill_chunk", 0) or prompt_tokens)

    def _answer(self, row: StepRow) -> StepOutcome:
        if row.action in (Action.END_ROUND, Action.INTERRUPT):
            return StepOutcome(-1, "", "", 0, 0)
        if row.action is Action.RELEASE:
            self.max_tokens.pop(row.seq_id, None)
            return StepOutcome(-1, "", "", 0, 0)
        if row.action is Action.PREFILL:
            self._admit(row)
            self.prefix_cache.prefill(row, 3)
        elif row.seq_id not in self.max_tokens:  # as the engine answers a round sent ahead of a finish
            return StepOutcome(-1, "", FINISH_ERROR, 0, 0, f"seq_id {row.seq_id} is not running (never started, finished or released)")
        cached = self.prefix_cache.of(row.seq_id)
        uncached, chunk = self.uncached.get(row.seq_id, (0, 1))
        if uncached:
            self.uncached[row.seq_id] = (max(0, uncached - chunk), chunk)
            if uncached > chunk:
                return StepOutcome(-1, "", "", 3, 0, cached_tokens=cached)
        self.generated[row.seq_id] += 1
        count = self.generated[row.seq_id]
        finish = "length" if count >= self.max_tokens[row.seq_id] else ""
        if finish:  # the engine frees a finished sequence's slot
            del self.max_tokens[row.seq_id]
        return StepOutcome(count, f"t{count} ", finish, 3, count, cached_tokens=cached)

    def rows_of(self, seq_id: int) -> list[tuple[int, Action]]:
        return [(index, row.action) for index, rows in enumerate(self.steps) for row in rows if row.seq_id == seq_id]

    async def wait_released(self, seq_id: int, within_s: float = 1.0) -> None:
        """Mid-round, a release goes out in a request of its own, moments after the stream ended."""
        deadline = time.monotonic() + within_s
        while seq_id not in self.rounds.released:
            assert time.monotonic() < deadline, f"{seq_id} was not released within {within_s}s: {self.rows_of(seq_id)}"
            await asyncio.sleep(0.005)


def request(max_tokens: int = 3, priority: Priority = Priority.INTERACTIVE, deadline: float | None = None, prompt: str = "p") -> GenerationRequest:
    return GenerationRequest("rid", "tenant", PromptSpec(prompt=prompt), Sampling(max_tokens=max_tokens), priority, deadline)


def tenant_request(tenant: str) -> GenerationRequest:
    return GenerationRequest("rid", tenant, PromptSpec(prompt="p"), Sampling(max_tokens=1))


@pytest.fixture
async def model_and_scheduler():
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4, max_waiting=3))
    scheduler.start()
    yield model, scheduler
    await scheduler.stop()


async def test_streams_tokens_then_finishes_with_usage_and_timings(model_and_scheduler) -> None:
    model, scheduler = model_and_scheduler
    text, finish = await collect(scheduler.submit(request(max_tokens=3)))
    assert text == "t1 t2 t3 "
    assert finish.finish is Finish.LENGTH and finish.completion_tokens == 3 and finish.prompt_tokens == 3
    assert finish.cached_tokens == 0  # the engine had not seen the prompt
    assert 0 < finish.timings.time_to_first_token_s <= finish.timings.total_s
    assert scheduler.running_count == 0


async def test_the_prompt_tokens_the_engine_took_from_its_prefix_cache_reach_the_finish(model_and_scheduler) -> None:
    model, scheduler = model_and_scheduler
    _, first = await collect(scheduler.submit(request(max_tokens=3, prompt="a long system prompt")))
    # The same prompt again: the engine serves all of it but the last token from its cache.
    _, again = await collect(scheduler.submit(request(max_tokens=3, prompt="a long system prompt")))
    _, other = await collect(scheduler.submit(request(max_tokens=3, prompt="another prompt")))
    assert (first.cached_tokens, again.cached_tokens, other.cached_tokens) == (0, 2, 0)
    assert again.prompt_tokens == 3 and again.completion_tokens == 3  # cached tokens are still prompt tokens


async def test_a_bulk_prompt_prefilled_in_chunks_reports_its_cached_tokens_too() -> None:
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4, bulk_prefill_chunk=2))
    scheduler.start()
    try:
        await collect(scheduler.submit(request(max_tokens=2, priority=Priority.BULK, prompt="ten chars!")))
        text, finish = await collect(scheduler.submit(request(max_tokens=2, priority=Priority.BULK, prompt="ten chars!")))
    finally:
        await scheduler.stop()
    assert text == "t1 t2 " and finish.cached_tokens == 2


async def test_a_new_sequence_joins_the_running_batch_at_the_next_step(model_and_scheduler) -> None:
    model, scheduler = model_and_scheduler
    long = scheduler.submit(request(max_tokens=30))
    long_task = asyncio.create_task(collect(long))
    while len(model.steps) < 3:
        await asyncio.sleep(0.001)
    short = scheduler.submit(request(max_tokens=2))
    short_text, _ = await collect(short)
    assert short_text == "t1 t2 "
    short_rows = model.rows_of(short.seq_id)
    # The short one was prefilled while the long one kept decoding, and it finished first.
    assert short_rows[0][1] is Action.PREFILL
    assert (short_rows[0][0], Action.DECODE) in model.rows_of(long.seq_id)
    assert not long_task.done()
    await long_task


async def test_cancel_sends_a_release_row_at_the_next_step(model_and_scheduler) -> None:
    model, scheduler = model_and_scheduler
    handle = scheduler.submit(request(max_tokens=1000))
    events = handle.events()
    await anext(events)
    handle.cancel()
    finish = None
    async for event in events:
        finish = event
    assert finish.finish is Finish.CANCELLED
    await model.wait_released(handle.seq_id)
    rows = model.rows_of(handle.seq_id)
    assert rows[-1][1] is Action.RELEASE
    assert len(rows) < 10
    assert scheduler.running_count == 0


async def test_deadline_ends_a_running_sequence_and_releases_it(model_and_scheduler) -> None:
    model, scheduler = model_and_scheduler
    handle = scheduler.submit(request(max_tokens=100000, deadline=time.monotonic() + 0.05))
    _, finish = await collect(handle)
    assert finish.finish is Finish.DEADLINE
    await model.wait_released(handle.seq_id)
    assert model.rows_of(handle.seq_id)[-1][1] is Action.RELEASE


def test_a_call_cancelled_by_its_own_deadline_is_counted_a_deadline() -> None:
    """The gateway passes the deadline as the call's gRPC timeout, whose expiry cancels the call:
    both are true by the time the scheduler looks, and the deadline is what happened (it read
    CANCELLED, and the deadline series of the metrics and traces stayed empty)."""
    sequence = Sequence(seq_id=1, request=request(deadline=100.0), submitted_at=90.0, cancelled=True)
    assert sequence.abandon_reason(now=100.0) is Finish.DEADLINE
    assert sequence.abandon_reason(now=99.0) is Finish.CANCELLED  # a client that left before it


async def test_full_queue_rejects_with_retry_after() -> None:
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=1, max_waiting=2, retry_after_s=0.5))
    # Not started: nothing leaves the queue.
    scheduler.submit(request())
    scheduler.submit(request())
    with pytest.raises(ResourceExhausted) as caught:
        scheduler.submit(request())
    assert caught.value.retry_after_s == 0.5 and "queue is full" in caught.value.message


async def test_interactive_is_admitted_before_bulk() -> None:
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=1, max_waiting=10))
    bulk = scheduler.submit(request(max_tokens=1, priority=Priority.BULK))
    interactive = scheduler.submit(request(max_tokens=1, priority=Priority.INTERACTIVE))
    scheduler.start()
    try:
        await asyncio.gather(collect(bulk), collect(interactive))
    finally:
        await scheduler.stop()
    assert model.rows_of(interactive.seq_id)[0][0] < model.rows_of(bulk.seq_id)[0][0]


async def test_backend_failure_fails_the_step_sequences_with_error() -> None:
    class Broken(RecordingStepModel):
        async def step(self, rows):
            raise ConnectionError("triton went away")

    scheduler = Scheduler(Broken(), SchedulerLimits())
    scheduler.start()
    try:
        _, finish = await collect(scheduler.submit(request()))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.ERROR and "triton went away" in finish.error


async def test_tenants_take_turns_within_a_class() -> None:
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=1, max_waiting=100))
    flood = [scheduler.submit(tenant_request("noisy")) for _ in range(20)]
    single = scheduler.submit(tenant_request("quiet"))
    scheduler.start()
    try:
        await collect(single)
        single_step = model.rows_of(single.seq_id)[0][0]
        admitted_before_single = sum(1 for h in flood if model.rows_of(h.seq_id) and model.rows_of(h.seq_id)[0][0] < single_step)
        await asyncio.gather(*(collect(h) for h in flood))
    finally:
        await scheduler.stop()
    # Round robin: the quiet tenant waits for one of the noisy tenant's requests, not twenty.
    assert admitted_before_single == 1


async def test_kv_token_budget_limits_the_batch() -> None:
    model = RecordingStepModel()
    # Each request reserves its estimated prompt plus 100 tokens; the budget fits two of them.
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=8, max_batch_tokens=2 * (100 + 33)))
    handles = [scheduler.submit(request(max_tokens=100)) for _ in range(3)]
    scheduler.start()
    try:
        while not model.steps:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        assert scheduler.running_count == 2 and scheduler.waiting_count == 1
        await asyncio.gather(*(collect(h) for h in handles))
    finally:
        await scheduler.stop()


async def test_prefills_wait_to_go_together_but_not_longer_than_max_waiting_steps() -> None:
    model = RecordingStepModel()
    limits = SchedulerLimits(max_batch_size=8, min_prefill_rows=3, max_waiting_steps=4)
    scheduler = Scheduler(model, limits)
    running = scheduler.submit(request(max_tokens=50))
    scheduler.start()
    try:
        while len(model.steps) < 2:
            await asyncio.sleep(0.001)
        late = scheduler.submit(request(max_tokens=1))
        submitted_at_step = len(model.steps)
        await collect(late)
        joined_at_step = model.rows_of(late.seq_id)[0][0]
        # Alone it waits for company, at most max_waiting_steps steps (plus the one in flight).
        assert 4 <= joined_at_step - submitted_at_step <= 6
        running.cancel()
    finally:
        await scheduler.stop()


async def test_backend_failure_fails_waiting_sequences_too_and_marks_them_retryable() -> None:
    class Broken(RecordingStepModel):
        async def step(self, rows):
            await asyncio.sleep(0.01)
            raise ConnectionError("triton went away")

    health: list[bool] = []
    scheduler = Scheduler(Broken(), SchedulerLimits(max_batch_size=1), on_step=health.append)
    first, second = scheduler.submit(request()), scheduler.submit(request())
    scheduler.start()
    try:
        results = await asyncio.gather(collect(first), collect(second))
    finally:
        await scheduler.stop()
    assert all(finish.finish is Finish.ERROR for _, finish in results)
    assert first.backend_failed and second.backend_failed
    assert health[0] is False


async def test_bulk_prefills_go_one_per_step_never_beside_an_interactive_one_and_leave_a_slot() -> None:
    model = RecordingStepModel()
    limits = SchedulerLimits(max_batch_size=4, max_waiting=20, max_bulk_prefill_rows=1, interactive_reserved_slots=1)
    scheduler = Scheduler(model, limits)
    bulk = [scheduler.submit(request(max_tokens=50, priority=Priority.BULK)) for _ in range(5)]
    interactive = scheduler.submit(request(max_tokens=2))
    scheduler.start()
    try:
        await collect(interactive)
        while scheduler.running_count < 3:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        # Bulk never takes the reserved slot.
        assert scheduler.running_count == 3 and scheduler.waiting_count == 2
        for h in bulk:
            h.cancel()
    finally:
        await scheduler.stop()
    bulk_ids = {h.seq_id for h in bulk}
    for rows in model.steps:
        prefills = [r for r in rows if r.action is Action.PREFILL]
        assert sum(r.seq_id in bulk_ids for r in prefills) <= 1
        if any(r.seq_id == interactive.seq_id for r in prefills):
            assert not any(r.seq_id in bulk_ids for r in prefills)
    assert model.rows_of(interactive.seq_id)[0][0] == 0


async def test_bulk_prompts_are_cached_in_chunks_one_bulk_sequence_at_a_time() -> None:
    model = RecordingStepModel()
    limits = SchedulerLimits(max_batch_size=4, max_waiting=20, max_bulk_prefill_rows=1, bulk_prefill_chunk=4)
    scheduler = Scheduler(model, limits)
    first, second = (scheduler.submit(request(max_tokens=2, priority=Priority.BULK, prompt="x" * 10)) for _ in range(2))
    scheduler.start()
    try:
        texts = [await collect(first), await collect(second)]
    finally:
        await scheduler.stop()
    # 10 prompt tokens in chunks of 4: a prefill row and two decode rows cache it, the last of them
    # answers the first token, one more decode row the second; the text is whole.
    assert texts[0][0] == "t1 t2 " and texts[0][1].finish is Finish.LENGTH
    assert [action for _, action in model.rows_of(first.seq_id)] == [Action.PREFILL] + [Action.DECODE] * 3
    prefill = next(row for rows in model.steps for row in rows if row.seq_id == first.seq_id)
    assert json.loads(prefill.request)["prefill_chunk"] == 4
    # The second bulk sequence starts caching only once the first has its first token.
    assert model.rows_of(second.seq_id)[0][0] == 3


class ArrivalEveryStep(RecordingStepModel):
    """An interactive request arrives during each of six steps once a bulk sequence runs, so each
    of the next six steps admits an interactive prefill. Each engine step takes 0.1 s of `now`."""

    def __init__(self) -> None:
        super().__init__()
        self.arrivals: list = []
        self.scheduler: Scheduler | None = None
        self.bulk_id = 0
        self.now = 1000.0

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        engine_step = any(row.action in (Action.PREFILL, Action.DECODE) for row in rows)
        if engine_step and self.scheduler is not None and len(self.arrivals) < 6 and self.rows_of(self.bulk_id):
            self.arrivals.append(self.scheduler.submit(request(max_tokens=1, prompt="a long interactive prompt")))
        self.now += 0.1 if engine_step else 0.0
        return await super().step(rows)


async def test_interactive_prefill_steps_carry_no_bulk_rows_until_bulk_has_waited_its_most() -> None:
    model = ArrivalEveryStep()
    limits = SchedulerLimits(max_batch_size=8, max_waiting=20, bulk_prefill_chunk=4)
    scheduler = model.scheduler = Scheduler(model, limits, clock=lambda: model.now)
    bulk = scheduler.submit(request(max_tokens=30, priority=Priority.BULK))
    model.bulk_id = bulk.seq_id
    arrivals = model.arrivals
    scheduler.start()
    try:
        while len(arrivals) < 6:
            await asyncio.sleep(0.001)
        for handle in arrivals:
            await collect(handle)
        bulk.cancel()
        await collect(bulk)
    finally:
        await scheduler.stop()
    interactive_ids = {h.seq_id for h in arrivals}
    prefill_steps = [i for i, rows in enumerate(model.steps) if any(r.seq_id in interactive_ids for r in rows)]
    bulk_steps = {index for index, _ in model.rows_of(bulk.seq_id)}
    assert len(prefill_steps) == 6 and prefill_steps == list(range(prefill_steps[0], prefill_steps[0] + 6))
    # Six interactive prefills in a row, 0.1 s apart: bulk sits out those planned 0, 0.1 and 0.2 s
    # after its last step, and joins the one planned 0.3 s after it (BULK_MAX_WAIT_S: 0.25 s).
    assert BULK_MAX_WAIT_S == 0.25
    assert [i in bulk_steps for i in prefill_steps] == [False, False, False, True, False, False]
    # An interactive prompt is never chunked.
    assert all("prefill_chunk" not in json.loads(model.steps[i][-1].request) for i in prefill_steps)


def most_bulk_rows_in_a_step(model: RecordingStepModel, bulk_ids: set[int]) -> int:
    return max(sum(row.seq_id in bulk_ids for row in rows) for rows in model.steps)


@pytest.mark.parametrize(("target_s", "most_bulk"), [(0.01, 1), (0.0, 4)])
async def test_while_interactive_requests_run_bulk_joins_only_while_steps_stay_under_the_target(target_s: float, most_bulk: int) -> None:
    # Steps of 20 ms: over a 10 ms target, so beside a running interactive sequence bulk runs one
    # sequence at a time; with no target (0) all four run together.
    model = RecordingStepModel(step_delay_s=0.02)
    replica = f"held-{target_s}"
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=8, max_waiting=20, bulk_step_target_s=target_s), replica=replica)
    interactive = scheduler.submit(request(max_tokens=40))
    bulk = [scheduler.submit(request(max_tokens=3, priority=Priority.BULK)) for _ in range(4)]
    scheduler.start()
    try:
        for handle in bulk:
            _, finish = await collect(handle)
            assert finish.finish is Finish.LENGTH  # bulk still progresses
        interactive.cancel()
        await collect(interactive)
    finally:
        await scheduler.stop()
    assert most_bulk_rows_in_a_step(model, {h.seq_id for h in bulk}) == most_bulk
    # An operator sees why the job slowed: the steps that left a bulk sequence waiting.
    held = REGISTRY.get_sample_value("sluice_adapter_bulk_held_total", {"replica": replica}) or 0
    assert (held > 0) == bool(target_s)


async def test_a_job_alone_or_long_after_the_last_interactive_request_fills_the_batch() -> None:
    now = [1000.0]
    model = RecordingStepModel(step_delay_s=0.02)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=8, max_waiting=20, bulk_step_target_s=0.01), clock=lambda: now[0])
    scheduler.start()
    try:
        await collect(scheduler.submit(request(max_tokens=3)))  # its steps took 20 ms each: over the target
        now[0] += INTERACTIVE_RECENT_S + 1
        bulk = [scheduler.submit(request(max_tokens=3, priority=Priority.BULK)) for _ in range(4)]
        for handle in bulk:
            await collect(handle)
    finally:
        await scheduler.stop()
    assert most_bulk_rows_in_a_step(model, {h.seq_id for h in bulk}) == 4


class SharedSlotsModel(RecordingStepModel):
    """A step model with `slots` KV slots, some held by another adapter: a prefill that finds
    none free answers "busy" and changes nothing, as triton-local's engine does."""

    def __init__(self, slots: int, held_by_others: int = 0) -> None:
        super().__init__()
        self.slots = slots
        self.held_by_others = held_by_others
        self.peak = 0

    def _answer(self, row: StepRow) -> StepOutcome:
        held = len(self.max_tokens) + self.held_by_others
        if row.action is Action.PREFILL and held >= self.slots:
            return StepOutcome(-1, "", "busy", 3, 0, "no free slot")
        outcome = super()._answer(row)
        if outcome.finish:
            self.max_tokens.pop(row.seq_id, None)
        self.peak = max(self.peak, len(self.max_tokens) + self.held_by_others)
        return outcome


async def test_a_full_engine_is_backpressure_not_an_error() -> None:
    model = SharedSlotsModel(slots=2)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4), replica="triton-a:8001")
    scheduler.start()
    try:
        results = await asyncio.gather(*(collect(scheduler.submit(request(max_tokens=3))) for _ in range(5)))
    finally:
        await scheduler.stop()
    assert [(text, finish.finish) for text, finish in results] == [("t1 t2 t3 ", Finish.LENGTH)] * 5
    assert model.peak == 2


async def test_prefills_wait_while_another_adapter_holds_every_slot() -> None:
    model = SharedSlotsModel(slots=2, held_by_others=2)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4, engine_full_retry_s=0.02))
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=2))
        await asyncio.sleep(0.2)
        busy_answers = sum(1 for rows in model.steps for row in rows if row.action is Action.PREFILL)
        # Retried about every 20 ms, not in a busy loop; the engine admitted nothing of ours yet.
        assert 3 <= busy_answers <= 15 and model.max_tokens == {}
        model.held_by_others = 0  # the other adapter's sequences ended
        text, finish = await asyncio.wait_for(collect(handle), timeout=2)
    finally:
        await scheduler.stop()
    assert (text, finish.finish) == ("t1 t2 ", Finish.LENGTH)


async def test_a_prefill_answered_busy_counts_its_queue_wait_once() -> None:
    """Turned away busy twice or more, then served: one observation of the whole wait (arrival to
    the prefill the engine took), as the stream's own timings report it; not one per admission."""
    from prometheus_client import REGISTRY

    replica = "triton-queue-wait:8001"
    model = SharedSlotsModel(slots=1, held_by_others=1)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=2, engine_full_retry_s=0.02), replica=replica)
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=2))
        while sum(1 for rows in model.steps for row in rows if row.action is Action.PREFILL) < 3:
            await asyncio.sleep(0.01)
        model.held_by_others = 0
        _, finish = await asyncio.wait_for(collect(handle), timeout=2)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    count = REGISTRY.get_sample_value("sluice_adapter_queue_seconds_count", {"replica": replica})
    total = REGISTRY.get_sample_value("sluice_adapter_queue_seconds_sum", {"replica": replica})
    assert count == 1
    assert total == pytest.approx(finish.timings.queue_s)


async def test_stop_releases_the_running_sequences_slots() -> None:
    """A scheduler that stops (the adapter drains, or its replica leaves the pool) gives its slots back
    at once rather than leaving them to the engine's slot lease."""
    model = StepReplica("triton-a:8001", delay_s=0.005, slots=4)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4))
    scheduler.start()
    handles = [scheduler.submit(request(max_tokens=1_000)) for _ in range(3)]
    while len(model.held) < 3:
        await asyncio.sleep(0.005)
    await scheduler.stop()
    assert model.held == set()
    assert {h.seq_id for h in handles} <= {seq_id for action, seq_id in model.rows if action is Action.RELEASE}


async def test_a_failed_step_releases_its_sequences_once_the_replica_answers() -> None:
    model = StepReplica("triton-a:8001", delay_s=0.005, slots=2)
    health: list[bool] = []
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=2, release_timeout_s=0.1), on_step=health.append)
    scheduler.start()
    try:
        handles = [scheduler.submit(request(max_tokens=1_000)) for _ in range(2)]
        while len(model.held) < 2:
            await asyncio.sleep(0.005)
        model.failing = True  # the step fails, and so does the release step after it
        results = await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 5)
        assert all(finish.finish is Finish.ERROR for _, finish in results) and health[-1] is False
        model.failing = False
        text, finish = await asyncio.wait_for(collect(scheduler.submit(request(max_tokens=2))), 5)
    finally:
        await scheduler.stop()
    assert (text, finish.finish) == ("xx", Finish.LENGTH)
    assert model.held == set()


async def test_slots_a_failed_step_left_held_count_as_release_pending_until_their_release_lands() -> None:
    """The engine keeps the slots of sequences a failed round dropped until a release reaches it:
    they read nowhere, where triton-local's own slot metrics said they were held. They are owed a
    release, not running: kv_slots_in_use (vllm:num_requests_running) counts the running alone."""
    model = StepReplica("triton-a:8001", delay_s=0.005, slots=2)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=2, release_timeout_s=0.1), replica="owed-releases")
    in_use = lambda: REGISTRY.get_sample_value("sluice_adapter_kv_slots_in_use", {"replica": "owed-releases"})  # noqa: E731
    pending = lambda: REGISTRY.get_sample_value("sluice_adapter_kv_slots_release_pending", {"replica": "owed-releases"})  # noqa: E731
    scheduler.start()
    try:
        handles = [scheduler.submit(request(max_tokens=1_000)) for _ in range(2)]
        while len(model.held) < 2:
            await asyncio.sleep(0.005)
        assert in_use() == 2 and pending() == 0
        model.failing = True  # the step fails, and so do the releases after it
        await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 5)
        assert len(model.held) == 2 and pending() == 2 and in_use() == 0
        model.failing = False
        while model.held:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert pending() == 0 and in_use() == 0
    finally:
        await scheduler.stop()
    metrics.forget_replica("owed-releases", [])  # as ReplicaPool._remove does: both series go
    assert in_use() is None and pending() is None


class StaleSlotsModel(SharedSlotsModel):
    """Every slot held by sequences nobody steps: triton-local answers such a prefill "stale"."""

    def _answer(self, row: StepRow) -> StepOutcome:
        if row.action is Action.PREFILL and self.held_by_others >= self.slots:
            return StepOutcome(-1, "", "stale", 3, 0, "every slot is held by sequences nobody has stepped")
        return super()._answer(row)


async def test_a_stale_engine_counts_against_the_replica_and_the_prefill_waits() -> None:
    """A "busy" engine is serving someone (a healthy replica); a "stale" one serves nobody until its
    slot lease frees the slots: the step counts as a failure, and the prefill waits as for "busy"."""
    model = StaleSlotsModel(slots=2, held_by_others=2)
    health: list[bool] = []
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=2, engine_full_retry_s=0.02), on_step=health.append)
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=2))
        deadline = time.monotonic() + 5
        while len(health) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert len(health) >= 3 and not any(health), health
        model.held_by_others = 0  # the lease freed them
        text, finish = await asyncio.wait_for(collect(handle), timeout=2)
    finally:
        await scheduler.stop()
    assert (text, finish.finish) == ("t1 t2 ", Finish.LENGTH)
    assert health[-1] is True


class FailsItsFirstReleaseRound(RecordingStepModel):
    """One clock, which passes every deadline once a round has ended (after its last response was
    read, before the next round is planned); the first step that carries a release fails before the
    engine applies it, as a transport error does. `released`: what answered steps released."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0
        self.fail_a_release = True
        self.released: list[int] = []

    def round(self, rows: list[StepRow], steps: int, follows: bool = False, interruptible: bool = False):  # type: ignore[no-untyped-def]
        async def then_time_passes():  # type: ignore[no-untyped-def]
            async for outcomes in super(FailsItsFirstReleaseRound, self).round(rows, steps, follows, interruptible):
                yield outcomes
            self.now += 60.0

        return then_time_passes()

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if self.fail_a_release and any(row.action is Action.RELEASE for row in rows):
            self.fail_a_release = False
            raise ConnectionError("triton went away")
        outcomes = await super().step(rows)
        self.released.extend(row.seq_id for row in rows if row.action is Action.RELEASE)
        return outcomes


async def test_a_release_planned_into_a_round_that_fails_before_answering_is_sent_again() -> None:
    """The deadline passed between rounds: the next round's plan drops the sequence with a release
    row of its own. That round failed before the engine saw it, and the slot was left to the lease."""
    model = FailsItsFirstReleaseRound()
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=1), clock=lambda: model.now)
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=100, deadline=model.now + 30.0))
        text, finish = await collect(handle)
        assert (text, finish.finish) == ("t1 ", Finish.DEADLINE)
        deadline = time.monotonic() + 2
        while handle.seq_id not in model.released and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # Before the stop, which releases what it knows to be held.
        assert not model.fail_a_release, "the round carrying the release failed"
        assert model.released == [handle.seq_id]
    finally:
        await scheduler.stop()


class FailsItsFirstAsideRelease(RecordingStepModel):
    """A request of releases alone is answered after `release_s`; the first one fails then (Triton
    went away for a moment). `released`: what answered ones released."""

    def __init__(self, step_delay_s: float, release_s: float) -> None:
        super().__init__(step_delay_s)
        self.release_s = release_s
        self.failed_releases = 0
        self.released: list[int] = []

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if rows and all(row.action is Action.RELEASE for row in rows):
            await asyncio.sleep(self.release_s)
            if not self.failed_releases:
                self.failed_releases += 1
                raise ConnectionError("triton went away")
            self.rounds.note(rows)
            self.released.extend(row.seq_id for row in rows)
            return [self._answer(row) for row in rows]
        return await super().step(rows)


async def test_a_release_that_failed_while_nothing_runs_is_tried_again_without_a_new_request() -> None:
    """A cancel's release failed after its round had ended: no round came to carry it again, and
    an idle engine holds the slot (its lease frees slots only while it steps others)."""
    model = FailsItsFirstAsideRelease(step_delay_s=0.05, release_s=0.1)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=1, release_retry_s=0.05))
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=1_000))
        events = handle.events()
        await anext(events)  # the first token
        while len(model.steps) < 2:  # the next round's step in flight
            await asyncio.sleep(0.001)
        handle.cancel()  # released by a request of its own, which fails after the round has ended
        assert [event async for event in events][-1].finish is Finish.CANCELLED
        deadline = time.monotonic() + 2
        while handle.seq_id not in model.released and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        # Before the stop, which releases what it knows to be held.
        assert model.failed_releases == 1 and model.released == [handle.seq_id]
        assert not any(row.action is Action.RELEASE for rows in model.steps for row in rows), "no round carried it"
        assert handle.seq_id not in model.max_tokens, "the engine holds no slot for it"
        assert scheduler.running_count == scheduler.waiting_count == 0
    finally:
        await scheduler.stop()


class AnswersItsPrefills(RecordingStepModel):
    """Answers every prefill row with one outcome, as triton-local's engine answers a row it failed."""

    def __init__(self, finish: str, error: str) -> None:
        super().__init__()
        self.outcome = StepOutcome(-1, "", finish, 0, 0, error)

    def _answer(self, row: StepRow) -> StepOutcome:
        return self.outcome if row.action is Action.PREFILL else super()._answer(row)


@pytest.mark.parametrize(
    ("finish", "error", "replica_fault"),
    [
        # step_engine.py's own faults: the replica's, and another may serve the request.
        (FINISH_ERROR, "forward pass failed: RuntimeError('CUDA error: an illegal memory access was encountered')", True),
        (FINISH_ERROR, "sampling failed: FloatingPointError('nan')", True),
        (FINISH_ERROR, "admission failed: MemoryError()", True),
        # "error" that is not the engine's: the same everywhere, or a sequence it no longer runs.
        (FINISH_ERROR, "prompt is 9000 tokens and max_tokens is 16; the context holds 8192 tokens including max_tokens", False),
        (FINISH_ERROR, "seq_id 7 is not running (never started, finished or released)", False),
        (FINISH_INVALID, "sampling.top_k: must be >= 0", False),
    ],
)
async def test_a_row_the_engine_failed_counts_against_the_replica_and_may_be_retried(finish: str, error: str, replica_fault: bool) -> None:
    health: list[bool] = []
    scheduler = Scheduler(AnswersItsPrefills(finish, error), SchedulerLimits(), on_step=health.append)
    scheduler.start()
    try:
        handle = scheduler.submit(request())
        text, event = await collect(handle)
    finally:
        await scheduler.stop()
    assert text == "" and event.finish is (Finish.ERROR if finish == FINISH_ERROR else Finish.INVALID) and event.error == error
    assert handle.backend_failed is replica_fault
    assert health == [not replica_fault]


async def test_a_prefill_row_names_its_request_for_the_engines_log_lines() -> None:
    """The prefill's REQUEST JSON carries the request id (an engine that does not know the key
    ignores it), so Triton's lines about the sequence join the adapter's and the gateway's."""
    model = RecordingStepModel()
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=4))
    scheduler.start()
    try:
        await collect(scheduler.submit(GenerationRequest("req-123", "tenant", PromptSpec(prompt="p"), Sampling(max_tokens=1))))
    finally:
        await scheduler.stop()
    (prefill,) = [row for step in model.steps for row in step if row.action is Action.PREFILL]
    assert json.loads(prefill.request)["request_id"] == "req-123"
    # A count row (no request to name) and an unnamed request carry none.
    assert "request_id" not in json.loads(PromptSpec(prompt="p").to_json(Sampling(max_tokens=1)))


async def test_a_failed_rounds_log_lines_name_its_sequences_within_a_bound() -> None:
    """The scheduler's task serves every request of the replica, so its lines have no request id of
    their own: a failed round's line names its sequences' request ids and seq_ids (at most 16 of
    each, then how many more), and a failed release its seq_ids."""
    model = StepReplica("triton-a:8001", delay_s=0.005)
    limits = SchedulerLimits(max_batch_size=20, max_batch_tokens=1_000_000, release_timeout_s=0.1)
    scheduler = Scheduler(model, limits, replica="logged-failures")
    scheduler.start()
    try:
        requests = [GenerationRequest(f"req-{i}", "tenant", PromptSpec(prompt="p"), Sampling(max_tokens=1_000)) for i in range(18)]
        handles = [scheduler.submit(r) for r in requests]
        while len({seq_id for action, seq_id in model.rows if action is Action.PREFILL}) < 18:
            await asyncio.sleep(0.005)
        with capture_logs() as logs:
            model.failing = True  # the round fails, and so does the release of its sequences after it
            await asyncio.wait_for(asyncio.gather(*(collect(h) for h in handles)), 5)
            for _ in range(200):
                if any(line["event"] == "release_failed" for line in logs):
                    break
                await asyncio.sleep(0.01)
    finally:
        model.failing = False
        await scheduler.stop()
    (failed,) = [line for line in logs if line["event"] == "step_failed"]
    assert failed["replica"] == "logged-failures", failed
    assert failed["request_ids"][-1] == failed["seq_ids"][-1] == "... 2 more"
    named = dict(zip(failed["seq_ids"][:16], failed["request_ids"][:16]))
    assert len(named) == 16 and named == {h.seq_id: r.request_id for h, r in zip(handles, requests) if h.seq_id in named}
    releases = [line for line in logs if line["event"] == "release_failed"]
    assert releases and set(releases[0]["seq_ids"][:16]) <= {h.seq_id for h in handles} and releases[0]["sequences"] == 18
