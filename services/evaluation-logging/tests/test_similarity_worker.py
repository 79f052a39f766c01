"""Similarity off the consume path: pending markers stored with the record, scored later in batches.

The embeddings come from `StandInAdapter`, a real grpc.aio server in this process implementing
sluice.inference.v1.InferenceService.Embed (a stand-in for the inference-adapter, as other unit
tests here use stand-ins for their neighbours): it embeds deterministically (a character
histogram, so the expected cosine is computable here), counts calls and texts, and can be told to
answer UNIMPLEMENTED, UNAVAILABLE or RESOURCE_EXHAUSTED, or to stall past the caller's deadline
(a slow CPU encoder) on large calls or on one text. As the adapter does, it refuses a text over its
model's maximum input (INVALID_ARGUMENT naming inputs[i]) unless the call asks for truncation
(truncate_prompt_tokens -1), and then embeds its first tokens. The real adapter and model are
exercised in tests/e2e.
Every store test runs on SQLite and on the running PostgreSQL (the `store` fixture).
"""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import AsyncIterator, Sequence

import aio_pika
import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import AMQP_URL, make_event
from sluice_common.amqp import EventTopology
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_common.config import ConfigError, load_config
from sluice_evaluation_logging.config import ENV_PREFIX, EvalLogConfig
from sluice_evaluation_logging.consumer import CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.embeddings import AdapterEmbedder
from sluice_evaluation_logging.evaluators import evaluate_batch
from sluice_evaluation_logging.evaluators.base import Deferred, EvalContext, EvalSettings, ScoreResult, prompt_text
from sluice_evaluation_logging.model import RecordFilter
from sluice_evaluation_logging.queries import EvalLogQueries
from sluice_evaluation_logging.records import to_row
from sluice_evaluation_logging.similarity_worker import SimilarityWorker, WorkerSettings
from sluice_evaluation_logging.store import PostgresStore, SqliteStore, Store

SETTINGS = EvalSettings(similarity_sample_rate=1.0, similarity_min=0.2)
DIMS = 32
# A stalled Embed outlasts SHORT_DEADLINE_S, the deadline of the `short_deadline` embedder.
STALL_S = 3.0
SHORT_DEADLINE_S = 0.3
# The stand-in model's maximum input in tokens (all-MiniLM-L6-v2's): a token per word, plus two.
MAX_INPUT_TOKENS = 256


def tokens_of(text: str) -> int:
    return len(text.split()) + 2  # words plus [CLS] and [SEP]


def cut(text: str) -> str:
    """What the stand-in model embeds of a text when truncation is asked for: its first tokens."""
    words = text.split()
    return text if len(words) + 2 <= MAX_INPUT_TOKENS else " ".join(words[: MAX_INPUT_TOKENS - 2])


def histogram(text: str) -> list[float]:
    vector = [0.0] * DIMS
    for char in text.lower():
        vector[ord(char) % DIMS] += 1.0
    return vector


def expected_cosine(prompt: str, output: str) -> float:
    a, b = histogram(prompt), histogram(output)
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


