"""Multi-step rounds: how many engine steps the scheduler asks for per round trip, and what
happens mid-round (arrivals, cancellations, deadlines), over the step protocol's round semantics
(conftest.RoundsOfSteps)."""

from __future__ import annotations

import asyncio
import time

from conftest import collect
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from test_scheduler import RecordingStepModel, request

from sluice_inference_adapter.sequence import Finish, FinishEvent, SequenceHandle
from sluice_inference_adapter.scheduler import Scheduler, SchedulerLimits
from sluice_inference_adapter.step_rows import Action, StepOutcome, StepRow


async def _until(condition, within_s: float = 2.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


def long_rounds(max_batch_size: int = 8, rounds_ahead: bool = False, replica: str = "") -> tuple[RecordingStepModel, Scheduler]:
    """A started scheduler allowed rounds of up to 32 steps of ~10 ms."""
    model = RecordingStepModel(step_delay_s=0.01)
    limits = SchedulerLimits(max_batch_size=max_batch_size, max_round_steps=32, round_target_s=1.0, rounds_ahead=rounds_ahead)
    scheduler = Scheduler(model, limits, replica=replica)
    scheduler.start()
    return model, scheduler


async def until_a_long_round(model: RecordingStepModel) -> None:
    await _until(lambda: model.rounds.asked and model.rounds.asked[-1] > 1 and len(model.steps) > 4)


async def test_a_steady_batch_asks_for_as_many_steps_as_fit_the_round_target() -> None:
    model = RecordingStepModel(step_delay_s=0.01)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=32, round_target_s=0.05))
    scheduler.start()
    try:
        text, finish = await collect(scheduler.submit(request(max_tokens=30)))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH and finish.completion_tokens == 30
    assert text == "".join(f"t{i} " for i in range(1, 31)), "every step's token, in order, once"
    asked = model.rounds.asked
    assert asked[0] == 1, "no step time measured yet: one step"
    # Steps take at least their 10 ms sleep, so a 50 ms target never fits more than 5 (the cap of
    # 32 is not what bounds them); several fit as long as a step takes under 25 ms.
    assert all(steps <= 5 for steps in asked), asked
    assert max(asked) >= 2, asked


async def test_steps_sharing_a_response_reach_the_caller_as_one_event_in_order() -> None:
    """A response that several steps share (STREAM_INTERVAL_MS) gives the caller one event with its
    tokens in order and their count, and the round length still comes from the time of one step."""
    model = RecordingStepModel(step_delay_s=0.01)
    model.rounds.shared_steps = 4
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=32, round_target_s=0.1))
    scheduler.start()
    try:
        events = [event async for event in scheduler.submit(request(max_tokens=120)).events()]
    finally:
        await scheduler.stop()
    tokens, finish = events[:-1], events[-1]
    assert isinstance(finish, FinishEvent) and finish.completion_tokens == 120
    assert "".join(e.text for e in tokens) == "".join(f"t{i} " for i in range(1, 121))
    assert sum(e.token_count for e in tokens) == 120
    assert tokens[0].token_count == 1, "the first token alone"
    assert max(e.token_count for e in tokens) == 4 and len(tokens) < 60
    # A shared response takes 4 steps' sleeps, at least 40 ms: timed as one step, no more than 2
    # steps would fit 100 ms once the step time has followed it. Timed per step, 10 fit (at least 5
    # while a busy box keeps a 10 ms step under 20 ms).
    asked = model.rounds.asked
    assert len(asked) > 5 and min(asked[3:]) >= 5, asked


async def test_max_round_steps_1_is_one_round_trip_per_token() -> None:
    model = RecordingStepModel(step_delay_s=0.002)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=1))
    scheduler.start()
    try:
        await collect(scheduler.submit(request(max_tokens=10)))
    finally:
        await scheduler.stop()
    assert model.rounds.asked == [1] * 10


