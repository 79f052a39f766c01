from __future__ import annotations

import pytest
from sluice.common.v1 import types_pb2

from sluice_common.errors import InvalidArgument
from sluice_common.validation import validate_generation

MODEL = types_pb2.ModelInfo(name="m", context_length=2048, max_output_tokens=1024, logprobs=True, structured_outputs=True, logit_bias=True)
HELLO = [types_pb2.ChatMessage(role="user", content="hello")]


def check(messages=HELLO, prompt="", **sampling) -> None:
    sampling.setdefault("max_tokens", 16)
    validate_generation(messages, prompt, types_pb2.SamplingParams(**sampling), MODEL)


def test_a_valid_request_passes() -> None:
    check(temperature=0.7, top_p=0.9, stop=["\n"])
    check(top_k=5, min_p=0.1, presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=1.3, logit_bias={3: -100.0}, seed=7)
    check(messages=[], prompt="raw text")
    check(max_tokens=1024)
    check(logprobs=20, n=8)
    check(logprobs=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(messages=[]), "messages"),
        (dict(prompt="x"), "prompt"),
        (dict(max_tokens=0), "sampling.max_tokens"),
        (dict(max_tokens=1025), "sampling.max_tokens"),
        (dict(temperature=-0.1), "sampling.temperature"),
        (dict(top_p=0.0), "sampling.top_p"),
        (dict(top_k=-1), "sampling.top_k"),
        (dict(min_p=1.5), "sampling.min_p"),
        (dict(presence_penalty=2.5), "sampling.presence_penalty"),
        (dict(frequency_penalty=-3.0), "sampling.frequency_penalty"),
        (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
        (dict(logit_bias={5: 101.0}), "sampling.logit_bias"),
        (dict(logit_bias={-5: 1.0}), "sampling.logit_bias"),
        (dict(stop=["a", "b", "c", "d", "e"]), "sampling.stop"),
        (dict(stop=[""]), "sampling.stop[0]"),
        (dict(logprobs=21), "sampling.logprobs"),
        (dict(n=9), "sampling.n"),
        (dict(messages=[types_pb2.ChatMessage(role="tool", content="x")]), "messages[0].role"),
        (dict(messages=[types_pb2.ChatMessage(role="user", content="")]), "messages[0].content"),
    ],
)
def test_each_problem_names_its_field(kwargs, field) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check(**kwargs)
    assert caught.value.field_name == field
    assert caught.value.reason


def test_logprobs_from_a_model_that_reports_none_is_refused_naming_it() -> None:
    silent = types_pb2.ModelInfo(name="vllm", context_length=2048, max_output_tokens=1024)
    validate_generation(HELLO, "", types_pb2.SamplingParams(max_tokens=4, n=3), silent)
    with pytest.raises(InvalidArgument) as caught:
        validate_generation(HELLO, "", types_pb2.SamplingParams(max_tokens=4, logprobs=0), silent)
    assert caught.value.field_name == "sampling.logprobs" and "vllm" in caught.value.reason


def test_logit_bias_for_a_model_that_does_not_apply_it_is_refused_naming_it() -> None:
    """Triton's vLLM backend hands vLLM the JSON object's string keys: every such request failed on
    every replica, each counted as the replica's failure."""
    vllm = types_pb2.ModelInfo(name="vllm", context_length=2048, max_output_tokens=1024)
    biased = types_pb2.SamplingParams(max_tokens=4, logit_bias={11: -100.0})
    with pytest.raises(InvalidArgument) as caught:
        validate_generation(HELLO, "", biased, vllm)
    assert caught.value.field_name == "sampling.logit_bias" and "vllm does not apply logit_bias" in caught.value.reason
    validate_generation(HELLO, "", biased, MODEL)