class StandInAdapter(inference_pb2_grpc.InferenceServiceServicer):
    """InferenceService.Embed over real gRPC, deterministic; `mode` is "ok", "unimplemented", "unavailable",
    "exhausted" or "invalid". A call of more than `stall_above` texts, or with a text containing
    `stall_on`, outlasts any deadline used here."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.calls: list[int] = []  # texts per Embed call
        self.answered: list[int] = []  # texts per Embed call answered with vectors
        self.stalled: list[int] = []  # texts per Embed call left to time out
        self.stall_above: int | None = None
        self.stall_on = ""
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def Embed(self, request, context):  # type: ignore[no-untyped-def]
        self.calls.append(len(request.inputs))
        if self.mode == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this adapter serves no embedding model")
        if self.mode == "unavailable":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the embedding backend is down")
        if self.mode == "exhausted":  # the adapter's backpressure: its embed queue is full
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "embed queue full")
        if self._stalls(request.inputs):
            self.stalled.append(len(request.inputs))
            await asyncio.sleep(STALL_S)  # the caller's deadline passes first
        if self.mode == "invalid":  # SLUICE_EVALLOG_EMBEDDING_MODEL naming a model the adapter lacks
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model: unknown embedding model")
        truncate = request.HasField("truncate_prompt_tokens") and request.truncate_prompt_tokens == -1
        for index, text in enumerate(request.inputs):
            if tokens_of(text) > MAX_INPUT_TOKENS and not truncate:  # the adapter's refusal, in its words
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"inputs[{index}]: This model's maximum context length is {MAX_INPUT_TOKENS} tokens. However, you requested"
                    f" {tokens_of(text)} tokens in the input for embedding generation. Please reduce the length of the input.",
                )
        assert request.priority_class == types_pb2.PRIORITY_CLASS_BULK
        self.answered.append(len(request.inputs))
        return inference_pb2.EmbedResponse(embeddings=[types_pb2.Embedding(values=histogram(cut(text))) for text in request.inputs])

    def _stalls(self, inputs: Sequence[str]) -> bool:
        too_many = self.stall_above is not None and len(inputs) > self.stall_above
        return too_many or (bool(self.stall_on) and any(self.stall_on in text for text in inputs))

    async def start(self) -> None:
        self.server = grpc.aio.server()
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"


@pytest.fixture
async def adapter():  # type: ignore[no-untyped-def]
    standin = StandInAdapter()
    await standin.start()
    embedder = AdapterEmbedder(standin.address, "all-minilm-l6-v2", timeout_s=5)
    standin.embedder = embedder  # type: ignore[attr-defined]
    yield standin
    await embedder.close()
    assert standin.server is not None
    await standin.server.stop(0)


def worker_for(store: Store, adapter: StandInAdapter, **settings: float) -> SimilarityWorker:
    defaults = {"batch_max": 64, "poll_s": 0.05, "claim_lease_s": 30.0, "min_backoff_s": 0.05, "max_backoff_s": 0.2}
    return SimilarityWorker(store, adapter.embedder, SETTINGS, WorkerSettings(**{**defaults, **settings}))  # type: ignore[attr-defined, arg-type]


@pytest.fixture
async def short_deadline(adapter) -> AsyncIterator[AdapterEmbedder]:  # type: ignore[no-untyped-def]
    """An embedder to the stand-in whose calls time out (DEADLINE_EXCEEDED) when it stalls."""
    embedder = AdapterEmbedder(adapter.address, "all-minilm-l6-v2", timeout_s=SHORT_DEADLINE_S)
    yield embedder
    await embedder.close()


async def run_until_settled(store: Store, worker: SimilarityWorker, most_runs: int) -> None:
    for _ in range(most_runs):
        if await store.pending_count() == 0:
            return
        await worker.run_once()
    assert await store.pending_count() == 0, f"markers still pending after {most_runs} runs"


async def consume_path_rows(events, adapter: StandInAdapter):  # type: ignore[no-untyped-def]
    """What the consumer stores: every evaluator runs, similarity answers Deferred (no Embed call)."""
    ctx = EvalContext(SETTINGS, adapter.embedder, defer_model_calls=True)  # type: ignore[attr-defined]
    return [to_row(event, scores) for event, scores in zip(events, await evaluate_batch(events, ctx), strict=True)]


async def reopened(store: Store) -> Store:
    """The same database from a new process's point of view: a fresh store object."""
    if isinstance(store, SqliteStore):
        fresh: Store = SqliteStore(store.path)
    else:
        assert isinstance(store, PostgresStore)
        fresh = PostgresStore(store.dsn, store.schema)
    await fresh.open()
    return fresh


def similarity_of(record):  # type: ignore[no-untyped-def]
    found = [s for s in record.scores if s.name == "similarity"]
    assert len(found) <= 1
    return found[0] if found else None


