"""Log-probabilities and a request's n siblings in the step engine.

Logprobs: on logits we choose, each sampled token's logprob is log_softmax of the raw logits (before
logit_bias, penalties and temperature, as vLLM's default raw_logprobs), the top list is sorted and
holds the greedy token first; rows that did not ask get none. Then on the real GGUF: the logprobs
of a greedy run equal log_softmax of the forward pass's logits, and n sequences of one prompt in
one step are prefilled once (one forward row), their KV copied, each reproducible by its seed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest

from sluice_common.sampling import Sampling, StructuredOutputs
from sluice_triton_local.engine import DecodeRow, PrefillRow, RowResult, StepEngine
from sluice_triton_local.engine.sampling import LOGPROB_FLOOR, BatchSampler, log_softmax
from sluice_triton_local.model_files import gguf_path

VOCAB = 1000


def logits_rows(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, (rows, VOCAB)).astype(np.float32)


def reference_log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_the_logprob_is_log_softmax_of_the_raw_logits_and_the_top_list_is_sorted() -> None:
    options = [
        Sampling(max_tokens=1, logprobs=5),  # greedy
        Sampling(max_tokens=1, temperature=0.7, seed=3, logprobs=20, logit_bias=((7, 30.0),), presence_penalty=1.0),
        Sampling(max_tokens=1, temperature=1.0, seed=4),  # asked for none
        Sampling(max_tokens=1, logprobs=0),
    ]
    sampler = BatchSampler(len(options), VOCAB)
    for slot, params in enumerate(options):
        sampler.start(slot, params, (1, 2))
    logits = logits_rows(len(options))
    raw = logits.copy()
    tokens = sampler.sample(logits, np.arange(len(options)))
    found = sampler.last_logprobs
    assert found[2] is None
    for row in (0, 1, 3):
        expected = reference_log_softmax(raw[row])
        got = found[row]
        assert got is not None
        assert got.logprob == pytest.approx(expected[tokens[row]], abs=1e-9)
        k = options[row].logprobs
        assert len(got.top) == k
        ids = [token for token, _ in got.top]
        values = [value for _, value in got.top]
        assert values == sorted(values, reverse=True)
        assert set(ids) == set(np.argsort(-expected)[:k].tolist())
        assert values == pytest.approx(expected[ids].tolist(), abs=1e-9)
        assert all(v < 0 for v in values)
    assert tokens[1] == 7  # the bias decided the token, but its logprob is the raw distribution's
    assert found[0] is not None and found[0].top[0][0] == tokens[0]  # greedy: first of its list


def test_rows_that_ask_for_nothing_cost_no_log_softmax(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice_triton_local.engine.sampling as sampling

    calls: list[int] = []
    original = sampling.row_logprobs
    monkeypatch.setattr(sampling, "row_logprobs", lambda lg, t, k: calls.append(len(lg)) or original(lg, t, k))
    sampler = BatchSampler(3, VOCAB)
    for slot in range(3):
        sampler.start(slot, Sampling(max_tokens=1, logprobs=2 if slot == 1 else None), ())
    sampler.sample(logits_rows(3), np.arange(3))
    assert calls == [1]  # only the row that asked
    sampler.start(1, Sampling(max_tokens=1), ())
    sampler.sample(logits_rows(3), np.arange(3))
    assert calls == [1] and sampler.last_logprobs == [None, None, None]


@pytest.fixture(scope="module")
def engine() -> Iterator[StepEngine]:
    yield StepEngine(gguf_path(), max_slots=8, max_context=512, threads=2, prefix_cache=True)


def prompt(engine: StepEngine) -> tuple[int, ...]:
    return tuple(engine.encode_chat([("user", "Name a fruit and a color.")]))


def drive(engine: StepEngine, rows: list[PrefillRow]) -> dict[int, list[RowResult]]:
    results: dict[int, list[RowResult]] = {row.seq_id: [] for row in rows}
    step: list[PrefillRow | DecodeRow] = list(rows)
    while step:
        for r in engine.step(step):
            results[r.seq_id].append(r)
        step = [DecodeRow(sid) for sid, rs in results.items() if not rs[-1].finish_reason]
    return results


def test_greedy_logprobs_are_log_softmax_of_the_models_logits(engine: StepEngine) -> None:
    engine.clear_prefix_cache()
    ids = prompt(engine)
    seen: list[np.ndarray] = []
    forward = engine._model.forward  # noqa: SLF001

    def spy(items, interruptible=False):  # type: ignore[no-untyped-def]
        out = forward(items, interruptible)
        seen.append(out.copy())
        return out

    engine._model.forward = spy  # type: ignore[method-assign]  # noqa: SLF001
    try:
        out = drive(engine, [PrefillRow(1, ids, Sampling(max_tokens=6, logprobs=3))])[1]
    finally:
        engine._model.forward = forward  # type: ignore[method-assign]  # noqa: SLF001
    assert len(seen) == len(out) == 6
    for logits, result in zip(seen, out):
        expected = log_softmax(logits[:1])[0]
        lp = result.logprobs
        assert lp is not None
        assert lp.logprob == pytest.approx(float(expected[result.token_id]), abs=1e-6) and lp.logprob <= 0
        assert [t.logprob for t in lp.top_logprobs] == sorted((t.logprob for t in lp.top_logprobs), reverse=True)
        assert lp.top_logprobs[0].bytes == lp.bytes  # greedy: the sampled token is the most likely
        assert lp.bytes == engine.tokenizer.token_piece(result.token_id)
        assert lp.token == lp.bytes.decode("utf-8", errors="replace")


def test_n_siblings_are_prefilled_once_and_each_seed_reproduces_its_stream(engine: StepEngine) -> None:
    engine.clear_prefix_cache()
    ids = prompt(engine)
    rows_seen: list[int] = []
    forward = engine._model.forward  # noqa: SLF001

    def spy(items, interruptible=False):  # type: ignore[no-untyped-def]
        rows_seen.append(sum(len(item.token_ids) for item in items))
        return forward(items, interruptible)

    def choices(base: int, seed: int) -> dict[int, list[RowResult]]:
        rows = [PrefillRow(base + i, ids, Sampling(max_tokens=12, temperature=1.0, seed=seed + i, logprobs=1)) for i in range(3)]
        return drive(engine, rows)

    engine._model.forward = spy  # type: ignore[method-assign]  # noqa: SLF001
    try:
        before = engine.prefills_total, engine.cached_tokens_total
        first = choices(10, 100)
    finally:
        engine._model.forward = forward  # type: ignore[method-assign]  # noqa: SLF001
    assert rows_seen[0] == len(ids)  # one prefill of the prompt carried the three sequences
    firsts = [first[10 + i][0] for i in range(3)]
    assert [r.cached_tokens for r in firsts] == [0, len(ids), len(ids)]
    assert engine.prefills_total - before[0] == 3 and engine.cached_tokens_total - before[1] == 2 * len(ids)
    streams = [[r.token_id for r in first[10 + i]] for i in range(3)]
    assert len({tuple(s) for s in streams}) == 3  # seed + i: distinct streams
    # A sibling alone, cold, with its seed: the same stream (its KV copy is the prefill it skipped).
    engine.clear_prefix_cache()
    alone = drive(engine, [PrefillRow(20, ids, Sampling(max_tokens=12, temperature=1.0, seed=101, logprobs=1))])[20]
    assert [r.token_id for r in alone] == streams[1]
    assert [r.logprobs.logprob for r in alone] == pytest.approx([r.logprobs.logprob for r in first[11]], abs=1e-5)  # type: ignore[union-attr]
    again = choices(30, 100)
    assert [[r.token_id for r in again[30 + i]] for i in range(3)] == streams


def test_tokens_a_constraint_rules_out_report_a_finite_floor_not_minus_infinity(engine: StepEngine) -> None:
    """The constraint masks ruled-out tokens' logits to -inf before the logprobs are taken: JSON has
    no -Infinity (json.dumps writes it, strict parsers refuse it), so they report vLLM's floor."""
    choice = Sampling(max_tokens=4, logprobs=5, structured_outputs=StructuredOutputs.choice(["purple"]))
    out = drive(engine, [PrefillRow(1, prompt(engine), choice)])[1]
    entries = [r.logprobs for r in out if r.logprobs is not None]
    assert entries and "".join(r.text for r in out) == "purple"
    values = [lp.logprob for lp in entries] + [t.logprob for lp in entries for t in lp.top_logprobs]
    assert all(math.isfinite(v) for v in values)
    assert LOGPROB_FLOOR in values  # one token allowed at a time: the rest of each top 5 is ruled out
    assert all(lp.top_logprobs[0].token_id == lp.token_id for lp in entries)  # the allowed token ranks first
