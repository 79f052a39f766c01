"""The step engine's sampling options: each changes sampling as specified, per row, over a batch.

First against the batch sampler alone (logits we choose, so the formulas can be checked exactly),
then through the engine on the real SmolLM2 GGUF, where a seeded sequence must give the same
tokens alone and in a batch of eight sequences with other options.
"""

from __future__ import annotations

import numpy as np
import pytest

from sluice_common.sampling import Sampling
from sluice_triton_local.engine import DecodeRow, PrefillRow, RowResult, StepEngine
from sluice_triton_local.model_files import gguf_path
from sluice_triton_local.engine.sampling import BatchSampler, uniforms

VOCAB = 1000  # not a multiple of the inverse CDF's block: its padding is exercised too


def logits_row(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, VOCAB).astype(np.float32)


def sampler_with(*params: Sampling, prompt: tuple[int, ...] = (1, 2, 3)) -> BatchSampler:
    sampler = BatchSampler(len(params), VOCAB)
    for slot, p in enumerate(params):
        sampler.start(slot, p, prompt)
    return sampler


def draw(sampler: BatchSampler, logits: np.ndarray, slots: list[int]) -> np.ndarray:
    return sampler.sample(logits.copy(), np.array(slots))


def frequencies(params: Sampling, logits: np.ndarray, draws: int = 4000) -> np.ndarray:
    """How often each token is drawn by `draws` sequences (one batch) with these options and seeds 0.."""
    sampler = BatchSampler(draws, VOCAB)
    for slot in range(draws):
        sampler.start(slot, Sampling(**{**params.__dict__, "seed": slot}), ())
    tokens = sampler.sample(np.tile(logits, (draws, 1)), np.arange(draws))
    return np.bincount(tokens, minlength=VOCAB) / draws


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max())
    return e / e.sum()


# -- the options, on logits we choose ----------------------------------------------


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one() -> None:
    logits = logits_row()
    favourite = int(np.argmax(logits))
    forced = 17 if favourite != 17 else 18
    for temperature in (0.0, 1.0):
        sampler = sampler_with(Sampling(max_tokens=1, temperature=temperature, seed=1, logit_bias=((forced, 100.0),)))
        assert draw(sampler, logits[None], [0])[0] == forced
    banned = sampler_with(Sampling(max_tokens=1, logit_bias=((favourite, -100.0),)))
    assert draw(banned, logits[None], [0])[0] == int(np.argsort(-logits)[1])
    # The bias is the row's own: a neighbour without one samples as before.
    mixed = sampler_with(Sampling(max_tokens=1, logit_bias=((forced, 100.0),)), Sampling(max_tokens=1))
    assert list(draw(mixed, np.stack([logits, logits]), [0, 1])) == [forced, favourite]


def test_top_k_1_is_greedy() -> None:
    rows = np.stack([logits_row(seed) for seed in range(16)])
    sampler = sampler_with(*[Sampling(max_tokens=1, temperature=1.5, top_k=1, seed=seed) for seed in range(16)])
    assert list(draw(sampler, rows, list(range(16)))) == list(np.argmax(rows, axis=1))


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = logits_row(3)
    seen = frequencies(Sampling(max_tokens=1, temperature=1.0, top_k=5), logits) > 0
    top5 = set(np.argsort(-logits)[:5].tolist())
    assert set(np.flatnonzero(seen).tolist()) == top5


def test_min_p_drops_tokens_below_its_share_of_the_most_likely() -> None:
    logits = logits_row(4)
    probs = softmax(logits)
    kept = probs >= 0.2 * probs.max()
    assert 2 <= kept.sum() < VOCAB // 10  # a cut that keeps some and drops most
    seen = frequencies(Sampling(max_tokens=1, temperature=1.0, min_p=0.2), logits) > 0
    assert not (seen & ~kept).any()
    assert seen[kept].mean() > 0.9  # the kept ones are drawn (the rarest may not be, in 4000 draws)