async def test_an_arrival_as_a_finished_round_closes_asks_no_round_to_end() -> None:
    """A round whose sequences have all finished ends by itself: an end-round ask then would reach
    the engine after the arrival's own round and end that one instead."""
    model = RecordingStepModel(step_delay_s=0.005)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=32, round_target_s=1.0))
    scheduler.start()
    try:
        for _ in range(3):  # each arrives as the round of the one before closes
            await collect(scheduler.submit(request(max_tokens=12)))
    finally:
        await scheduler.stop()
    assert max(model.rounds.asked) > 1  # long rounds ran, so an ask was possible
    assert model.end_asks == 0


async def test_one_step_rounds_while_requests_wait_to_be_admitted() -> None:
    model = RecordingStepModel(step_delay_s=0.005)
    scheduler = Scheduler(model, SchedulerLimits(max_batch_size=1, max_round_steps=8, round_target_s=1.0))
    scheduler.start()
    try:
        first = scheduler.submit(request(max_tokens=12))
        second = scheduler.submit(request(max_tokens=12))
        await collect(first)
        rounds_while_waiting = len(model.rounds.asked)
        await collect(second)
    finally:
        await scheduler.stop()
    # The second waited for the batch's one slot the whole time the first ran: no long round then.
    assert model.rounds.asked[:rounds_while_waiting] == [1] * rounds_while_waiting
    assert max(model.rounds.asked[rounds_while_waiting:]) > 1


async def test_an_arrival_mid_round_ends_the_round_and_joins_at_the_next_step() -> None:
    model, scheduler = long_rounds()
    try:
        long = scheduler.submit(request(max_tokens=200))
        await until_a_long_round(model)
        arrived_at_step = len(model.steps)
        newcomer = scheduler.submit(request(max_tokens=2))
        _, finish = await collect(newcomer)
        long.cancel()
        await collect(long)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    assert model.end_asks == 1
    joined_at = model.rows_of(newcomer.seq_id)[0]
    assert joined_at[1] is Action.PREFILL
    # The step in progress when it arrived ends the round; the next one carries its prefill.
    assert joined_at[0] <= arrived_at_step + 1, (joined_at, arrived_at_step)


async def test_an_end_ask_sent_before_the_round_answered_is_sent_again_with_its_first_response() -> None:
    """The ask travels apart from the round: one sent before the round reached the engine can get
    there first and end nothing, and the round would run on for up to round_target_s."""
    model, scheduler = long_rounds(replica="ask-again")
    arrivals: list[SequenceHandle] = []
    arrived_at_step: list[int] = []

    def arrive_as_a_long_round_starts(steps: int) -> None:
        if steps > 1 and not arrivals and len(model.steps) > 4:
            model.rounds.end_asks_lost = 1  # the ask this arrival makes gets to the engine first
            arrived_at_step.append(len(model.steps))
            arrivals.append(scheduler.submit(request(max_tokens=2)))

    model.rounds.on_round = arrive_as_a_long_round_starts
    try:
        long = scheduler.submit(request(max_tokens=200))
        await _until(lambda: bool(arrivals))
        _, finish = await collect(arrivals[0])
        long.cancel()
        await collect(long)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    assert model.end_asks == 2
    assert REGISTRY.get_sample_value("sluice_adapter_round_end_asked_again_total", {"replica": "ask-again"}) == 1
    # The round's first step, the one the second ask reaches, then the arrival's prefill.
    joined_at = model.rows_of(arrivals[0].seq_id)[0][0]
    assert joined_at <= arrived_at_step[0] + 2, (joined_at, arrived_at_step)


async def test_a_cancel_mid_round_releases_the_sequence_at_the_next_step() -> None:
    model, scheduler = long_rounds()
    try:
        handle = scheduler.submit(request(max_tokens=500))
        await until_a_long_round(model)
        cancelled_at_step = len(model.steps)
        handle.cancel()
        _, finish = await collect(handle)
        await model.wait_released(handle.seq_id)
        await asyncio.sleep(0.05)  # the round would have gone on for many steps more
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.CANCELLED
    rows = model.rows_of(handle.seq_id)
    decodes_after = [index for index, action in rows if action is Action.DECODE and index > cancelled_at_step]
    assert len(decodes_after) <= 1, rows[-5:]  # the step in progress, at most one more
    assert rows[-1][1] is Action.RELEASE
    assert scheduler.running_count == 0


