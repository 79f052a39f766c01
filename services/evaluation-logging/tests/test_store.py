"""The same store tests on SQLite and on the running PostgreSQL."""

from __future__ import annotations

import base64
import dataclasses
import math
import random
import sqlite3
import time
import uuid
from dataclasses import replace
from pathlib import Path

import asyncpg
import pytest
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, events_pb2

from conftest import PG_DSN, make_event
from sluice_common.channels import PAGE_BYTES
from sluice_common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from sluice_common.sqlstore import open_sql_db
from sluice_evaluation_logging import queries as queries_module
from sluice_evaluation_logging.evaluators import evaluate_all
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings, ScoreResult
from sluice_evaluation_logging.model import RecordFilter, RecordRow, Threshold
from sluice_evaluation_logging.queries import MAX_METADATA_PAIRS, MAX_THRESHOLDS, EvalLogQueries
from sluice_evaluation_logging.records import otel_attributes, to_row
from sluice_evaluation_logging.servicer import _record, _summary
from sluice_evaluation_logging.store import LATEST_VERSION, MIGRATIONS, PostgresStore, SqliteStore, Store, database_outage, refused_for_content

CTX = EvalContext(EvalSettings(similarity_sample_rate=0.0))


async def rows(*events):  # type: ignore[no-untyped-def]
    return [to_row(event, await evaluate_all(event, CTX)) for event in events]


async def test_migrations_are_recorded_and_rerunnable(store) -> None:  # type: ignore[no-untyped-def]
    assert await store.schema_version() == LATEST_VERSION
    await store.close()
    await store.open()  # a second start finds the schema current and changes nothing
    assert await store.schema_version() == LATEST_VERSION


async def test_insert_is_idempotent_by_event_id(store) -> None:  # type: ignore[no-untyped-def]
    a, b = make_event(), make_event()
    assert await store.insert_batch(await rows(a, b)) == 2
    assert await store.insert_batch(await rows(a, b, a)) == 0
    c = make_event()
    assert await store.insert_batch(await rows(c, c)) == 1
    assert await store.count() == 3
    record = await store.get(a.event_id)
    assert record is not None and record.tenant == "demo" and record.input_tokens == 12
    assert {s.name for s in record.scores} >= {"latency_slo", "repetition", "pii"}
    assert len(record.scores) == len({s.name for s in record.scores})
    assert record.stored_at > 0


async def test_query_filters_and_pages_newest_first(store) -> None:  # type: ignore[no-untyped-def]
    base = time.time() - 1000
    events = [make_event(finished_at=base + i) for i in range(7)]
    events.append(make_event(finished_at=base + 3, model="other-model"))
    events.append(make_event(tenant="private", finished_at=base + 4))
    events.append(make_event(finished_at=base + 5, output="the cat sat " * 20, finish_reason=types_pb2.FINISH_REASON_LENGTH))
    await store.insert_batch(await rows(*events))

    seen, token = [], ""
    while True:
        page, token = await store.query(RecordFilter(tenant="demo"), 3, token)
        seen.extend(page)
        if not token:
            break
    assert len(seen) == 9  # not the other tenant's
    assert [r.finished_at for r in seen] == sorted((r.finished_at for r in seen), reverse=True)
    assert len({r.event_id for r in seen}) == 9

    page, _ = await store.query(RecordFilter(tenant="demo", model="other-model"), 50, "")
    assert [r.model for r in page] == ["other-model"]
    page, _ = await store.query(RecordFilter(tenant="demo", start=base + 2, end=base + 4), 50, "")
    assert sorted(r.finished_at for r in page) == [base + 2, base + 3, base + 3]
    page, _ = await store.query(RecordFilter(tenant="demo", finish_reason=types_pb2.FINISH_REASON_LENGTH), 50, "")
    assert len(page) == 1
    repetitive = RecordFilter(tenant="demo", thresholds=(Threshold("repetition", min_value=0.5),))
    page, _ = await store.query(repetitive, 50, "")
    assert len(page) == 1 and page[0].event_id == events[-1].event_id
    failed_repetition = RecordFilter(tenant="demo", thresholds=(Threshold("repetition", passed=False),))
    assert [r.event_id for r in (await store.query(failed_repetition, 50, ""))[0]] == [events[-1].event_id]
    bounded = RecordFilter(tenant="demo", thresholds=(Threshold("latency_slo", min_value=0, max_value=100),))
    assert (await store.query(bounded, 50, ""))[0] == []
    with pytest.raises(InvalidArgument):
        await store.query(RecordFilter(tenant="demo"), 3, "garbage!")


