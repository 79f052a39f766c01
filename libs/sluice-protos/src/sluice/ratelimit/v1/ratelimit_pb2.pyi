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

class Budget(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUDGET_UNSPECIFIED: _ClassVar[Budget]
    BUDGET_REQUESTS_PER_MINUTE: _ClassVar[Budget]
    BUDGET_TOKENS_PER_MINUTE: _ClassVar[Budget]
    BUDGET_REQUESTS_IN_FLIGHT: _ClassVar[Budget]
    BUDGET_TOKENS_IN_FLIGHT: _ClassVar[Budget]
    BUDGET_MODEL_CAPACITY: _ClassVar[Budget]
BUDGET_UNSPECIFIED: Budget
BUDGET_REQUESTS_PER_MINUTE: Budget
BUDGET_TOKENS_PER_MINUTE: Budget
BUDGET_REQUESTS_IN_FLIGHT: Budget
BUDGET_TOKENS_IN_FLIGHT: Budget
BUDGET_MODEL_CAPACITY: Budget

class BudgetStatus(_message.Message):
    __slots__ = ("budget", "limit", "remaining", "reset_after")
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    REMAINING_FIELD_NUMBER: _ClassVar[int]
    RESET_AFTER_FIELD_NUMBER: _ClassVar[int]
    budget: Budget
    limit: int
    remaining: int
    reset_after: _duration_pb2.Duration
    def __init__(self, budget: _Optional[_Union[Budget, str]] = ..., limit: _Optional[int] = ..., remaining: _Optional[int] = ..., reset_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("tenant", "model", "priority_class", "requests", "reserved_tokens", "request_id", "lease_ttl")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_CLASS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    priority_class: _types_pb2.PriorityClass
    requests: int
    reserved_tokens: int
    request_id: str
    lease_ttl: _duration_pb2.Duration
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., priority_class: _Optional[_Union[_types_pb2.PriorityClass, str]] = ..., requests: _Optional[int] = ..., reserved_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("allowed", "lease_id", "lease_expires_at", "budgets", "denied_by", "retry_after", "shadow", "degraded", "exceeds_limit", "lease_ttl")
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    DENIED_BY_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    EXCEEDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    allowed: bool
    lease_id: str
    lease_expires_at: _timestamp_pb2.Timestamp
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetStatus]
    denied_by: Budget
    retry_after: _duration_pb2.Duration
    shadow: bool
    degraded: bool
    exceeds_limit: bool
    lease_ttl: _duration_pb2.Duration
    def __init__(self, allowed: _Optional[bool] = ..., lease_id: _Optional[str] = ..., lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., budgets: _Optional[_Iterable[_Union[BudgetStatus, _Mapping]]] = ..., denied_by: _Optional[_Union[Budget, str]] = ..., retry_after: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., shadow: _Optional[bool] = ..., degraded: _Optional[bool] = ..., exceeds_limit: _Optional[bool] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "used_tokens")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    used_tokens: int
    def __init__(self, lease_id: _Optional[str] = ..., used_tokens: _Optional[int] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("budgets",)
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetStatus]
    def __init__(self, budgets: _Optional[_Iterable[_Union[BudgetStatus, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ttl")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl: _duration_pb2.Duration
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_expires_at", "lease_ttl")
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_FIELD_NUMBER: _ClassVar[int]
    lease_expires_at: _timestamp_pb2.Timestamp
    lease_ttl: _duration_pb2.Duration
    def __init__(self, lease_expires_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., lease_ttl: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "model", "budgets")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUDGETS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    model: str
    budgets: _containers.RepeatedCompositeFieldContainer[BudgetStatus]
    def __init__(self, tenant: _Optional[str] = ..., model: _Optional[str] = ..., budgets: _Optional[_Iterable[_Union[BudgetStatus, _Mapping]]] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("usage", "limits_version", "limits_error")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_ERROR_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    limits_version: str
    limits_error: str
    def __init__(self, usage: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., limits_version: _Optional[str] = ..., limits_error: _Optional[str] = ...) -> None: ...