def test_a_constraint_is_checked_and_needs_a_model_that_enforces_constraints() -> None:
    constraint = types_pb2.StructuredOutputs(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    check(structured_outputs=constraint)
    with pytest.raises(InvalidArgument) as caught:
        check(structured_outputs=types_pb2.StructuredOutputs(json='{"type": "object", "if": {}}'))
    assert caught.value.field_name == "sampling.structured_outputs" and "if" in caught.value.reason
    plain = types_pb2.ModelInfo(name="plain", context_length=2048, max_output_tokens=1024)
    with pytest.raises(InvalidArgument) as caught:
        validate_generation(HELLO, "", types_pb2.SamplingParams(max_tokens=4, structured_outputs=constraint), plain)
    assert caught.value.field_name == "sampling.structured_outputs" and "plain does not enforce" in caught.value.reason


def test_a_priority_class_outside_the_enum_is_refused_naming_it() -> None:
    from sluice_common.validation import validate_priority_class

    for value in (types_pb2.PRIORITY_CLASS_UNSPECIFIED, types_pb2.PRIORITY_CLASS_INTERACTIVE, types_pb2.PRIORITY_CLASS_BULK):
        validate_priority_class(value)
    for value in (-1, 3, 1 << 20):
        with pytest.raises(InvalidArgument) as caught:
            validate_priority_class(value)
        assert caught.value.field_name == "priority_class" and str(value) in caught.value.reason


def _no_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    def compile_(constraint: object) -> None:
        raise AssertionError("compiled before its size was checked")

    monkeypatch.setattr("sluice_common.validation.check", compile_)


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        (dict(logit_bias={token: 1.0 for token in range(1025)}), "at most 1024 tokens"),
        (dict(structured_outputs=types_pb2.StructuredOutputs(choice=types_pb2.ChoiceList(options=[f"o{i}" for i in range(1025)]))), "1024 options"),
        (dict(structured_outputs=types_pb2.StructuredOutputs(choice=types_pb2.ChoiceList(options=["x" * 40_000, "y" * 40_000]))), "65536"),
        (dict(structured_outputs=types_pb2.StructuredOutputs(json='{"type": "object", "description": "' + "d" * 70_000 + '"}')), "65536"),
        (dict(structured_outputs=types_pb2.StructuredOutputs(regex="a" * 70_000)), "65536"),
        (dict(structured_outputs=types_pb2.StructuredOutputs(grammar='start: "' + "a" * 70_000 + '"')), "65536"),
    ],
    ids=["logit_bias", "choice_count", "choice_size", "json", "regex", "grammar"],
)
def test_what_would_be_costly_to_convert_or_compile_is_refused_by_size_first(monkeypatch, sampling, named) -> None:  # type: ignore[no-untyped-def]
    """A request of megabytes held the event loop while it was compiled (80,000 choice options: 5 s)
    or converted (a million logit_bias entries: 0.4 s); its size is checked first, at the cost of a length."""
    _no_compiling(monkeypatch)
    with pytest.raises(InvalidArgument) as caught:
        check(**sampling)
    field = "sampling.logit_bias" if "logit_bias" in sampling else "sampling.structured_outputs"
    assert caught.value.field_name == field and named in caught.value.reason, caught.value.reason


def test_the_size_bounds_hold_their_limits() -> None:
    check(logit_bias={token: 1.0 for token in range(1024)})
    check(structured_outputs=types_pb2.StructuredOutputs(choice=types_pb2.ChoiceList(options=[f"o{i}" for i in range(1024)])))
    check(structured_outputs=types_pb2.StructuredOutputs(regex="a" * (64 * 1024)))


def test_a_long_role_or_metadata_key_is_quoted_in_part() -> None:
    """Quoted whole, a 20,000-character role or key outgrew gRPC's metadata (16 KiB): the client heard
    RESOURCE_EXHAUSTED instead of the error."""
    from sluice_common.validation import validate_recorded

    with pytest.raises(InvalidArgument) as caught:
        check(messages=[types_pb2.ChatMessage(role="r" * 20_000, content="hi")])
    assert caught.value.field_name == "messages[0].role" and len(caught.value.message) < 200, len(caught.value.message)
    with pytest.raises(InvalidArgument) as caught:
        validate_recorded("", {"k" * 20_000: "v"})
    assert caught.value.field_name == "metadata" and len(caught.value.message) < 200, len(caught.value.message)