async def test_a_cancel_landing_in_a_rounds_last_step_leaves_no_slot_counted_in_use() -> None:
    """One-step rounds: the cancelled sequence leaves with the round's only response, and no later
    step would correct the slots-in-use gauge (it read 1 with nothing running)."""
    model = RecordingStepModel(step_delay_s=0.05)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=1), replica="cancel-gauge")
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=500))
        events = handle.events()
        await anext(events)  # the first token
        await _until(lambda: len(model.steps) >= 2)  # the next round's step in flight (50 ms)
        handle.cancel()
        finish = [event async for event in events][-1]
        await model.wait_released(handle.seq_id)
        await asyncio.sleep(0.1)
        assert isinstance(finish, FinishEvent) and finish.finish is Finish.CANCELLED
        assert scheduler.running_count == 0
        assert REGISTRY.get_sample_value("sluice_adapter_kv_slots_in_use", {"replica": "cancel-gauge"}) == 0
    finally:
        await scheduler.stop()


async def test_a_deadline_passing_mid_round_ends_and_releases_the_sequence() -> None:
    model, scheduler = long_rounds()
    try:
        deadline = time.monotonic() + 0.3
        handle = scheduler.submit(request(max_tokens=500, deadline=deadline))
        _, finish = await collect(handle)
        await model.wait_released(handle.seq_id)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.DEADLINE
    assert max(model.rounds.asked) > 1, "the deadline passed during a long round"
    # Counted in steps, not seconds: at most the step in progress when it passed decodes after it.
    decodes_after = [i for i, action in model.rows_of(handle.seq_id) if action is Action.DECODE and model.started_at[i] > deadline]
    assert len(decodes_after) <= 1, decodes_after


async def test_a_slot_freed_mid_round_ends_the_round_for_a_waiting_request() -> None:
    model, scheduler = long_rounds(max_batch_size=2)
    try:
        short = scheduler.submit(request(max_tokens=12))
        long = scheduler.submit(request(max_tokens=300))
        await until_a_long_round(model)
        waiting = scheduler.submit(request(max_tokens=2))  # the batch is full: it waits, no end asked
        assert model.end_asks == 0
        await collect(short)
        freed_at_step = len(model.steps)
        _, finish = await collect(waiting)
        long.cancel()
        await collect(long)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH and model.end_asks == 1
    joined_at = model.rows_of(waiting.seq_id)[0][0]
    assert joined_at <= freed_at_step + 1, (joined_at, freed_at_step)


def _sent_ahead(replica: str) -> float:
    return REGISTRY.get_sample_value("sluice_adapter_rounds_sent_ahead_total", {"replica": replica}) or 0.0


async def test_the_next_round_is_sent_while_one_runs_and_goes_on_where_it_ended() -> None:
    """Rounds sent ahead (round_ahead.py): in a steady batch each next round's request comes while
    the round before it runs, follows it rather than ending it, and the tokens come once, in order."""
    model = RecordingStepModel(step_delay_s=0.01)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=4, round_target_s=1.0, rounds_ahead=True), replica="ahead")
    before = _sent_ahead("ahead")
    scheduler.start()
    try:
        text, finish = await collect(scheduler.submit(request(max_tokens=30)))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH and text == "".join(f"t{i} " for i in range(1, 31))
    rounds = model.rounds
    assert rounds.followed[0] is False, "the prefill's round is sent as rounds always were"
    assert sum(rounds.followed) >= 5, rounds.followed
    assert all(came for came, followed in zip(rounds.came_while_one_ran, rounds.followed) if followed), rounds.came_while_one_ran
    # Each round sent ahead ran, but the one sent during the last round may not have before the stop.
    assert sum(rounds.followed) <= _sent_ahead("ahead") - before <= sum(rounds.followed) + 1
    # A round of 4 steps ran whole: the one sent ahead did not end it.
    assert all(len(rows) == 1 for rows in model.steps) and len(model.steps) <= 31


