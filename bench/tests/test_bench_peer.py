"""What `make bench-peer` counts, on made-up event streams and phases (its runs need the whole
stack, llama-server and minutes of a quiet machine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bench_openai import Outcome, Phase
from bench_peer import (
    LOADS,
    PEER,
    SAMPLING,
    SIDES,
    Figures,
    StreamState,
    cached_ratio_lines,
    chat_body,
    figures,
    ratio_lines,
    report,
    servers,
)
from llama_server import GGML_FLAGS, REPO_ROOT, cached_source, locked_version


def data(event: dict) -> str:
    return f"data: {json.dumps(event)}\n"


def test_ttft_from_the_first_content_and_tokens_from_the_reported_usage() -> None:
    state = StreamState()
    state.feed(data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), now=10.1)
    state.feed(data({"choices": [{"index": 0, "delta": {"content": "Hello"}}]}), now=10.3)
    state.feed(data({"choices": [{"index": 0, "delta": {"content": " there"}}]}), now=10.4)
    state.feed(data({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}), now=10.5)
    state.feed(data({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 64, "total_tokens": 84}}), now=10.5)
    state.feed("\n", now=10.5)
    state.feed("data: [DONE]\n", now=10.6)
    assert state.done
    outcome = state.outcome(sent=10.0, ended=10.6)
    assert outcome is not None
    assert round(outcome.ttft_s, 3) == 0.3
    assert outcome.tokens == 64


def test_usage_in_the_finishing_chunk_counts_too() -> None:
    """llama-server may put usage beside the finish reason rather than in a chunk of its own."""
    state = StreamState()
    state.feed(data({"choices": [{"delta": {"content": "Hi"}}]}), now=1.0)
    state.feed(data({"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 7}}), now=1.2)
    outcome = state.outcome(sent=0.5, ended=1.2)
    assert outcome is not None and outcome.tokens == 7


def test_only_requests_that_finished_count() -> None:
    cut = StreamState()
    cut.feed(data({"choices": [{"delta": {"content": "Hi"}}]}), now=1.0)
    assert cut.outcome(sent=0.5, ended=1.0) is None  # no finish reason, no usage
    failed = StreamState()
    failed.feed(data({"choices": [{"delta": {"content": "Hi"}}]}), now=1.0)
    failed.feed("event: error\n", now=1.1)
    failed.feed(data({"error": {"message": "The generation failed", "type": "server_error"}}), now=1.1)
    assert failed.done and failed.outcome(sent=0.5, ended=1.1) is None


def test_only_llama_server_gets_its_extra_fields() -> None:
    body = chat_body("Write a short poem about rivers.", 1000, {"cache_prompt": False})
    assert body["cache_prompt"] is False and body["stream_options"] == {"include_usage": True}
    assert "cache_prompt" not in chat_body("Write a short poem about rivers.", 1000, {})


def test_every_side_samples_the_same_distribution() -> None:
    """llama-server truncates with top_k 40, top_p 0.95 and min_p 0.05 when a request names none; Sluice
    does not truncate by default: every side is sent the same three, so both sample alike."""
    stack = SimpleNamespace(openai_base_url="http://127.0.0.1:1/v1")
    by_side = servers(stack, stack, 2, 3)  # type: ignore[arg-type]
    assert set(by_side) == set(SIDES)
    for side, server in by_side.items():
        body = chat_body("Write a short poem about rivers.", 1000, server.extra)
        assert {name: body[name] for name in SAMPLING} == {"top_k": 40, "top_p": 0.95, "min_p": 0.05}, side
        assert ("cache_prompt" in body) == (side == PEER), side


def test_the_stream_says_the_prompt_tokens_of_a_counted_request() -> None:
    state = StreamState()
    state.feed(data({"choices": [{"delta": {"content": "Hi"}, "finish_reason": "stop"}]}), now=1.0)
    state.feed(data({"choices": [], "usage": {"prompt_tokens": 31, "completion_tokens": 2}}), now=1.0)
    outcome = state.outcome(sent=0.5, ended=1.0)
    assert outcome is not None and (outcome.prompt_tokens, outcome.tokens) == (31, 2)


def test_figures_say_the_mean_prompt_and_completion_tokens_of_the_counted_requests() -> None:
    f = figures([Phase("stack", "streams1", [Outcome(0.1, 60, 0.0, 1.0, 30), Outcome(0.3, 40, 1.0, 2.0, 40)], 1)])
    assert (f.mean_prompt_tokens, f.mean_completion_tokens) == (35.0, 50.0)


def test_each_round_beside_the_pooled_figure() -> None:
    """Per-round figures and their min and max go in the BENCH line's parenthesis: `BENCH <name>
    <value> <unit>` stays as it was for whatever reads the lines."""
    one, many = (load.name for load in LOADS)

    def rounds(*tokens_per_s: float) -> list[Phase]:
        return [Phase("side", one, [Outcome(0.1, int(t), 10.0 * i, 10.0 * i + 1.0)], 0) for i, t in enumerate(tokens_per_s)]

    phases = {}
    for side in SIDES:
        phases[(side, one)] = rounds(50, 60) if side == PEER else rounds(45, 60)
        phases[(side, many)] = rounds(100, 100)
    lines = report(phases)
    ratio = next(line for line in lines if line.startswith(f"BENCH stack_vs_llamaserver_tokens_per_s_{one} "))
    assert ratio == f"BENCH stack_vs_llamaserver_tokens_per_s_{one} 0.95 x (target >= 0.9; rounds 0.90, 1.00; min 0.90, max 1.00)"
    assert ratio.split()[:4] == ["BENCH", f"stack_vs_llamaserver_tokens_per_s_{one}", "0.95", "x"]
    side = next(line for line in lines if line.startswith(f"BENCH peer_llamaserver_{one}_tokens_per_s "))
    assert side == f"BENCH peer_llamaserver_{one}_tokens_per_s 55.0 tok/s (rounds 50.0, 60.0; min 50.0, max 60.0)"
    assert all(len(line.split()) >= 4 for line in lines if line.startswith("BENCH "))


def test_figures_pool_rounds_over_their_summed_wall_time() -> None:
    rounds = [
        Phase("stack", "streams1", [Outcome(0.1, 60, 0.0, 1.0), Outcome(0.3, 40, 1.0, 2.0)], 0),
        Phase("stack", "streams1", [Outcome(0.2, 100, 5.0, 7.0)], 1),
    ]
    f = figures(rounds)
    assert f.tokens_per_s == 200 / 4  # 200 tokens over 2 s + 2 s of wall time
    assert round(f.ttft_p50_ms, 6) == 200.0
    assert (f.ok, f.failed) == (3, 1)


def test_ratio_lines_carry_their_targets() -> None:
    one, many = (load.name for load in LOADS)
    stack = {one: Figures(45.0, 120.0, 150.0, 8, 0), many: Figures(150.0, 300.0, 900.0, 64, 0)}
    peer = {one: Figures(50.0, 110.0, 140.0, 8, 0), many: Figures(125.0, 400.0, 800.0, 64, 0)}
    assert ratio_lines(stack, peer) == [
        f"BENCH stack_vs_llamaserver_tokens_per_s_{one} 0.90 x (target >= 0.9)",
        f"BENCH stack_vs_llamaserver_tokens_per_s_{many} 1.20 x (target >= 1.0)",
        f"BENCH stack_minus_llamaserver_ttft_p50_ms_{one} 10.0 ms (target <= 20)",
        f"BENCH stack_vs_llamaserver_ttft_p50_{many} 0.75 x (target <= 1.0)",
    ]
    assert cached_ratio_lines(stack, peer)[2:] == [
        f"BENCH stack_vs_llamaserver_cached_tokens_per_s_{many} 1.20 x (target >= 1.0)",
        f"BENCH stack_vs_llamaserver_cached_ttft_p50_{many} 0.75 x (target <= 1.5)",
    ]


def test_the_stream_says_the_text_and_the_cached_prompt_tokens() -> None:
    state = StreamState()
    state.feed(data({"choices": [{"delta": {"content": "Hel"}}]}), now=1.0)
    state.feed(data({"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]}), now=1.1)
    state.feed(
        data({"choices": [], "usage": {"prompt_tokens": 1030, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 1000}}}), now=1.1
    )
    assert (state.text, state.prompt_tokens, state.cached_tokens) == ("Hello", 1030, 1000)


def test_llama_server_is_built_from_the_locked_bindings(tmp_path, monkeypatch) -> None:
    assert locked_version().count(".") == 2
    source = tmp_path / "sdists-v11" / "pypi" / "llama-cpp-python" / "0.3.36" / "abc" / "src" / "vendor" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path))
    assert cached_source("0.3.36") == source
    assert cached_source("0.3.35") is None


def test_llama_server_runs_the_kernels_the_bindings_are_built_with() -> None:
    """The GGML_* flags of the Makefile's CMAKE_ARGS (what `make setup` compiles llama-cpp-python with)."""
    makefile = (REPO_ROOT / "Makefile").read_text()
    args = makefile.split("export CMAKE_ARGS ?=", 1)[1].split("\n\n", 1)[0].replace("\\\n", " ").split()
    assert sorted(GGML_FLAGS) == sorted(a for a in args if a.startswith("-DGGML_"))