async def wait_for(predicate, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_the_marker_is_stored_with_the_record_and_the_score_is_absent_until_computed(store, adapter) -> None:  # type: ignore[no-untyped-def]
    events = [make_event() for _ in range(3)]
    cancelled = make_event(finish_reason=types_pb2.FINISH_REASON_CANCELLED)  # similarity does not apply
    assert await store.insert_batch(await consume_path_rows([*events, cancelled], adapter)) == 4
    assert adapter.calls == []  # storing waited on no model
    assert await store.pending_count("similarity") == 3
    record = await store.get(events[0].event_id)
    assert record is not None and similarity_of(record) is None
    assert {"latency_slo", "ttft_slo", "truncation", "empty_output", "repetition", "pii"} <= {s.name for s in record.scores}
    (summary,) = await EvalLogQueries(store).summarize("demo", RecordFilter())
    assert "similarity" not in summary.scores and summary.count == 4


async def test_the_worker_embeds_a_batch_in_one_call_writes_scores_and_clears_markers(store, adapter) -> None:  # type: ignore[no-untyped-def]
    events = [make_event(output=f"Paris, answer number {i}.") for i in range(10)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    worker = worker_for(store, adapter, batch_max=8)
    assert await worker.run_once() == 8
    assert await worker.run_once() == 2
    assert await worker.run_once() == 0
    assert adapter.calls == [16, 4]  # one Embed per batch: prompt and output of each event
    assert await store.pending_count() == 0
    for event in events:
        record = await store.get(event.event_id)
        score = similarity_of(record)
        assert score is not None and not score.skipped
        assert score.value == pytest.approx(expected_cosine(prompt_text(event), event.output), rel=1e-5)
        assert score.passed == (score.value >= SETTINGS.similarity_min)
    (summary,) = await EvalLogQueries(store).summarize("demo", RecordFilter())
    assert summary.scores["similarity"].count == 10 and summary.scores["similarity"].skipped == 0
    page, _ = await EvalLogQueries(store).query_records("demo", RecordFilter(), 50, "")
    assert all(similarity_of(r) is not None for r in page)


async def test_a_text_over_the_models_maximum_input_is_scored_from_its_first_tokens_not_skipped(store, adapter) -> None:  # type: ignore[no-untyped-def]
    """The adapter refuses an input over its model's 256 tokens (INVALID_ARGUMENT) unless the call
    asks for truncation. A claim's events go in one call: one long output failed the call, the claim
    was retried, and every score in it was finally recorded as skipped. The worker asks for
    truncation, so a long text is scored on its first 256 tokens, as similarity always was."""
    long_output = "Paris is the capital of France. " * 40 + "Unrelated filler words here. " * 60  # 440 tokens
    assert tokens_of(long_output) > MAX_INPUT_TOKENS and cut(long_output) != long_output
    events = [make_event(output=long_output), make_event(), make_event(output="Paris, answer number 2.")]
    await store.insert_batch(await consume_path_rows(events, adapter))
    worker = worker_for(store, adapter, min_backoff_s=0.01, max_backoff_s=0.02, max_attempts=2)
    await run_until_settled(store, worker, most_runs=6)
    assert adapter.answered == [6]  # the claim's one call, answered the first time
    for event in events:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and not score.skipped, score
        assert score.value == pytest.approx(expected_cosine(prompt_text(event), cut(event.output)), rel=1e-5)
    # The score is the first tokens' (what the model reads), not the whole text's.
    assert expected_cosine(prompt_text(events[0]), cut(long_output)) != pytest.approx(expected_cosine(prompt_text(events[0]), long_output), rel=1e-3)


async def test_reference_similarity_scores_a_reference_over_the_models_maximum_input(adapter) -> None:  # type: ignore[no-untyped-def]
    """ScoreCompletions (`sluice eval`) embeds output and reference through the same embedder: a long
    reference was refused by the adapter, and its reference_similarity not scored."""
    from sluice_evaluation_logging.scoring import ScoreInput, score_items

    reference = "Paris is the capital of France. " * 40 + "Unrelated filler words here. " * 60
    (scores,) = await score_items([ScoreInput(make_event(output="Paris."), reference=reference)], EvalContext(SETTINGS, adapter.embedder))  # type: ignore[attr-defined]
    (score,) = [s for s in scores if s.name == "reference_similarity"]
    assert not score.skipped, score
    a, b = histogram("Paris."), histogram(cut(reference))
    cosine = sum(x * y for x, y in zip(a, b, strict=True)) / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))
    assert score.value == pytest.approx(cosine, rel=1e-5)


