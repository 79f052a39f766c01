"""An error answered as OpenAI answers it: the one type every OpenAI-shaped refusal is raised as, and
the one table of gRPC status names -> HTTP statuses (the HTTP front's answers and a batch's error lines)."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with its status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


# gRPC status names -> OpenAI's HTTP status and error type; any other name is a 500 server_error.
_STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "invalid_request_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "invalid_request_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "request_cancelled"),
    "UNIMPLEMENTED": (501, "server_error"),
    "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"),
}


def status_error(code: str, message: str) -> OpenAIError:
    """What OpenAI answers for a failure with this gRPC status name, its code the name in lower case."""
    status, type_ = _STATUS.get(code, (500, "server_error"))
    return OpenAIError(status, message, type_, code=code.lower())


def generation_failed(message: str) -> OpenAIError:
    """A generation that ended without finishing (the engine's ERROR or CANCELLED finish)."""
    return OpenAIError(500, message, "server_error", code="generation_failed")
