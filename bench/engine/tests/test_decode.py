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


def test_a_decode_row_that_ends_in_error_raises_rather_than_leaving_the_batch() -> None:
    """As the step protocol's side of gpu.py does: a row ending "error" mid-decode would otherwise
    make every later step's batch smaller than the one measured, unsaid."""
    import pytest

    from decode import greedy_decode
    from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, RowResult

    class Engine:
        def __init__(self) -> None:
            self.released: list[int] = []
            self.decode_steps = 0

        def step(self, rows: list) -> list[RowResult]:
            if isinstance(rows[0], PrefillRow):
                return [RowResult(r.seq_id, 5, "a", "", 3, 1) for r in rows]
            if isinstance(rows[0], ReleaseRow):
                self.released += [r.seq_id for r in rows]
                return [RowResult(r.seq_id, -1, "", "", 0, 0) for r in rows]
            assert all(isinstance(r, DecodeRow) for r in rows)
            self.decode_steps += 1
            # The second decode step: the last row fails, the others go on.
            return [
                RowResult(r.seq_id, -1, "", "error", 3, 2, error="KV cache full")
                if self.decode_steps == 2 and i == len(rows) - 1
                else RowResult(r.seq_id, 6, "b", "", 3, 2)
                for i, r in enumerate(rows)
            ]

    engine = Engine()
    with pytest.raises(RuntimeError, match="decode failed: sequence 10002 ended error: KV cache full"):
        greedy_decode(engine, ["p"] * 3, 8)  # type: ignore[arg-type]
    assert engine.decode_steps == 2 and sorted(engine.released) == [10000, 10001, 10002]  # its slots given back first

    engine = Engine()
    engine.step = lambda rows: [RowResult(r.seq_id, -1, "", "busy", 0, 0) for r in rows] if isinstance(rows[0], PrefillRow) else []  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="prefill failed: sequence 10000 ended busy"):
        greedy_decode(engine, ["p"], 8)  # type: ignore[arg-type]
