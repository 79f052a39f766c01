"""The query side, without transport: tenant scoping, filters, paging limits."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import replace

from sluice_common.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from sluice_evaluation_logging.model import RecordFilter, RecordRow
from sluice_evaluation_logging.records import GroupSummary, summarize
from sluice_evaluation_logging.store import Store, database_outage

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000
# Each metadata pair and each score threshold is a subquery of the statement: SQLite refuses a
# statement past its expression-depth limit ("Expression tree is too large", at ~1000 of them),
# and no real question needs more than a few.
MAX_METADATA_PAIRS = 16
MAX_THRESHOLDS = 16
# The most records one Summarize reads. Its latency percentiles need every record's row, read in
# one transaction: on SQLite the one connection's, which the consumer's inserts wait for. 50k
# records (and their scores, aggregated by the database) are well under a second there and ~15 MB
# here; a window that holds more is refused rather than sampled, so no summary is partial.
MAX_SUMMARY_RECORDS = 50_000


def scoped_tenant(caller: str, asked: str) -> str:
    """A tenant's key sees only that tenant's records."""
    if asked and asked != caller:
        raise PermissionDenied(f"this API key belongs to tenant {caller!r} and cannot read tenant {asked!r}")
    return caller


def _filter(caller: str, asked: RecordFilter) -> RecordFilter:
    """The request's filter, checked and scoped to the caller's tenant: what the store is handed."""
    if asked.start is not None and asked.end is not None and asked.end <= asked.start:
        raise InvalidArgument("end_time", "must be after start_time")
    if len(asked.thresholds) > MAX_THRESHOLDS:
        raise InvalidArgument("score_thresholds", f"{len(asked.thresholds)} thresholds; at most {MAX_THRESHOLDS}")
    if len(asked.metadata) > MAX_METADATA_PAIRS:
        raise InvalidArgument("metadata", f"{len(asked.metadata)} pairs; at most {MAX_METADATA_PAIRS}")
    for index, threshold in enumerate(asked.thresholds):
        if not threshold.name:
            raise InvalidArgument(f"score_thresholds[{index}].name", "must name a score, such as 'repetition'")
        # NaN would compare differently on SQLite (bound as NULL: nothing matches) and PostgreSQL
        # (NaN above every number); an infinite bound is no bound: leave it unset instead.
        for bound, value in (("min_value", threshold.min_value), ("max_value", threshold.max_value)):
            if value is not None and not math.isfinite(value):
                raise InvalidArgument(f"score_thresholds[{index}].{bound}", f"must be a finite number, not {value}")
    for key, _ in asked.metadata:
        if not key:
            raise InvalidArgument("metadata", "a metadata filter's keys must not be empty")
    return replace(asked, tenant=scoped_tenant(caller, asked.tenant))


@contextlib.contextmanager
def _store_outages() -> Iterator[None]:
    """A database that cannot answer now is UNAVAILABLE (the caller may retry), not INTERNAL."""
    try:
        yield
    except Exception as exc:
        if database_outage(exc):
            raise Unavailable(f"the record store cannot answer now ({type(exc).__name__}); try again") from exc
        raise


class EvalLogQueries:
    def __init__(self, store: Store) -> None:
        self._store = store

    async def get_record(self, caller: str, event_id: str) -> RecordRow:
        if not event_id:
            raise InvalidArgument("event_id", "must not be empty")
        with _store_outages():
            row = await self._store.get(event_id)
        # Another tenant's record answers exactly like a missing one: its existence is not revealed.
        if row is None or row.tenant != caller:
            raise NotFound(f"no record with event id {event_id!r}")
        return row

    async def query_records(self, caller: str, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]:
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be in 0..{MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})")
        where = _filter(caller, where)
        with _store_outages():
            return await self._store.query(where, page_size or DEFAULT_PAGE_SIZE, page_token)

    async def summarize(self, caller: str, where: RecordFilter) -> list[GroupSummary]:
        where = _filter(caller, where)
        with _store_outages():
            data = await self._store.summary_data(where, MAX_SUMMARY_RECORDS)
        if len(data.records) > MAX_SUMMARY_RECORDS:
            raise InvalidArgument(
                "start_time",
                f"the window holds more than {MAX_SUMMARY_RECORDS} records, the most one summary reads:"
                " ask for a shorter one (a later start_time, an end_time) or fewer records (a model, a user, metadata)",
            )
        return summarize(data)