async def test_a_page_of_long_records_stays_under_the_grpc_message_limit(store) -> None:  # type: ignore[no-untyped-def]
    """A thousand records of long answers would make a response over gRPC's 4 MiB default, which
    clients refuse: a page stops short of PAGE_BYTES and the token resumes after its last record."""
    base = time.time() - 100
    long_ones = [make_event(finished_at=base + i, output="x" * 1_200_000) for i in range(7)]
    huge = make_event(finished_at=base + 10, output="y" * 3_500_000)  # alone over the budget: a page by itself
    await store.insert_batch(await rows(*long_ones, huge))
    queries = EvalLogQueries(store)
    pages, token = [], ""
    while True:
        page, token = await queries.query_records("demo", RecordFilter(), 1000, token)
        pages.append(page)
        if not token:
            break
    assert [len(page) for page in pages] == [1, 2, 2, 2, 1]
    assert [r.event_id for page in pages for r in page] == [e.event_id for e in (huge, *reversed(long_ones))]
    for page in pages[1:]:
        response = evallog_pb2.QueryRecordsResponse(records=[_record(r) for r in page], next_page_token="t" * 100)
        assert response.ByteSize() < PAGE_BYTES


async def test_summaries_and_tenant_isolation(store) -> None:  # type: ignore[no-untyped-def]
    events = [make_event(timings=types_pb2.Timings(time_to_first_token_ms=10 * i, total_time_ms=100 * i)) for i in range(1, 11)]
    events.append(make_event(finish_reason=types_pb2.FINISH_REASON_ERROR, error_code="UNAVAILABLE"))
    events.append(make_event(finish_reason=types_pb2.FINISH_REASON_CANCELLED))
    secret = make_event(tenant="private")
    await store.insert_batch(await rows(*events, secret))
    queries = EvalLogQueries(store)

    (summary,) = await queries.summarize("demo", RecordFilter())
    assert summary.count == 12 and summary.cancelled == 1
    assert abs(summary.error_rate - 1 / 12) < 1e-9
    assert summary.latency(50) == pytest.approx(550) and summary.latency(99) == pytest.approx(991)
    assert summary.input_tokens == 12 * 12
    assert summary.scores["latency_slo"].count == 10

    with pytest.raises(PermissionDenied):
        await queries.query_records("demo", RecordFilter(tenant="private"), 10, "")
    with pytest.raises(PermissionDenied):
        await queries.summarize("demo", RecordFilter(tenant="private"))
    with pytest.raises(NotFound):
        await queries.get_record("demo", secret.event_id)
    assert (await queries.get_record("private", secret.event_id)).tenant == "private"
    page, _ = await queries.query_records("private", RecordFilter(), 0, "")
    assert [r.event_id for r in page] == [secret.event_id]


