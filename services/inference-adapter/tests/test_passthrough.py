"""The passthrough scheduler, with a stand-in for a self-batching engine's stream.

`CountingEngine` streams like Triton's vLLM backend with its additional outputs (a text delta,
the tokens generated since the last response, the prompt's tokens, and the finish reason on the
last response) and records how many streams are open at once; the real decoupled model is tested in
tests/e2e/test_passthrough.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from conftest import StepReplica, collect, run_through

from sluice_common.sampling import Sampling, split_field_error
from sluice_inference_adapter.backend_errors import RequestRejected
from sluice_inference_adapter.generated_chunk import GeneratedChunk
from sluice_inference_adapter.passthrough import PassthroughLimits, PassthroughScheduler
from sluice_inference_adapter.replica_pool import ReplicaPool
from sluice_inference_adapter.sequence import Finish, FinishEvent, GenerationRequest
from sluice_inference_adapter.step_rows import PromptSpec
from sluice_inference_adapter.priority import Priority


PROMPT_TOKENS = 7


class CountingEngine:
    """Two tokens per response, like a vLLM engine that streams every other step."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.open = 0
        self.peak = 0
        self.closed_early = 0
        self.started: list[str] = []
        self.request_ids: list[str] = []
        self._stop_after = stop_after

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        self.open += 1
        self.peak = max(self.peak, self.open)
        self.started.append(text)
        self.request_ids.append(request_id)
        finished = False
        limit = sampling.max_tokens if self._stop_after is None else min(self._stop_after, sampling.max_tokens)
        try:
            made = 0
            while made < limit:
                await asyncio.sleep(0.005)
                step = min(2, limit - made)
                made += step
                reason = None if made < limit else ("length" if made == sampling.max_tokens else "stop")
                yield GeneratedChunk(f"t{made} ", step, PROMPT_TOKENS, reason)
            finished = True
        finally:
            self.open -= 1
            self.closed_early += not finished


def raw(prompt: PromptSpec) -> str:
    return prompt.prompt


def scheduler_for(engine: object, max_in_flight: int = 2, on_step: object = None) -> PassthroughScheduler:
    return PassthroughScheduler(engine, PassthroughLimits(max_in_flight=max_in_flight), raw, on_step=on_step)  # type: ignore[arg-type]


def request(max_tokens: int, prompt: str = "p", priority: Priority = Priority.INTERACTIVE) -> GenerationRequest:
    return GenerationRequest("rid", "t", PromptSpec(prompt=prompt), Sampling(max_tokens=max_tokens), priority)


async def test_usage_and_finish_reason_are_the_engines() -> None:
    steps: list[bool] = []
    scheduler = scheduler_for(CountingEngine(), on_step=steps.append)
    scheduler.start()
    try:
        text, length = await collect(scheduler.submit(request(3)))
    finally:
        await scheduler.stop()
    assert text == "t2 t3 " and length.finish is Finish.LENGTH
    assert (length.prompt_tokens, length.completion_tokens) == (PROMPT_TOKENS, 3)
    scheduler = scheduler_for(CountingEngine(stop_after=5))
    scheduler.start()
    try:
        _, stop = await collect(scheduler.submit(request(10)))
    finally:
        await scheduler.stop()
    assert stop.finish is Finish.STOP and (stop.prompt_tokens, stop.completion_tokens) == (PROMPT_TOKENS, 5)
    assert steps == [True]


async def test_each_stream_names_its_request_to_the_backend() -> None:
    """The request id goes with the stream (Triton's request id), so the engine side's lines join the
    adapter's and the gateway's."""
    engine = CountingEngine()
    scheduler = scheduler_for(engine)
    scheduler.start()
    try:
        await collect(scheduler.submit(GenerationRequest("req-7", "t", PromptSpec(prompt="p"), Sampling(max_tokens=2))))
    finally:
        await scheduler.stop()
    assert engine.request_ids == ["req-7"]


class RejectingEngine:
    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        raise RequestRejected("The decoder prompt (length 3000) is longer than the maximum model length of 2048.")
        yield  # pragma: no cover - makes this an async generator


class RejectingOption:
    """vLLM refusing a logit_bias id outside its vocabulary (vllm/v1/engine/processor.py)."""

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        raise RequestRejected("token_id(s) [49152] in logit_bias contain out-of-vocab token ids. Vocabulary size: 49152")
        yield  # pragma: no cover - makes this an async generator


class FailingEngine:
    def __init__(self, message: str = "engine crashed", finish_reason: str | None = None) -> None:
        self._message = message
        self._finish_reason = finish_reason

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        yield GeneratedChunk("", 0, PROMPT_TOKENS, self._finish_reason)
        if self._finish_reason is None:
            raise RuntimeError(self._message)


async def run_one(engine: object) -> tuple[FinishEvent, bool, list[bool]]:
    """One request's finish, whether it was marked a backend failure, and the health reports."""
    steps: list[bool] = []
    scheduler = scheduler_for(engine, on_step=steps.append)
    scheduler.start()
    try:
        handle = scheduler.submit(request(4))
        _, finish = await collect(handle)
    finally:
        await scheduler.stop()
    return finish, handle.backend_failed, steps


async def test_a_refused_request_is_invalid_and_the_replica_stays_healthy() -> None:
    finish, backend_failed, steps = await run_one(RejectingEngine())
    assert finish.finish is Finish.INVALID and "maximum model length of 2048" in finish.error
    assert steps == [True] and not backend_failed


