"""`sluice eval` against the real stack: two bulk jobs, scored by evaluation-logging, a table and a
verdict. Side B is triton-local's second variant (SmolLM2 re-quantized to Q4_0), served by the
adapter as a second model; then a planted regression (B cut to one token) must fail the gate.

Greedy decoding, and a sequence's tokens do not depend on who shares its batch (triton-local's
engine): the outputs, hence the scores and the verdicts, are the same on every run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from conftest import DEMO_KEY, MODEL

from sluice_stack import REPO_ROOT, VARIANT_MODEL, Stack

# References are what the main model answers greedily to the first two (exact_match passes for A).
ROWS = [
    {"id": "france", "prompt": "Which city is the capital of France?", "reference": "The capital of France is Paris."},
    {"id": "sum", "prompt": "What is 2 + 2? Answer with a number only.", "reference": "2 + 2 = 4"},
    {"id": "planet", "prompt": "Name the largest planet in the solar system.", "reference": "Jupiter is the largest planet in the solar system."},
    {"id": "sky", "prompt": "What color is the sky on a clear day? Answer in one word.", "reference": "Blue."},
    {"id": "shakespeare", "prompt": "Who wrote Romeo and Juliet?", "reference": "William Shakespeare wrote Romeo and Juliet."},
    {"id": "chat", "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}], "reference": "Hello!"},
    # Longer than the model's context (2048 tokens): fails on both sides, reported and counted.
    {"id": "too-long", "prompt": "word " * 3000, "reference": "x"},
]
EVALUATORS = [
    "rows_ok", "latency_slo", "ttft_slo", "truncation", "empty_output", "repetition", "stop_sequence",
    "json_validity", "pii", "similarity", "exact_match", "reference_similarity",
]  # fmt: skip
# Evaluators that score every successful row here (the others need timings, stops or JSON mode).
SCORED_ON_BOTH = ["truncation", "empty_output", "repetition", "pii", "similarity", "exact_match", "reference_similarity"]


def sluice_eval(stack: Stack, dataset: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SLUICE_GATEWAY_URL": stack.gateway_address, "SLUICE_EVALLOG_URL": stack.evallog_address, "SLUICE_API_KEY": DEMO_KEY}
    return subprocess.run(
        [str(REPO_ROOT / "bin" / "sluice"), "eval", "--dataset", str(dataset), "-q", "--max-tokens", "24", *args],
        env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def table(stdout: str) -> dict[str, list[str]]:
    """EVALUATOR -> its columns (BETTER, MEAN A, MEAN B, PASS A, PASS B, DELTA, N A, N B, VERDICT...)."""
    return {m.group(1): m.group(2).split() for m in re.finditer(r"^([a-z_]+)\s+((?:higher|lower)\s.*)$", stdout, re.M)}


def test_a_model_and_its_quantized_variant_side_by_side_then_a_planted_regression(stack: Stack, tmp_path: Path) -> None:
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    per_row = tmp_path / "rows.out.jsonl"

    # A vs the Q4_0 variant with a lenient threshold: half the rows would have to flip to fail it
    # (here it loses 1 of 6 on truncation and exact_match: at the default 0.05 it would).
    compared = sluice_eval(stack, dataset, "--model-a", MODEL, "--model-b", VARIANT_MODEL, "--threshold", "0.5", "-o", str(per_row))
    assert compared.returncode == 0, compared.stdout + compared.stderr
    print(compared.stdout)
    lines = table(compared.stdout)
    assert list(lines) == EVALUATORS, compared.stdout
    for name in SCORED_ON_BOTH:
        better, mean_a, mean_b, pass_a, pass_b, delta, n_a, n_b, verdict = lines[name][:9]
        assert (n_a, n_b) == ("6", "6") and verdict in ("same", "improved", "REGRESSED"), (name, lines[name])
    assert lines["rows_ok"][3:5] == ["85.7%", "85.7%"] and lines["rows_ok"][6:8] == ["7", "7"]
    assert lines["json_validity"][-1] == "n/a"
    assert f"A: {MODEL}\nB: {VARIANT_MODEL}\n" in compared.stdout
    assert "VERDICT: OK" in compared.stdout
    # The failing row is reported per side with its error, not dropped.
    assert compared.stderr.count("1 of 7 rows failed") == 2 and "too-long: INVALID_ARGUMENT" in compared.stderr
    # Two real models: the re-quantized one answers differently somewhere.
    outputs = [json.loads(line) for line in per_row.read_text().splitlines()]
    assert [o["id"] for o in outputs] == [row["id"] for row in ROWS]
    assert outputs[0]["A"]["output"] == "The capital of France is Paris." and outputs[0]["A"]["scores"]["exact_match"] == 1.0
    assert any(o["A"]["output"] != o["B"]["output"] for o in outputs[:-1])
    assert "error" in outputs[-1]["A"] and "error" in outputs[-1]["B"]

    # The same model cut to one token: truncated everywhere, and of the exact matches only a
    # one-token answer is left ("Hello" for "Hello!"): exit 1.
    regressed = sluice_eval(stack, dataset, "--model-a", MODEL, "--sampling-b", "max_tokens=1")
    assert regressed.returncode == 1, regressed.stdout + regressed.stderr
    print(regressed.stdout)
    lines = table(regressed.stdout)
    assert lines["truncation"][-1] == "REGRESSED" and lines["truncation"][4] == "0.0%"
    assert lines["exact_match"][-1] == "REGRESSED" and lines["exact_match"][4] == "16.7%"
    assert lines["rows_ok"][-1] == "same"
    verdict = regressed.stdout.strip().splitlines()[-1]
    assert verdict.startswith("VERDICT: REGRESSION") and "truncation" in verdict and "exact_match" in verdict


def test_score_completions_needs_a_key_and_bounds_its_items(stack: Stack) -> None:
    import grpc
    from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc, events_pb2

    from conftest import auth

    item = evallog_pb2.ScoreItem(event=events_pb2.CompletionEvent(output="Paris", text_logged=True), reference="paris")
    with grpc.insecure_channel(stack.evallog_address) as channel:
        stub = evallog_pb2_grpc.EvalLogServiceStub(channel)
        for items, metadata, code in (
            ([item], (), grpc.StatusCode.UNAUTHENTICATED),
            ([item] * 1001, auth(), grpc.StatusCode.INVALID_ARGUMENT),
        ):
            try:
                stub.ScoreCompletions(evallog_pb2.ScoreCompletionsRequest(items=items), metadata=metadata, timeout=30)
            except grpc.RpcError as error:
                assert error.code() == code, error
            else:
                raise AssertionError(f"ScoreCompletions answered; expected {code}")
        reply = stub.ScoreCompletions(evallog_pb2.ScoreCompletionsRequest(items=[item]), metadata=auth(), timeout=30)
    scores = {s.name: s for s in reply.items[0].scores}
    assert scores["exact_match"].passed and scores["reference_similarity"].value > 0.99
    assert {e.name: e.higher_is_better for e in reply.evaluators}["repetition"] is False
