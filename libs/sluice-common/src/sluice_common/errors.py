"""Errors that domain code raises; the server interceptor turns each into its gRPC status.

This module does not import grpc on purpose: domain modules raise these and stay
free of transport concerns. `code` is a gRPC status code name.
"""

from __future__ import annotations

# How much of a client's string an error message quotes (clip): enough to recognise it, and never so
# much that the message outgrows gRPC's metadata (16 KiB, where grpc answers RESOURCE_EXHAUSTED
# instead) or a log line.
QUOTED_CHARS = 64


def clip(text: str, limit: int = QUOTED_CHARS) -> str:
    """`text` as an error message or a log line shows it: its first `limit` characters and "…" when
    it is longer. Quote it with !r (repr-escaped) where it is the client's."""
    return text if len(text) <= limit else text[:limit] + "…"


class SluiceError(Exception):
    code = "INTERNAL"
    # Sent beside the status as trailing metadata (gRPC) or as headers (HTTP).
    metadata: tuple[tuple[str, str], ...] = ()

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(SluiceError):
    """A request field is wrong; `field_name` is its path, such as "sampling.max_tokens"."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field_name = field_name
        self.reason = reason


class ContextLengthExceeded(InvalidArgument):
    """The prompt, with the tokens asked for, does not fit the model's context. Worded as OpenAI
    words it (so is vLLM's), which clients and frameworks match to trim a conversation; OpenAI's
    HTTP error code for it is context_length_exceeded."""

    def __init__(self, field_name: str, context_length: int, prompt_tokens: int, max_tokens: int | None) -> None:
        where = "messages" if field_name == "messages" else "prompt"
        if max_tokens is None:  # none asked for: the prompt alone leaves no room
            reason = (
                f"This model's maximum context length is {context_length} tokens. However, your {where} resulted in"
                f" {prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of the {where}."
            )
        else:
            reason = (
                f"This model's maximum context length is {context_length} tokens. However, you requested"
                f" {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the completion)."
                f" Please reduce the length of the {where} or completion."
            )
        super().__init__(field_name, reason)
        self.context_length = context_length
        self.prompt_tokens = prompt_tokens


class Unauthenticated(SluiceError):
    code = "UNAUTHENTICATED"


class PermissionDenied(SluiceError):
    code = "PERMISSION_DENIED"


class NotFound(SluiceError):
    code = "NOT_FOUND"


class ResourceExhausted(SluiceError):
    """Capacity is short; the client may retry after `retry_after_s` seconds. None: the request
    is larger than the allowance itself, no retry can admit it (no RetryInfo is sent)."""

    code = "RESOURCE_EXHAUSTED"

    def __init__(
        self,
        message: str,
        retry_after_s: float | None = 1.0,
        quota_subject: str = "",
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.quota_subject = quota_subject
        # The budgets' x-ratelimit-* figures, when a rate limit refused the request.
        self.metadata = metadata


class Unavailable(SluiceError):
    """A dependency cannot serve now; `retry_after_s`, when known, is when to try again (sent as
    RetryInfo on gRPC, Retry-After on HTTP)."""

    code = "UNAVAILABLE"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineExceeded(SluiceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(SluiceError):
    code = "CANCELLED"


class Unimplemented(SluiceError):
    code = "UNIMPLEMENTED"
