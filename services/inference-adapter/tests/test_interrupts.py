"""Interactive arrivals interrupting bulk work (step protocol's INTERRUPTIBLE rounds and INTERRUPT
asks), over conftest.RoundsOfSteps' emulation of the engine: a step an interrupt stops answers no
token and changes nothing but admissions, and every sequence still gets each of its tokens once."""

from __future__ import annotations

import asyncio

from conftest import collect
from prometheus_client import REGISTRY
from test_rounds import _until
from test_scheduler import RecordingStepModel, request

from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.sequence import Finish
from sluice_inference_adapter.step_rows import Action
from sluice_inference_adapter.priority import Priority


def started(interrupt_bulk: bool = True, interrupts: bool = True, replica: str = "") -> tuple[RecordingStepModel, Scheduler]:
    """A scheduler over steps of ~20 ms, long enough for an arrival's ask to reach one in progress."""
    model = RecordingStepModel(step_delay_s=0.02, interrupts=interrupts)
    limits = SchedulerLimits(max_batch_size=8, max_round_steps=32, round_target_s=1.0, interrupt_bulk=interrupt_bulk)
    scheduler = Scheduler(model, limits, replica=replica)
    scheduler.start()
    return model, scheduler


def tokens(count: int) -> str:
    return "".join(f"t{i} " for i in range(1, count + 1))


async def test_an_interactive_arrival_stops_the_bulk_step_in_progress_and_no_token_is_lost() -> None:
    model, scheduler = started(replica="interrupting")
    try:
        bulk = [scheduler.submit(request(max_tokens=40, priority=Priority.BULK)) for _ in range(2)]
        await _until(lambda: len(model.steps) > 3)
        interactive = scheduler.submit(request(max_tokens=3))
        text, finish = await collect(interactive)
        bulk_results = await asyncio.gather(*(collect(handle) for handle in bulk))
    finally:
        await scheduler.stop()
    assert (text, finish.finish) == (tokens(3), Finish.LENGTH)
    assert model.interrupt_asks == 1 and model.end_asks == 0
    assert model.rounds.interrupted_steps == 1
    assert REGISTRY.get_sample_value("sluice_adapter_interrupts_asked_total", {"replica": "interrupting"}) == 1
    # The stopped step made no token: each bulk sequence still has every token, once and in order.
    for bulk_text, bulk_finish in bulk_results:
        assert (bulk_text, bulk_finish.finish, bulk_finish.completion_tokens) == (tokens(40), Finish.LENGTH, 40)
    # Rounds of bulk work went interruptible; the interactive prefill's round did not.
    prefill_round = next(i for i, rows in enumerate(model.rounds.opening) if any(r.seq_id == interactive.seq_id for r in rows))
    assert any(model.rounds.interruptible[:prefill_round])
    assert model.rounds.interruptible[prefill_round] is False


async def test_an_interrupt_asked_as_a_round_starts_stops_its_first_step_and_is_not_sent_again() -> None:
    """An ask sent before the round answered is sent again with its first response, in case it
    reached the engine first; not when that response shows the ask stopped the step."""
    model, scheduler = started()
    arrivals: list = []

    def arrive_as_a_long_bulk_round_starts(steps: int) -> None:
        if steps > 1 and not arrivals:
            arrivals.append(scheduler.submit(request(max_tokens=2)))

    model.rounds.on_round = arrive_as_a_long_bulk_round_starts
    try:
        bulk = scheduler.submit(request(max_tokens=60, priority=Priority.BULK))
        await _until(lambda: bool(arrivals))
        text, _ = await collect(arrivals[0])
        await collect(bulk)
    finally:
        await scheduler.stop()
    assert text == tokens(2)
    assert model.rounds.interrupted_steps == 1
    assert model.interrupt_asks == 1, "not sent again after the response that shows it stopped the step"


async def test_a_bulk_prefill_stopped_midway_is_admitted_and_caches_its_prompt_at_its_next_step() -> None:
    model, scheduler = started()
    try:
        first = scheduler.submit(request(max_tokens=40, priority=Priority.BULK))
        await _until(lambda: len(model.steps) > 3)
        # The interactive request arrives while the step that prefills the second bulk one runs.
        second = scheduler.submit(request(max_tokens=5, priority=Priority.BULK))
        await _until(lambda: any(r.seq_id == second.seq_id for rows in model.steps for r in rows))
        interactive = scheduler.submit(request(max_tokens=2))
        results = await asyncio.gather(collect(first), collect(second), collect(interactive))
    finally:
        await scheduler.stop()
    assert [(text, finish.finish) for text, finish in results] == [
        (tokens(40), Finish.LENGTH),
        (tokens(5), Finish.LENGTH),
        (tokens(2), Finish.LENGTH),
    ]
    (stopped,) = model.interrupted
    assert (Action.PREFILL, second.seq_id) in [(row.action, row.seq_id) for row in stopped]


