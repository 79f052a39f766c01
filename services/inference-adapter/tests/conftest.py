"""Helpers shared by the scheduler and replica pool tests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace

from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.sequence import FinishEvent, GenerationRequest, SequenceHandle, TokenEvent
from sluice_inference_adapter.step_rows import FINISH_BUSY, FINISH_ERROR, Action, StepOutcome, StepRow


class PrefixCache:
    """What a test double's engine keeps of the prompts it prefilled, as triton-local's prefix
    cache does: a prompt prefilled before is served from the cache but for its last token (whose
    logits the first token needs), and CACHED_TOKENS says how many, on every row of the sequence."""

    def __init__(self) -> None:
        self.prompts: set[str] = set()
        self.cached: dict[int, int] = {}

    def prefill(self, row: StepRow, prompt_tokens: int) -> None:
        body = json.loads(row.request)
        prompt = json.dumps([body.get("messages"), body.get("prompt")])
        self.cached[row.seq_id] = prompt_tokens - 1 if prompt in self.prompts else 0
        self.prompts.add(prompt)

    def of(self, seq_id: int) -> int:
        return self.cached.get(seq_id, 0)


async def collect(handle: SequenceHandle) -> tuple[str, FinishEvent]:
    """A sequence's whole text and its finish event."""
    text = ""
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            text += event.text
        else:
            return text, event
    raise AssertionError("no finish event")


async def run_through(pool: ReplicaPool, request: GenerationRequest) -> tuple[int, FinishEvent]:
    """A request through the pool: how many tokens it streamed, and its finish event."""
    tokens = 0
    async with aclosing(pool.generate(request)) as events:
        async for event in events:
            if isinstance(event, TokenEvent):
                tokens += 1
            else:
                return tokens, event
    raise AssertionError("no finish")


