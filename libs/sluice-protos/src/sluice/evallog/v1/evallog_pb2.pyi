import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from sluice.common.v1 import types_pb2 as _types_pb2
from sluice.evallog.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Score(_message.Message):
    __slots__ = ("name", "value", "passed", "detail", "skipped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    passed: bool
    detail: str
    skipped: bool
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ..., passed: _Optional[bool] = ..., detail: _Optional[str] = ..., skipped: _Optional[bool] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("event", "scores", "stored_at", "trace_id")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.CompletionEvent
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    stored_at: _timestamp_pb2.Timestamp
    trace_id: str
    def __init__(self, event: _Optional[_Union[_events_pb2.CompletionEvent, _Mapping]] = ..., scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ..., stored_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., trace_id: _Optional[str] = ...) -> None: ...

class GetRecordRequest(_message.Message):
    __slots__ = ("event_id",)
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    def __init__(self, event_id: _Optional[str] = ...) -> None: ...

class GetRecordResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: Record
    def __init__(self, record: _Optional[_Union[Record, _Mapping]] = ...) -> None: ...

class ScoreThreshold(_message.Message):
    __slots__ = ("name", "min_value", "max_value", "passed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MIN_VALUE_FIELD_NUMBER: _ClassVar[int]
    MAX_VALUE_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    name: str
    min_value: float
    max_value: float
    passed: bool
    def __init__(self, name: _Optional[str] = ..., min_value: _Optional[float] = ..., max_value: _Optional[float] = ..., passed: _Optional[bool] = ...) -> None: ...

class QueryRecordsRequest(_message.Message):
    __slots__ = ("tenant", "model", "start_time", "end_time", "finish_reason", "score_thresholds", "page_size", "page_token", "user", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SCORE_THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    finish_reason: _types_pb2.FinishReason
    score_thresholds: _containers.RepeatedCompositeFieldContainer[ScoreThreshold]
    page_size: int
    page_token: str
    user: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., score_thresholds: _Optional[_Iterable[_Union[ScoreThreshold, _Mapping]]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., user: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class QueryRecordsResponse(_message.Message):
    __slots__ = ("records", "next_page_token")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    next_page_token: str
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class SummarizeRequest(_message.Message):
    __slots__ = ("tenant", "model", "start_time", "end_time", "user", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    END_TIME_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    start_time: _timestamp_pb2.Timestamp
    end_time: _timestamp_pb2.Timestamp
    user: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., user: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class LatencySummary(_message.Message):
    __slots__ = ("p50_ms", "p95_ms", "p99_ms")
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P95_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    p50_ms: float
    p95_ms: float
    p99_ms: float
    def __init__(self, p50_ms: _Optional[float] = ..., p95_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ...) -> None: ...

class ScoreSummary(_message.Message):
    __slots__ = ("name", "count", "mean", "pass_rate", "skipped_count", "min", "max")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_COUNT_FIELD_NUMBER: _ClassVar[int]
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    name: str
    count: int
    mean: float
    pass_rate: float
    skipped_count: int
    min: float
    max: float
    def __init__(self, name: _Optional[str] = ..., count: _Optional[int] = ..., mean: _Optional[float] = ..., pass_rate: _Optional[float] = ..., skipped_count: _Optional[int] = ..., min: _Optional[float] = ..., max: _Optional[float] = ...) -> None: ...

class Summary(_message.Message):
    __slots__ = ("tenant", "model", "count", "error_rate", "latency", "time_to_first_token", "prompt_tokens", "completion_tokens", "scores", "cancelled_count", "cached_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ERROR_RATE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCORES_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_COUNT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    count: int
    error_rate: float
    latency: LatencySummary
    time_to_first_token: LatencySummary
    prompt_tokens: int
    completion_tokens: int
    scores: _containers.RepeatedCompositeFieldContainer[ScoreSummary]
    cancelled_count: int
    cached_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., count: _Optional[int] = ..., error_rate: _Optional[float] = ..., latency: _Optional[_Union[LatencySummary, _Mapping]] = ..., time_to_first_token: _Optional[_Union[LatencySummary, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., scores: _Optional[_Iterable[_Union[ScoreSummary, _Mapping]]] = ..., cancelled_count: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class SummarizeResponse(_message.Message):
    __slots__ = ("summaries",)
    SUMMARIES_FIELD_NUMBER: _ClassVar[int]
    summaries: _containers.RepeatedCompositeFieldContainer[Summary]
    def __init__(self, summaries: _Optional[_Iterable[_Union[Summary, _Mapping]]] = ...) -> None: ...

class ScoreItem(_message.Message):
    __slots__ = ("event", "reference")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    event: _events_pb2.CompletionEvent
    reference: str
    def __init__(self, event: _Optional[_Union[_events_pb2.CompletionEvent, _Mapping]] = ..., reference: _Optional[str] = ...) -> None: ...

class ScoreCompletionsRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ScoredItem(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[Score]
    def __init__(self, scores: _Optional[_Iterable[_Union[Score, _Mapping]]] = ...) -> None: ...

class EvaluatorInfo(_message.Message):
    __slots__ = ("name", "higher_is_better", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    HIGHER_IS_BETTER_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    higher_is_better: bool
    description: str
    def __init__(self, name: _Optional[str] = ..., higher_is_better: _Optional[bool] = ..., description: _Optional[str] = ...) -> None: ...

class ScoreCompletionsResponse(_message.Message):
    __slots__ = ("items", "evaluators")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    EVALUATORS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoredItem]
    evaluators: _containers.RepeatedCompositeFieldContainer[EvaluatorInfo]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoredItem, _Mapping]]] = ..., evaluators: _Optional[_Iterable[_Union[EvaluatorInfo, _Mapping]]] = ...) -> None: ...
