import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from sluice.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompletionEvent(_message.Message):
    __slots__ = ("event_id", "request_id", "client_request_id", "tenant", "model", "priority_class", "messages", "prompt", "output", "text_logged", "sampling", "response_format", "finish_reason", "usage", "timings", "started_at", "finished_at", "job_id", "custom_id", "error_code", "user", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TEXT_LOGGED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    request_id: str
    client_request_id: str
    tenant: str
    model: str
    priority_class: _types_pb2.PriorityClass
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    prompt: str
    output: str
    text_logged: bool
    sampling: _types_pb2.SamplingParams
    response_format: _types_pb2.ResponseFormat
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    timings: _types_pb2.Timings
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    job_id: str
    custom_id: str
    error_code: str
    user: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, event_id: _Optional[str] = ..., request_id: _Optional[str] = ..., client_request_id: _Optional[str] = ..., tenant: _Optional[str] = ..., model: _Optional[str] = ..., priority_class: _Optional[_Union[_types_pb2.PriorityClass, str]] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., output: _Optional[str] = ..., text_logged: _Optional[bool] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., response_format: _Optional[_Union[_types_pb2.ResponseFormat, str]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_types_pb2.Timings, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., job_id: _Optional[str] = ..., custom_id: _Optional[str] = ..., error_code: _Optional[str] = ..., user: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...