class RoundsOfSteps:
    """Rounds as triton-local's step model runs them (step_protocol, SharedEngine.round), out of a
    test double's own one-step calls: the rows, then one decode row for each of their sequences
    still running, up to `steps` steps. The double calls `note` with every request's rows as it
    arrives: a sequence a release request names meanwhile is released at the round's next step
    instead, and an end-round request ends the round after its current step. Outcomes carry their
    row's seq_id, as ROW_SEQ_ID does. With `shared_steps` > 1 the steps after the first share
    responses, that many a response (a first token, a row without a token and the round's last at
    once), as STREAM_INTERVAL_MS makes them. Rounds run one at a time, in the order they came, as
    on the engine's one thread; a round that `follows` (FOLLOWS_ROUND) waits for the one in flight
    without ending it and releases at its first step a sequence a release request named; an
    end-round ask ends the rounds that came before it (a following one queued behind the round in
    flight included) after their current step, not a round that came after it. With
    `end_asks_lost` > 0, that many end-round asks are taken for an earlier round's and do nothing,
    as when an ask reaches the engine before the round it was for (they travel apart); `on_round`
    is called with each round's steps as it starts, before its first step. An interrupt ask (an
    INTERRUPT row) is an end-round ask that also stops the step in progress when its round came
    `interruptible`: the double's step asks `interrupted()` before it answers, and then answers
    that step's rows with no token (a prefill admitted with nothing cached, as the engine does)."""

    def __init__(self, shared_steps: int = 1) -> None:
        self.shared_steps = shared_steps
        self.end_asks_lost = 0
        self.on_round: Callable[[int], None] | None = None
        self.released: set[int] = set()
        self.submitted = 0  # rounds numbered as they came
        self.end_through = 0  # rounds numbered up to this end after their current step (an end-round ask)
        self.asked: list[int] = []  # the steps each round asked for
        self.followed: list[bool] = []  # whether each round came as a following one
        self.opening: list[list[StepRow]] = []  # each round's rows, as it came
        self.came_while_one_ran: list[bool] = []  # whether each round's request came while another ran
        self.interruptible: list[bool] = []  # whether each round came interruptible
        self.interrupted_steps = 0
        self._stepping_interruptible = False  # the step in progress may be stopped
        self._interrupt_asked = False  # and an interrupt ask came while it ran
        self.ran: list[int] = []  # the steps each round ran
        self._turn = asyncio.Lock()

    def steps_of(self, seq_id: int) -> list[int]:
        """The steps asked by each round that came with a row of the sequence."""
        return [steps for steps, rows in zip(self.asked, self.opening) if any(row.seq_id == seq_id for row in rows)]

    def note(self, rows: list[StepRow]) -> None:
        self.released.update(row.seq_id for row in rows if row.action is Action.RELEASE)
        if any(row.action is Action.INTERRUPT for row in rows) and self._stepping_interruptible:
            self._interrupt_asked = True
        if any(row.action in (Action.END_ROUND, Action.INTERRUPT) for row in rows):
            if self.end_asks_lost:
                self.end_asks_lost -= 1
            else:
                self.end_through = self.submitted

    def interrupted(self) -> bool:
        """Whether an interrupt stopped the step in progress (asked once by the double's step, before it answers)."""
        asked, self._interrupt_asked = self._interrupt_asked, False
        self.interrupted_steps += asked
        return asked

    async def round(
        self,
        step: Callable[[list[StepRow]], Awaitable[list[StepOutcome]]],
        rows: list[StepRow],
        steps: int,
        follows: bool = False,
        interruptible: bool = False,
    ) -> AsyncIterator[list[StepOutcome]]:
        came_while_one_ran = self._turn.locked()
        self.submitted += 1
        number = self.submitted
        async with self._turn:
            self.came_while_one_ran.append(came_while_one_ran)
            self.interruptible.append(interruptible)
            async for outcomes in self._round(step, rows, steps, follows, number, interruptible):
                yield outcomes

    async def _round(
        self,
        step: Callable[[list[StepRow]], Awaitable[list[StepOutcome]]],
        rows: list[StepRow],
        steps: int,
        follows: bool,
        number: int,
        interruptible: bool,
    ) -> AsyncIterator[list[StepOutcome]]:
        if self.on_round is not None:
            self.on_round(steps)
        self.asked.append(steps)
        self.followed.append(follows)
        self.opening.append(rows)
        if not follows:  # an ask before it was for rounds that have ended
            self.end_through = min(self.end_through, number - 1)
        rows = [StepRow(Action.RELEASE, row.seq_id) if row.action is Action.DECODE and row.seq_id in self.released else row for row in rows]
        held: list[StepOutcome] = []
        self.ran.append(0)
        for done in range(1, steps + 1):
            self._stepping_interruptible = interruptible
            try:
                answers = await step(rows)
            finally:
                self._stepping_interruptible = False
            outcomes = [replace(outcome, seq_id=row.seq_id) for row, outcome in zip(rows, answers)]
            self.ran[-1] = done
            held.extend(outcomes)
            running = [o.seq_id for row, o in zip(rows, outcomes) if row.action is not Action.RELEASE and not o.finish]
            final = not running or done == steps
            # As step_protocol: a first token or a row without a token is answered at once.
            at_once = any(o.completion_tokens <= 1 or o.token_id < 0 for o in outcomes)
            ended = number <= self.end_through
            if final or at_once or done % self.shared_steps == 0 or ended:
                yield held
                held = []
                await asyncio.sleep(0)  # a request sent meanwhile arrives before the next step
            if ended or final:
                if held:
                    yield held
                return
            rows = [StepRow(Action.RELEASE if s in self.released else Action.DECODE, s) for s in running]