async def test_step_seconds_leaves_out_the_first_answer_of_a_round_sent_ahead() -> None:
    """sluice_adapter_step_seconds observes the steps the scheduler times, in one place: a round sent
    ahead starts at once and its first answer waits for the round before it (here 7 steps of 50 ms),
    which timed from its request read as a step of ~400 ms; the scheduler leaves that answer out."""
    model = RecordingStepModel(step_delay_s=0.05)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=8, round_target_s=1.0, rounds_ahead=True), replica="ahead-timed")

    def sample(suffix: str, le: str | None = None) -> float:
        labels = {"replica": "ahead-timed", **({"le": le} if le else {})}
        return REGISTRY.get_sample_value(f"sluice_adapter_step_seconds_{suffix}", labels) or 0.0

    scheduler.start()
    try:
        _, finish = await collect(scheduler.submit(request(max_tokens=40)))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    followed = sum(model.rounds.followed)
    assert followed >= 3, model.rounds.followed
    # Every step the sequence took but the first of each round sent ahead (the one sent during the
    # last round may have stepped before the stop, unread).
    steps = len(model.steps)
    assert steps - followed <= sample("count") <= steps - followed + 1, (steps, followed, sample("count"))
    # None of them waited for a round before it: all well under the 400 ms such a wait reads as.
    assert sample("bucket", "0.25") == sample("count")


async def test_with_rounds_ahead_off_each_round_is_sent_after_the_one_before_ended() -> None:
    model = RecordingStepModel(step_delay_s=0.005)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=4, round_target_s=1.0))  # the default
    scheduler.start()
    try:
        text, _ = await collect(scheduler.submit(request(max_tokens=20)))
    finally:
        await scheduler.stop()
    assert text == "".join(f"t{i} " for i in range(1, 21))
    assert not any(model.rounds.followed) and not any(model.rounds.came_while_one_ran)


async def test_no_round_is_sent_ahead_while_a_request_waits_to_be_admitted() -> None:
    """An arrival's prefill goes in a round of its own that ends the one in flight: a round sent
    ahead would be planned without it, and wait its turn behind the round in flight."""
    model, scheduler = long_rounds(rounds_ahead=True)
    try:
        long = scheduler.submit(request(max_tokens=200))
        await until_a_long_round(model)
        newcomer = scheduler.submit(request(max_tokens=2))
        _, finish = await collect(newcomer)
        after_it = len(model.steps)
        await _until(lambda: len(model.steps) > after_it + 40)
        long.cancel()
        text, _ = await collect(long)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.LENGTH
    rounds = model.rounds
    (joined,) = [i for i, rows in enumerate(rounds.opening) if any(r.seq_id == newcomer.seq_id and r.action is Action.PREFILL for r in rows)]
    assert any(rounds.followed[:joined]), "rounds were sent ahead before it came"
    assert rounds.followed[joined] is False
    # Once it has joined, long rounds sent ahead again: the end-round ask it made ended the rounds
    # sent before it, not every round sent ahead after it.
    assert any(rounds.followed[joined:]) and max(rounds.ran[joined + 2 :]) >= 8, list(zip(rounds.followed, rounds.ran))
    made = text.split()
    assert made == [f"t{i}" for i in range(1, len(made) + 1)], "the long sequence's tokens once each, in order"


async def test_a_cancel_while_a_round_is_sent_ahead_stops_the_sequence_within_one_step() -> None:
    """Rounds of 2 steps: the next round is on its way for most of each; the cancelled sequence is
    released by the round in flight or, when that one has ended, by the round sent ahead."""
    model = RecordingStepModel(step_delay_s=0.02)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=2, round_target_s=1.0, rounds_ahead=True))
    scheduler.start()
    try:
        handle = scheduler.submit(request(max_tokens=500))
        await _until(lambda: sum(model.rounds.followed) >= 3)
        cancelled_at_step = len(model.steps)
        handle.cancel()
        _, finish = await collect(handle)
        await model.wait_released(handle.seq_id)
        await asyncio.sleep(0.1)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.CANCELLED
    rows = model.rows_of(handle.seq_id)
    decodes_after = [index for index, action in rows if action is Action.DECODE and index > cancelled_at_step]
    assert len(decodes_after) <= 1, rows[-5:]
    assert Action.RELEASE in [action for _, action in rows]
    assert scheduler.running_count == 0


