"""The query side, without transport: tenant scoping, filters, paging limits."""

from __future__ import annotations

from dataclasses import replace

from sluice_common.errors import InvalidArgument, NotFound, PermissionDenied
from sluice_evaluation_logging.model import RecordFilter, RecordRow
from sluice_evaluation_logging.records import GroupSummary, summarize
from sluice_evaluation_logging.store import Store

DEFAULT_PAGE_SIZE = 50
MAX_PAGE_SIZE = 1000


def scoped_tenant(caller: str, asked: str) -> str:
    """A tenant's key sees only that tenant's records."""
    if asked and asked != caller:
        raise PermissionDenied(f"this API key belongs to tenant {caller!r} and cannot read tenant {asked!r}")
    return caller


def _filter(caller: str, asked: RecordFilter) -> RecordFilter:
    """The request's filter, checked and scoped to the caller's tenant: what the store is handed."""
    if asked.start is not None and asked.end is not None and asked.end <= asked.start:
        raise InvalidArgument("end_time", "must be after start_time")
    for index, threshold in enumerate(asked.thresholds):
        if not threshold.name:
            raise InvalidArgument(f"score_thresholds[{index}].name", "must name a score, such as 'repetition'")
    for key, _ in asked.metadata:
        if not key:
            raise InvalidArgument("metadata", "a metadata filter's keys must not be empty")
    return replace(asked, tenant=scoped_tenant(caller, asked.tenant))


class EvalLogQueries:
    def __init__(self, store: Store) -> None:
        self._store = store

    async def get_record(self, caller: str, event_id: str) -> RecordRow:
        if not event_id:
            raise InvalidArgument("event_id", "must not be empty")
        row = await self._store.get(event_id)
        # Another tenant's record answers exactly like a missing one: its existence is not revealed.
        if row is None or row.tenant != caller:
            raise NotFound(f"no record with event id {event_id!r}")
        return row

    async def query_records(self, caller: str, where: RecordFilter, page_size: int, page_token: str) -> tuple[list[RecordRow], str]:
        if page_size < 0 or page_size > MAX_PAGE_SIZE:
            raise InvalidArgument("page_size", f"must be in 0..{MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})")
        return await self._store.query(_filter(caller, where), page_size or DEFAULT_PAGE_SIZE, page_token)

    async def summarize(self, caller: str, where: RecordFilter) -> list[GroupSummary]:
        return summarize(await self._store.summary_data(_filter(caller, where)))