class StepReplica:
    """A Triton replica speaking the step protocol, in memory, that a test can break.

    Each sequence ends ("length") after `tokens` tokens, or after its request's max_tokens when
    `tokens` is None. Every row is recorded. `failing`: steps raise and probes fail (a crashed
    Triton); `stalled`: a step never returns (a wedged one); `hold` cleared: steps wait until it
    is set again (a pod paused mid-work); `probes_ok` False: probes fail (ready, but no token),
    steps still work. `token_probes` and `ready_checks` count the probes of each kind.
    With `slots`, the replica holds that many sequences at most, as triton-local's engine does: a
    prefill that finds none free answers "busy", a finish or a release frees one (`held`). A prompt
    prefilled before is served from its prefix cache (`PrefixCache`): 1 of its 2 tokens.
    """

    def __init__(self, url: str, tokens: int | None = None, delay_s: float = 0.002, slots: int | None = None) -> None:
        self.url = url
        self.tokens = tokens
        self.delay_s = delay_s
        self.slots = slots
        self.held: set[int] = set()
        self.failing = False
        self.stalled = False
        self.probes_ok = True
        self.token_probes = 0
        self.ready_checks = 0
        self.closed = False
        self.hold = asyncio.Event()
        self.hold.set()
        self.steps = 0
        self.prefills = 0
        self.rows: list[tuple[Action, int]] = []
        self.generated: dict[int, int] = {}
        self.rounds = RoundsOfSteps()
        self.prefix_cache = PrefixCache()
        self._ends_at: dict[int, int] = {}

    follows_rounds = True
    interrupts = False

    def round(self, rows: list[StepRow], steps: int, follows: bool = False, interruptible: bool = False) -> AsyncIterator[list[StepOutcome]]:
        return self.rounds.round(self.step, rows, steps, follows, interruptible)

    async def step(self, rows: list[StepRow]) -> list[StepOutcome]:
        self.rounds.note(rows)
        self.steps += 1
        if self.stalled:
            await asyncio.Event().wait()
        await self.hold.wait()
        await asyncio.sleep(self.delay_s)
        if self.failing:
            raise ConnectionError(f"{self.url} is down")
        return [self._answer(row) for row in rows]

    def _answer(self, row: StepRow) -> StepOutcome:
        self.rows.append((row.action, row.seq_id))
        if row.action in (Action.END_ROUND, Action.INTERRUPT):
            return StepOutcome(-1, "", "", 0, 0)
        if row.action is Action.RELEASE:
            self.held.discard(row.seq_id)
            return StepOutcome(-1, "", "", 0, 0)
        if row.action is Action.PREFILL:
            if self.slots is not None and len(self.held) >= self.slots:
                return StepOutcome(-1, "", FINISH_BUSY, 2, 0, f"no free slot (max_slots={self.slots}); retry the prefill later")
            self.held.add(row.seq_id)
            self.prefills += 1
            self.prefix_cache.prefill(row, 2)
            self.generated[row.seq_id] = 0
            self._ends_at[row.seq_id] = self.tokens if self.tokens is not None else json.loads(row.request)["max_tokens"]
        elif row.seq_id not in self.held:  # as the engine answers a round sent ahead of a finish
            return StepOutcome(-1, "", FINISH_ERROR, 0, 0, f"seq_id {row.seq_id} is not running (never started, finished or released)")
        count = self.generated.get(row.seq_id, 0) + 1
        self.generated[row.seq_id] = count
        finished = count >= self._ends_at.get(row.seq_id, count)
        if finished:
            self.held.discard(row.seq_id)
        return StepOutcome(count, "x", "length" if finished else "", 2, count, cached_tokens=self.prefix_cache.of(row.seq_id))

    async def is_ready(self) -> bool:
        self.ready_checks += 1
        return not self.failing and not self.stalled

    async def probe(self) -> bool:
        self.token_probes += 1
        return self.probes_ok and not self.failing and not self.stalled

    async def close(self) -> None:
        self.closed = True

    @property
    def sequences(self) -> set[int]:
        """Every sequence this replica saw a row of."""
        return {seq_id for _, seq_id in self.rows}