def test_top_p_keeps_the_smallest_set_reaching_its_mass() -> None:
    logits = logits_row(5)
    probs = softmax(logits)
    order = np.argsort(-probs)
    nucleus = order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1]
    freq = frequencies(Sampling(max_tokens=1, temperature=1.0, top_p=0.5), logits)
    assert set(np.flatnonzero(freq).tolist()) <= set(nucleus.tolist())
    # Within the nucleus, the renormalised probabilities.
    expected = probs[nucleus] / probs[nucleus].sum()
    assert np.abs(freq[nucleus] - expected).max() < 0.03


def test_plain_sampling_follows_the_softmax_at_the_temperature() -> None:
    logits = np.full(VOCAB, -20.0, dtype=np.float32)
    logits[[3, 300, 511, 512, 999]] = [2.0, 1.0, 0.5, 0.0, -1.0]  # across blocks, the last one included
    draws = 20000
    for temperature in (0.5, 1.0, 2.0):
        freq = frequencies(Sampling(max_tokens=1, temperature=temperature), logits, draws=draws)
        expected = softmax(logits / temperature)
        # Each token within 4.5 standard deviations of a multinomial count.
        sigma = np.sqrt(expected * (1 - expected) / draws)
        assert (np.abs(freq - expected) <= 4.5 * sigma + 1e-4).all(), temperature


def test_a_temperature_too_small_to_divide_by_is_greedy() -> None:
    """1 / float32(1e-39) overflows: the weights were NaN and the inverse CDF picked token 0 every time."""
    logits = logits_row()
    greedy = int(np.argmax(logits))
    assert greedy != 0
    for temperature in (1e-39, 1e-30, 9e-6):
        sampler = sampler_with(*(Sampling(max_tokens=1, temperature=temperature, seed=seed) for seed in range(8)))
        assert draw(sampler, np.tile(logits, (8, 1)), list(range(8))).tolist() == [greedy] * 8


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() -> None:
    logits = np.linspace(-3.0, 3.0, VOCAB).astype(np.float32)
    positive, negative, unseen = VOCAB - 1, 0, 500
    sampler = sampler_with(Sampling(max_tokens=4, repetition_penalty=2.0), prompt=(positive,))
    sampler._counts[0, negative] = 1  # type: ignore[index]  # as if generated before
    adjusted = logits.copy()[None]
    sampler.adjust(adjusted, np.array([0]))
    assert adjusted[0, positive] == pytest.approx(logits[positive] / 2.0)  # seen in the prompt
    assert adjusted[0, negative] == pytest.approx(logits[negative] * 2.0)  # seen in the output
    assert adjusted[0, unseen] == logits[unseen]


def test_frequency_and_presence_penalties_follow_openais_formula() -> None:
    """logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c: generated counts."""
    logits = np.zeros((1, VOCAB), dtype=np.float32)
    logits[0, 10] = 5.0  # greedy picks 10 until its penalties outweigh the gap
    sampler = sampler_with(Sampling(max_tokens=8, frequency_penalty=1.5, presence_penalty=0.5), prompt=(10,))
    picked = [int(draw(sampler, logits, [0])[0]) for _ in range(3)]
    assert picked[:2] == [10, 10]  # 5 -> 5 - 1.5 - 0.5 = 3 > 0: still the best
    adjusted = logits.copy()
    sampler.adjust(adjusted, np.array([0]))
    assert adjusted[0, 10] == pytest.approx(5.0 - 3 * 1.5 - 0.5)  # after three 10s
    # The prompt does not count: only generated tokens are penalised.
    fresh = sampler_with(Sampling(max_tokens=8, presence_penalty=2.0), prompt=(10,))
    untouched = logits.copy()
    fresh.adjust(untouched, np.array([0]))
    assert untouched[0, 10] == 5.0


def test_a_repeated_tokens_probability_drops_as_the_penalties_say() -> None:
    logits = logits_row(7)
    token = int(np.argmax(logits))
    sampler = sampler_with(Sampling(max_tokens=8, temperature=1.0, presence_penalty=1.0, frequency_penalty=0.5, seed=3))
    sampler._counts[0, token] = 2  # type: ignore[index]
    adjusted = logits.copy()[None]
    sampler.adjust(adjusted, np.array([0]))
    before, after = softmax(logits)[token], softmax(adjusted[0])[token]
    shifted = logits.copy()
    shifted[token] -= 2 * 0.5 + 1.0
    assert after < before and after == pytest.approx(softmax(shifted)[token], rel=1e-5)


