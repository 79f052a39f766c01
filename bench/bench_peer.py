"""`make bench-peer`: the whole stack as `make run` starts it against llama.cpp's own HTTP server
(`llama-server`, bench/llama_server.py builds it from the same llama.cpp triton-local runs) on the
same GGUF with the same 2 threads, both through the OpenAI-compatible streamed chat API.

llama-server runs with `-t 2 -tb 2 --parallel 32 -c 32768 --cont-batching --jinja` (32 slots like
triton-local's); the stack is reached through its gateway's HTTP front with the demo key. One
client for both sides: aiohttp, a new connection per request (llama-server closes idle keep-alive
connections), bench-load's chat prompts of mixed lengths, temperature 0.7 and a seed per request,
max_tokens MAX_TOKENS, `stream: true` with `stream_options: {include_usage: true}`.

Sampling (SAMPLING, sent to every side): top_k 40, top_p 0.95 and min_p 0.05, what a llama-server
user gets when a request names none (llama.cpp's common_params_sampling defaults; this GGUF carries
no general.sampling.* of its own). Sluice's OpenAI front takes all three (top_k and min_p as vLLM's
extensions), whose own defaults are no truncation (top_k 0, top_p 1, min_p 0). Until 2026-12-07 the
requests named only temperature, seed and max_tokens, so the stack sampled the whole distribution
and llama-server a truncated one: different work per token and different end points. What still
differs is the order: llama-server applies the temperature after the three cuts (its default
sampler chain), Sluice before them, so its min_p and top_p keep somewhat fewer tokens at 0.7; the
table prints each side's mean prompt and completion tokens over its counted requests, so a reader
sees whether both did the same work.

  streams1    SEQUENTIAL_REQUESTS requests one at a time
  streams<N>  CONCURRENT_REQUESTS requests, N = CONCURRENCY in flight (a new one sent when one ends)

  tokens/s   completion tokens of the finished requests (the usage each server reports) over the
             phase's wall time, first request sent -> last request ended, the rounds summed
  TTFT       request sent -> first chunk carrying content, p50 and p99 over the rounds
  Each BENCH figure is pooled over the rounds; beside it, in its parenthesis, each round's own
  figure and their min and max (one round of 8 requests is one stall away from another figure).
  Only requests that ended with a finish_reason count; the others are printed and counted.
  A 429 from the stack (the demo tenant admits 32 in flight) is retried after its Retry-After,
  its TTFT counted from the first attempt.

Four sides, every server up the whole run, in two pairs that reuse prompt prefixes alike: the
stack with its prefix cache off (SLUICE_TRITON_LOCAL_PREFIX_CACHE=false) against llama-server
with `"cache_prompt": false` in every request (the transport and batching figures: neither side
reuses a prefix), and the stack as `make run` starts it (prefix cache on) against llama-server
with its prompt cache on (both as their users run them: the `_cached` figures). Each side is a
server process of its own (two stacks, two llama-servers), so each cache holds only its own
side's earlier requests.
ROUNDS rounds; each load runs every side in turn, the order reversed in even rounds, so the noise
of a shared machine falls on all of them alike. Each side is warmed with one request first, and each
phase starts SETTLE_S after the one before ended, off every clock: a side's tail (the stack's
completion events, evaluations and releases) would otherwise run beside the next side's first
requests, and triton-local, whose engine steps with fewer threads after a pause when the box was
busy just before (engine/thread_governor.py), would prefill the first request of every phase on one
thread because the other side had just had both cores.
BENCH_RUN_DIR keeps the services' and llama-server's logs (a temporary folder otherwise).

Thread waits: both sides wait at llama.cpp's barriers as libgomp does by default (a ~3 ms spin, then
sleep), as their users run them; triton-local also steps with fewer threads while another process
takes cores (SLUICE_TRITON_LOCAL_ADAPTIVE_THREADS), which llama-server does not: beside a busy
process its spinning threads collapse (2 tok/s per stream seen here while another stack ran).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import aiohttp

from bench_load import prompts  # bench-load's chat prompts of mixed lengths
from bench_openai import Outcome, Phase, percentile
from llama_server import build, locked_version
from sluice_stack import REPO_ROOT, Stack, StackPorts, free_ports

MODEL = "smollm2-135m-instruct"
DEMO_KEY = "sk-sluice-demo"
THREADS = 2
TEMPERATURE = 0.7
MAX_TOKENS = int(os.environ.get("BENCH_MAX_TOKENS", "64"))
SEQUENTIAL_REQUESTS = int(os.environ.get("BENCH_SEQUENTIAL_REQUESTS", "8"))
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "32"))
CONCURRENT_REQUESTS = int(os.environ.get("BENCH_CONCURRENT_REQUESTS", "64"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
SETTLE_S = float(os.environ.get("BENCH_SETTLE_S", "1.0"))
STACK_UNCACHED, PEER, STACK, PEER_CACHED = "stack cache off", "llama-server", "stack", "llama-server cache on"
# Sent to every side (module docstring): llama-server's defaults, named so that Sluice samples the same.
SAMPLING: dict[str, Any] = {"top_k": 40, "top_p": 0.95, "min_p": 0.05}
SIDES = (PEER, STACK_UNCACHED, PEER_CACHED, STACK)


@dataclass(frozen=True)
class Load:
    name: str
    requests: int
    concurrency: int


LOADS = (Load("streams1", SEQUENTIAL_REQUESTS, 1), Load(f"streams{CONCURRENCY}", CONCURRENT_REQUESTS, CONCURRENCY))


@dataclass(frozen=True)
class Server:
    """Where one side sends its chat requests, and what it adds to each body."""

    url: str
    headers: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# --- one streamed request -----------------------------------------------------------------------


@dataclass
class StreamState:
    """What the server-sent events of one chat completion said so far."""

    first_content_at: float | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    text: str = ""
    error: str | None = None
    done: bool = False

    def feed(self, line: str, now: float) -> None:
        """One line of the event stream, received at `now`."""
        if not line.startswith("data:"):
            return
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if event.get("error"):
            self.error = str(event["error"])
            self.done = True
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if self.first_content_at is None and content:
                self.first_content_at = now
            self.text += content or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if usage := event.get("usage"):
            self.completion_tokens = int(usage["completion_tokens"])
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)
            self.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def outcome(self, sent: float, ended: float) -> Outcome | None:
        """The request's figures when it finished with a finish_reason, content and usage."""
        if self.error or self.finish_reason is None or self.first_content_at is None or self.completion_tokens is None:
            return None
        prompt_tokens = int(self.prompt_tokens) if self.prompt_tokens is not None else None
        return Outcome(self.first_content_at - sent, self.completion_tokens, sent, ended, prompt_tokens)


