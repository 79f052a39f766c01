import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from sluice.common.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_VALIDATING: _ClassVar[JobState]
    JOB_STATE_IN_PROGRESS: _ClassVar[JobState]
    JOB_STATE_FINALIZING: _ClassVar[JobState]
    JOB_STATE_COMPLETED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_EXPIRED: _ClassVar[JobState]
    JOB_STATE_CANCELLING: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_VALIDATING: JobState
JOB_STATE_IN_PROGRESS: JobState
JOB_STATE_FINALIZING: JobState
JOB_STATE_COMPLETED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_EXPIRED: JobState
JOB_STATE_CANCELLING: JobState
JOB_STATE_CANCELLED: JobState

class GenerateRow(_message.Message):
    __slots__ = ("model", "messages", "prompt", "sampling", "response_format", "tool_use", "prompt_token_ids", "user", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    TOOL_USE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[_types_pb2.ChatMessage]
    prompt: str
    sampling: _types_pb2.SamplingParams
    response_format: _types_pb2.ResponseFormat
    tool_use: _types_pb2.ToolUse
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    user: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_types_pb2.ChatMessage, _Mapping]]] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., response_format: _Optional[_Union[_types_pb2.ResponseFormat, str]] = ..., tool_use: _Optional[_Union[_types_pb2.ToolUse, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., user: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class EmbedRow(_message.Message):
    __slots__ = ("model", "inputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[str]] = ...) -> None: ...

class JobRow(_message.Message):
    __slots__ = ("custom_id", "generate", "embed")
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    custom_id: str
    generate: GenerateRow
    embed: EmbedRow
    def __init__(self, custom_id: _Optional[str] = ..., generate: _Optional[_Union[GenerateRow, _Mapping]] = ..., embed: _Optional[_Union[EmbedRow, _Mapping]] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("job_id", "api_key", "rows", "reply_to", "completion_window")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_WINDOW_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    api_key: str
    rows: _containers.RepeatedCompositeFieldContainer[JobRow]
    reply_to: str
    completion_window: _duration_pb2.Duration
    def __init__(self, job_id: _Optional[str] = ..., api_key: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[JobRow, _Mapping]]] = ..., reply_to: _Optional[str] = ..., completion_window: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AdmittedJob(_message.Message):
    __slots__ = ("job", "tenant", "text_logging")
    JOB_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TEXT_LOGGING_FIELD_NUMBER: _ClassVar[int]
    job: JobRequest
    tenant: str
    text_logging: bool
    def __init__(self, job: _Optional[_Union[JobRequest, _Mapping]] = ..., tenant: _Optional[str] = ..., text_logging: _Optional[bool] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "tenant", "state", "total_rows", "completed_rows", "failed_rows", "created_at", "updated_at", "error", "expires_at")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_ROWS_FIELD_NUMBER: _ClassVar[int]
    FAILED_ROWS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant: str
    state: JobState
    total_rows: int
    completed_rows: int
    failed_rows: int
    created_at: _timestamp_pb2.Timestamp
    updated_at: _timestamp_pb2.Timestamp
    error: str
    expires_at: _timestamp_pb2.Timestamp
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., total_rows: _Optional[int] = ..., completed_rows: _Optional[int] = ..., failed_rows: _Optional[int] = ..., created_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., updated_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RowError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class RowResult(_message.Message):
    __slots__ = ("job_id", "custom_id", "output", "embeddings", "finish_reason", "usage", "error", "request_id", "choices", "tool_calls")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    custom_id: str
    output: str
    embeddings: _containers.RepeatedCompositeFieldContainer[_types_pb2.Embedding]
    finish_reason: _types_pb2.FinishReason
    usage: _types_pb2.Usage
    error: RowError
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[RowChoice]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolCall]
    def __init__(self, job_id: _Optional[str] = ..., custom_id: _Optional[str] = ..., output: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[_types_pb2.Embedding, _Mapping]]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_types_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[RowError, _Mapping]] = ..., request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[RowChoice, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_types_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class RowChoice(_message.Message):
    __slots__ = ("index", "text", "finish_reason", "logprobs", "tool_calls")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    finish_reason: _types_pb2.FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprob]
    tool_calls: _containers.RepeatedCompositeFieldContainer[_types_pb2.ToolCall]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprob, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[_types_pb2.ToolCall, _Mapping]]] = ...) -> None: ...

class JobRejection(_message.Message):
    __slots__ = ("job_id", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RowTask(_message.Message):
    __slots__ = ("job_id", "tenant", "row", "reply_to", "text_logging", "reply_content_type")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    TEXT_LOGGING_FIELD_NUMBER: _ClassVar[int]
    REPLY_CONTENT_TYPE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    tenant: str
    row: JobRow
    reply_to: str
    text_logging: bool
    reply_content_type: str
    def __init__(self, job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., row: _Optional[_Union[JobRow, _Mapping]] = ..., reply_to: _Optional[str] = ..., text_logging: _Optional[bool] = ..., reply_content_type: _Optional[str] = ...) -> None: ...