async def test_a_restarted_process_picks_up_markers_left_behind(store, adapter) -> None:  # type: ignore[no-untyped-def]
    events = [make_event() for _ in range(5)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    # A process that claimed two markers and died before storing their scores.
    crashed = await store.claim_pending("similarity", 2, lease_s=0.5)
    assert len(crashed) == 2
    await store.close()

    store2 = await reopened(store)
    try:
        worker = worker_for(store2, adapter)
        worker.start()  # no nudge: it looks for leftovers on its own at start

        async def unclaimed_done() -> bool:
            return await store2.pending_count() == 2

        await wait_for(unclaimed_done, 5)
        # The dead process's claim runs out, then its markers are taken too.

        async def all_done() -> bool:
            return await store2.pending_count() == 0

        await wait_for(all_done, 10)
        await worker.stop()
        for event in events:
            score = similarity_of(await store2.get(event.event_id))
            assert score is not None and not score.skipped
    finally:
        await store2.close()
        await store.open()  # the fixture closes (and for PostgreSQL drops) it


async def test_a_redelivered_event_gets_no_second_marker_or_score(store, adapter) -> None:  # type: ignore[no-untyped-def]
    event = make_event()
    rows = await consume_path_rows([event], adapter)
    assert await store.insert_batch(rows) == 1
    assert await store.insert_batch(await consume_path_rows([event, event], adapter)) == 0  # redelivered while pending
    assert await store.pending_count() == 1
    worker = worker_for(store, adapter)
    assert await worker.run_once() == 1
    assert await store.insert_batch(await consume_path_rows([event], adapter)) == 0  # redelivered after scoring
    assert await store.pending_count() == 0 and await worker.run_once() == 0
    assert adapter.calls == [2]
    # A score computed twice (two replicas, one past its lease) is written once.
    assert await store.complete_pending("similarity", [(event.event_id, ScoreResult("similarity", 0.0, False))]) == 0
    record = await store.get(event.event_id)
    assert [s.name for s in record.scores].count("similarity") == 1 and similarity_of(record).value > 0


async def test_unimplemented_embed_is_recorded_as_skipped(store, adapter) -> None:  # type: ignore[no-untyped-def]
    adapter.mode = "unimplemented"
    events = [make_event() for _ in range(3)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    assert await worker_for(store, adapter).run_once() == 3
    assert await store.pending_count() == 0
    for event in events:
        score = similarity_of(await store.get(event.event_id))
        assert score.skipped and score.detail.startswith("skipped: embeddings unavailable")
        assert "UNIMPLEMENTED" in score.detail
    (summary,) = await EvalLogQueries(store).summarize("demo", RecordFilter())
    assert summary.scores["similarity"].skipped == 3 and summary.scores["similarity"].count == 0


@pytest.mark.parametrize("mode", ["unavailable", "exhausted"])
async def test_unavailable_embed_backs_off_and_keeps_the_markers(store, adapter, mode) -> None:  # type: ignore[no-untyped-def]
    adapter.mode = mode
    events = [make_event() for _ in range(4)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    worker = worker_for(store, adapter, min_backoff_s=0.1, max_backoff_s=0.4)
    worker.start()
    try:

        async def tried_a_few_times() -> bool:
            return len(adapter.calls) >= 3

        await wait_for(tried_a_few_times, 10)
        assert await store.pending_count() == 4
        assert similarity_of(await store.get(events[0].event_id)) is None  # nothing made up meanwhile
        adapter.mode = "ok"

        async def all_done() -> bool:
            return await store.pending_count() == 0

        await wait_for(all_done, 10)
    finally:
        await worker.stop()
    for event in events:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and not score.skipped
    # Retries while unavailable did not count against the attempts that give up on a broken batch.
    assert len(adapter.calls) < 20
    assert set(adapter.calls) == {8}  # waited for, never split: the batch's size was not the problem


async def test_a_batch_that_times_out_is_split_until_it_is_stored(store, adapter, short_deadline) -> None:  # type: ignore[no-untyped-def]
    """A DEADLINE_EXCEEDED released the batch uncounted and it was claimed again whole, for ever:
    a slow encoder that cannot embed 64 events in time never stored any of them."""
    adapter.stall_above = 4  # texts: calls of more than two events outlast the deadline
    events = [make_event(output=f"Paris, answer number {i}.") for i in range(8)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    worker = SimilarityWorker(
        store, short_deadline, SETTINGS, WorkerSettings(batch_max=8, poll_s=0.05, min_backoff_s=0.01, max_backoff_s=0.02, max_attempts=2)
    )
    await run_until_settled(store, worker, most_runs=12)
    for event in events:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and not score.skipped, score  # the split tries did not count as attempts
        assert score.value == pytest.approx(expected_cosine(prompt_text(event), event.output), rel=1e-5)
    assert adapter.answered and max(adapter.answered) <= 4 and sum(adapter.answered) == 16
    assert adapter.calls[0] == 16  # the first try was the whole batch


async def test_a_marker_that_times_out_even_alone_is_given_up_and_the_rest_are_stored(store, adapter, short_deadline) -> None:  # type: ignore[no-untyped-def]
    adapter.stall_on = "POISON"  # never embedded in time, in any call
    good = [make_event() for _ in range(5)]
    poison = make_event(output="POISON " * 40)
    await store.insert_batch(await consume_path_rows([*good, poison], adapter))
    worker = SimilarityWorker(
        store, short_deadline, SETTINGS, WorkerSettings(batch_max=8, poll_s=0.05, min_backoff_s=0.01, max_backoff_s=0.02, max_attempts=3)
    )
    await run_until_settled(store, worker, most_runs=20)
    score = similarity_of(await store.get(poison.event_id))
    assert score is not None and score.skipped and "timed out" in score.detail and "DEADLINE_EXCEEDED" in score.detail, score
    for event in good:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and not score.skipped, score
    # Tried alone max_attempts times, then never again.
    assert adapter.stalled.count(2) == 3
    calls = len(adapter.calls)
    assert await worker.run_once() == 0 and len(adapter.calls) == calls


async def test_claims_grow_back_by_one_per_answer_once_a_slow_spell_has_passed(store, adapter, short_deadline) -> None:  # type: ignore[no-untyped-def]
    adapter.stall_above = 2  # texts: only one event per call is embedded in time
    events = [make_event() for _ in range(14)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    settings = WorkerSettings(batch_max=4, poll_s=0.05, min_backoff_s=0.01, max_backoff_s=0.02)
    worker = SimilarityWorker(store, short_deadline, SETTINGS, settings)
    assert await worker.run_once() == 0 and await worker.run_once() == 0  # 4 events, then 2: timed out
    adapter.stall_above = None  # the encoder is fast again
    await run_until_settled(store, worker, most_runs=6)
    assert adapter.calls[:2] == [8, 4] and adapter.stalled == [8, 4]
    assert adapter.answered == [2, 4, 6, 8, 8]  # 1, 2, 3, then batch_max events per claim


def test_an_embed_deadline_that_could_outlast_the_claim_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A claim is embedded in one call: with a deadline as long as the lease, the call could still run
    when another replica may claim the same markers and embed them again."""
    WorkerSettings(claim_lease_s=0.5, embed_timeout_s=0.49)
    with pytest.raises(ValueError, match=r"embed_timeout_s \(0.5\) must be shorter than claim_lease_s \(0.5\)"):
        WorkerSettings(claim_lease_s=0.5, embed_timeout_s=0.5)
    # The service builds WorkerSettings from its configuration, which refuses the same at load.
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("")
    environ = {f"{ENV_PREFIX}TENANTS_FILE": str(tenants), f"{ENV_PREFIX}SIMILARITY_LEASE_S": "10", f"{ENV_PREFIX}EMBED_TIMEOUT_S": "10"}
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}SIMILARITY_LEASE_S must be longer than {ENV_PREFIX}EMBED_TIMEOUT_S"):
        load_config(EvalLogConfig, ENV_PREFIX, environ)


async def test_markers_that_keep_failing_are_given_up_while_fresh_ones_keep_arriving(store, adapter) -> None:  # type: ignore[no-untyped-def]
    """The batch was retried while any marker in it had attempts left: with a sampled event arriving
    between tries, the oldest markers never reached max_attempts' verdict and piled up for ever."""
    adapter.mode = "invalid"
    first = [make_event() for _ in range(3)]
    await store.insert_batch(await consume_path_rows(first, adapter))
    worker = worker_for(store, adapter, min_backoff_s=0.01, max_backoff_s=0.02, max_attempts=3)
    for _ in range(5):
        await store.insert_batch(await consume_path_rows([make_event()], adapter))  # fresh traffic
        await worker.run_once()
    for event in first:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and score.skipped and "evaluator failed" in score.detail, score
    assert await store.pending_count() <= 3  # only the fresh ones still have tries left


class DegenerateEmbedder:
    """Embeds texts containing `bad` as a vector with a NaN or infinite component, the others as one finite vector."""

    def __init__(self, bad: str, component: float) -> None:
        self.bad, self.component = bad, component

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        return [[self.component, 1.0] if self.bad in text else [1.0, 0.5] for text in texts]


@pytest.mark.parametrize("component", [math.nan, math.inf])
async def test_a_degenerate_embedding_skips_that_event_alone(store, component: float) -> None:  # type: ignore[no-untyped-def]
    """A NaN cosine went to SQLite as NULL, which scores.value refuses: run_once raised and the whole
    claim was retried for ever; PostgreSQL stored the NaN."""
    degenerate = make_event(output="DEGENERATE answer")
    fine = [make_event() for _ in range(2)]
    rows = [to_row(event, [Deferred("similarity")]) for event in (degenerate, *fine)]
    await store.insert_batch(rows)
    worker = SimilarityWorker(store, DegenerateEmbedder("DEGENERATE", component), SETTINGS, WorkerSettings(min_backoff_s=0.01, max_backoff_s=0.02))
    assert await worker.run_once() == 3
    assert await store.pending_count() == 0
    score = similarity_of(await store.get(degenerate.event_id))
    assert score is not None and score.skipped and score.detail == "skipped: embedding not finite" and score.value == 0.0
    for event in fine:
        score = similarity_of(await store.get(event.event_id))
        assert score is not None and not score.skipped and math.isfinite(score.value) and score.value > 0


def test_reference_similarity_of_a_degenerate_embedding_is_skipped() -> None:
    from sluice_evaluation_logging.evaluators import reference_similarity

    score = reference_similarity.score([math.nan, 1.0], [1.0, 0.0], 0.5)
    assert score.skipped and score.detail == "skipped: embedding not finite"
    assert reference_similarity.score([1.0, 0.0], [1.0, 0.0], 0.5).value == 1.0


async def test_consumer_and_worker_over_rabbitmq_store_each_event_and_score_once(tmp_path, adapter) -> None:  # type: ignore[no-untyped-def]
    topology = EventTopology(f"sluice-unit-{uuid.uuid4().hex[:8]}")
    publisher = ConfirmingPublisher(
        AMQP_URL,
        topology.events_exchange,
        topology.declare,
        PublisherMetrics.get("test_unit_similarity_publisher"),
        spill_path=tmp_path / "spill",
    )
    events = [make_event() for _ in range(120)]
    for event in [*events, events[0], events[1]]:  # two redeliveries
        publisher.submit(OutgoingMessage(event.SerializeToString(), "completion.v1", event.event_id, event.request_id))
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    worker = worker_for(store, adapter, poll_s=5.0)  # a long poll: only the consumer's nudge is fast
    consumer = CompletionConsumer(
        ConsumerSettings(AMQP_URL, topology, prefetch=64, batch_max=32, batch_delay_s=0.02),
        store,
        EvalContext(SETTINGS, adapter.embedder, defer_model_calls=True),  # type: ignore[attr-defined]
        on_pending=worker.nudge,
    )
    publisher.start()
    consumer.start()
    worker.start()
    try:

        async def all_scored() -> bool:
            return await store.count() == 120 and await store.pending_count() == 0

        await wait_for(all_scored, 30)
        page, _ = await store.query(RecordFilter(tenant="demo"), 1000, "")
        assert len(page) == 120 and all(similarity_of(r) is not None and not similarity_of(r).skipped for r in page)
        assert sum(adapter.calls) == 240 and len(adapter.calls) < 120  # batched, one text pair per event
    finally:
        await consumer.stop()
        await worker.stop()
        await publisher.stop(2)
        await store.close()
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await topology.delete(await connection.channel())


async def test_the_worker_gives_way_to_a_busy_consumer_but_still_progresses(store, adapter) -> None:  # type: ignore[no-untyped-def]
    events = [make_event() for _ in range(3)]
    await store.insert_batch(await consume_path_rows(events, adapter))
    busy = True
    worker = SimilarityWorker(
        store,
        adapter.embedder,
        SETTINGS,  # type: ignore[attr-defined]
        WorkerSettings(batch_max=2, poll_s=0.05, max_pause_s=0.4),
        busy=lambda: busy,
    )
    started = asyncio.get_running_loop().time()
    worker.start()
    try:

        async def first_batch() -> bool:
            return await store.pending_count() < 3

        await wait_for(first_batch, 5)
        assert asyncio.get_running_loop().time() - started >= 0.35  # it waited for the consumer first
        busy = False

        async def all_done() -> bool:
            return await store.pending_count() == 0

        await wait_for(all_done, 5)
    finally:
        await worker.stop()


async def test_a_failed_deferred_batch_is_logged_with_its_traceback() -> None:
    """The store down (or a bug) fails a pass of the worker, which retries later: its line had only
    the error's repr, no traceback."""
    from structlog.testing import capture_logs

    worker = SimilarityWorker(None, None, SETTINGS, WorkerSettings(poll_s=0.05))  # type: ignore[arg-type]

    async def broken() -> int:
        worker._stopping.set()  # one pass only
        raise ConnectionError("database down")

    worker.run_once = broken  # type: ignore[method-assign]
    with capture_logs() as logs:
        await asyncio.wait_for(worker._run(), 5)
    (line,) = [e for e in logs if e["event"] == "deferred_batch_failed"]
    assert line["error"] == "ConnectionError: database down" and isinstance(line["exc_info"], ConnectionError)
