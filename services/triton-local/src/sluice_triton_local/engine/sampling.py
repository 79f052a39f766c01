"""Per-sequence token sampling from one logits row.

Each sequence owns its numpy Generator and draws exactly one uniform number
per sampled token, so a seeded sequence produces the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import numpy as np


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    if temperature <= 0.0:
        return int(np.argmax(logits))
    weights = _weights(logits, temperature)
    if top_p < 1.0:
        probs = weights / weights.sum(dtype=np.float64)
        order = _top_order(probs, top_p)
        sorted_p = probs[order]
        cum = np.cumsum(sorted_p)
        # Smallest prefix whose mass reaches top_p (always at least one token).
        keep = min(int(np.searchsorted(cum, top_p)) + 1, len(order))
        cum = np.cumsum(sorted_p[:keep])
        u = rng.random() * cum[-1]
        return int(order[min(int(np.searchsorted(cum, u, side="right")), keep - 1)])
    return _inverse_cdf(weights, rng.random())


def _weights(logits: np.ndarray, temperature: float) -> np.ndarray:
    """exp((logits - max) / temperature), unnormalized: float32 is exact enough for weights in
    (0, 1] and twice as fast as float64 over 49k entries; their sums are taken in float64."""
    z = np.asarray(logits, dtype=np.float32) * np.float32(1.0 / temperature)
    z -= z.max()
    return np.exp(z, out=z)


# The inverse CDF by blocks: block sums, then one block's running sum, instead of a running sum
# over all 49k weights (a third of the time: 0.29 ms instead of 0.97 per token here).
_BLOCK = 256


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    """The token whose cumulative weight first exceeds u x the total."""
    n = weights.size
    whole = n - n % _BLOCK
    block_sums = weights[:whole].reshape(-1, _BLOCK).sum(axis=1, dtype=np.float64)
    if whole < n:
        block_sums = np.append(block_sums, weights[whole:].sum(dtype=np.float64))
    cum_blocks = np.cumsum(block_sums)
    target = u * cum_blocks[-1]
    block = min(int(np.searchsorted(cum_blocks, target, side="right")), len(cum_blocks) - 1)
    before = cum_blocks[block - 1] if block else 0.0
    inner = np.cumsum(weights[block * _BLOCK : (block + 1) * _BLOCK], dtype=np.float64) + before
    return block * _BLOCK + min(int(np.searchsorted(inner, target, side="right")), len(inner) - 1)


# Sorting all 49k probabilities costs ~3 ms per token; the nucleus almost
# always lies within the few hundred most likely tokens, so sort those first.
_CANDIDATES = 1024


def _top_order(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Token ids by descending probability, covering at least top_p mass."""
    if probs.size > _CANDIDATES:
        cand = np.argpartition(-probs, _CANDIDATES)[:_CANDIDATES]
        # Deterministic tie order (by id) so equal logits always give equal output.
        cand.sort()
        order = cand[np.argsort(-probs[cand], kind="stable")]
        if probs[order].sum() >= top_p:
            return order
    return np.argsort(-probs, kind="stable")
