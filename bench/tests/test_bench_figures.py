"""What the benchmarks count, on made-up streams and results (their runs need the whole stack or
minutes of a quiet machine; `make bench-rolling`, `make bench-engine` run them)."""

from __future__ import annotations

from bench_engine import ratio_lines
from bench_rolling import Stream, failed_during, phase_of

ROLLING = (100.0, 160.0)  # the first SIGTERM, the last restarted process serving again


def test_a_stream_in_flight_at_the_first_sigterm_counts_in_the_rolling_restart() -> None:
    cut = Stream(sent_at=95.0, ended_at=101.0, error="UNAVAILABLE: the gateway went away")
    assert phase_of(cut, ROLLING) == "during"
    assert failed_during([cut], ROLLING) == 1


def test_phases_by_when_a_stream_was_in_flight() -> None:
    streams = [
        Stream(sent_at=10.0, ended_at=99.0, finished=True),  # ended before: the baseline
        Stream(sent_at=99.0, ended_at=100.0, finished=True),  # still running at the first SIGTERM
        Stream(sent_at=120.0, ended_at=130.0, error="ended without a finish reason"),
        Stream(sent_at=159.0, ended_at=170.0, finished=True),
        Stream(sent_at=160.0, ended_at=170.0, error="UNAVAILABLE"),  # sent once it was over: after
    ]
    assert [phase_of(s, ROLLING) for s in streams] == ["before", "during", "during", "during", "after"]
    assert failed_during(streams, ROLLING) == 1


def side(tokens: list[int], prefill: float, decode: float) -> dict:
    return {"tokens": tokens, "prefill_tok_s": prefill, "decode_tok_s": decode}


def test_ratios_only_when_greedy_tokens_match() -> None:
    engine = {"1": side([1, 2, 3], 80.0, 40.0), "8": side([1, 2, 3], 400.0, 160.0)}
    llamacpp = {"1": side([1, 2, 3], 100.0, 50.0), "8": side([1, 2, 3], 500.0, 200.0)}
    assert ratio_lines(engine, llamacpp, ["1", "8"]) == [
        "BENCH engine_vs_llamacpp_prefill_batch1 0.80 x",
        "BENCH engine_vs_llamacpp_prefill_batch8 0.80 x",
        "BENCH engine_vs_llamacpp_batch1 0.80 x (target >= 0.8)",
        "BENCH engine_vs_llamacpp_batch8 0.80 x (target >= 0.8)",
        "BENCH engine_vs_llamacpp_prefill 0.80 x (target >= 0.8; the lowest of batch 1, 8)",
    ]
    engine["8"] = side([1, 2, 4], 4000.0, 1600.0)  # fast, but not the same computation
    lines = ratio_lines(engine, llamacpp, ["1", "8"])
    assert not any(line.startswith("BENCH") for line in lines)
    assert lines == ["no ratios: the engine's greedy tokens differ from llama.cpp's at batch 8"]


def test_failures_are_told_by_the_restart_they_ended_in() -> None:
    from bench_rolling import failures_by_restart

    took = [("gateway", 100.0, 30.0), ("inference-adapter", 140.0, 20.0)]
    streams = [
        Stream(sent_at=99.0, ended_at=101.0, error="UNAVAILABLE"),
        Stream(sent_at=120.0, ended_at=135.0, error="UNAVAILABLE"),  # between the two restarts
        Stream(sent_at=141.0, ended_at=150.0, error="ended without a finish reason"),
        Stream(sent_at=141.0, ended_at=150.0, finished=True),  # not a failure
    ]
    assert failures_by_restart(streams, took) == {"gateway": 1, "between": 1, "inference-adapter": 1}


def test_structured_bench_lines_from_its_figures() -> None:
    from bench_structured import bench_lines

    result = {
        "schemas": 4,
        "compile_ms_p50": 0.512,
        "batch1": {"structured_tok_s": 45.0, "free_tok_s": 50.0},
        "batch8": {"structured_tok_s": 190.0, "free_tok_s": 200.0},
        "valid_greedy": [True, True, True, False],
        "valid_sampled": [True, False, True, False],
    }
    assert bench_lines(result) == [
        "BENCH structured_vs_free_batch1 0.90 x",
        "BENCH structured_vs_free_batch8 0.95 x (target >= 0.9)",
        "BENCH structured_compile_ms 0.51 ms (p50 over 4 schemas)",
        "BENCH structured_valid_fraction 0.75 (greedy, 4 schemas; target 1.0)",
        "BENCH structured_valid_fraction_sampled 0.50 (temperature 1)",
    ]


def test_tracing_counts_a_streams_tokens_not_its_responses() -> None:
    """With the adapter's 50 ms stream interval a response carries several tokens: the batch counts
    the completion tokens the stream's usage reports (its last count), not the responses."""
    from bench_tracing import completion_tokens

    assert completion_tokens(iter([("Hello", None), (" there, how", None), (" are you?", None), ("", 9)])) == 9
    assert completion_tokens(iter([("Hi", None)])) == 0  # no usage: nothing counted


def test_jobs_interactive_alternates_which_phase_goes_first() -> None:
    from bench_jobs_interactive import ROUNDS, phase_order

    orders = [phase_order(r) for r in range(ROUNDS)]
    assert orders[:2] == [(False, True), (True, False)]
    assert all(sorted(order) == [False, True] for order in orders)  # each round runs both phases
    assert sum(order[0] for order in orders) == ROUNDS // 2  # the job phase first in half the rounds


def test_load_and_rolling_percentiles_stay_within_the_samples() -> None:
    """statistics.quantiles' default (exclusive) method reaches past the slowest of fewer than 99 samples."""
    import bench_load
    import bench_rolling

    ttfts = [0.1 * i for i in range(1, 17)]  # 16 streams
    for percentile in (bench_load.percentile, bench_rolling.percentile):
        assert percentile(ttfts, 99) <= max(ttfts)
        assert abs(percentile(ttfts, 50) - (ttfts[7] + ttfts[8]) / 2) < 1e-9
