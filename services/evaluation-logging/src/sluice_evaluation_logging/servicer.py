"""sluice.evallog.v1.EvalLogService: thin; queries.py and scoring.py do the work."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import timestamp_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc, events_pb2

from sluice_common.tenants import TenantDirectory, authorization
from sluice_evaluation_logging.evaluators import Offload
from sluice_evaluation_logging.evaluators.base import EvalContext
from sluice_evaluation_logging.model import RecordFilter, RecordRow, Threshold
from sluice_evaluation_logging.queries import EvalLogQueries
from sluice_evaluation_logging.records import GroupSummary
from sluice_evaluation_logging.scoring import ScoreInput, ScoreSlots, evaluator_infos, score_items


def _seconds(timestamp: timestamp_pb2.Timestamp, present: bool) -> float | None:
    return timestamp.seconds + timestamp.nanos / 1e9 if present else None


def thresholds(asked: Iterable[evallog_pb2.ScoreThreshold]) -> tuple[Threshold, ...]:
    """A request's score bounds; a bound not set is none (a score may be negative, or 0)."""
    return tuple(
        Threshold(
            name=t.name,
            min_value=t.min_value if t.HasField("min_value") else None,
            max_value=t.max_value if t.HasField("max_value") else None,
            passed=t.passed if t.HasField("passed") else None,
        )
        for t in asked
    )


def _record(row: RecordRow) -> evallog_pb2.Record:
    event = events_pb2.CompletionEvent()
    event.ParseFromString(row.event)
    stored_at = timestamp_pb2.Timestamp()
    stored_at.FromNanoseconds(int(row.stored_at * 1e9))
    scores = [evallog_pb2.Score(name=s.name, value=s.value, passed=s.passed, detail=s.detail, skipped=s.skipped) for s in row.scores]
    return evallog_pb2.Record(event=event, scores=scores, stored_at=stored_at, trace_id=row.trace_id)


def _summary(group: GroupSummary) -> evallog_pb2.Summary:
    return evallog_pb2.Summary(
        tenant=group.tenant,
        model=group.model,
        count=group.count,
        error_rate=group.error_rate,
        cancelled_count=group.cancelled,
        latency=evallog_pb2.LatencySummary(p50_ms=group.latency(50), p95_ms=group.latency(95), p99_ms=group.latency(99)),
        time_to_first_token=evallog_pb2.LatencySummary(p50_ms=group.ttft(50), p95_ms=group.ttft(95), p99_ms=group.ttft(99)),
        prompt_tokens=group.input_tokens,
        completion_tokens=group.output_tokens,
        cached_tokens=group.cached_tokens,
        scores=[
            evallog_pb2.ScoreSummary(
                name=stats.name,
                count=stats.count,
                mean=stats.total / stats.count if stats.count else 0.0,
                pass_rate=stats.passed / stats.count if stats.count else 0.0,
                skipped_count=stats.skipped,
                min=stats.low if stats.count else 0.0,
                max=stats.high if stats.count else 0.0,
            )
            for stats in sorted(group.scores.values(), key=lambda s: s.name)
        ],
    )


class EvalLogServicer(evallog_pb2_grpc.EvalLogServiceServicer):
    def __init__(
        self, tenants: TenantDirectory, queries: EvalLogQueries, scoring: EvalContext, score_slots: ScoreSlots, offload: Offload | None = None
    ) -> None:
        self._tenants = tenants
        self._queries = queries
        # ScoreCompletions: the evaluators' settings and embedder, and the CPU-heavy ones' pool;
        # each tenant's calls in flight are bounded (SCORE_MAX_CONCURRENT_PER_TENANT).
        self._scoring = scoring
        self._score_slots = score_slots
        self._offload = offload

    def _caller(self, context: grpc.aio.ServicerContext) -> str:
        return self._tenants.authenticate(authorization(context)).name

    async def GetRecord(self, request: evallog_pb2.GetRecordRequest, context: grpc.aio.ServicerContext) -> evallog_pb2.GetRecordResponse:
        row = await self._queries.get_record(self._caller(context), request.event_id)
        return evallog_pb2.GetRecordResponse(record=_record(row))

    async def QueryRecords(self, request: evallog_pb2.QueryRecordsRequest, context: grpc.aio.ServicerContext) -> evallog_pb2.QueryRecordsResponse:
        where = RecordFilter(
            tenant=request.tenant,
            model=request.model,
            start=_seconds(request.start_time, request.HasField("start_time")),
            end=_seconds(request.end_time, request.HasField("end_time")),
            finish_reason=request.finish_reason,
            thresholds=thresholds(request.score_thresholds),
            user=request.user,
            metadata=tuple(sorted(request.metadata.items())),
        )
        rows, token = await self._queries.query_records(self._caller(context), where, request.page_size, request.page_token)
        return evallog_pb2.QueryRecordsResponse(records=[_record(row) for row in rows], next_page_token=token)

    async def Summarize(self, request: evallog_pb2.SummarizeRequest, context: grpc.aio.ServicerContext) -> evallog_pb2.SummarizeResponse:
        where = RecordFilter(
            tenant=request.tenant,
            model=request.model,
            start=_seconds(request.start_time, request.HasField("start_time")),
            end=_seconds(request.end_time, request.HasField("end_time")),
            user=request.user,
            metadata=tuple(sorted(request.metadata.items())),
        )
        groups = await self._queries.summarize(self._caller(context), where)
        return evallog_pb2.SummarizeResponse(summaries=[_summary(group) for group in groups])

    async def ScoreCompletions(
        self, request: evallog_pb2.ScoreCompletionsRequest, context: grpc.aio.ServicerContext
    ) -> evallog_pb2.ScoreCompletionsResponse:
        tenant = self._caller(context)  # any tenant may score; nothing is stored or read
        with self._score_slots.admit(tenant):
            items = [ScoreInput(item.event, item.reference) for item in request.items]
            scored = await score_items(items, self._scoring, self._offload)
        return evallog_pb2.ScoreCompletionsResponse(
            items=[
                evallog_pb2.ScoredItem(
                    scores=[evallog_pb2.Score(name=s.name, value=s.value, passed=s.passed, detail=s.detail, skipped=s.skipped) for s in scores]
                )
                for scores in scored
            ],
            evaluators=[
                evallog_pb2.EvaluatorInfo(name=i.name, higher_is_better=i.higher_is_better, description=i.description) for i in evaluator_infos()
            ],
        )
