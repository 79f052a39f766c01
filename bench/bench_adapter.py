"""make bench-adapter: continuous batching in the adapter, measured side by side in one run.

Against one stack (triton-local with 32 KV slots, adapter with max batch 32), straight to the
adapter's gRPC API (the gateway and its rate limits are not what is measured here):

  (a) output tokens/s of 16 and 32 concurrent streams, continuous batching vs the same
      streams served one at a time                                       target >= 4x
  (b) decode tokens/s through adapter + Triton vs the engine's batched step loop run
      in-process (a subprocess in triton-local's environment) at the same batch size
                                                                          target >= 0.85
      The in-process engine gets the threads triton-local gives its own (TritonLocalConfig.
      engine_threads: every usable CPU; ENGINE_THREADS=0 to bench/engine/decode.py) and one
      untimed warm-up at the batch size before its clock, as the stack's engine is warm by then
      (until 2026-12-07 it ran on one thread, cold).
  (c) mixed output lengths (16..256 tokens): continuous vs static batching (a batch runs
      until its longest member ends), throughput and p50 latency of the short ones
                                                                          target >= 1.5x
  (d) 256 texts embedded batched vs one request per text                  target >= 5x
      The one-per-request baseline runs against a second adapter on the same Triton started
      with no micro-batch delay (SLUICE_ADAPTER_EMBED_MAX_DELAY_S=0): a client sending one text
      at a time gains nothing from waiting for company, so that adapter is what such a client
      would really be served by. The target is judged against that baseline. The same loop
      through the stack's adapter (default delay, 5 ms paid on every lone request) is also
      reported, as `..._via_batch_delay_...`, for reference only.

Ends with `BENCH <name> <value> <unit>` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_stack import REPO_ROOT, ServiceProcess, Stack, StackPorts

MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"
# A raw prompt that keeps the model counting, so every stream runs to its max_tokens.
COUNTING = "Numbers in order: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
STORY = "Write a long story about a dragon and a knight."


@dataclass
class Stream:
    submitted: float
    arrivals: list[float]

    @property
    def finished(self) -> float:
        return self.arrivals[-1] if self.arrivals else self.submitted


async def stream(stub: inference_pb2_grpc.InferenceServiceStub, max_tokens: int, raw: bool = True) -> Stream:
    request = inference_pb2.GenerateRequest(
        model=MODEL,
        tenant="bench",
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )
    if raw:
        request.prompt = COUNTING
    else:
        request.messages.append(types_pb2.ChatMessage(role="user", content=STORY))
    result = Stream(time.perf_counter(), [])
    async for response in stub.Generate(request, timeout=900):
        if response.token_count:
            result.arrivals.extend([time.perf_counter()] * response.token_count)
    return result


def tokens_per_s(streams: list[Stream], started: float) -> float:
    tokens = sum(len(s.arrivals) for s in streams)
    return tokens / (max(s.finished for s in streams) - started)


async def concurrent(stub, n: int, max_tokens: int) -> float:
    started = time.perf_counter()
    streams = await asyncio.gather(*(stream(stub, max_tokens) for _ in range(n)))
    return tokens_per_s(list(streams), started)


async def one_at_a_time(stub, n: int, max_tokens: int) -> float:
    started = time.perf_counter()
    streams = [await stream(stub, max_tokens) for _ in range(n)]
    return tokens_per_s(streams, started)


async def steady_decode_rate(stub, batch: int, max_tokens: int) -> float:
    """Tokens/s while all `batch` streams are decoding (after the last prefill, before the first end)."""
    streams = await asyncio.gather(*(stream(stub, max_tokens, raw=False) for _ in range(batch)))
    start = max(s.arrivals[0] for s in streams)
    end = min(s.arrivals[-1] for s in streams)
    counted = sum(1 for s in streams for t in s.arrivals if start < t <= end)
    return counted / (end - start) if end > start else 0.0


def in_process_decode_rate(batch: int) -> tuple[float, int]:
    """The engine's own batched step loop in triton-local's environment: (tokens/s, engine threads).

    As triton-local runs its engine: one BLAS thread (it sets OPENBLAS_NUM_THREADS and
    OMP_NUM_THREADS to 1 before numpy loads; llama.cpp's thread count is its own argument) and
    the engine threads its config gives (ENGINE_THREADS=0: TritonLocalConfig.engine_threads, every
    usable CPU). decode.py warms the engine up at the batch size, untimed, before its clock."""
    python = REPO_ROOT / "services" / "triton-local" / ".venv" / "bin" / "python"
    env = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "ENGINE_THREADS": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [str(python), str(REPO_ROOT / "bench" / "engine" / "decode.py"), str(batch)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=REPO_ROOT,
    ).stdout
    measured = json.loads(out.strip().splitlines()[-1])
    return float(measured[f"batch{batch}_tok_s"]), int(measured["threads"])


async def mixed_lengths(stub, lengths: list[int], batch: int, static: bool) -> tuple[float, float]:
    """(useful tokens/s, p50 latency in s of the requests of at most 64 tokens), all submitted at t=0.

    Static batching as a static batcher does it: every member of a batch is computed for as many
    steps as the longest one (padding), and all results come back when the batch ends.
    """
    started = time.perf_counter()
    finished_at: list[float] = []
    # Useful tokens: those each request wanted (its length) and actually received; padding
    # computed past a request's length, and tokens a stream never delivered, do not count.
    useful = 0
    if static:
        for offset in range(0, len(lengths), batch):
            group = lengths[offset : offset + batch]
            streams = await asyncio.gather(*(stream(stub, max(group)) for _ in group))
            finished_at += [time.perf_counter()] * len(group)
            useful += sum(min(n, len(s.arrivals)) for n, s in zip(group, streams))
    else:
        # At most `batch` in flight: a new request starts as soon as one ends, joining the
        # adapter's running batch at its next step.
        slots = asyncio.Semaphore(batch)

        async def bounded(n: int) -> Stream:
            async with slots:
                return await stream(stub, n)

        streams = list(await asyncio.gather(*(bounded(n) for n in lengths)))
        finished_at = [s.finished for s in streams]
        useful = sum(min(n, len(s.arrivals)) for n, s in zip(lengths, streams))
    elapsed = max(finished_at) - started
    short = [end - started for end, n in zip(finished_at, lengths) if n <= 64]
    return useful / elapsed, statistics.median(short)


async def embed(stub, texts: list[str]) -> None:
    await stub.Embed(inference_pb2.EmbedRequest(model=EMBEDDING_MODEL, tenant="bench", inputs=texts), timeout=300)


async def one_per_request(stub, texts: list[str]) -> float:
    """Texts/s of one Embed request per text, each sent when the previous one has answered."""
    started = time.perf_counter()
    for text in texts:
        await embed(stub, [text])
    return len(texts) / (time.perf_counter() - started)


async def embeddings(stub, no_delay_stub, n: int) -> dict[str, float]:
    texts = [f"Sentence number {i} is about rivers, mountains and the sea." for i in range(n)]
    timings: dict[str, float] = {}
    # The fair baseline: an adapter that sends a lone text at once (no micro-batch delay).
    timings["one_per_request"] = await one_per_request(no_delay_stub, texts)
    # For reference: the same loop through the batching adapter, paying its max delay each time.
    timings["one_per_request_via_batch_delay"] = await one_per_request(stub, texts)
    started = time.perf_counter()
    await asyncio.gather(*(embed(stub, [text]) for text in texts))
    timings["concurrent_micro_batched"] = n / (time.perf_counter() - started)
    started = time.perf_counter()
    await embed(stub, texts)
    timings["one_request"] = n / (time.perf_counter() - started)
    return timings


async def part_a(stub, args: argparse.Namespace) -> list[str]:
    lines = []
    for n in (16, 32):
        batched = await concurrent(stub, n, args.tokens)
        alone = await one_at_a_time(stub, n, args.tokens)
        print(f"(a) {n} streams x {args.tokens} tokens: batched {batched:.1f} tok/s, one at a time {alone:.1f} tok/s", flush=True)
        lines += [
            f"BENCH a_streams{n}_continuous_tokens_per_s {batched:.1f} tok/s",
            f"BENCH a_streams{n}_one_at_a_time_tokens_per_s {alone:.1f} tok/s",
            f"BENCH a_streams{n}_speedup {batched / alone:.2f} x (target >= 4)",
        ]
    return lines


async def part_b(stub, args: argparse.Namespace) -> list[str]:
    lines = []
    for batch in (8, 16):
        through = await steady_decode_rate(stub, batch, 33)
        local, threads = in_process_decode_rate(batch)
        print(f"(b) batch {batch}: adapter+Triton {through:.1f} tok/s, in-process {local:.1f} tok/s ({threads} engine threads)", flush=True)
        lines += [
            f"BENCH b_batch{batch}_adapter_triton_decode_tokens_per_s {through:.1f} tok/s",
            f"BENCH b_batch{batch}_in_process_decode_tokens_per_s {local:.1f} tok/s",
            f"BENCH b_batch{batch}_ratio {through / local:.2f} x (target >= 0.85)",
        ]
    return lines


async def part_c(stub, args: argparse.Namespace) -> list[str]:
    lengths = [16, 256, 32, 128, 16, 64, 256, 32, 16, 128, 64, 16, 32, 256, 16, 64][: args.mixed]
    lengths = [max(4, n // args.shrink) for n in lengths]
    cont_tps, cont_p50 = await mixed_lengths(stub, lengths, args.mixed_batch, static=False)
    stat_tps, stat_p50 = await mixed_lengths(stub, lengths, args.mixed_batch, static=True)
    print(
        f"(c) mixed lengths {lengths}: continuous {cont_tps:.1f} tok/s p50(short) {cont_p50:.1f}s;"
        f" static {stat_tps:.1f} tok/s p50(short) {stat_p50:.1f}s",
        flush=True,
    )
    return [
        f"BENCH c_continuous_tokens_per_s {cont_tps:.1f} tok/s",
        f"BENCH c_static_tokens_per_s {stat_tps:.1f} tok/s",
        f"BENCH c_throughput_ratio {cont_tps / stat_tps:.2f} x (target >= 1.5)",
        f"BENCH c_short_p50_latency_continuous {cont_p50 * 1000:.0f} ms",
        f"BENCH c_short_p50_latency_static {stat_p50 * 1000:.0f} ms",
    ]


def start_no_delay_adapter(stack: Stack) -> tuple[ServiceProcess, str]:
    """A second inference-adapter on the same Triton, configured like the stack's one except for
    SLUICE_ADAPTER_EMBED_MAX_DELAY_S=0 (a batch leaves as soon as its first text is waiting)."""
    process, address, _ = stack.add_adapter("inference-adapter-no-embed-delay", timeout_s=120, env={"SLUICE_ADAPTER_EMBED_MAX_DELAY_S": "0"})
    return process, address


async def part_d(stub, args: argparse.Namespace) -> list[str]:
    no_delay, address = await asyncio.to_thread(start_no_delay_adapter, args.stack)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            no_delay_stub = inference_pb2_grpc.InferenceServiceStub(channel)
            await embed(no_delay_stub, ["warm-up"])  # its first request pays the channel's set-up
            rates = await embeddings(stub, no_delay_stub, 256)
    finally:
        await asyncio.to_thread(no_delay.stop)
    print(f"(d) embeddings texts/s: {rates}", flush=True)
    base, delayed = rates["one_per_request"], rates["one_per_request_via_batch_delay"]
    return [f"BENCH d_embed_{name}_texts_per_s {value:.1f} texts/s" for name, value in rates.items()] + [
        f"BENCH d_embed_one_request_speedup {rates['one_request'] / base:.2f} x (target >= 5, vs one per request with no batch delay)",
        f"BENCH d_embed_concurrent_speedup {rates['concurrent_micro_batched'] / base:.2f} x (target >= 5, vs one per request with no batch delay)",
        f"BENCH d_embed_one_request_speedup_vs_batch_delay_baseline {rates['one_request'] / delayed:.2f} x (reference only: that baseline pays the batch delay)",
        f"BENCH d_embed_concurrent_speedup_vs_batch_delay_baseline {rates['concurrent_micro_batched'] / delayed:.2f} x (reference only)",
    ]


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}


async def run(stack: Stack, args: argparse.Namespace) -> list[str]:
    lines: list[str] = []
    async with grpc.aio.insecure_channel(stack.adapter_address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        await concurrent(stub, 2, 4)  # warm-up
        for name in args.only:
            lines += await PARTS[name](stub, args)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=24, help="max_tokens of each stream in (a)")
    parser.add_argument("--mixed", type=int, default=16, help="requests in (c)")
    parser.add_argument("--mixed-batch", type=int, default=8, help="batch size in (c)")
    parser.add_argument("--shrink", type=int, default=1, help="divide (c)'s lengths by this, for a quick run")
    parser.add_argument("--only", default="abcd", help="which parts to run, e.g. 'c'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(
            run_dir=Path(run_dir),
            ports=StackPorts.ephemeral(),
            extra_env={
                "triton-local": {"SLUICE_TRITON_LOCAL_MAX_SLOTS": "32"},
                # The embedding cache off: part (d) sends the same texts round after round, and
                # measures batching, not the cache (make bench-embed-cache measures that).
                "inference-adapter": {
                    "SLUICE_ADAPTER_MAX_BATCH_SIZE": "32",
                    "SLUICE_ADAPTER_MAX_BATCH_TOKENS": "65536",
                    "SLUICE_ADAPTER_EMBED_CACHE_BYTES": "0",
                },
            },
        )
        print("starting the stack ...", flush=True)
        stack.start()
        try:
            args.stack = stack  # part (d) starts a second adapter beside the stack's one
            lines = asyncio.run(run(stack, args))
        finally:
            stack.stop()
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
