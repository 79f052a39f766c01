"""The generation scheduler: one task owns the running batch (as in TGI's router).

Callers `submit` a request and iterate its handle's events; they never touch the
batch. Each iteration the loop sends the backend one round: its first step carries
release rows for sequences that were cancelled or ran past their deadline, prefill rows
for waiting sequences that fit the batch, and one decode row for every running sequence;
the engine then decodes the round's sequences for up to k-1 more steps on its own,
streaming every step's tokens back as it makes them (multi-step rounds), so a round trip
is paid once per k tokens. A sequence therefore joins at a round and a short request never
waits for a long one to end. k is 1 while anything waits to be admitted (its first token
must not wait for a long round) and for the round an interactive prefill joins, and otherwise
as many steps as fit `round_target_s`; when a
request arrives mid-round, or a sequence finishes while one waits, and the batch has room,
the round is asked to end after the step in progress (an end-round request); a sequence
cancelled or past its deadline mid-round is released at once, by a request of its own that
the engine applies at the round's next step. A round that carries bulk sequences (and no
interactive prefill) is sent interruptible, and an interactive request that arrives during it asks
for an interrupt instead: the engine stops the step in progress midway (its rows make no token and
are stepped again at a later round), so an interactive first token does not wait for a step made
long by bulk rows. With `rounds_ahead`, while a round runs the next
one is planned and sent to follow it (round_ahead.py), so that the engine does not wait a round
trip between them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from sluice_common.supervision import stop_tasks
from sluice_inference_adapter import metrics
from sluice_inference_adapter.step_timeout import StepTimeouts
from sluice_inference_adapter.step_rows import (
    FINISH_BUSY,
    FINISH_ERROR,
    FINISH_INVALID,
    FINISH_STALE,
    Action,
    StepBackend,
    StepOutcome,
    StepRow,
    engine_fault,
    steps_in,
)
from sluice_inference_adapter import sequence_trace
from sluice_inference_adapter.replica_work import ReplicaWork
from sluice_inference_adapter.round_ahead import RoundAhead, SentResponses
from sluice_inference_adapter.sequence import Finish, Sequence
from sluice_inference_adapter.priority import Priority

log = structlog.stdlib.get_logger("sluice.scheduler")

# Who drives our sequences at Triton (the step model's per-owner slot metrics).
ADAPTER_ID = f"{socket.gethostname()}/{os.getpid()}"

# How long after an interactive sequence last ran bulk admission still keeps steps short for the
# next one (SchedulerLimits.bulk_step_target_s): a chat's next message comes tens of seconds after
# the last answer, and with 5 s a job refilled the batch in between (bench-jobs-interactive's
# first requests of a phase met it).
INTERACTIVE_RECENT_S = 30.0
# How long bulk sequences may go without a step (sitting out interactive prefills' steps, or their
# steps interrupted for interactive arrivals) before they join the next step and their rounds are
# no longer interrupted: under a steady stream of interactive requests a job still advances, at
# least every quarter second. Two prefills a few tens of milliseconds apart (two chat clients)
# both go without bulk rows.
BULK_MAX_WAIT_S = 0.25
# The longest wait between two tries of releases that failed while nothing runs: a replica that stays
# down is tried twice a minute, not every second.
RELEASE_RETRY_MAX_S = 30.0
# Ids a failure's log line names at most (the request ids of the sequences a failed round ends, the seq_ids
# of a failed release): a batch may hold hundreds; the rest are counted.
MAX_LOGGED_IDS = 16


@dataclass(frozen=True)
class SchedulerLimits:
    max_batch_size: int = 8
    # The KV budget: prompt + max_tokens summed over running sequences.
    max_batch_tokens: int = 16384
    max_waiting: int = 256
    # A prefill stalls every running sequence for its duration, so while a batch runs, new
    # prefills wait until `min_prefill_rows` of them can go together, but never more than
    # `max_waiting_steps` steps. min_prefill_rows=1 admits at the very next step.
    min_prefill_rows: int = 1
    max_waiting_steps: int = 8
    # Bulk beside interactive. On a compute-bound backend a step costs about the tokens it
    # carries, and an interactive request's first token waits for the step in progress and then
    # for its own prefill step. So:
    # - bulk prompts are cached `bulk_prefill_chunk` tokens per step (0: whole), and at most
    #   `max_bulk_prefill_rows` bulk sequences cache their prompts at once (0: no cap), which
    #   bounds what any step in progress costs;
    # - a step that an interactive prefill joins starts no bulk prefill, and carries no bulk row
    #   at all (no decode, no prompt chunk) unless bulk has not stepped for BULK_MAX_WAIT_S (so
    #   bulk always advances);
    # - bulk sequences leave `interactive_reserved_slots` of the batch free for interactive ones;
    # - while interactive requests come (one ran within INTERACTIVE_RECENT_S), no bulk sequence
    #   joins a batch that already runs one while the recent step time is above
    #   `bulk_step_target_s` (0: no bound): every bulk row lengthens each step, and an interactive
    #   arrival waits for the step in progress (on this CPU engine 8-12 bulk rows made steps of
    #   100-250 ms; a GPU's stay at a few ms, so a time and not a row count). A job alone fills
    #   the batch as before.
    max_bulk_prefill_rows: int = 0
    bulk_prefill_chunk: int = 0
    interactive_reserved_slots: int = 0
    bulk_step_target_s: float = 0.0
    # A round carrying bulk sequences (and no interactive prefill) is sent interruptible, and an
    # interactive arrival interrupts its step in progress (where the backend `interrupts`).
    interrupt_bulk: bool = False
    # After a prefill found the engine full (its slots shared with other adapters), how long
    # before prefills are tried again, unless one of ours ends first.
    engine_full_retry_s: float = 0.05
    # After a failed or timed-out step, how long one step releasing the dropped sequences' slots
    # may take before the loop goes on without it (those not released ride with the next step).
    release_timeout_s: float = 1.0
    # While nothing runs, releases that failed (a failed step's, a cancel's) are tried again after
    # this long, then twice as long after each failure, up to RELEASE_RETRY_MAX_S.
    release_retry_s: float = 1.0
    # Advertised in RetryInfo when the waiting queue is full.
    retry_after_s: float = 1.0
    # Multi-step rounds: at most `max_round_steps` engine steps per round trip (1: one step per
    # round trip), and no more than fit `round_target_s` at the recent decode step time (a round
    # is asked to end early when a request arrives or a slot frees for one that waits).
    max_round_steps: int = 64
    round_target_s: float = 1.0
    # Send the next round while one runs, to follow it (round_ahead.py), where the backend can.
    rounds_ahead: bool = False


class Scheduler(ReplicaWork):
    def __init__(
        self,
        backend: StepBackend,
        limits: SchedulerLimits,
        clock: Callable[[], float] = time.monotonic,
        on_step: Callable[[bool], None] | None = None,
        replica: str = "",
        timeouts: StepTimeouts | None = None,
    ):
        super().__init__(limits.max_waiting, limits.retry_after_s, clock, on_step, replica)
        self._backend = backend
        self._limits = limits
        # The adaptive step timeout, shared by every replica of the model (None: steps are bounded
        # only by the backend's own fixed timeout).
        self._timeouts = timeouts
        self._running: dict[int, Sequence] = {}
        # Sequences whose slots the engine may still hold: dropped on a failure, their release failed,
        # or released by a row of a round that has not answered yet (its first response removes
        # them). Released by a step of their own after a failure (or, while nothing runs, every
        # `release_retry_s` until one is answered), else by release rows riding with the next step.
        self._unreleased: set[int] = set()
        self._interactive_prefill = False  # the round planned last admits an interactive prefill
        self._bulk_stepped_at = float("-inf")  # when a step carrying bulk rows last completed
        # Set when a prefill found the engine full (other adapters share it): no new prefill
        # until one of ours ends or this time passes.
        self._engine_full_until = 0.0
        # The sequences of the round in flight, by seq_id, and the recent decode step time.
        self._in_round: dict[int, Sequence] = {}
        self._round_steps_asked = 0
        self._round_end_asked = False
        # Whether the round in flight was sent interruptible (it carries bulk work), and whether an
        # interrupt was asked of it.
        self._round_interruptible = False
        self._round_interrupt_asked = False
        # Whether the round in flight has answered, and whether its end was asked before it had
        # (that ask may have reached the engine before the round did: _end_round_for_waiting).
        self._round_answered = False
        self._end_asked_early = False
        # The round in flight's prefills, and those of them cancelled before it answered: their
        # release travels apart from the round and may reach the engine first, where it releases
        # nothing and the prefill then takes a slot (held until the engine's slot lease), so the
        # release is sent again once the round has answered (a second release changes nothing).
        self._round_prefills: set[int] = set()
        self._released_before_prefill: set[int] = set()
        self._decode_step_s: float | None = None
        # The recent time of any step, prompt chunks included: what an arrival waits for.
        self._step_s: float | None = None
        self._interactive_at = float("-inf")  # when an interactive sequence last ran
        # Requests sent beside the round in flight (releases, end-round asks), held until done.
        self._sent_aside: set[asyncio.Task[None]] = set()
        # The next round, sent while the one in flight runs (None: none sent).
        self._ahead: RoundAhead | None = None
        self._said_no_follow = False  # rounds_ahead asked of a step model without FOLLOWS_ROUND, logged once

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def batch_tokens(self) -> int:
        return sum(s.reserved_tokens for s in self._running.values())

    # -- lifecycle -----------------------------------------------------------------

    task_name = "generation-scheduler"

    def _on_death(self, error: BaseException) -> None:
        # Running sequences lose their place: the new loop starts with an empty batch.
        self._fail_everything(f"the generation scheduler failed: {error!r}")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_tasks(self._task)
        await self._discard_ahead()
        self._fail_everything("the adapter is shutting down")
        await self._land_sent_aside()
        await self._release_dropped()

    async def _land_sent_aside(self) -> None:
        """Waits, at most `release_timeout_s`, for the requests sent beside the rounds (a cancel's
        release among them): the backend's channel closes after the stop, cancelling any still on
        its way, and a release lost so holds its slot until the engine's lease. One that fails
        joins the releases `_release_dropped` sends next."""
        if self._sent_aside:
            await asyncio.wait(set(self._sent_aside), timeout=self._limits.release_timeout_s)

    # -- the loop ------------------------------------------------------------------

    async def _run(self) -> None:
        await self._release_dropped()  # what a previous loop held when it died
        try:
            while True:
                ahead, self._ahead = self._ahead, None
                if ahead is not None:
                    rows, stepped, steps, responses = ahead.rows, ahead.stepped, ahead.steps, ahead.responses
                    interruptible = ahead.interruptible
                else:
                    if not self._running and not self.waiting_count:
                        await self._wait_for_work()
                    rows, stepped = self._plan_step()
                    if not rows:
                        # Only prefills wait, and the engine is full of other adapters' sequences.
                        await asyncio.sleep(max(0.0, self._engine_full_until - self._clock()))
                        continue
                    steps = self._round_steps()
                    metrics.ROUND_STEPS.observe(steps)
                    responses = None
                    interruptible = self._interruptible(stepped)
                self._in_round = {s.seq_id: s for s in stepped}
                self._round_prefills = {row.seq_id for row in rows if row.action is Action.PREFILL}
                self._round_interruptible, self._round_interrupt_asked = interruptible, False
                # An end asked of the round before ends the round sent ahead of it too (step_protocol).
                self._round_steps_asked, self._round_end_asked = steps, ahead is not None and self._round_end_asked
                self._round_answered, self._end_asked_early = False, self._round_end_asked
                try:
                    await self._run_round(rows, stepped, steps, responses, interruptible)
                finally:
                    self._in_round, self._round_prefills = {}, set()
                    self._released_before_prefill.clear()
        finally:
            await self._discard_ahead()

    async def _wait_for_work(self) -> None:
        """Until a request waits. Releases that failed are tried again meanwhile: no round would
        carry them, and an idle engine holds their slots (its slot lease frees a slot only while it
        steps other sequences). First after `release_retry_s`, then twice as long after each failure."""
        retry_s = self._limits.release_retry_s
        while not self._running and not self.waiting_count:
            self._wakeup.clear()
            try:
                async with asyncio.timeout(retry_s if self._unreleased else None):
                    await self._wakeup.wait()  # a request, or a release that failed (`_release_now`)
            except TimeoutError:
                await self._release_dropped()
                retry_s = min(2 * retry_s, RELEASE_RETRY_MAX_S)

    def _interruptible(self, stepped: list[Sequence]) -> bool:
        """A round that carries bulk sequences and no interactive prefill may be stopped midway for
        an interactive arrival: bulk rows are what make its steps long, and an interactive
        sequence already streaming loses one step's wait, less than the arrival gains."""
        return (
            self._limits.interrupt_bulk
            and self._backend.interrupts
            and any(s.priority is Priority.BULK for s in stepped)
            and not any(s.priority is Priority.INTERACTIVE and s.first_token_at is None for s in stepped)
            and not self._bulk_starved(self._clock())
        )

    def _stopped_midway(self, outcomes: list[StepOutcome]) -> bool:
        """Whether a response answers a step an interrupt stopped: no row made a token after we
        asked, or a sequence already streaming answered none and did not finish (which only a
        stopped step answers: an ask can also come from another adapter sharing the engine,
        sent before its own round got there)."""
        if self._round_interrupt_asked and all(outcome.token_id < 0 for outcome in outcomes):
            return True
        for outcome in outcomes:
            sequence = self._in_round.get(outcome.seq_id)
            if outcome.token_id < 0 and not outcome.finish and sequence is not None and sequence.seq_id in self._running:
                if sequence.first_token_at is not None and not sequence.cancelled:
                    return True
        return False

    def _bulk_starved(self, now: float) -> bool:
        return now - self._bulk_stepped_at >= BULK_MAX_WAIT_S

    def _round_steps(self) -> int:
        """Steps for the next round: 1 while anything waits to be admitted or an interactive prefill
        joins (its first token must not wait for a long round), else as many as fit round_target_s."""
        limits = self._limits
        if limits.max_round_steps <= 1 or self.waiting_count or self._interactive_prefill or self._decode_step_s is None:
            return 1
        return max(1, min(limits.max_round_steps, int(limits.round_target_s / max(self._decode_step_s, 1e-4))))

    async def _run_round(
        self, rows: list[StepRow], stepped: list[Sequence], steps: int, sent: SentResponses | None, interruptible: bool = False
    ) -> None:
        """One round, read to its end; `sent`: its request already went out, ahead of its turn."""
        prefill_tokens = self._prefill_tokens(stepped)
        round_span = sequence_trace.start_round((s.trace for s in stepped), len(rows), steps, self._replica)
        responses = sent if sent is not None else self._backend.round(rows, steps, interruptible=interruptible)
        first, failed, steps_answered = True, "", 0
        try:
            while True:
                limit = self._timeouts.limit(prefill_tokens) if self._timeouts is not None else None
                started = time.perf_counter()
                try:
                    async with asyncio.timeout(limit):
                        outcomes = await anext(responses)
                except StopAsyncIteration:
                    return
                except TimeoutError as exc:
                    if limit is None:  # not ours: the backend's own timeout, a failure like any other
                        failed = self._step_failed(exc, len(rows))
                    else:
                        failed = self._step_timed_out(limit, prefill_tokens, len(rows))
                    break
                except Exception as exc:  # noqa: BLE001 - the backend failed: its KV state is unknown
                    failed = self._step_failed(exc, len(rows))
                    break
                elapsed = time.perf_counter() - started
                steps_answered += steps_in(outcomes)
                if first:  # the engine applied the round's releases with its first step
                    self._unreleased.difference_update(row.seq_id for row in rows if row.action is Action.RELEASE)
                    self._publish_slots()
                # A round sent ahead may have stepped before it was read: its first answer is not
                # a step's time; nor is a step an interrupt stopped midway.
                interrupted = self._stopped_midway(outcomes)
                if interrupted:  # an ask reached it: sent again, it would reach the next round
                    self._end_asked_early = False
                timed = not (first and sent is not None) and not interrupted
                if timed:
                    self._observe_step(elapsed, steps_in(outcomes), decode=not prefill_tokens)
                if self._timeouts is not None and timed:
                    self._timeouts.observe(elapsed, prefill_tokens)
                    metrics.STEP_TIMEOUT.labels(model=self._timeouts.model).set(self._timeouts.limit())
                # A replica whose slots are all held by sequences nobody steps answers, but cannot serve;
                # nor can one whose engine fails the rows it computes.
                self._report_step(ok=not any(outcome.finish == FINISH_STALE or engine_fault(outcome) for outcome in outcomes))
                self._apply(outcomes)
                if not interrupted and any(s.priority is Priority.BULK for s in stepped):
                    self._bulk_stepped_at = self._clock()
                self._abandon_mid_round()
                # After both: the round may end with this response, and no later step would set it.
                self._publish_slots()
                self._round_answered = True
                self._end_round_for_waiting()
                self._send_next_round_ahead(stepped, steps_answered, steps)
                # The engine may leave prompts beyond its per-step prefill budget to the round's
                # later steps: those steps are timed as prefills until every prompt is in.
                first, prefill_tokens = False, self._prefill_tokens([s for s in stepped if s.seq_id in self._running])
        finally:
            await responses.aclose()
            sequence_trace.end_round(round_span, error=failed)
            if failed:  # planned on sequences the failure ended
                await self._discard_ahead()
        await self._release_dropped()

    def _send_next_round_ahead(self, stepped: list[Sequence], steps_answered: int, steps: int) -> None:
        """Plans the next round and sends it to follow this one, once per round, while this one has
        steps to run and its sequences do: not while requests wait (the next round must admit
        them, and preempts this one to do it) nor after a failure dropped the batch."""
        if (
            not self._limits.rounds_ahead
            or self._ahead is not None
            or steps_answered >= steps
            or self.waiting_count
            or self._round_end_asked
            or self._unreleased
            or not any(s.seq_id in self._running for s in stepped)
        ):
            return
        if not self._backend.follows_rounds:
            if not self._said_no_follow:
                self._said_no_follow = True
                log.warning(
                    "rounds_ahead_not_supported",
                    replica=self._replica,
                    hint="the step model does not declare FOLLOWS_ROUND: each round is sent when the one before has ended (upgrade the step model)",
                )
            return
        rows, ahead = self._plan_step()
        if not rows:
            return
        steps_ahead = self._round_steps()
        metrics.ROUND_STEPS.observe(steps_ahead)
        metrics.ROUNDS_SENT_AHEAD.labels(replica=self._replica).inc()
        interruptible = self._interruptible(ahead)
        responses = SentResponses(self._backend.round(rows, steps_ahead, follows=True, interruptible=interruptible))
        self._ahead = RoundAhead(rows, ahead, steps_ahead, responses, interruptible)

    async def _discard_ahead(self) -> None:
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            await ahead.responses.aclose()

    def _observe_step(self, elapsed: float, steps: int, decode: bool) -> None:
        """A response that answered `steps` engine steps `elapsed` after the previous one (or the
        round's request): the one place step times are taken, for the scheduler's own estimates and
        for sluice_adapter_step_seconds alike, so that the histogram leaves out what the scheduler
        does (a round sent ahead's first answer, which waited for the round before it; a step an
        interrupt stopped midway)."""
        seconds = elapsed / steps
        self._step_s = _moving_average(self._step_s, seconds)
        if decode:
            self._decode_step_s = _moving_average(self._decode_step_s, seconds)
        histogram = metrics.STEP_SECONDS.labels(replica=self._replica)
        for _ in range(steps):
            histogram.observe(seconds)

    def _on_arrival(self) -> None:
        self._end_round_for_waiting()

    def _end_round_for_waiting(self) -> None:
        """A request waiting during a long round need not wait for its end: when the batch has room
        for it (it arrived, or a sequence finished), the round is asked to end after its current
        step (once per round), and the next round admits it. Only while the round has sequences
        running: one whose sequences have all finished ends by itself, and an ask then would reach
        the engine after the next round, the arrival's own, and end that one after its first step.
        An interactive request waiting during an interruptible round (one carrying bulk work) asks
        for an interrupt instead, even of a one-step round: the step in progress stops midway.

        The ask travels apart from the round (a request of its own), so one sent before the round
        answered can reach the engine before the round does, and the engine takes it for an
        earlier round's: such an ask is sent again with the round's first response, when the
        round is surely there (one step later, not the round's whole length). So is an ask that a
        round sent ahead inherits."""
        if not (
            any(seq_id in self._running for seq_id in self._in_round) and self.waiting_count and len(self._running) < self._limits.max_batch_size
        ):
            return
        interrupt = self._round_interruptible and self._waiting.count(Priority.INTERACTIVE) > 0
        if interrupt and self._round_answered and self._round_steps_asked == 1:
            return  # a one-step round that has answered is over: an interrupt would reach the next
        if not interrupt and self._round_steps_asked <= 1:
            return
        if not (self._round_interrupt_asked if interrupt else self._round_end_asked):
            self._round_end_asked, self._end_asked_early = True, not self._round_answered
            self._round_interrupt_asked = self._round_interrupt_asked or interrupt
        elif self._end_asked_early and self._round_answered:
            self._end_asked_early = False
            metrics.ROUND_END_ASKED_AGAIN.labels(replica=self._replica).inc()
        else:
            return
        if interrupt:
            metrics.INTERRUPTS_ASKED.labels(replica=self._replica).inc()
        self._send_in_background([StepRow(Action.INTERRUPT if interrupt else Action.END_ROUND, 0)], "end_round_failed")

    def _on_cancel(self, sequence: Sequence) -> None:
        """Mid-round the engine steps on without us: release the sequence now, so that it stops
        within one step (or the round sent ahead releases it at its first); the loop ends its stream
        when the round's next step comes back."""
        if sequence.seq_id in self._in_round or (self._ahead is not None and sequence.seq_id in self._ahead.seq_ids):
            self._release_now([sequence.seq_id])
            if sequence.seq_id in self._round_prefills and not self._round_answered:
                self._released_before_prefill.add(sequence.seq_id)
        self._wakeup.set()

    def _abandon_mid_round(self) -> None:
        """Sequences of the round in flight that were cancelled or ran past their deadline end now,
        and are released by a request of their own (the engine applies it at its next step). A
        cancel's release went out when it came, but one that may have overtaken its prefill goes
        again: the response shows the engine has the prefill now (one that finished, was refused or
        answered busy left the batch in `_apply` and holds no slot)."""
        now = self._clock()
        abandoned = []
        for sequence in self._in_round.values():
            reason = sequence.abandon_reason(now) if sequence.seq_id in self._running else None
            if reason is not None:
                del self._running[sequence.seq_id]
                sequence.finish(reason, now)
                if reason is not Finish.CANCELLED or sequence.seq_id in self._released_before_prefill:
                    abandoned.append(sequence.seq_id)
        # After any response every prefill of the round is in: a later cancel's release follows it.
        self._released_before_prefill.clear()
        if abandoned:
            self._release_now(abandoned)

    def _release_now(self, seq_ids: list[int]) -> None:
        rows = [StepRow(Action.RELEASE, seq_id) for seq_id in seq_ids]

        def failed() -> None:
            # The next round carries them again; the loop is woken in case none comes (`_wait_for_work`).
            self._unreleased.update(seq_ids)
            self._wakeup.set()

        self._send_in_background(rows, "release_failed", on_failure=failed)

    def _send_in_background(self, rows: list[StepRow], failed: str, on_failure: Callable[[], None] | None = None) -> None:
        """A request of its own beside the round in flight (the engine applies it between steps)."""

        async def send() -> None:
            try:
                await self._backend.step(rows)
            except Exception as exc:  # noqa: BLE001 - best effort, logged
                released = [row.seq_id for row in rows if row.action is Action.RELEASE]
                named = {"seq_ids": _some(released)} if released else {}
                log.warning(failed, replica=self._replica, rows=len(rows), error=str(exc) or type(exc).__name__, **named)
                if on_failure is not None:
                    on_failure()

        task = asyncio.get_running_loop().create_task(send())
        self._sent_aside.add(task)
        task.add_done_callback(self._sent_aside.discard)

    def _step_failed(self, exc: BaseException, rows: int) -> str:
        """A round that failed: its replica counts it, every sequence ends. Returns the error. The
        log line names the sequences the failure ends (request and seq ids, bounded): this task
        serves every request of the replica, so no request id is bound in its context."""
        error = f"the model backend failed: {exc}"
        log.warning("step_failed", replica=self._replica, error=str(exc) or type(exc).__name__, rows=rows, **self._sequences_ended())
        self._report_step(ok=False)
        self._fail_everything(error, backend_failed=True)
        return error

    def _step_timed_out(self, limit: float, prefill_tokens: int, rows: int) -> str:
        """A step that outlived its timeout: the replica is treated as failed (its KV state is now
        unknown), its sequences end, and those without tokens may be retried on another replica.
        Returns the error."""
        assert self._timeouts is not None
        p99 = self._timeouts.decode_p99  # what the limit came from, before this step counts
        self._timeouts.observe_timeout(limit, prefill_tokens)
        metrics.STEP_TIMEOUT.labels(model=self._timeouts.model).set(self._timeouts.limit())
        metrics.TIMEOUTS.labels(kind="step").inc()
        log.warning(
            "step_timed_out", replica=self._replica, timeout_s=round(limit, 3), rows=rows, prefill_tokens=prefill_tokens, **self._sequences_ended()
        )
        self._report_step(ok=False)
        basis = (
            f"{self._timeouts.policy.multiplier:g}x the p99 of recent steps ({p99:.3f}s), within"
            f" [{self._timeouts.policy.floor_s:g}s, {self._timeouts.policy.ceiling_s:g}s]"
            if p99 is not None
            else "the ceiling, until enough steps are seen"
        )
        error = (
            f"Triton replica {self._replica or '(unnamed)'} did not answer a step within its timeout of {limit:.2f}s"
            f" ({basis}); the replica is counted as failing, retry"
        )
        self._fail_everything(error, backend_failed=True)
        return error

    def _prefill_tokens(self, stepped: list[Sequence]) -> int:
        """Prompt tokens this step caches (estimated until the model has counted): a whole prompt
        for an interactive prefill, a chunk for a bulk one."""
        chunk = self._limits.bulk_prefill_chunk
        total = 0
        for sequence in stepped:
            if sequence.first_token_at is not None:
                continue  # decoding: one token
            prompt = sequence.prompt_tokens or sequence.request.prompt.estimated_tokens()
            total += min(prompt, chunk) if chunk and sequence.priority is Priority.BULK else prompt
        return total

    def _sequences_ended(self) -> dict[str, object]:
        """What a failure's log line names: the sequences `_fail_everything` ends (running, then
        waiting), bounded: their request ids (what the rest of each request's lines carry) and seq_ids
        (what Triton's lines name), in the same order."""
        ended = [*self._running.values(), *self._waiting]
        return {"request_ids": _some([s.request.request_id for s in ended]), "seq_ids": _some([s.seq_id for s in ended])}

    def _fail_everything(self, error: str, backend_failed: bool = False) -> None:
        """Ends every sequence, running and waiting; those without tokens may be retried elsewhere.
        The running ones' slots are released by the caller (`_release_dropped`) or the next step."""
        sequences = [*self._running.values(), *self._waiting.remove_if(lambda _: True)]
        self._unreleased.update(self._running)
        self._running.clear()
        for sequence in sequences:
            sequence.backend_failed = backend_failed
            sequence.finish(Finish.ERROR, self._clock(), error=error)
        self._publish_slots()

    async def _release_dropped(self) -> None:
        """One step releasing the slots of `_unreleased` (a failure dropped them, or their release
        did not reach the engine), best effort and bounded by `release_timeout_s`: a replica that
        failed a step may fail this one too, and must not hold up the loop. Whatever it does not
        release rides with the next step, or is tried again while nothing runs (`_wait_for_work`; a
        release of a sequence the engine no longer holds changes nothing there)."""
        # Those a round sent ahead releases are on their way with it (it was planned as they were
        # dropped); if it is discarded they are still here for the next call.
        riding = {row.seq_id for row in self._ahead.rows if row.action is Action.RELEASE} if self._ahead is not None else set()
        seq_ids = sorted(self._unreleased - riding)
        if not seq_ids:
            return
        try:
            async with asyncio.timeout(self._limits.release_timeout_s):
                await self._backend.step([StepRow(Action.RELEASE, seq_id) for seq_id in seq_ids])
        except Exception as exc:  # noqa: BLE001 - best effort: the next step carries them again
            log.warning("release_failed", replica=self._replica, sequences=len(seq_ids), seq_ids=_some(seq_ids), error=str(exc) or type(exc).__name__)
            return
        self._unreleased.difference_update(seq_ids)
        self._publish_slots()

    def _publish_slots(self) -> None:
        # The running sequences (vllm:num_requests_running reads this), and apart from them the slots
        # the engine still holds for sequences that ended here, owed a release that has not reached it.
        metrics.SLOTS_IN_USE.labels(replica=self._replica).set(len(self._running))
        metrics.SLOTS_RELEASE_PENDING.labels(replica=self._replica).set(len(self._unreleased))

    def _plan_step(self) -> tuple[list[StepRow], list[Sequence]]:
        """Rows for this step, and the sequences whose rows produce tokens (in row order)."""
        now = self._clock()
        # Slots a failure left held come back first, before this step's prefills need them.
        rows: list[StepRow] = [StepRow(Action.RELEASE, seq_id) for seq_id in sorted(self._unreleased)]
        for sequence in list(self._running.values()):
            reason = sequence.abandon_reason(now)
            if reason is not None:
                del self._running[sequence.seq_id]
                rows.append(StepRow(Action.RELEASE, sequence.seq_id))
                # Until this round answers: if it fails first, or it is sent ahead and discarded, the
                # engine still holds the slot and `_release_dropped` releases it.
                self._unreleased.add(sequence.seq_id)
                sequence.finish(reason, now)
        self._drop_abandoned_waiting(now)
        stepped: list[Sequence] = list(self._running.values())
        admitted = self._admit(now)
        if any(s.priority is Priority.INTERACTIVE for s in (*stepped, *admitted)):
            self._interactive_at = now
        # An interactive first token waits for this step: bulk sequences sit it out (unless they have
        # waited BULK_MAX_WAIT_S already), and the round is one step whether or not bulk runs: the
        # first token then travels out while the engine waits for the next round, not while its
        # threads take the cores (a round going on past the prefill made 1-stream TTFT ~25 ms worse
        # on 2 cores, bench-peer).
        self._interactive_prefill = any(s.priority is Priority.INTERACTIVE for s in admitted)
        if self._interactive_prefill and not self._bulk_starved(now):
            stepped = [s for s in stepped if s.priority is Priority.INTERACTIVE]
        decode_rows = [StepRow(Action.DECODE, s.seq_id) for s in stepped]
        prefill_rows = [StepRow(Action.PREFILL, s.seq_id, self._prefill_request(s)) for s in admitted]
        stepped.extend(admitted)
        if stepped:
            metrics.BATCH_SIZE.observe(len(stepped))
            metrics.BATCH_TOKENS.labels(replica=self._replica).observe(self.batch_tokens)
        self._publish_slots()
        return rows + decode_rows + prefill_rows, stepped

    def _prefill_request(self, sequence: Sequence) -> bytes:
        chunk = self._limits.bulk_prefill_chunk if sequence.priority is Priority.BULK else 0
        request = sequence.request
        return request.prompt.to_json(request.sampling, prefill_chunk=chunk, owner=ADAPTER_ID, request_id=request.request_id)

    def _admit(self, now: float) -> list[Sequence]:
        """Waiting sequences whose prefill joins this step."""
        engine_full = now < self._engine_full_until
        admitted = self._take_within_budgets(now) if not engine_full and (not self._running or self._prefill_due()) else []
        for sequence in self._waiting:
            sequence.waited_steps += 1
        return admitted

    def _take_within_budgets(self, now: float) -> list[Sequence]:
        admitted: list[Sequence] = []
        tokens = self.batch_tokens
        limits = self._limits
        bulk = [s for s in self._running.values() if s.priority is Priority.BULK]
        bulk_slots = max(1, limits.max_batch_size - limits.interactive_reserved_slots)
        # Bulk sequences still caching their prompts count against the prefill cap like new ones.
        bulk_prefilling = sum(1 for s in bulk if s.prefilling)
        interactive_admitted = False
        while len(self._running) < limits.max_batch_size:
            head = self._waiting.peek()
            if head is None:
                break
            # Interactive sequences come first, so a bulk head means only bulk ones wait.
            if head.priority is Priority.BULK:
                if (
                    interactive_admitted
                    or (limits.max_bulk_prefill_rows and bulk_prefilling >= limits.max_bulk_prefill_rows)
                    or len(bulk) >= bulk_slots
                ):
                    break
                if bulk and self._steps_over_bulk_target(now):
                    metrics.BULK_HELD.labels(replica=self._replica).inc()
                    break
            # An oversized request still runs when it would be alone, or it would starve.
            if self._running and tokens + head.reserved_tokens > limits.max_batch_tokens:
                break
            self._waiting.pop()
            head.prefilled_at = now
            tokens += head.reserved_tokens
            self._running[head.seq_id] = head
            admitted.append(head)
            if head.priority is Priority.BULK:
                bulk.append(head)
                bulk_prefilling += 1
            else:
                interactive_admitted = True
        return admitted

    def _steps_over_bulk_target(self, now: float) -> bool:
        """Whether another bulk sequence would make interactive arrivals wait on long steps."""
        target = self._limits.bulk_step_target_s
        if not target or self._step_s is None or now - self._interactive_at > INTERACTIVE_RECENT_S:
            return False
        return self._step_s > target

    def _prefill_due(self) -> bool:
        if not len(self._waiting):
            return False
        if len(self._waiting) >= self._limits.min_prefill_rows:
            return True
        return max(s.waited_steps for s in self._waiting) >= self._limits.max_waiting_steps

    def _drop_abandoned_waiting(self, now: float) -> None:
        for sequence in self._waiting.remove_if(lambda s: s.abandon_reason(now) is not None):
            sequence.finish(sequence.abandon_reason(now) or Finish.CANCELLED, now)

    def _apply(self, outcomes: list[StepOutcome]) -> None:
        """One response's outcomes for the round's sequences, in step order (release rows and
        sequences that already ended answer too: they are skipped). A sequence's tokens of one
        response reach its caller as one event: the steps shared the response to save its costs."""
        now = self._clock()
        tokens: dict[int, list[StepOutcome]] = {}
        for outcome in outcomes:
            sequence = self._in_round.get(outcome.seq_id)
            if sequence is None or sequence.done or sequence.seq_id not in self._running:
                continue
            if outcome.finish in (FINISH_BUSY, FINISH_STALE):
                self._requeue(sequence, now)
                continue
            self._observe_queue_wait(sequence)
            sequence.prompt_tokens = outcome.prompt_tokens or sequence.prompt_tokens
            # Every row of the sequence carries it (step_protocol); a row that says 0 (a release's
            # answer, an engine without a prefix cache) does not undo what an earlier one said.
            sequence.cached_tokens = outcome.cached_tokens or sequence.cached_tokens
            sequence.completion_tokens = outcome.completion_tokens
            if outcome.token_id >= 0 and not sequence.cancelled:
                tokens.setdefault(sequence.seq_id, []).append(outcome)
            if sequence.trace is not None:
                sequence.trace.step(len(self._in_round), outcome.completion_tokens, outcome.finish)
            if outcome.finish:
                self._running.pop(sequence.seq_id, None)
                _emit_tokens(sequence, tokens.pop(sequence.seq_id, []), now)
                if engine_fault(outcome) and sequence.first_token_at is None:
                    sequence.backend_failed = True  # nothing streamed yet: another replica may serve it
                sequence.finish(_finish_of(outcome.finish), now, error=outcome.error)
                self._engine_full_until = 0.0  # a slot is free now: prefills may try again
        for seq_id, made in tokens.items():
            _emit_tokens(self._in_round[seq_id], made, now)

    def _observe_queue_wait(self, sequence: Sequence) -> None:
        """A sequence's whole wait in this replica's queue, from joining it to the prefill the engine
        took, observed once: at admission it is not known yet whether the engine has a slot, and a
        prefill answered busy goes back to the queue to wait on (observing each admission counted the
        first wait twice). Per replica: a request retried elsewhere waits in that queue anew, observed
        there; its whole time from arrival is in its Timings (and its time to first token)."""
        if not sequence.queue_wait_observed and sequence.prefilled_at is not None:
            sequence.queue_wait_observed = True
            if sequence.trace is not None:
                sequence.trace.admitted()
            metrics.QUEUE_SECONDS.labels(replica=self._replica).observe(sequence.prefilled_at - sequence.queued_at)

    def _requeue(self, sequence: Sequence, now: float) -> None:
        """A prefill the engine had no slot for: back to the head of the queue, not an error; while
        the replica drains it never started here, so it is handed back instead (ReplicaWork.drain)."""
        self._running.pop(sequence.seq_id, None)
        sequence.prefilled_at = None
        if self._draining:
            self._hand_back(sequence)
            return
        self._waiting.push_front(sequence)
        self._engine_full_until = now + self._limits.engine_full_retry_s
        metrics.ENGINE_FULL.labels(replica=self._replica).inc()


def _some(ids: list[int] | list[str]) -> list[int | str]:
    """At most MAX_LOGGED_IDS of `ids`, then how many more there were."""
    shown: list[int | str] = list(ids[:MAX_LOGGED_IDS])
    if len(ids) > MAX_LOGGED_IDS:
        shown.append(f"... {len(ids) - MAX_LOGGED_IDS} more")
    return shown


def _moving_average(previous: float | None, value: float) -> float:
    return value if previous is None else 0.8 * previous + 0.2 * value


def _emit_tokens(sequence: Sequence, made: list[StepOutcome], now: float) -> None:
    if made:
        logprobs = tuple(o.logprobs for o in made if o.logprobs is not None)
        sequence.emit_text("".join(o.text for o in made), now, tokens=len(made), logprobs=logprobs)


def _finish_of(value: str) -> Finish:
    if value == FINISH_INVALID:
        return Finish.INVALID
    if value == FINISH_ERROR:
        return Finish.ERROR
    try:
        return Finish(value)
    except ValueError:
        return Finish.ERROR