async def test_a_bulk_arrival_does_not_interrupt() -> None:
    model, scheduler = started()
    try:
        first = scheduler.submit(request(max_tokens=30, priority=Priority.BULK))
        await _until(lambda: len(model.steps) > 3)
        second = scheduler.submit(request(max_tokens=3, priority=Priority.BULK))
        await asyncio.gather(collect(first), collect(second))
    finally:
        await scheduler.stop()
    assert model.interrupt_asks == 0 and model.rounds.interrupted_steps == 0
    assert model.end_asks == 1, "it ends the long round after its current step, as any arrival"


async def test_a_streaming_interactive_sequence_beside_bulk_is_interrupted_but_not_its_prefill() -> None:
    model, scheduler = started()
    try:
        streaming = scheduler.submit(request(max_tokens=40))
        await _until(lambda: any(r.seq_id == streaming.seq_id for rows in model.steps for r in rows))
        bulk = scheduler.submit(request(max_tokens=40, priority=Priority.BULK))
        await _until(lambda: len(model.steps) > 6)
        arrival = scheduler.submit(request(max_tokens=2))
        results = await asyncio.gather(collect(streaming), collect(bulk), collect(arrival))
    finally:
        await scheduler.stop()
    assert [text for text, _ in results] == [tokens(40), tokens(40), tokens(2)]
    assert model.interrupt_asks == 1 and model.rounds.interrupted_steps == 1
    # The streaming sequence's own prefill round carried no bulk: not interruptible.
    assert model.rounds.interruptible[0] is False


async def test_without_interrupts_an_interactive_arrival_only_ends_the_round() -> None:
    for interrupt_bulk, interrupts in ((False, True), (True, False)):
        model, scheduler = started(interrupt_bulk=interrupt_bulk, interrupts=interrupts)
        try:
            bulk = scheduler.submit(request(max_tokens=30, priority=Priority.BULK))
            await _until(lambda: len(model.steps) > 3)
            await collect(scheduler.submit(request(max_tokens=2)))
            await collect(bulk)
        finally:
            await scheduler.stop()
        assert not any(model.rounds.interruptible), (interrupt_bulk, interrupts)
        assert model.interrupt_asks == 0 and model.end_asks == 1, (interrupt_bulk, interrupts)
        assert all(row.action is not Action.INTERRUPT for rows in model.steps for row in rows)


class ArrivalEveryOtherStep(RecordingStepModel):
    """An interactive request arrives during every other engine step (an interactive prefill's step
    comes between) for `arrivals` arrivals once the bulk sequence has stepped, each engine step
    taking 0.1 s of `now`; records the bulk sequence's tokens made as they came."""

    def __init__(self, arrivals: int) -> None:
        super().__init__(interrupts=True)
        self.left = arrivals
        self.scheduler: Scheduler | None = None
        self.bulk_id = 0
        self.now = 1000.0
        self.bulk_tokens_during: list[int] = []
        self.engine_steps = 0

    async def step(self, rows):  # type: ignore[no-untyped-def]
        engine_step = any(row.action in (Action.PREFILL, Action.DECODE) for row in rows)
        self.engine_steps += engine_step
        if engine_step and self.engine_steps % 2 and self.scheduler is not None and self.left and self.rows_of(self.bulk_id):
            self.left -= 1
            self.scheduler.submit(request(max_tokens=1))
            self.bulk_tokens_during.append(self.generated.get(self.bulk_id, 0))
        self.now += 0.1 if engine_step else 0.0
        return await super().step(rows)


async def test_bulk_interrupted_by_a_stream_of_arrivals_still_steps_once_it_has_waited_its_most() -> None:
    model = ArrivalEveryOtherStep(arrivals=20)
    limits = SchedulerLimits(max_batch_size=8, max_waiting=40, interrupt_bulk=True)
    scheduler = model.scheduler = Scheduler(model, limits, clock=lambda: model.now)
    bulk = scheduler.submit(request(max_tokens=30, priority=Priority.BULK))
    model.bulk_id = bulk.seq_id
    scheduler.start()
    try:
        await _until(lambda: model.left == 0, within_s=10)
        text, finish = await collect(bulk)
    finally:
        await scheduler.stop()
    assert model.rounds.interrupted_steps >= 3
    # 20 arrivals over 4 s of steps: bulk went on making tokens (BULK_MAX_WAIT_S: 0.25 s at most
    # without a step), and none was lost or made twice by the steps interrupted.
    assert model.bulk_tokens_during[-1] - model.bulk_tokens_during[0] >= 4, model.bulk_tokens_during
    assert (text, finish.completion_tokens) == (tokens(30), 30)
