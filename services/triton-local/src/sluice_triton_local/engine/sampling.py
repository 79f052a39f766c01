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
    # float64 keeps the softmax/cumsum stable for low temperatures and 49k entries.
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    probs = np.exp(z)
    probs /= probs.sum()
    if top_p < 1.0:
        order = _top_order(probs, top_p)
        sorted_p = probs[order]
        cum = np.cumsum(sorted_p)
        # Smallest prefix whose mass reaches top_p (always at least one token).
        keep = min(int(np.searchsorted(cum, top_p)) + 1, len(order))
        order, sorted_p = order[:keep], sorted_p[:keep]
        cum = np.cumsum(sorted_p)
    else:
        order = None
        cum = np.cumsum(probs)
    u = rng.random() * cum[-1]
    idx = min(int(np.searchsorted(cum, u, side="right")), len(cum) - 1)
    return int(order[idx]) if order is not None else idx


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
