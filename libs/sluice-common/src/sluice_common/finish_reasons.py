"""Names of FinishReason values, for log lines and the CLI's output.

proto3 keeps an enum value this build has no name for (a newer gateway's), and
`FinishReason.Name` raises ValueError on it: a log line or a printed record must not fail on one,
so such a value is shown as its number.
"""

from __future__ import annotations

from sluice.common.v1 import types_pb2


def finish_reason_enum_name(number: int) -> str:
    """The enum's own name ("FINISH_REASON_STOP", ...), or the number for a value this build has no name for."""
    try:
        return types_pb2.FinishReason.Name(number)
    except ValueError:
        return str(number)


def finish_reason_name(number: int) -> str:
    """The short name ("stop", "length", ...), or the number for a value this build has no name for."""
    return finish_reason_enum_name(number).removeprefix("FINISH_REASON_").lower()