def test_each_row_has_its_own_stream_whatever_its_neighbours() -> None:
    logits = logits_row(8)
    options = Sampling(max_tokens=8, temperature=1.0, seed=1234)
    alone = sampler_with(options)
    tokens_alone = [int(draw(alone, logits[None], [0])[0]) for _ in range(6)]
    crowd = BatchSampler(8, VOCAB)
    for slot in range(8):
        crowd.start(slot, options if slot == 5 else Sampling(max_tokens=8, temperature=0.7, seed=slot), ())
    tokens_crowd = [int(draw(crowd, np.tile(logits, (8, 1)), list(range(8)))[5]) for _ in range(6)]
    assert tokens_crowd == tokens_alone
    assert len(set(tokens_alone)) > 1  # the draws do move on


def test_the_streams_are_uniform_and_independent_of_each_other() -> None:
    keys = np.arange(64, dtype=np.uint64)
    draws = np.stack([uniforms(keys, np.full(64, k, dtype=np.uint64)) for k in range(256)])
    assert 0.0 <= draws.min() and draws.max() < 1.0
    assert abs(draws.mean() - 0.5) < 0.01
    assert np.histogram(draws, bins=10, range=(0, 1))[0].min() > 0.9 * draws.size / 10
    correlation = np.corrcoef(draws.T)  # between streams
    assert np.abs(correlation[np.triu_indices(64, 1)]).max() < 0.3


def test_a_stream_is_splitmix64_from_its_key() -> None:
    """Draw n of key k is SplitMix64's output n + 1 from state k (its published sequence from state
    0 starts 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4), the top 53 bits as a float: a seed's tokens
    stay what they were whatever computes the arithmetic."""
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    draws = uniforms(np.zeros(2, dtype=np.uint64), np.array([0, 1], dtype=np.uint64))
    assert draws.tolist() == [(z >> 11) / (1 << 53) for z in expected]
    # The state wraps at 2**64 as uint64 arithmetic does.
    top = np.array([2**64 - 1], dtype=np.uint64)
    assert (
        uniforms(top, np.array([2**64 - 2], dtype=np.uint64)).tolist()
        == uniforms(top - np.uint64(2**63), np.array([2**63 - 2], dtype=np.uint64)).tolist()
    )


# -- through the engine, on the real model ----------------------------------------------


@pytest.fixture(scope="module")
def engine() -> StepEngine:
    """llama.cpp's forward pass: its logits for a sequence of a short prompt and answer are bit for
    bit the same whatever else the step carries (test_llamacpp_logits_do_not_depend_on_the_batch),
    which the seed guarantee needs."""
    return StepEngine(gguf_path(), max_slots=8, threads=2, prefix_cache=False)


def run(engine: StepEngine, jobs: list[tuple[int, str, Sampling]]) -> dict[int, list[RowResult]]:
    """All jobs prefilled in one step, then decoded together until each ends."""
    results: dict[int, list[RowResult]] = {sid: [] for sid, _, _ in jobs}
    rows: list[PrefillRow | DecodeRow] = [PrefillRow(sid, prompt, params) for sid, prompt, params in jobs]
    while rows:
        for r in engine.step(rows):
            results[r.seq_id].append(r)
        rows = [DecodeRow(sid) for sid, rs in results.items() if not rs[-1].finish_reason]
    return results


def token_ids(results: list[RowResult]) -> list[int]:
    return [r.token_id for r in results]


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_batch(engine: StepEngine) -> None:
    story = engine.apply_chat_template([("user", "Tell me a short story about a cat.")])
    options = Sampling(max_tokens=24, temperature=1.0, top_k=50, top_p=0.95, min_p=0.02,
                       presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                       logit_bias=((28, -5.0),), seed=4242)  # fmt: skip
    alone = token_ids(run(engine, [(1, story, options)])[1])
    again = token_ids(run(engine, [(2, story, options)])[2])
    assert alone == again
    others = [engine.apply_chat_template([("user", q)]) for q in ("Name three colors.", "Why is the sky blue?", "Count to five.")]
    crowd = [(10 + i, others[i % 3], Sampling(max_tokens=30, temperature=0.9, seed=i, top_p=0.8)) for i in range(7)]
    batched = run(engine, [*crowd[:3], (3, story, options), *crowd[3:]])
    assert token_ids(batched[3]) == alone
    different_seed = token_ids(run(engine, [(4, story, Sampling(**{**options.__dict__, "seed": 4243}))])[4])
    assert different_seed != alone