async def test_rounds_ahead_asked_of_a_step_model_without_follows_round_is_said_once_and_not_sent() -> None:
    """An older step model would read a round sent ahead as one that ends the round in flight: the
    setting is not silently dropped, it is logged, and each round goes when the one before has ended."""
    model = RecordingStepModel(step_delay_s=0.005)
    model.follows_rounds = False  # type: ignore[misc]
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=4, round_target_s=1.0, rounds_ahead=True), replica="old-model")
    scheduler.start()
    try:
        with capture_logs() as logs:
            text, _ = await collect(scheduler.submit(request(max_tokens=20)))
    finally:
        await scheduler.stop()
    assert text == "".join(f"t{i} " for i in range(1, 21))
    assert not any(model.rounds.followed) and not any(model.rounds.came_while_one_ran)
    assert [entry["event"] for entry in logs if entry["event"] == "rounds_ahead_not_supported"] == ["rounds_ahead_not_supported"]


class ReleasesFirstModel(RecordingStepModel):
    """Answers a request of releases alone at once, without the step's sleep: a release sent just
    after a round is applied before that round's rows, as when Triton takes the release's stream
    first (nothing orders two gRPC streams) and the prefill after it takes a slot."""

    def __init__(self, step_delay_s: float) -> None:
        super().__init__(step_delay_s)
        self.aside_releases: list[int] = []

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if rows and all(row.action is Action.RELEASE for row in rows):
            self.rounds.note(rows)
            self.aside_releases.extend(row.seq_id for row in rows)
            return [self._answer(row) for row in rows]
        return await super().step(rows)


async def test_a_cancel_whose_release_overtakes_its_prefill_is_released_again_once_the_prefill_answered() -> None:
    """The release found nothing to release and the prefill then took a slot: without a second
    release the engine held it until its slot lease (30 s)."""
    model = ReleasesFirstModel(step_delay_s=0.01)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=32, round_target_s=1.0))
    handles: list[SequenceHandle] = []

    def cancel_as_its_round_goes_out(steps: int) -> None:
        if len(model.rounds.asked) == 0:  # the prefill's round, sent and not yet answered
            handles[0].cancel()

    model.rounds.on_round = cancel_as_its_round_goes_out
    scheduler.start()
    try:
        handles.append(scheduler.submit(request(max_tokens=500)))
        _, finish = await collect(handles[0])
        seq_id = handles[0].seq_id
        await _until(lambda: model.aside_releases.count(seq_id) >= 2, within_s=1.0)
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.CANCELLED
    assert model.rows_of(seq_id) == [(0, Action.PREFILL)], "the prefill reached the engine after the first release"
    assert seq_id not in model.max_tokens, "the engine holds no slot for it"


class SlowAsideReleasesModel(RecordingStepModel):
    """A request of releases alone is answered after `release_s` (a busy engine's next step)."""

    def __init__(self, release_s: float) -> None:
        super().__init__(step_delay_s=0.01)
        self.release_s = release_s
        self.releases_answered: list[int] = []

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        if rows and all(row.action is Action.RELEASE for row in rows):
            self.rounds.note(rows)
            await asyncio.sleep(self.release_s)
            self.releases_answered.extend(row.seq_id for row in rows)
            return [self._answer(row) for row in rows]
        return await super().step(rows)


async def test_stop_waits_for_a_release_still_on_its_way() -> None:
    """A cancel's release goes in a request of its own; stopping without it (the channel closes
    next) left the slot held until the engine's lease."""
    model = SlowAsideReleasesModel(release_s=0.2)
    scheduler = Scheduler(model, SchedulerLimits(max_round_steps=32, round_target_s=1.0, release_timeout_s=1.0))
    scheduler.start()
    handle = scheduler.submit(request(max_tokens=500))
    try:
        await until_a_long_round(model)
        handle.cancel()
        _, finish = await collect(handle)  # ended at the round's next step, its release still on its way
        assert finish.finish is Finish.CANCELLED and handle.seq_id not in model.releases_answered
    finally:
        await scheduler.stop()
    assert handle.seq_id in model.releases_answered
