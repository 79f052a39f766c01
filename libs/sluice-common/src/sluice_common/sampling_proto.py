"""sluice.common.v1.SamplingParams <-> sluice_common.sampling.Sampling, field by field.

The two have the same field names; these walk them (a proto field that Sampling lacks, or the
reverse, fails the tests in libs/sluice-common/tests/test_sampling.py), so a new option needs no
code here. Kept apart from `sampling` because that module must import without protobuf.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from sluice.common.v1 import types_pb2

from sluice_common.sampling import Sampling, StructuredOutputs, logit_bias_pairs


def from_proto(message: types_pb2.SamplingParams) -> Sampling:
    """Unset fields take Sampling's defaults (what the proto documents for them)."""
    values: dict[str, Any] = {}
    descriptors = message.DESCRIPTOR.fields_by_name
    for f in fields(Sampling):
        descriptor = descriptors[f.name]
        value = getattr(message, f.name)
        if f.name == "structured_outputs":
            if message.HasField(f.name):
                values[f.name] = structured_outputs_from_proto(value)
        elif descriptor.has_presence:
            if message.HasField(f.name):
                values[f.name] = value
        elif f.name == "logit_bias":
            values[f.name] = logit_bias_pairs(value.items())
        elif isinstance(f.default, tuple):
            values[f.name] = tuple(value)
        else:
            values[f.name] = value
    return Sampling(**values)


def to_proto(sampling: Sampling) -> types_pb2.SamplingParams:
    """Fields at their defaults stay unset, which the proto reads as the same defaults."""
    message = types_pb2.SamplingParams()
    for f in fields(sampling):
        value = getattr(sampling, f.name)
        if value == f.default:
            continue
        if f.name == "logit_bias":
            message.logit_bias.update(dict(value))
        elif f.name == "structured_outputs":
            message.structured_outputs.CopyFrom(structured_outputs_to_proto(value))
        elif isinstance(value, tuple):
            getattr(message, f.name).extend(value)
        else:
            setattr(message, f.name, value)
    return message


def structured_outputs_from_proto(message: types_pb2.StructuredOutputs) -> StructuredOutputs:
    """Unparsed (a malformed schema is `StructuredOutputs.problem`'s to name); a message with no
    field of its oneof set is kind "" (refused there too)."""
    kind = message.WhichOneof("constraint") or ""
    if kind == "choice":
        return StructuredOutputs("choice", tuple(message.choice.options))
    if kind == "json_object":
        return StructuredOutputs("json_object" if message.json_object else "")
    return StructuredOutputs(kind, getattr(message, kind) if kind else "")


def structured_outputs_to_proto(constraint: StructuredOutputs) -> types_pb2.StructuredOutputs:
    message = types_pb2.StructuredOutputs()
    if constraint.kind == "choice":
        message.choice.options.extend(constraint.value)
    elif constraint.kind == "json_object":
        message.json_object = True
    else:
        setattr(message, constraint.kind, constraint.value)
    return message
