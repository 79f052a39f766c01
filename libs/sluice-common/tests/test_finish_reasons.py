"""FinishReason names for a value this build knows, and for one it does not (a newer peer's)."""

from __future__ import annotations

from sluice.common.v1 import types_pb2

from sluice_common.finish_reasons import finish_reason_enum_name, finish_reason_name


def test_a_known_value_is_named_and_an_unknown_one_is_its_number() -> None:
    assert finish_reason_name(types_pb2.FINISH_REASON_LENGTH) == "length"
    assert finish_reason_enum_name(types_pb2.FINISH_REASON_STOP) == "FINISH_REASON_STOP"
    assert finish_reason_name(99) == finish_reason_enum_name(99) == "99"