async def test_too_many_metadata_pairs_or_thresholds_are_refused_by_name(store) -> None:  # type: ignore[no-untyped-def]
    # A thousand of them made SQLite refuse the statement ("Expression tree is too large"): INTERNAL.
    event = make_event(metadata={f"k{i}": "v" for i in range(MAX_METADATA_PAIRS)})
    await store.insert_batch(await rows(event))
    queries = EvalLogQueries(store)
    most = RecordFilter(
        metadata=tuple((f"k{i}", "v") for i in range(MAX_METADATA_PAIRS)),
        thresholds=tuple(Threshold("pii", max_value=float(i)) for i in range(MAX_THRESHOLDS)),
    )
    page, _ = await queries.query_records("demo", most, 10, "")
    assert [r.event_id for r in page] == [event.event_id]
    assert (await queries.summarize("demo", replace(most, thresholds=())))[0].count == 1
    for where, field in (
        (RecordFilter(metadata=tuple((f"k{i}", "v") for i in range(1000))), "metadata"),
        (RecordFilter(thresholds=tuple(Threshold("pii", min_value=0) for _ in range(1000))), "score_thresholds"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            await queries.query_records("demo", where, 10, "")
        assert refused.value.field_name == field
    with pytest.raises(InvalidArgument, match="metadata"):
        await queries.summarize("demo", RecordFilter(metadata=tuple((f"k{i}", "v") for i in range(1000))))


@pytest.mark.parametrize("number", [math.nan, math.inf, -math.inf])
async def test_a_non_finite_number_in_a_threshold_or_a_page_token_is_refused(store, number: float) -> None:  # type: ignore[no-untyped-def]
    """NaN compares one way on SQLite (bound as NULL) and another on PostgreSQL: refused on both."""
    await store.insert_batch(await rows(make_event()))
    queries = EvalLogQueries(store)
    for threshold, field in (
        (Threshold("pii", min_value=number), "score_thresholds[1].min_value"),
        (Threshold("pii", max_value=number), "score_thresholds[1].max_value"),
    ):
        with pytest.raises(InvalidArgument) as refused:
            await queries.query_records("demo", RecordFilter(thresholds=(Threshold("pii"), threshold)), 10, "")
        assert refused.value.field_name == field
    forged = base64.urlsafe_b64encode(f"{number!r}|zzz".encode()).decode()
    with pytest.raises(InvalidArgument) as refused:
        await queries.query_records("demo", RecordFilter(), 10, forged)
    assert refused.value.field_name == "page_token"


async def test_score_summaries_are_aggregated_in_the_database(store) -> None:  # type: ignore[no-untyped-def]
    def scored(*scores: ScoreResult, model: str = "m") -> RecordRow:
        return to_row(make_event(model=model), scores)

    await store.insert_batch(
        [
            scored(ScoreResult("cos", 1.0, True), ScoreResult("down", 0.0, False, skipped=True)),
            scored(ScoreResult("cos", -2.0, False), ScoreResult("down", 0.0, False, skipped=True)),
            scored(ScoreResult("cos", 0.5, False, skipped=True)),
            scored(ScoreResult("cos", 7.0, True), model="other"),
        ]
    )
    groups = {g.model: g for g in await EvalLogQueries(store).summarize("demo", RecordFilter())}
    cos = groups["m"].scores["cos"]
    assert (cos.count, cos.total, cos.passed, cos.skipped, cos.low, cos.high) == (2, -1.0, 1, 1, -2.0, 1.0)
    down = _summary(groups["m"]).scores[1]
    assert (down.name, down.count, down.skipped_count, down.mean, down.min, down.max) == ("down", 0, 2, 0.0, 0.0, 0.0)
    assert groups["m"].count == 3 and groups["other"].scores["cos"].total == 7.0


async def test_a_summary_of_more_records_than_it_reads_is_refused(store, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Percentiles need every record's row, read in one transaction (on SQLite the one the consumer's
    inserts wait for): a window over MAX_SUMMARY_RECORDS is refused, not read or sampled."""
    monkeypatch.setattr(queries_module, "MAX_SUMMARY_RECORDS", 5)
    base = time.time() - 100
    await store.insert_batch(await rows(*(make_event(finished_at=base + i) for i in range(6))))
    queries = EvalLogQueries(store)
    with pytest.raises(InvalidArgument) as refused:
        await queries.summarize("demo", RecordFilter())
    assert refused.value.field_name == "start_time" and "more than 5 records" in refused.value.reason
    (summary,) = await queries.summarize("demo", RecordFilter(start=base + 1))  # five: summarized
    assert summary.count == 5 and summary.scores["pii"].count == 5


def cached_usage(prompt: int, cached: int) -> types_pb2.Usage:
    return types_pb2.Usage(prompt_tokens=prompt, completion_tokens=8, total_tokens=prompt + 8, cached_tokens=cached)


async def test_the_prompt_tokens_served_from_the_prefix_cache_are_stored_returned_and_summed(store) -> None:  # type: ignore[no-untyped-def]
    base = time.time() - 100
    first = make_event(usage=cached_usage(200, 0), finished_at=base)
    again = make_event(usage=cached_usage(200, 192), finished_at=base + 1)
    other = make_event(usage=cached_usage(30, 16), finished_at=base + 2, model="other-model")
    await store.insert_batch(await rows(first, again, other))
    stored = await store.get(again.event_id)
    assert stored is not None and (stored.input_tokens, stored.cached_tokens) == (200, 192)
    page, _ = await store.query(RecordFilter(tenant="demo"), 10, "")
    assert [r.cached_tokens for r in page] == [16, 192, 0]  # newest first
    # The query API's record: the stored event's usage says it.
    assert _record(stored).event.usage.cached_tokens == 192
    # The consumer's log line, in the OpenTelemetry GenAI conventions' name (part of input_tokens).
    assert otel_attributes(again)["gen_ai.usage.cache_read.input_tokens"] == 192

    summaries = {s.model: s for s in await EvalLogQueries(store).summarize("demo", RecordFilter())}
    assert (summaries["smollm2-135m-instruct"].input_tokens, summaries["smollm2-135m-instruct"].cached_tokens) == (400, 192)
    assert summaries["other-model"].cached_tokens == 16
    summary = _summary(summaries["smollm2-135m-instruct"])
    assert (summary.prompt_tokens, summary.cached_tokens) == (400, 192)


@pytest.mark.parametrize("applied", [1, 2])
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_a_database_of_an_older_schema_opens_migrated_with_its_records(backend: str, applied: int, tmp_path: Path) -> None:
    """A store written before migration 3 (no cached_tokens column; before 2, no pending_scores and
    the scores index 2 drops) opens, keeps its records (none cached: their events predate the
    count) and stores new ones with the count and their pending markers."""
    dsn = PG_DSN if backend == "postgresql" else ""
    schema = f"evallog_test_{uuid.uuid4().hex[:10]}"
    path = tmp_path / "evallog.sqlite3"
    old_event = make_event(usage=cached_usage(12, 0))
    old = open_sql_db(dsn, path, schema, MIGRATIONS[:applied])
    await old.open()
    try:
        async with old.transaction() as tx:
            columns = (
                "event_id, tenant, model, priority_class, request_id, finish_reason, error_code, input_tokens, output_tokens,"
                " latency_ms, ttft_ms, started_at, finished_at, stored_at, text_logged, event"
            )
            await tx.execute(
                f"INSERT INTO records ({columns}) VALUES (?, 'demo', 'smollm2-135m-instruct', 1, 'r', 1, '', 12, 8, 600.0, 120.0, ?, ?, ?, ?, ?)",
                old_event.event_id, time.time() - 10, time.time() - 10, time.time() - 10, True, old_event.SerializeToString(),
            )  # fmt: skip
    finally:
        await old.close()

    store: Store = PostgresStore(dsn, schema) if dsn else SqliteStore(path)
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION == 5
        kept = await store.get(old_event.event_id)
        assert kept is not None and (kept.input_tokens, kept.cached_tokens) == (12, 0)
        new_event = make_event(usage=cached_usage(40, 32))
        assert await store.insert_batch([replace(row, pending=("similarity",)) for row in await rows(new_event)]) == 1
        stored = await store.get(new_event.event_id)
        assert stored is not None and stored.cached_tokens == 32
        assert await store.pending_count("similarity") == 1
        (summary,) = await EvalLogQueries(store).summarize("demo", RecordFilter())
        assert (summary.count, summary.input_tokens, summary.cached_tokens) == (2, 52, 32)
    finally:
        await store.close()
        if dsn:
            connection = await asyncpg.connect(PG_DSN)
            await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await connection.close()


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_migration_4_adds_trace_ids(backend: str, tmp_path: Path) -> None:
    """A store written before migration 4 opens with its records (no trace id) and stores and
    returns the trace id of new ones."""
    dsn, schema, path, old_event = await _a_record_stored_at(3, backend, tmp_path)
    store: Store = PostgresStore(dsn, schema) if dsn else SqliteStore(path)
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION == 5
        kept = await store.get(old_event.event_id)
        assert kept is not None and kept.trace_id == ""
        new_event = make_event()
        trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
        (row,) = await rows(new_event)
        assert await store.insert_batch([dataclasses.replace(row, trace_id=trace_id)]) == 1
        stored = await store.get(new_event.event_id)
        assert stored is not None and stored.trace_id == trace_id
        page, _ = await store.query(RecordFilter(tenant="demo"), 10, "")
        assert {r.event_id: r.trace_id for r in page} == {old_event.event_id: "", new_event.event_id: trace_id}
    finally:
        await store.close()
        if dsn:
            connection = await asyncpg.connect(PG_DSN)
            await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await connection.close()


async def test_the_end_user_and_metadata_are_stored_filtered_on_and_returned(store) -> None:  # type: ignore[no-untyped-def]
    alice_eval = make_event(user="alice", metadata={"run": "eval-7", "team": "search"})
    alice_prod = make_event(user="alice", metadata={"run": "prod"})
    bob = make_event(user="bob", metadata={"run": "eval-7"})
    nobody = make_event()
    private = make_event(tenant="private", user="alice", metadata={"run": "eval-7"})
    assert await store.insert_batch(await rows(alice_eval, alice_prod, bob, nobody, private)) == 5
    queries = EvalLogQueries(store)

    async def found(**where: object) -> set[str]:
        page, _ = await queries.query_records("demo", RecordFilter(**where), 0, "")  # type: ignore[arg-type]
        return {row.event_id for row in page}

    assert await found(user="alice") == {alice_eval.event_id, alice_prod.event_id}
    assert await found(metadata=(("run", "eval-7"),)) == {alice_eval.event_id, bob.event_id}
    assert await found(user="alice", metadata=(("run", "eval-7"),)) == {alice_eval.event_id}
    # Every pair must match: a key=value the record lacks (or has with another value) excludes it.
    assert await found(metadata=(("run", "eval-7"), ("team", "search"))) == {alice_eval.event_id}
    assert await found(metadata=(("run", "eval-7"), ("team", "ads"))) == set()
    assert await found(metadata=(("team", "eval-7"),)) == set()
    assert await found(user="carol") == set()
    assert len(await found()) == 4  # no filter: every record of the tenant, with or without either
    with pytest.raises(InvalidArgument):
        await found(metadata=(("", "eval-7"),))
    # Summaries take the same filters.
    (summary,) = await queries.summarize("demo", RecordFilter(user="alice"))
    assert summary.count == 2
    (summary,) = await queries.summarize("demo", RecordFilter(metadata=(("run", "eval-7"),)))
    assert summary.count == 2
    assert await queries.summarize("demo", RecordFilter(user="alice", metadata=(("run", "none"),))) == []
    record = _record(await queries.get_record("demo", alice_eval.event_id))
    assert (record.event.user, dict(record.event.metadata)) == ("alice", {"run": "eval-7", "team": "search"})
    page, _ = await queries.query_records("demo", RecordFilter(user="bob"), 0, "")
    assert [(_record(r).event.user, dict(_record(r).event.metadata)) for r in page] == [("bob", {"run": "eval-7"})]


async def test_a_score_bound_not_set_is_no_bound_so_negative_scores_are_found(store) -> None:  # type: ignore[no-untyped-def]
    """An unset min_value was read as 0: asking for failed similarity scores left out the negative
    ones, the worst answers."""
    from sluice.evallog.v1 import evallog_pb2

    from sluice_evaluation_logging.evaluators.base import ScoreResult
    from sluice_evaluation_logging.servicer import thresholds

    def with_similarity(value: float) -> tuple[object, object]:
        event = make_event()
        return event, to_row(event, [ScoreResult("similarity", value, passed=value >= 0.2)])

    worst, weak, good = with_similarity(-0.08), with_similarity(0.05), with_similarity(0.9)
    assert await store.insert_batch([worst[1], weak[1], good[1]]) == 3
    queries = EvalLogQueries(store)

    async def found(*asked: evallog_pb2.ScoreThreshold) -> set[str]:
        page, _ = await queries.query_records("demo", RecordFilter(thresholds=thresholds(asked)), 0, "")
        return {row.event_id for row in page}

    failed = evallog_pb2.ScoreThreshold(name="similarity", passed=False)
    assert await found(failed) == {worst[0].event_id, weak[0].event_id}
    assert await found(evallog_pb2.ScoreThreshold(name="similarity", max_value=0.0)) == {worst[0].event_id}
    assert await found(evallog_pb2.ScoreThreshold(name="similarity", min_value=0.0)) == {weak[0].event_id, good[0].event_id}


async def test_a_nul_in_the_end_user_metadata_or_output_is_stored_and_found(store) -> None:  # type: ignore[no-untyped-def]
    """PostgreSQL's text cannot hold NUL: such a value failed its whole batch on every retry, and
    every later batch waited behind it. Stored there as U+FFFD, and found by the value as sent."""
    odd = make_event(user="a\x00b", metadata={"k\x00": "v\x00"}, output="before\x00after " * 4)
    assert await store.insert_batch(await rows(odd, make_event())) == 2
    queries = EvalLogQueries(store)
    page, _ = await queries.query_records("demo", RecordFilter(user="a\x00b", metadata=(("k\x00", "v\x00"),)), 0, "")
    assert [row.event_id for row in page] == [odd.event_id]
    record = _record(page[0])  # the event as received, NUL and all
    assert (record.event.user, dict(record.event.metadata), record.event.output) == ("a\x00b", {"k\x00": "v\x00"}, odd.output)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
async def test_migration_5_adds_end_users_and_metadata(backend: str, tmp_path: Path) -> None:
    """A store written before migration 5 opens with its records (no user, no metadata: matched by
    no such filter) and stores, filters on and returns those of new ones."""
    dsn, schema, path, old_event = await _a_record_stored_at(4, backend, tmp_path)
    store: Store = PostgresStore(dsn, schema) if dsn else SqliteStore(path)
    await store.open()
    try:
        assert await store.schema_version() == LATEST_VERSION == 5
        kept = await store.get(old_event.event_id)
        assert kept is not None and kept.user == ""
        new_event = make_event(user="u-1", metadata={"k": "v"})
        assert await store.insert_batch(await rows(new_event)) == 1
        for where in (RecordFilter(tenant="demo", user="u-1"), RecordFilter(tenant="demo", metadata=(("k", "v"),))):
            page, _ = await store.query(where, 10, "")
            assert [r.event_id for r in page] == [new_event.event_id]
            assert dict(_record(page[0]).event.metadata) == {"k": "v"} and page[0].user == "u-1"
        page, _ = await store.query(RecordFilter(tenant="demo"), 10, "")
        assert {r.event_id for r in page} == {old_event.event_id, new_event.event_id}
    finally:
        await store.close()
        if dsn:
            connection = await asyncpg.connect(PG_DSN)
            await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
            await connection.close()


async def _a_record_stored_at(version: int, backend: str, tmp_path: Path) -> tuple[str, str, Path, events_pb2.CompletionEvent]:
    """A store at schema `version` (3 or 4) holding one record written as that version wrote it:
    (dsn, schema, SQLite path, the record's event)."""
    dsn = PG_DSN if backend == "postgresql" else ""
    schema = f"evallog_test_{uuid.uuid4().hex[:10]}"
    path = tmp_path / "evallog.sqlite3"
    old_event = make_event()
    old = open_sql_db(dsn, path, schema, MIGRATIONS[:version])
    await old.open()
    try:
        async with old.transaction() as tx:
            columns = (
                "event_id, tenant, model, priority_class, request_id, finish_reason, error_code, input_tokens, output_tokens,"
                " latency_ms, ttft_ms, started_at, finished_at, stored_at, text_logged, event, cached_tokens"
            ) + (", trace_id" if version >= 4 else "")
            values = "?, 'demo', 'smollm2-135m-instruct', 1, 'r', 1, '', 12, 8, 600.0, 120.0, ?, ?, ?, ?, ?, 0" + (", ''" if version >= 4 else "")
            then = time.time() - 10
            await tx.execute(
                f"INSERT INTO records ({columns}) VALUES ({values})", old_event.event_id, then, then, then, True, old_event.SerializeToString()
            )
    finally:
        await old.close()
    return dsn, schema, path, old_event


async def test_a_record_the_database_cannot_hold_is_a_content_refusal(store) -> None:  # type: ignore[no-untyped-def]
    # PostgreSQL refuses an index entry over ~8 kB (54000), whatever the retries: the consumer
    # must dead-letter such an event, not retry its batch for ever.
    huge = random.Random(7).randbytes(10_000).hex()  # random: no compression brings it under the limit
    row = (await rows(make_event(user=huge)))[0]
    if isinstance(store, SqliteStore):
        assert await store.insert_batch([row]) == 1  # SQLite has no such limit
    else:
        with pytest.raises(Exception) as refused:
            await store.insert_batch([row])
        assert refused_for_content(refused.value)


async def test_a_locked_database_answers_unavailable_not_internal(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "evallog.sqlite3")
    await store.open()
    try:
        event = make_event()
        await store.insert_batch(await rows(event))
        queries = EvalLogQueries(store)
        await store._sqlite.run(lambda db: db.execute("PRAGMA busy_timeout = 50"))  # not the 30 s
        other = sqlite3.connect(store.path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            with pytest.raises(Unavailable, match="OperationalError"):
                await queries.get_record("demo", event.event_id)
            with pytest.raises(Unavailable, match="OperationalError"):
                await queries.query_records("demo", RecordFilter(), 10, "")
            with pytest.raises(Unavailable, match="OperationalError"):
                await queries.summarize("demo", RecordFilter())
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert (await queries.get_record("demo", event.event_id)).event_id == event.event_id  # and answers again
    finally:
        await store.close()


def test_what_is_a_database_outage() -> None:
    with pytest.raises(sqlite3.OperationalError) as bug:
        sqlite3.connect(":memory:").execute("SELECT * FROM no_such_table")
    assert not database_outage(bug.value)  # a bug in a statement: INTERNAL
    for outage in (
        ConnectionRefusedError(),
        TimeoutError(),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
    ):
        assert database_outage(outage), outage
    assert not database_outage(asyncpg.exceptions.UndefinedTableError("relation does not exist"))
    assert not database_outage(ValueError())


def test_a_database_failure_is_not_a_content_refusal() -> None:
    assert not refused_for_content(sqlite3.OperationalError("database is locked"))
    assert not refused_for_content(ConnectionResetError())
    assert refused_for_content(sqlite3.IntegrityError("NOT NULL constraint failed: records.latency_ms"))
