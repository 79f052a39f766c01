"""bench/engine/decode.py and embeddings.py run and report a figure for each batch size. Printed,
not asserted: the machine is shared."""

from __future__ import annotations

from conftest import run_bench


def test_decode_throughput_single_thread() -> None:
    stats = run_bench("decode.py", "1", "8")
    print(
        f"\n[engine perf, 1 BLAS thread] load {stats['load_s']} s; greedy decode "
        f"{stats['batch1_tok_s']} tok/s at batch 1, {stats['batch8_tok_s']} tok/s at batch 8"
    )
    assert stats["batch1_tok_s"] > 0 and stats["batch8_tok_s"] > 0


def test_sentences_per_second_single_thread() -> None:
    """Reference: ~226 sentences/s with torch."""
    stats = run_bench("embeddings.py", "128", "1", "32")
    print(f"\nMiniLM numpy, 1 BLAS thread: {stats['batch_1']} sentences/s at batch 1, {stats['batch_32']} at batch 32")
    assert stats["batch_1"] > 0 and stats["batch_32"] > 0
