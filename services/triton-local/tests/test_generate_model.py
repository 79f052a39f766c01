"""The vLLM-backend stand-in: its interface is upstream's, and it reads and answers requests as
the backend does (the whole model is exercised through a real Triton in tests/e2e/test_passthrough.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sluice_common.logprobs import from_vllm
from sluice_triton_local.engine.rows import RowResult, TokenLogprob, TopLogprob
from sluice_triton_local.generate_model import VLLM_INPUTS, VLLM_OUTPUTS, _Progress, _response, fit_to_context, parse_request, vllm_logprobs

UPSTREAM = json.loads((Path(__file__).parents[3] / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())
TRITON_TYPES = {bytes: "TYPE_STRING", np.bool_: "TYPE_BOOL", np.float32: "TYPE_FP32", np.uint32: "TYPE_UINT32"}


def declared(tensors: tuple[tuple[str, type, tuple[int, ...]], ...]) -> list[tuple[str, str, list[int]]]:
    return [(name, TRITON_TYPES[dtype], list(shape)) for name, dtype, shape in tensors]


def test_inputs_and_outputs_are_upstreams() -> None:
    assert declared(VLLM_INPUTS) == [(t["name"], t["data_type"], t["dims"]) for t in UPSTREAM["inputs"]]
    assert declared(VLLM_OUTPUTS) == [(t["name"], t["data_type"], t["dims"]) for t in UPSTREAM["outputs"]]


def request(sampling: dict[str, object] | None = None, **flags: bool) -> dict[str, np.ndarray]:
    inputs = {"text_input": np.array([b"Hello"], dtype=np.object_)}
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    inputs.update({name: np.array([value]) for name, value in flags.items()})
    return inputs


def test_reads_sampling_parameters_and_the_requested_outputs() -> None:
    parsed = parse_request(
        request(
            {"max_tokens": 5, "temperature": 0, "seed": 3, "stop": ["."]},
            stream=True,
            exclude_input_in_output=True,
            return_finish_reason=True,
            return_num_output_tokens=True,
        )
    )
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.params.seed, parsed.params.stop) == (5, 0.0, 3, (".",))
    assert parsed.stream and not parsed.prepend_input
    assert parsed.outputs == {"finish_reason", "num_output_tokens"}


def test_vllm_defaults_without_sampling_parameters() -> None:
    parsed = parse_request(request())
    assert (parsed.params.max_tokens, parsed.params.temperature, parsed.stream, parsed.prepend_input) == (16, 1.0, False, True)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (request({"max_tokens": 0}), "max_tokens must be at least 1, got 0."),
        (request({"temperature": -1}), "temperature must be non-negative, got -1.0."),
        (request({"top_p": 1.5}), "top_p must be in (0, 1], got 1.5."),
        (request(stream=True, exclude_input_in_output=False), "When streaming, `exclude_input_in_output` = False is not allowed."),
    ],
)
def test_refuses_what_vllm_refuses_in_its_words(inputs: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_request(inputs)
    assert str(caught.value) == message


def test_prompt_longer_than_the_context_is_refused_and_max_tokens_cut_at_its_end() -> None:
    parsed = parse_request(request({"max_tokens": 100}))
    with pytest.raises(ValueError, match=r"^The decoder prompt \(length 2049\) is longer than the maximum model length of 2048\."):
        fit_to_context(parsed, 2049, 2048)
    assert fit_to_context(parsed, 2000, 2048).max_tokens == 48
    assert fit_to_context(parsed, 10, 2048).max_tokens == 100


def test_responses_carry_finish_reason_and_token_counts_since_the_last_one() -> None:
    progress = _Progress(prompt_tokens=12)
    outputs = frozenset({"finish_reason", "num_input_tokens", "num_output_tokens"})
    first = _response("Par", RowResult(1, 5, "Par", "", 12, 2), progress, outputs)
    last = _response("is", RowResult(1, 6, "is", "stop", 12, 3), progress, outputs)
    assert [r["finish_reason"][0] for r in (first, last)] == [b"None", b"stop"]
    assert [int(r["num_output_tokens"][0]) for r in (first, last)] == [2, 1]
    assert int(last["num_input_tokens"][0]) == 12 and last["num_input_tokens"].dtype == np.uint32
    assert set(_response("x", RowResult(1, 7, "x", "", 12, 4), progress, frozenset())) == {"text_output"}


def test_the_stand_ins_turned_away_prefill_gets_the_next_freed_slot() -> None:
    """An adapter keeps every slot of the shared engine busy: each of its steps releases a finished
    sequence and prefills a new one. The stand-in's prefill, turned away, must get the slot freed
    next (the engine's rule for owners turned away), not starve behind the adapter's refills."""
    import itertools
    import threading
    import time

    from sluice_triton_local.engine import PrefillRow, ReleaseRow, Sampling, StepEngine
    from sluice_triton_local.model_files import gguf_path
    from sluice_triton_local.generate_model import SelfBatchingGenerator
    from sluice_triton_local.shared_engine import SharedEngine

    engine = SharedEngine(StepEngine(gguf_path(), max_slots=2, max_context=256, threads=1))
    prompt = engine.apply_chat_template([("user", "Write a long story about a dragon.")])
    params = Sampling(max_tokens=100)
    seq_ids = itertools.count(1)
    held = [next(seq_ids) for _ in range(2)]
    assert [r.finish_reason for r in engine.step([PrefillRow(s, prompt, params, owner="adapter") for s in held])] == ["", ""]
    generator = SelfBatchingGenerator(engine, max_running=2, owner="smollm2_vllm")
    served = threading.Event()
    generator.submit(prompt, Sampling(max_tokens=1), lambda result: served.set())
    refills = 0
    # Bounded by rounds of the adapter, not by a time the stand-in must meet: it retries every 50 ms
    # and the engine keeps its place for a second; on a loaded box a round only takes longer.
    while not served.is_set() and refills < 50:
        released, new = held.pop(0), next(seq_ids)
        _, refill = engine.step([ReleaseRow(released), PrefillRow(new, prompt, params, owner="adapter")])
        if refill.finish_reason != "busy":
            held.append(new)
            refills += 1
        time.sleep(0.02)  # an adapter's step takes this long, at least
    assert served.wait(timeout=10), f"the stand-in starved: the adapter refilled {refills} freed slots before it"
    engine.step([ReleaseRow(s) for s in held])


def test_the_stand_ins_batcher_answers_a_fault_and_keeps_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine step that raises, or a request's callback that does, must not end the batcher's
    thread: the requests in hand hear the error and later requests are served."""
    import queue

    from sluice_triton_local.engine import Sampling, StepEngine
    from sluice_triton_local.model_files import gguf_path
    from sluice_triton_local.generate_model import SelfBatchingGenerator
    from sluice_triton_local.shared_engine import SharedEngine

    engine = SharedEngine(StepEngine(gguf_path(), max_slots=2, max_context=256, threads=1))
    prompt = engine.apply_chat_template([("user", "Name a color.")])
    step, faults = engine.step, ["engine fault"]

    def step_once_faulty(rows: list[object]) -> list[RowResult]:
        if faults:
            raise RuntimeError(faults.pop())
        return step(rows)  # type: ignore[arg-type]

    monkeypatch.setattr(engine, "step", step_once_faulty)
    generator = SelfBatchingGenerator(engine, max_running=2)
    failed: queue.Queue[RowResult] = queue.Queue()
    generator.submit(prompt, Sampling(max_tokens=3), failed.put)
    result = failed.get(timeout=30)
    assert result.finish_reason == "error" and "engine fault" in result.error

    def broken_callback(result: RowResult) -> None:
        raise RuntimeError("the request's loop is closed")

    generator.submit(prompt, Sampling(max_tokens=3), broken_callback)
    served: queue.Queue[RowResult] = queue.Queue()
    generator.submit(prompt, Sampling(max_tokens=3), served.put)
    answers = [served.get(timeout=30)]
    while not answers[-1].finish_reason:
        answers.append(served.get(timeout=30))
    assert answers[-1].finish_reason == "length" and len(answers) == 3


def test_logprobs_come_in_vllms_shape_and_read_back_as_the_engines() -> None:
    """return_logprobs: one {id: {logprob, rank, decoded_token}} object per token of the response, the
    sampled token among them (with its own rank when it is not among the most likely), null when the
    request asked for none; the adapter's reading (sluice_common.logprobs.from_vllm) gives back the
    engine's entries."""
    greedy = TokenLogprob("Par", b"Par", -0.1, (TopLogprob("Par", b"Par", -0.1, 5), TopLogprob("Lon", b"Lon", -2.5, 9)), token_id=5, rank=1)
    unlikely = TokenLogprob("is", b"is", -7.0, (TopLogprob("Par", b"Par", -0.2, 5), TopLogprob("ee", b"ee", -1.9, 8)), token_id=6, rank=40)
    assert parse_request(request({"logprobs": 2}, return_logprobs=True)).outputs == {"logprobs"}
    response = _response("Paris", RowResult(1, 6, "is", "", 12, 2), _Progress(12), frozenset({"logprobs"}), [greedy, unlikely])
    positions = json.loads(bytes(response["logprobs"][0]))
    assert positions == [
        {"5": {"logprob": -0.1, "rank": 1, "decoded_token": "Par"}, "9": {"logprob": -2.5, "rank": 2, "decoded_token": "Lon"}},
        {"5": {"logprob": -0.2, "rank": 1, "decoded_token": "Par"}, "8": {"logprob": -1.9, "rank": 2, "decoded_token": "ee"},
         "6": {"logprob": -7.0, "rank": 40, "decoded_token": "is"}},
    ]  # fmt: skip
    entries = from_vllm(positions, "Paris", 2)
    assert [(e["token"], e["logprob"]) for e in entries] == [("Par", -0.1), ("is", -7.0)]
    assert [[t["token"] for t in e["top_logprobs"]] for e in entries] == [["Par", "Lon"], ["Par", "ee"]]
    assert vllm_logprobs(None) == b"null"
