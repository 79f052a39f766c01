"""The same store tests on SQLite and on the running PostgreSQL."""

from __future__ import annotations

import time

import pytest
from sluice.common.v1 import types_pb2

from conftest import make_event
from sluice_common.errors import InvalidArgument, NotFound, PermissionDenied
from sluice_evaluation_logging.evaluators import evaluate_all
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.queries import EvalLogQueries, QueryArgs
from sluice_evaluation_logging.records import to_row
from sluice_evaluation_logging.store import LATEST_VERSION, RecordFilter, Threshold

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


async def test_summaries_and_tenant_isolation(store) -> None:  # type: ignore[no-untyped-def]
    events = [make_event(timings=types_pb2.Timings(time_to_first_token_ms=10 * i, total_time_ms=100 * i)) for i in range(1, 11)]
    events.append(make_event(finish_reason=types_pb2.FINISH_REASON_ERROR, error_code="UNAVAILABLE"))
    events.append(make_event(finish_reason=types_pb2.FINISH_REASON_CANCELLED))
    secret = make_event(tenant="private")
    await store.insert_batch(await rows(*events, secret))
    queries = EvalLogQueries(store)

    (summary,) = await queries.summarize("demo", QueryArgs())
    assert summary.count == 12 and summary.cancelled == 1
    assert abs(summary.error_rate - 1 / 12) < 1e-9
    assert summary.latency(50) == pytest.approx(550) and summary.latency(99) == pytest.approx(991)
    assert summary.input_tokens == 12 * 12
    assert summary.scores["latency_slo"].count == 10

    with pytest.raises(PermissionDenied):
        await queries.query_records("demo", QueryArgs(tenant="private"), 10, "")
    with pytest.raises(PermissionDenied):
        await queries.summarize("demo", QueryArgs(tenant="private"))
    with pytest.raises(NotFound):
        await queries.get_record("demo", secret.event_id)
    assert (await queries.get_record("private", secret.event_id)).tenant == "private"
    page, _ = await queries.query_records("private", QueryArgs(), 0, "")
    assert [r.event_id for r in page] == [secret.event_id]
