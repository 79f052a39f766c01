"""What `make bench-prefix` counts, on made-up results (its runs need four stacks and minutes)."""

from __future__ import annotations

import math

from bench_prefix import Phase, Result, busiest_share, figures


def test_figures_pool_rounds_and_count_the_cached_share_of_prompt_tokens() -> None:
    rounds = [
        Phase([Result(0.1, 10, 1000, 990, 0.0, 1.0), Result(0.3, 30, 1000, 0, 1.0, 2.0)], failed=1),
        Phase([Result(0.2, 20, 500, 490, 5.0, 6.0)]),
    ]
    f = figures(rounds)
    assert round(f.ttft_p50_ms, 6) == 200.0
    assert f.tokens_per_s == 60 / 3  # 60 tokens over 2 s + 1 s of wall time
    assert f.cached_share == 1480 / 2500
    assert (f.ok, f.failed) == (3, 1)


def test_a_side_with_no_answer_has_no_figures_but_its_failures() -> None:
    f = figures([Phase([], failed=4)])
    assert math.isnan(f.ttft_p50_ms) and (f.ok, f.failed) == (0, 4)


def test_the_busiest_replica_share_counts_only_this_runs_requests() -> None:
    before = {"a": 10.0, "b": 2.0}
    after = {"a": 40.0, "b": 20.0, "c": 0.0}
    assert busiest_share(before, after) == 30 / 48
