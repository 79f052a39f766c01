"""Token sampling for a whole step's rows at once, each row with its own options and random stream.

The options are sluice_common.sampling.Sampling's, applied in vLLM's order (its V1 sampler):

  1. logit_bias is added to the logits;
  2. penalties: repetition_penalty divides the positive logits (multiplies the negative ones) of
     every token seen in the prompt or the output so far; then each generated token's logit loses
     frequency_penalty x its count + presence_penalty (OpenAI's formula);
  3. temperature 0 (or below 1e-5, as vLLM): the most likely token (greedy, after 1 and 2); else the
     logits are divided by the temperature and turned into weights (exp, max 1);
  4. min_p drops tokens whose probability is below min_p x the most likely one's;
  5. top_k keeps the k most likely of what is left, top_p the smallest most-likely set whose mass
     (renormalised over what is left) reaches top_p; ties at a cut are kept;
  6. one uniform number picks the token by the inverse CDF of the weights left.

Everything is numpy over the rows of the step: no Python loop per row. A sequence's options and
penalty counts live in per-slot arrays (a slot holds one live sequence), so a step gathers them by
slot. Random numbers come from a counter-based generator (SplitMix64 of the sequence's key and its
count of draws): a row's k-th draw depends on its seed and k alone, never on the rows beside it, so
a seeded sequence samples the same tokens at any batch size, as long as its logits are the same
(llamacpp_model.py says when they are: on the CPU, for a prompt under 64 tokens and a sequence under
256 positions, whatever else a step carries; beyond that they may differ in the last bits).
An unseeded sequence gets a key from the OS's entropy.

Log-probabilities (Sampling.logprobs, for the rows that ask only): as vLLM's V1 sampler reports them by
default (logprobs_mode "raw_logprobs"), of the model's own distribution: log_softmax of the logits
as the forward pass gave them, before logit_bias, the penalties, the temperature and any truncation;
the sampled token's, and the k most likely tokens' (argpartition, then a sort of those k) by logprob
descending. A greedy token is therefore always the first of its top list. A structured output's
constraint masks the logits first: the tokens it rules out report LOGPROB_FLOOR, as vLLM's do.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sluice_common.sampling import Sampling

# top_k and top_p look at the most likely tokens first: the nucleus almost always lies within
# the few hundred most likely of the 49k, and a partial sort of those is much cheaper than a sort.
_CANDIDATES = 1024
# The inverse CDF by blocks: block sums, then one block's running sum, instead of a running sum
# over every weight of the row.
_BLOCK = 256

# SplitMix64 on Python ints (mod 2**64): a row's draw is a handful of integer operations, where
# numpy's uint64 arrays took sixteen calls a step, each slow on the caches a decode has just flushed.
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
# The least logprob reported, vLLM's (its OpenAI server's): a token a constraint rules out has a logit
# of -inf, and JSON has no -Infinity (json.dumps writes it; strict parsers refuse the document).
LOGPROB_FLOOR = -9999.0
# Temperatures below this sample greedily, as vLLM's (its _SAMPLING_EPS): 1 / float32(t) overflows
# to inf for t below ~3e-39 (NaN weights: token 0 every time), and below 1e-5 sampling is all but greedy.
GREEDY_BELOW_TEMPERATURE = 1e-5


def _mix(z: int) -> int:
    """SplitMix64's output function (uint64 arithmetic wraps, as it must)."""
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def seed_key(seed: int | None) -> int:
    """The stream key of a sequence: its seed mixed (nearby seeds give unrelated streams), or fresh entropy."""
    if seed is None:
        return secrets.randbits(64)
    return _mix(seed & _MASK64)


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Draw number `counters` of the streams `keys`: floats in [0, 1), one per row."""
    scale = 1.0 / (1 << 53)
    draws = [(_mix((key + (counter + 1) * _GOLDEN) & _MASK64) >> 11) * scale for key, counter in zip(keys.tolist(), counters.tolist())]
    return np.array(draws, dtype=np.float64)


@dataclass(frozen=True)
class RowLogprobs:
    """A sampled token's log-probability and the most likely tokens' at its position (ids), by
    logprob descending."""

    logprob: float
    top: tuple[tuple[int, float], ...]
    # 1 + the tokens more likely than the sampled one (vLLM's Logprob.rank; Triton's vLLM backend
    # reports it for every token of its logprobs output).
    rank: int = 1


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log_softmax in float64 (a float32 sum over 49k exps loses the small logprobs' digits)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    return z


def row_logprobs(logits: np.ndarray, tokens: np.ndarray, top: np.ndarray) -> list[RowLogprobs]:
    """Per row of raw `logits`: the logprob of `tokens[i]` and the `top[i]` most likely tokens', none
    below LOGPROB_FLOOR."""
    lp = log_softmax(logits)
    np.maximum(lp, LOGPROB_FLOOR, out=lp)
    rows = np.arange(len(lp))
    chosen = lp[rows, tokens]
    ranks = 1 + (lp > chosen[:, None]).sum(axis=1)
    k = int(top.max()) if len(top) else 0
    if 0 < k < lp.shape[1]:
        ids = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    else:
        ids = np.broadcast_to(np.arange(lp.shape[1]), lp.shape)[:, :k]
    values = np.take_along_axis(lp, ids, axis=1)
    order = np.argsort(-values, axis=1, kind="stable")
    ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
    return [RowLogprobs(float(chosen[i]), tuple(zip(ids[i, : top[i]].tolist(), values[i, : top[i]].tolist())), int(ranks[i])) for i in rows]


class BatchSampler:
    """The sampling state of every slot and the step's sampling over them."""

    def __init__(self, slots: int, vocab: int) -> None:
        self.vocab = vocab
        self._temperature = np.zeros(slots, dtype=np.float32)
        self._top_p = np.ones(slots, dtype=np.float64)
        self._top_k = np.zeros(slots, dtype=np.int64)
        self._min_p = np.zeros(slots, dtype=np.float32)
        self._presence = np.zeros(slots, dtype=np.float32)
        self._frequency = np.zeros(slots, dtype=np.float32)
        self._repetition = np.ones(slots, dtype=np.float32)
        self._keys = np.zeros(slots, dtype=np.uint64)
        self._draws = np.zeros(slots, dtype=np.uint64)
        self._has_bias = np.zeros(slots, dtype=bool)
        self._penalized = np.zeros(slots, dtype=bool)
        self._logprobs = np.full(slots, -1, dtype=np.int64)  # -1: the sequence asked for none
        # Filled by `sample` for its rows that asked (None for the others).
        self.last_logprobs: list[RowLogprobs | None] = []
        # [slots, vocab] arrays, made when a sequence first needs them (most requests use neither).
        self._bias: np.ndarray | None = None
        self._counts: np.ndarray | None = None  # how often each token was generated
        self._in_prompt: np.ndarray | None = None  # tokens of the prompt (repetition_penalty)

    def start(self, slot: int, params: Sampling, prompt: Sequence[int]) -> None:
        """A new sequence takes the slot: its options, a fresh stream, no counts."""
        self._temperature[slot] = params.temperature if params.temperature >= GREEDY_BELOW_TEMPERATURE else 0.0
        self._top_p[slot] = params.top_p
        self._top_k[slot] = params.top_k if 0 < params.top_k < self.vocab else 0
        self._min_p[slot] = params.min_p
        self._presence[slot] = params.presence_penalty
        self._frequency[slot] = params.frequency_penalty
        self._repetition[slot] = params.repetition_penalty
        self._keys[slot] = seed_key(params.seed)
        self._draws[slot] = 0
        self._logprobs[slot] = -1 if params.logprobs is None else params.logprobs
        self._has_bias[slot] = bool(params.logit_bias)
        if params.logit_bias:
            bias = self._bias = self._bias if self._bias is not None else self._dense(np.float32)
            bias[slot] = 0.0
            ids = np.fromiter((token for token, _ in params.logit_bias), dtype=np.int64)
            bias[slot, ids] = np.fromiter((value for _, value in params.logit_bias), dtype=np.float32)
        self._penalized[slot] = params.penalized
        if params.penalized:
            counts = self._counts = self._counts if self._counts is not None else self._dense(np.int32)
            in_prompt = self._in_prompt = self._in_prompt if self._in_prompt is not None else self._dense(bool)
            counts[slot] = 0
            in_prompt[slot] = False
            in_prompt[slot, np.asarray(prompt, dtype=np.int64)] = True

    def _dense(self, dtype: type) -> np.ndarray:
        return np.zeros((len(self._keys), self.vocab), dtype=dtype)

    def sample(self, logits: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """One token per row of `logits` ([rows, vocab], float32, changed in place), row i being the
        sequence in slot `slots[i]`; each row's state moves on by its token."""
        slots = np.asarray(slots, dtype=np.int64)
        top = self._logprobs[slots]
        asked = np.flatnonzero(top >= 0)
        raw = logits[asked] if len(asked) else None  # a copy: the model's logits, before adjust
        self.adjust(logits, slots)
        tokens = np.empty(len(slots), dtype=np.int64)
        greedy = self._temperature[slots] <= 0.0
        # A masked or indexed selection copies each row's vocabulary: taken only for a mixed batch.
        if greedy.all():
            tokens[:] = np.argmax(logits, axis=1)
        elif greedy.any():
            tokens[greedy] = np.argmax(logits[greedy], axis=1)
        sampled = np.flatnonzero(~greedy)
        if len(sampled):
            rows = slots[sampled]
            u = uniforms(self._keys[rows], self._draws[rows])
            self._draws[rows] += np.uint64(1)
            tokens[sampled] = self._draw(logits if len(sampled) == len(slots) else logits[sampled], rows, u)
        if self._counts is not None:
            penalized = self._penalized[slots]
            self._counts[slots[penalized], tokens[penalized]] += 1
        self.last_logprobs = [None] * len(slots)
        if raw is not None:
            for i, found in zip(asked, row_logprobs(raw, tokens[asked], top[asked])):
                self.last_logprobs[i] = found
        return tokens

    def adjust(self, logits: np.ndarray, slots: np.ndarray) -> None:
        """Steps 1 and 2: logit_bias and the penalties, in place."""
        biased = self._has_bias[slots]
        if self._bias is not None and biased.any():
            logits[biased] += self._bias[slots[biased]]
        penalized = np.flatnonzero(self._penalized[slots])
        if self._counts is None or self._in_prompt is None or not len(penalized):
            return
        rows = slots[penalized]
        counts = self._counts[rows]
        # Only the tokens seen (the prompt's and the output's, a few hundred of the vocabulary) change.
        seen_row, token = np.nonzero((counts > 0) | self._in_prompt[rows])
        row = penalized[seen_row]
        values = logits[row, token]
        repetition = self._repetition[rows][seen_row]
        values = np.where(values > 0, values / repetition, values * repetition)
        count = counts[seen_row, token].astype(np.float32)
        values -= self._frequency[rows][seen_row] * count + self._presence[rows][seen_row] * (count > 0)
        logits[row, token] = values

    def _draw(self, logits: np.ndarray, rows: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Temperature, min_p, top_k and top_p, then the inverse CDF at u, for sampled rows."""
        z = np.multiply(logits, (np.float32(1.0) / self._temperature[rows])[:, None], out=logits)  # the rows are ours to change
        z -= z.max(axis=1, keepdims=True)
        weights = np.exp(z, out=z)  # the most likely token weighs 1
        min_p = self._min_p[rows]
        if (min_p > 0).any():
            weights[weights < min_p[:, None]] = 0.0
        top_k, top_p = self._top_k[rows], self._top_p[rows]
        truncated = np.flatnonzero((top_k > 0) | (top_p < 1.0))
        if len(truncated):
            cut = _cut(weights[truncated], top_k[truncated], top_p[truncated])
            part = weights[truncated]
            part[part < cut[:, None]] = 0.0
            weights[truncated] = part
        return _inverse_cdf(weights, u)


def _cut(weights: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """Per row, the smallest weight that top_k and top_p keep (0 < k < vocab, or 0: no limit)."""
    vocab = weights.shape[1]
    # top_k alone needs only the k largest; top_p the nucleus, most likely within _CANDIDATES.
    needed = int(top_k.max()) if (top_p >= 1.0).all() else max(_CANDIDATES, int(top_k.max()))
    candidates = min(vocab, needed)
    top = _largest(weights, candidates)
    k = np.where(top_k > 0, top_k, candidates)
    in_k = np.arange(candidates)[None, :] < k[:, None]
    # top_p's mass is relative to what min_p and top_k left: all of it without top_k, else the top k.
    total = np.where(top_k > 0, (top * in_k).sum(axis=1, dtype=np.float64), weights.sum(axis=1, dtype=np.float64))
    mass = np.cumsum(top * in_k, axis=1, dtype=np.float64) / total[:, None]
    # The smallest prefix whose mass reaches top_p; a row whose candidates do not reach it (a flat
    # distribution) is sorted whole.
    short = (top_k == 0) & (mass[:, -1] < top_p) & (candidates < vocab)
    if short.any():
        whole = -np.sort(-weights[short], axis=1)
        cum = np.cumsum(whole, axis=1, dtype=np.float64) / total[short][:, None]
        last = np.minimum((cum < top_p[short][:, None]).sum(axis=1), vocab - 1)
        cut_short = whole[np.arange(len(whole)), last]
    last = np.minimum((mass < top_p[:, None]).sum(axis=1), k - 1)
    cut = top[np.arange(len(top)), last]
    if short.any():
        cut[short] = cut_short
    return cut


def _largest(weights: np.ndarray, n: int) -> np.ndarray:
    """Each row's n largest weights, in descending order."""
    if n < weights.shape[1]:
        part = -np.partition(-weights, n - 1, axis=1)[:, :n]
    else:
        part = weights
    return -np.sort(-part, axis=1)


def _inverse_cdf(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the token whose cumulative weight first exceeds u x the row's total."""
    rows, vocab = weights.shape
    blocks = -(-vocab // _BLOCK)
    padded = weights
    if blocks * _BLOCK != vocab:
        padded = np.zeros((rows, blocks * _BLOCK), dtype=weights.dtype)
        padded[:, :vocab] = weights
    shaped = padded.reshape(rows, blocks, _BLOCK)
    # Column b + 1: the weight of blocks 0..b; column 0: none, what comes before block 0.
    cum_blocks = np.zeros((rows, blocks + 1), dtype=np.float64)
    np.cumsum(shaped.sum(axis=2, dtype=np.float64), axis=1, out=cum_blocks[:, 1:])
    target = u * cum_blocks[:, -1]
    block = np.minimum((cum_blocks[:, 1:] <= target[:, None]).sum(axis=1), blocks - 1)
    index = np.arange(rows)
    inner = np.cumsum(shaped[index, block], axis=1, dtype=np.float64) + cum_blocks[index, block][:, None]
    tokens = block * _BLOCK + np.minimum((inner <= target[:, None]).sum(axis=1), _BLOCK - 1)
    # Rounding at the very end of a row may point past its last kept token: take the most likely.
    dropped = (tokens >= vocab) | (weights[index, np.minimum(tokens, vocab - 1)] <= 0.0)
    if dropped.any():
        tokens[dropped] = np.argmax(weights[dropped], axis=1)
    return tokens