Messages = list[dict[str, str]]


def chat_body(prompt: str | Messages, seed: int, extra: dict[str, Any], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    """A streamed chat request: one user message, or a whole conversation."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
        "max_tokens": max_tokens,
        "temperature": TEMPERATURE,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


async def one_request(session: aiohttp.ClientSession, server: Server, prompt: str, seed: int) -> Outcome | None:
    outcome, _ = await one_chat(session, server, prompt, seed)
    return outcome


async def one_chat(
    session: aiohttp.ClientSession, server: Server, prompt: str | Messages, seed: int, max_tokens: int = MAX_TOKENS
) -> tuple[Outcome | None, StreamState]:
    """One streamed chat: its figures when it finished (None otherwise), and what the stream said."""
    body = chat_body(prompt, seed, server.extra, max_tokens)
    sent = time.perf_counter()
    while True:
        state = StreamState()
        try:
            async with session.post(server.url, json=body, headers=server.headers) as response:
                if response.status == 429:  # the stack's rate limiter: retry as a client should
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                if response.status != 200:
                    print(f"  request failed: HTTP {response.status} {(await response.text())[:200]}", flush=True)
                    return None, state
                async for raw in response.content:
                    state.feed(raw.decode(), time.perf_counter())
                    if state.done:
                        break
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            print(f"  request failed: {error!r}", flush=True)
            return None, state
        outcome = state.outcome(sent, time.perf_counter())
        if outcome is None:
            print(f"  request failed: error {state.error}, finish_reason {state.finish_reason}, usage {state.completion_tokens}", flush=True)
        return outcome, state


async def run_load(server: Server, asks: list[tuple[str, int]], concurrency: int) -> list[Outcome | None]:
    """`concurrency` workers taking the requests in order, a new connection for each request."""
    results: list[Outcome | None] = [None] * len(asks)
    order = count()
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0), timeout=timeout) as session:

        async def worker() -> None:
            while (index := next(order)) < len(asks):
                results[index] = await one_request(session, server, *asks[index])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


def phase(side: str, server: Server, load: Load) -> Phase:
    asks = [(p, 1000 + i) for i, p in enumerate(prompts(load.requests))]
    results = asyncio.run(run_load(server, asks, load.concurrency))
    ok = [r for r in results if r is not None]
    return Phase(side, load.name, ok, len(results) - len(ok))


# --- figures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ok: int
    failed: int
    # Means over the counted requests: whether both sides did the same work.
    mean_prompt_tokens: float = float("nan")  # over those whose usage reported it
    mean_completion_tokens: float = float("nan")


def figures(phases: list[Phase]) -> Figures:
    """One side's figures for one load over its rounds: tokens over the summed wall times, TTFT pooled."""
    nan = float("nan")
    ok = [o for p in phases for o in p.ok]
    ttfts = [o.ttft_s * 1000 for o in ok]
    prompts = [o.prompt_tokens for o in ok if o.prompt_tokens is not None]
    wall = sum(p.wall_s for p in phases if p.ok)
    return Figures(
        sum(p.tokens for p in phases) / wall if wall else nan,
        percentile(ttfts, 50) if ttfts else nan,
        percentile(ttfts, 99) if ttfts else nan,
        len(ok),
        sum(p.failed for p in phases),
        sum(prompts) / len(prompts) if prompts else nan,
        sum(o.tokens for o in ok) / len(ok) if ok else nan,
    )


Rounds = dict[str, list[Figures]]  # a side's figures round by round, by load name


def spread(values: list[float], digits: int) -> str:
    """Each round's value and their range, for beside a figure pooled over the rounds; "" for one round."""
    if len(values) < 2:
        return ""
    finite = [v for v in values if v == v] or [float("nan")]  # a round with no finished request is nan
    shown = ", ".join(f"{v:.{digits}f}" for v in values)
    return f"rounds {shown}; min {min(finite):.{digits}f}, max {max(finite):.{digits}f}"


def note(*parts: str) -> str:
    """A BENCH line's trailing parenthesis (after `BENCH <name> <value> <unit>`), "" when empty."""
    said = "; ".join(part for part in parts if part)
    return f" ({said})" if said else ""


def tps_ratio(stack: Figures, peer: Figures) -> float:
    return stack.tokens_per_s / peer.tokens_per_s


def ttft_ratio(stack: Figures, peer: Figures) -> float:
    return stack.ttft_p50_ms / peer.ttft_p50_ms


def ttft_difference(stack: Figures, peer: Figures) -> float:
    return stack.ttft_p50_ms - peer.ttft_p50_ms


def per_round(stack_rounds: Rounds | None, peer_rounds: Rounds | None, load: str, value: Callable[[Figures, Figures], float]) -> list[float]:
    if not stack_rounds or not peer_rounds:
        return []
    return [value(s, p) for s, p in zip(stack_rounds[load], peer_rounds[load])]


def ratio_lines(
    stack: dict[str, Figures], peer: dict[str, Figures], stack_rounds: Rounds | None = None, peer_rounds: Rounds | None = None
) -> list[str]:
    """Neither side caching (issue 23's targets); each round's figure beside the pooled one when given."""
    one, many = (load.name for load in LOADS)

    def rounds(load: str, value: Callable[[Figures, Figures], float], digits: int) -> str:
        return spread(per_round(stack_rounds, peer_rounds, load, value), digits)

    return [
        f"BENCH stack_vs_llamaserver_tokens_per_s_{one} {tps_ratio(stack[one], peer[one]):.2f} x{note('target >= 0.9', rounds(one, tps_ratio, 2))}",
        f"BENCH stack_vs_llamaserver_tokens_per_s_{many} {tps_ratio(stack[many], peer[many]):.2f} x{note('target >= 1.0', rounds(many, tps_ratio, 2))}",
        f"BENCH stack_minus_llamaserver_ttft_p50_ms_{one} {ttft_difference(stack[one], peer[one]):.1f} ms{note('target <= 20', rounds(one, ttft_difference, 1))}",
        f"BENCH stack_vs_llamaserver_ttft_p50_{many} {ttft_ratio(stack[many], peer[many]):.2f} x{note('target <= 1.0', rounds(many, ttft_ratio, 2))}",
    ]


def cached_ratio_lines(
    stack: dict[str, Figures], peer: dict[str, Figures], stack_rounds: Rounds | None = None, peer_rounds: Rounds | None = None
) -> list[str]:
    """Both sides reusing cached prefixes, as their users run them (issue 24's targets)."""
    one, many = (load.name for load in LOADS)

    def rounds(load: str, value: Callable[[Figures, Figures], float]) -> str:
        return spread(per_round(stack_rounds, peer_rounds, load, value), 2)

    return [
        f"BENCH stack_vs_llamaserver_cached_tokens_per_s_{one} {tps_ratio(stack[one], peer[one]):.2f} x{note(rounds(one, tps_ratio))}",
        f"BENCH stack_vs_llamaserver_cached_ttft_p50_{one} {ttft_ratio(stack[one], peer[one]):.2f} x{note(rounds(one, ttft_ratio))}",
        f"BENCH stack_vs_llamaserver_cached_tokens_per_s_{many} {tps_ratio(stack[many], peer[many]):.2f} x{note('target >= 1.0', rounds(many, tps_ratio))}",
        f"BENCH stack_vs_llamaserver_cached_ttft_p50_{many} {ttft_ratio(stack[many], peer[many]):.2f} x{note('target <= 1.5', rounds(many, ttft_ratio))}",
    ]


def table(by_side: dict[str, dict[str, Figures]]) -> list[str]:
    lines = [
        f"{'load':<10} {'side':<22} {'tok/s':>7} {'TTFT p50':>10} {'TTFT p99':>10} {'ok':>4} {'failed':>6}"
        f" {'prompt tok':>10} {'compl. tok':>10}  (means over the ok requests)"
    ]
    for load in LOADS:
        for side in SIDES:
            f = by_side[side][load.name]
            lines.append(
                f"{load.name:<10} {side:<22} {f.tokens_per_s:7.1f} {f.ttft_p50_ms:8.1f} ms {f.ttft_p99_ms:7.1f} ms {f.ok:>4} {f.failed:>6}"
                f" {f.mean_prompt_tokens:10.1f} {f.mean_completion_tokens:10.1f}"
            )
    return lines


def side_lines(side: str, load: str, pooled: Figures, rounds: list[Figures]) -> list[str]:
    """One side's BENCH lines for one load, each round's figure beside the pooled one."""
    name = side.replace(" ", "_").replace("-", "")
    return [
        f"BENCH peer_{name}_{load}_tokens_per_s {pooled.tokens_per_s:.1f} tok/s{note(spread([f.tokens_per_s for f in rounds], 1))}",
        f"BENCH peer_{name}_{load}_ttft_p50 {pooled.ttft_p50_ms:.1f} ms{note(spread([f.ttft_p50_ms for f in rounds], 1))}",
        f"BENCH peer_{name}_{load}_ttft_p99 {pooled.ttft_p99_ms:.1f} ms{note(spread([f.ttft_p99_ms for f in rounds], 1))}",
        f"BENCH peer_{name}_{load}_failed {pooled.failed} requests",
    ]


def report(phases: dict[tuple[str, str], list[Phase]]) -> list[str]:
    by_side = {side: {load.name: figures(phases[(side, load.name)]) for load in LOADS} for side in SIDES}
    rounds = {side: {load.name: [figures([p]) for p in phases[(side, load.name)]] for load in LOADS} for side in SIDES}
    lines = [*table(by_side), ""]
    for side in SIDES:
        for load in LOADS:
            lines += side_lines(side, load.name, by_side[side][load.name], rounds[side][load.name])
    lines += ratio_lines(by_side[STACK_UNCACHED], by_side[PEER], rounds[STACK_UNCACHED], rounds[PEER])
    lines += cached_ratio_lines(by_side[STACK], by_side[PEER_CACHED], rounds[STACK], rounds[PEER_CACHED])
    return lines


# --- the servers --------------------------------------------------------------------------------


def smollm2_gguf() -> str:
    python = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
    script = "from sluice_triton_local.model_files import smollm2_gguf; print(smollm2_gguf())"
    return subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout.strip()


def start_llama_server(binary: Path, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    command = [
        str(binary), "-m", smollm2_gguf(), "-t", str(THREADS), "-tb", str(THREADS),
        "--parallel", "32", "-c", "32768", "--cont-batching", "--jinja", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama-server exited with {process.returncode}; its log: {log_path}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except (urllib.error.URLError, ConnectionError):
            pass  # still loading the model (503) or not listening yet
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"llama-server not ready after 120 s; its log: {log_path}")


def servers(stack: Stack, uncached: Stack, peer_port: int, cached_peer_port: int) -> dict[str, Server]:
    demo = {"Authorization": f"Bearer {DEMO_KEY}"}
    return {
        STACK: Server(f"{stack.openai_base_url}/chat/completions", demo, SAMPLING),
        STACK_UNCACHED: Server(f"{uncached.openai_base_url}/chat/completions", demo, SAMPLING),
        PEER: Server(f"http://127.0.0.1:{peer_port}/v1/chat/completions", extra={**SAMPLING, "cache_prompt": False}),
        PEER_CACHED: Server(f"http://127.0.0.1:{cached_peer_port}/v1/chat/completions", extra=SAMPLING),
    }


def two_stacks(run_dir: Path, bench: str) -> tuple[Stack, Stack]:
    """The stack as `make run` starts it, and the same with triton-local's prefix cache off."""

    def one(name: str, extra_env: dict[str, dict[str, str]]) -> Stack:
        return Stack(run_dir=run_dir / name, ports=StackPorts.ephemeral(), amqp_prefix=f"sluice-{bench}-{uuid.uuid4().hex[:8]}", extra_env=extra_env)

    return one("cached", {}), one("uncached", {"triton-local": {"SLUICE_TRITON_LOCAL_PREFIX_CACHE": "false"}})


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def run_rounds(
    by_side: dict[str, Server], sides: tuple[str, ...] = SIDES, loads: tuple[Load, ...] = LOADS, rounds: int = ROUNDS
) -> dict[tuple[str, str], list[Phase]]:
    """Every side warmed once, then each load on each side per round, the sides' order reversed every
    other round (also bench-rounds-ahead's loop)."""
    for side, server in by_side.items():  # warm every side once: connections, first allocations
        asyncio.run(run_load(server, [("Say hi.", 0)], 1))
    phases: dict[tuple[str, str], list[Phase]] = {(side, load.name): [] for side in sides for load in loads}
    for round_ in range(1, rounds + 1):
        for load in loads:
            for side in sides if round_ % 2 else sides[::-1]:
                time.sleep(SETTLE_S)  # the previous phase's tail ends off the clock (module docstring)
                done = phase(side, by_side[side], load)
                phases[(side, load.name)].append(done)
                tps = done.tokens / done.wall_s if done.ok else float("nan")
                mean = done.tokens / len(done.ok) if done.ok else float("nan")
                print(
                    f"round {round_} {load.name:>9} {side:<22} {len(done.ok)} ok, {done.failed} failed, {tps:.1f} tok/s,"
                    f" {mean:.1f} completion tokens a request",
                    flush=True,
                )
    return phases


def main() -> int:
    binary = build(locked_version())  # compiles it (minutes) only when .llama-server has none
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(os.environ.get("BENCH_RUN_DIR") or scratch)
        run_dir.mkdir(parents=True, exist_ok=True)
        stack, uncached = two_stacks(run_dir, "bench-peer")
        print(f"starting llama-server ({binary}) and the stack as `make run` does, with and without its prefix cache ...", flush=True)
        # One llama-server per side, as the stack has one stack per side: a server's prompt cache
        # holds only what its own side sent (one server for both would warm the cached side's slots
        # with the uncached side's run of the same prompts).
        peer_port, cached_peer_port = free_ports(2)
        peers = [
            start_llama_server(binary, peer_port, run_dir / "llama-server.log"),
            start_llama_server(binary, cached_peer_port, run_dir / "llama-server-cached.log"),
        ]
        try:
            with running(stack), running(uncached):
                phases = run_rounds(servers(stack, uncached, peer_port, cached_peer_port))
        finally:
            for peer in peers:
                peer.terminate()
                peer.wait(timeout=30)
    print()
    print("\n".join(report(phases)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
