"""bench-gpu's (gpu.py's) device-independent parts, on the CPU: its comparison and BENCH line with
both sides on the CPU, and the line and exit code it gives where there is no GPU."""

from __future__ import annotations

import re

import pytest

import gpu as bench_gpu
from conftest import run_script


def test_comparison_with_both_sides_on_the_cpu_is_identical() -> None:
    gpu, cpu = bench_gpu.engines([1, 2], steps=6, threads=2, gpu_layers=0)
    assert bench_gpu.kv_cache_line(cpu).startswith("KV cache a side: 2 slots x 198 positions x 22.5 KiB")
    for batch in (1, 2):
        result = bench_gpu.compare(gpu, cpu, batch, steps=6, rounds=1)
        assert result.divergence() == {}
        assert [len(row) for row in result.gpu.tokens] == [7] * batch  # the prefill's token and 6 steps
        assert re.fullmatch(
            rf"BENCH gpu batch={batch} decode_tok_s=\d+\.\d cpu_decode_tok_s=\d+\.\d ratio=\d+\.\d\d "
            rf"greedy_identical=true \({batch}/{batch} rows\) prefill_tok_s=[1-9]\d* cpu_prefill_tok_s=[1-9]\d*",
            result.line(),
        ), result.line()
    assert gpu.active_slots == cpu.active_slots == 0


def test_divergence_names_each_row_and_its_first_differing_token() -> None:
    same, other = bench_gpu.Side(10.0, [[1, 2, 3], [4, 5, 6], [7, 8]]), bench_gpu.Side(5.0, [[1, 2, 3], [4, 9, 6], [7, 8, 0]])
    result = bench_gpu.Comparison(3, same, other)
    assert result.divergence() == {1: 1, 2: 2}
    assert result.line().endswith("ratio=2.00 greedy_identical=false (1/3 rows) prefill_tok_s=0 cpu_prefill_tok_s=0")


def test_without_a_gpu_it_says_why_and_exits_no_gpu() -> None:
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("llama.cpp here can offload to a GPU")
    proc = run_script("gpu.py")
    assert proc.returncode == bench_gpu.NO_GPU == 3, proc.stderr
    assert proc.stdout.splitlines() == [proc.stdout.strip()] and "CPU build" in proc.stdout, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench-gpu: llama-cpp-python here is a CPU build"), lines
    assert 'CMAKE_ARGS="-DGGML_CUDA=on"' in lines[0]


def test_the_step_protocol_gives_the_engines_own_greedy_tokens_at_every_round_length() -> None:
    gpu, cpu = bench_gpu.engines([2], steps=6, threads=2, gpu_layers=0)
    alone = bench_gpu.compare(gpu, cpu, 2, steps=6, rounds=1).gpu
    shared = bench_gpu.SharedEngine(gpu)
    # Steps sharing responses (interval_ms, as the adapter asks) give the same tokens as a response per step.
    for round_steps, ahead, interval_ms in ((1, False, 0), (4, False, 0), (8, False, 50), (64, False, 50), (2, True, 0), (4, True, 50)):
        run = bench_gpu.protocol_run(shared, gpu, 2, round_steps, steps=6, rounds=1, ahead=ahead, interval_ms=interval_ms)
        assert run.protocol.tokens == alone.tokens, (round_steps, ahead, interval_ms)
        assert run.engine.tokens == alone.tokens  # the engine alone, measured beside the protocol on the engine's thread
        assert re.fullmatch(
            rf"BENCH gpu_protocol_in_process batch=2 round_steps={round_steps} ahead={str(ahead).lower()} interval_ms={interval_ms} tok_s=\d+\.\d engine_tok_s=\d+\.\d "
            r"ratio=\d+\.\d\d greedy_identical=true \(2/2 rows\)",
            run.line(),
        ), run.line()
    assert gpu.active_slots == 0  # every protocol sequence released


def test_each_protocol_figure_is_paired_with_the_engine_alone_measured_beside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A, B, A, B: the engine alone then the protocol, each pair's ratio its own, their spread said."""
    order: list[str] = []
    speeds = iter([(100.0, 80.0), (50.0, 45.0), (90.0, 63.0)])  # (engine alone, protocol) a pair: the box slowed in pair 2
    pair: list[tuple[float, float]] = []

    def alone(shared: object, engine: object, batch: int, steps: int = 0) -> bench_gpu.Side:
        order.append("engine")
        pair[:] = [next(speeds)]
        return bench_gpu.Side(pair[0][0], [[1, 2]] * batch)

    def protocol(shared: object, prompts: list[str], *_: object) -> bench_gpu.Side:
        order.append("protocol")
        return bench_gpu.Side(pair[0][1], [[1, 2]] * len(prompts))

    monkeypatch.setattr(bench_gpu, "engine_alone", alone)
    monkeypatch.setattr(bench_gpu, "protocol_decode", protocol)
    run = bench_gpu.protocol_run(None, None, 2, 8, rounds=3)  # type: ignore[arg-type]
    assert order == ["engine", "protocol"] * 3
    assert run.ratios() == pytest.approx([0.8, 0.9, 0.7])
    # Each side's best, the median of the pairs' ratios (not best over best: 80 / 100), and their range.
    assert run.line().endswith(
        "tok_s=80.0 engine_tok_s=100.0 ratio=0.80 (pairs 0.80, 0.90, 0.70; min 0.70, max 0.90) greedy_identical=true (2/2 rows)"
    ), run.line()


