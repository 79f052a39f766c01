"""triton-local's MiniLM encoder, sentences per second, in triton-local's environment:

  services/triton-local/.venv/bin/python bench/engine/embeddings.py [N] [BATCH ...]


Set OPENBLAS_NUM_THREADS (before Python starts) to fix the BLAS threads. Prints one JSON line:
{"texts": N, "batch_1": sentences/s, "batch_32": sentences/s, ...}.
"""

from __future__ import annotations

import json
import sys
import time

from sluice_triton_local.embeddings.minilm import MiniLMEncoder

SUBJECTS = ["The cat", "A young engineer", "The old harbour", "Every morning the train", "My neighbour's dog"]
VERBS = ["watches", "repairs", "remembers", "crosses", "ignores"]
OBJECTS = ["the quiet river.", "a broken bicycle near the station.", "the rain on the roof.", "three red apples.", "the city lights at night."]


def sample_texts(n: int) -> list[str]:
    return [f"{SUBJECTS[i % 5]} {VERBS[(i // 5) % 5]} {OBJECTS[(i // 25) % 5]} ({i})" for i in range(n)]


def sentences_per_second(encoder: MiniLMEncoder, texts: list[str], batch: int, repeats: int = 3) -> float:
    """Best of `repeats` passes over `texts` in chunks of `batch` (the best filters out noise
    from other processes on a shared machine)."""
    encoder.encode(texts[:batch])  # warm up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for i in range(0, len(texts), batch):
            encoder.encode(texts[i : i + batch])
        best = min(best, time.perf_counter() - started)
    return len(texts) / best


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 256
    batches = [int(b) for b in argv[1:]] or [1, 32]
    encoder = MiniLMEncoder()
    texts = sample_texts(n)
    result: dict[str, float] = {"texts": n}
    for batch in batches:
        result[f"batch_{batch}"] = round(sentences_per_second(encoder, texts, batch), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
