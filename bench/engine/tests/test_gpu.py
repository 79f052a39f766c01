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
        run = bench_gpu.protocol_run(shared, alone, 2, round_steps, steps=6, rounds=1, ahead=ahead, interval_ms=interval_ms)
        assert run.protocol.tokens == alone.tokens, (round_steps, ahead, interval_ms)
        assert re.fullmatch(
            rf"BENCH gpu_protocol_in_process batch=2 round_steps={round_steps} ahead={str(ahead).lower()} interval_ms={interval_ms} tok_s=\d+\.\d engine_tok_s=\d+\.\d "
            r"ratio=\d+\.\d\d greedy_identical=true \(2/2 rows\)",
            run.line(),
        ), run.line()
    assert gpu.active_slots == 0  # every protocol sequence released


def test_a_protocol_row_that_differs_is_counted() -> None:
    alone = bench_gpu.Side(10.0, [[1, 2], [3, 4]])
    run = bench_gpu.ProtocolRun(2, 8, bench_gpu.Side(8.0, [[1, 2], [3, 5]]), alone)
    assert run.line().endswith("ratio=0.80 greedy_identical=false (1/2 rows)")


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
