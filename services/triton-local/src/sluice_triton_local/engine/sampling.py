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
        order = np.argsort(-probs, kind="stable")
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