def test_logit_bias_forces_the_engines_answer(engine: StepEngine) -> None:
    prompt = engine.apply_chat_template([("user", "Which city is the capital of France?")])
    forced = engine.tokenizer.encode(" banana")
    assert len(forced) == 1
    out = run(engine, [(20, prompt, Sampling(max_tokens=4, logit_bias=((forced[0], 100.0),)))])[20]
    assert token_ids(out) == forced * 4
    assert "".join(r.text for r in out) == " banana" * 4


def test_penalties_break_a_greedy_loop(engine: StepEngine) -> None:
    """Greedy, the model counts "1. 1\n2. 2\n..." and repeats ". " and "\n" at every line; the
    penalties (which greedy decoding honours too) make it repeat less."""
    prompt = engine.apply_chat_template([("user", "Count from 1 to 10.")])

    def most_repeats(options: Sampling) -> int:
        tokens = token_ids(run(engine, [(30, prompt, options)])[30])
        return max(tokens.count(t) for t in tokens)

    plain = most_repeats(Sampling(max_tokens=24))
    assert plain >= 4
    assert most_repeats(Sampling(max_tokens=24, repetition_penalty=1.5)) < plain
    assert most_repeats(Sampling(max_tokens=24, frequency_penalty=2.0)) < plain


def test_an_option_out_of_range_or_a_token_outside_the_vocabulary_is_refused(engine: StepEngine) -> None:
    prompt = engine.apply_chat_template([("user", "Hi")])
    (bad,) = engine.step([PrefillRow(40, prompt, Sampling(max_tokens=4, logit_bias=((engine.vocab_size, 1.0),)))])
    assert bad.finish_reason == "invalid" and bad.error.startswith("sampling.logit_bias: ") and str(engine.vocab_size) in bad.error
    (bad,) = engine.step([PrefillRow(41, prompt, Sampling(max_tokens=4, min_p=2.0))])
    assert bad.error.startswith("sampling.min_p: ")
    assert engine.active_slots == 0


def test_llamacpp_logits_do_not_depend_on_the_batch() -> None:
    """What the seed guarantee rests on: llama.cpp on the CPU computes a sequence's logits bit for bit
    the same alone and beside 7 or 31 other sequences, at prefill and at decode (each sequence has its
    own KV stream, and its rows' products do not mix with other rows'), while its prompt has fewer
    than 64 tokens and it holds fewer than 256 positions: beyond, attention's kernel depends on how
    llama.cpp groups the step's rows (llamacpp_model.py's docstring). On a GPU, or on the numpy
    reference engine, other kernels may round differently at other batch sizes: there a seeded
    sequence's tokens may differ where two tokens' probabilities differ in the last bits."""
    from sluice_triton_local.engine.llamacpp_model import LlamaCppModel
    from sluice_triton_local.engine.model import BatchItem

    tokenizer = StepEngine(gguf_path(), max_slots=1, max_context=64, threads=1).tokenizer
    questions = ["Tell me a story about a cat.", "Name three colors.", "What is 2+2?", "Why is the sky blue?"]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([("user", q)])) for q in questions * 8]
    model = LlamaCppModel(gguf_path(), max_slots=32, max_context=128, threads=2)

    def first_row(n: int) -> list[np.ndarray]:
        for slot in range(32):
            model.release(slot)
        rows = [model.forward([BatchItem(s, prompts[s], 0) for s in range(n)])[0].copy()]
        positions = [len(p) for p in prompts[:n]]
        token = int(np.argmax(rows[0]))
        for _ in range(4):
            logits = model.forward([BatchItem(s, [token if s == 0 else 42], positions[s]) for s in range(n)])
            rows.append(logits[0].copy())
            token, positions = int(np.argmax(logits[0])), [p + 1 for p in positions]
        return rows

    alone = first_row(1)
    for n in (8, 32):
        assert all(np.array_equal(a, b) for a, b in zip(alone, first_row(n))), n
    model.close()