async def test_a_refused_option_is_named_as_the_step_engine_names_it() -> None:
    finish, backend_failed, steps = await run_one(RejectingOption())
    assert finish.finish is Finish.INVALID and not backend_failed and steps == [True]
    assert split_field_error(finish.error) == (
        "sampling.logit_bias",
        "token_id(s) [49152] in logit_bias contain out-of-vocab token ids. Vocabulary size: 49152",
    )


async def test_a_failed_stream_counts_against_the_replica() -> None:
    finish, backend_failed, steps = await run_one(FailingEngine())
    assert finish.finish is Finish.ERROR and "engine crashed" in finish.error
    assert steps == [False] and backend_failed


async def test_an_engine_abort_is_a_failure_not_a_finish() -> None:
    scheduler = scheduler_for(FailingEngine(finish_reason="abort"))
    scheduler.start()
    try:
        _, finish = await collect(scheduler.submit(request(4)))
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.ERROR and "'abort'" in finish.error


class EndsWithoutFinishEngine:
    """A stream that closes after a token without ever saying why the sequence ended."""

    async def stream(self, text: str, sampling: Sampling, request_id: str = "") -> AsyncIterator[GeneratedChunk]:
        yield GeneratedChunk("a", 1, PROMPT_TOKENS, None)


async def test_a_stream_that_ends_without_a_finish_reason_is_one_failure_not_a_success_too() -> None:
    """Issue 22: it reported a success and then a failure, so the failures never added up to the
    pool's threshold (each success reset the count)."""
    finish, backend_failed, steps = await run_one(EndsWithoutFinishEngine())
    assert finish.finish is Finish.ERROR and "without a finish reason" in finish.error
    assert steps == [False] and backend_failed


async def test_streams_that_end_without_a_finish_reason_take_the_replica_out_of_routing() -> None:
    pool = ReplicaPool(
        [StepReplica("a")],
        lambda backend, on_step: scheduler_for(EndsWithoutFinishEngine(), on_step=on_step),
        failure_threshold=2,
        probe_interval_s=60.0,
    )
    await pool.probe_once()  # proven, as the adapter's replicas are before it serves
    pool.start()
    try:
        for _ in range(2):
            _, finish = await run_through(pool, request(4))
            assert finish.finish is Finish.ERROR
        assert not pool.replicas[0].healthy
    finally:
        await pool.stop()


async def test_the_chat_is_rendered_by_the_given_template() -> None:
    engine = CountingEngine()
    scheduler = PassthroughScheduler(engine, PassthroughLimits(), lambda p: f"<{p.messages[0][1]}>")
    scheduler.start()
    try:
        chat = GenerationRequest("rid", "t", PromptSpec(messages=(("user", "hi"),)), Sampling(max_tokens=1), Priority.INTERACTIVE)
        await collect(scheduler.submit(chat))
    finally:
        await scheduler.stop()
    assert engine.started == ["<hi>"]


async def test_never_more_streams_open_than_the_bound() -> None:
    engine = CountingEngine()
    scheduler = scheduler_for(engine)
    scheduler.start()
    try:
        await asyncio.gather(*(collect(scheduler.submit(request(4))) for _ in range(7)))
    finally:
        await scheduler.stop()
    assert engine.peak == 2


async def test_cancel_closes_the_stream() -> None:
    engine = CountingEngine()
    scheduler = scheduler_for(engine)
    scheduler.start()
    try:
        handle = scheduler.submit(request(1000))
        events = handle.events()
        await anext(events)
        handle.cancel()
        finish = [event async for event in events][-1]
    finally:
        await scheduler.stop()
    assert finish.finish is Finish.CANCELLED
    assert engine.closed_early == 1 and engine.open == 0


async def test_interactive_takes_the_free_place_before_bulk() -> None:
    engine = CountingEngine()
    scheduler = scheduler_for(engine, max_in_flight=1)
    handles = [scheduler.submit(request(1, "bulk", Priority.BULK)), scheduler.submit(request(1, "interactive"))]
    scheduler.start()
    try:
        await asyncio.gather(*(collect(h) for h in handles))
    finally:
        await scheduler.stop()
    assert engine.started == ["interactive", "bulk"]


async def test_a_draining_replica_opens_no_new_stream_and_hands_back_those_waiting() -> None:
    """The passthrough shares the step scheduler's drain (ReplicaWork.drain): the stream open
    finishes, the one waiting is handed back to be retried elsewhere before its first token."""
    engine = CountingEngine()
    scheduler = scheduler_for(engine, max_in_flight=1)
    scheduler.start()
    try:
        streaming, waiting = scheduler.submit(request(4, "first")), scheduler.submit(request(4, "second"))
        await asyncio.sleep(0.01)
        assert scheduler.drain() == 1
        (_, finished), (_, handed_back) = await asyncio.gather(collect(streaming), collect(waiting))
        late = scheduler.submit(request(4, "late"))
        _, refused = await collect(late)
    finally:
        await scheduler.stop()
    assert finished.finish is Finish.LENGTH and finished.completion_tokens == 4
    assert handed_back.finish is Finish.ERROR and waiting.backend_failed
    assert refused.finish is Finish.ERROR and late.backend_failed
    assert engine.started == ["first"]