def test_a_protocol_row_that_differs_is_counted() -> None:
    alone = bench_gpu.Side(10.0, [[1, 2], [3, 4]])
    run = bench_gpu.ProtocolRun(2, 8, ((bench_gpu.Side(8.0, [[1, 2], [3, 5]]), alone),))
    assert run.line().endswith("ratio=0.80 greedy_identical=false (1/2 rows)")
    # A row that differs in one pair of two is counted as differing.
    twice = bench_gpu.ProtocolRun(2, 8, ((bench_gpu.Side(8.0, [[1, 2], [3, 4]]), alone), (bench_gpu.Side(9.0, [[1, 2], [3, 5]]), alone)))
    assert twice.line().endswith("ratio=0.85 (pairs 0.80, 0.90; min 0.80, max 0.90) greedy_identical=false (1/2 rows)")


def test_an_engine_alone_that_measured_nothing_gives_no_ratio_rather_than_dividing_by_zero() -> None:
    run = bench_gpu.ProtocolRun(1, 8, ((bench_gpu.Side(8.0, [[1]]), bench_gpu.Side(0.0, [[1]])),))
    assert "ratio=nan" in run.line()
    assert "ratio=nan" in bench_gpu.Comparison(1, bench_gpu.Side(1.0, [[1]]), bench_gpu.Side(0.0, [[1]])).line()


def test_a_protocol_round_that_fails_on_the_engine_thread_raises_its_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = bench_gpu.StepEngine(bench_gpu.gguf_path(), 1, 64, engine="llamacpp", threads=2, gpu_layers=0, prefix_cache=False)
    shared = bench_gpu.SharedEngine(gpu)

    def broken_step(*_: object, **__: object) -> None:
        raise RuntimeError("the engine's thread broke")

    # Outside the forward pass: the round's Future holds the error and no response is answered.
    monkeypatch.setattr(shared, "_step", broken_step)
    monkeypatch.setattr(bench_gpu, "RESPONSE_TIMEOUT_S", 10.0)  # a reader left waiting would end in TimeoutError
    with pytest.raises(RuntimeError, match="the engine's thread broke"):
        bench_gpu.protocol_decode(shared, bench_gpu.PROMPTS[:1], 2, 1)


def test_the_protocol_clock_runs_between_the_engine_threads_answers_not_the_readers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill's response answered at t=100, two decode steps at 101 and 102, all in one round;
    the reader gets to them only at 150, after the round: 2 tokens in 2 s, as greedy_decode's clock
    (after the prefill step, after the last decode step) would have it."""
    import types
    from concurrent.futures import Future

    import numpy as np

    clock = [0.0]
    monkeypatch.setattr(bench_gpu, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def start_round(engine: object, inputs: dict, on_response: object) -> Future[None]:
        seq = int(inputs["SEQ_ID"][0])
        if int(inputs["ACTION"][0]) == bench_gpu.PREFILL:
            for at, token, finish in ((100.0, 7, b""), (101.0, 8, b""), (102.0, 9, b"length")):
                clock[0] = at
                row = {
                    "ROW_SEQ_ID": np.array([seq]),
                    "TOKEN_ID": np.array([token]),
                    "FINISH": np.array([finish], object),
                    "ERROR": np.array([b""], object),
                }
                on_response(row, finish == b"length")  # type: ignore[operator]
            clock[0] = 150.0  # the reader's turn comes late
        done: Future[None] = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(bench_gpu, "start_round", start_round)
    side = bench_gpu.protocol_decode(None, bench_gpu.PROMPTS[:1], 2, 3)  # type: ignore[arg-type]
    assert side.tokens == [[7, 8, 9]]
    assert side.decode_tok_s == pytest.approx(1.0)


def test_an_engine_alone_run_that_does_not_end_raises_within_the_response_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    gpu = bench_gpu.StepEngine(bench_gpu.gguf_path(), 1, 64, engine="llamacpp", threads=2, gpu_layers=0, prefix_cache=False)
    shared = bench_gpu.SharedEngine(gpu)
    monkeypatch.setattr(bench_gpu, "greedy_decode", lambda *_: time.sleep(3))  # a step that hangs, on the engine's thread
    monkeypatch.setattr(bench_gpu, "RESPONSE_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the engine alone did not end 4 steps at batch 1 in 0 s"):
        bench_gpu.engine_alone(shared, gpu, 1, 4)
    assert time.monotonic() - t0 < 2.5
