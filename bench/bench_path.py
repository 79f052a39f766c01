"""make bench-path: one stream at a time, through each hop, side by side in one run.

For the same greedy request it measures time to first token (TTFT) and decode tokens/s
  triton   the step protocol driven directly over tritonclient (no Sluice service), as the adapter
           drives it by default: a prefill round of one step, then rounds of up to 64 decode steps
           whose steps share a response for up to 50 ms (its MAX_ROUND_STEPS, STREAM_INTERVAL_S),
  adapter  sluice.inference.v1.InferenceService/Generate,
  gateway  sluice.gateway.v1.GatewayService/Generate (auth + validation + adapter),
interleaving the three in every round so that noise on this shared machine hits all alike.

Where the clocks run (the same on every path):
  start  immediately before the request is built: `measure` reads the clock, then calls the path,
         and each path builds its request (the step protocol's inputs, or the GenerateRequest)
         and creates its call (the step model's stream, or the streaming `stub.Generate`) only after that.
         The clients and channels are made, and warmed with one request each, before any clock.
  first  the first chunk that carries text arrives: time to first token (TTFT).
  stop   the last chunk that carries text arrives: decode tokens/s = the completion's tokens after
         the first (the engine's count: its rows on the triton path, the usage on the others) over
         the time from the first text chunk to the last.
Ends with `BENCH <name> <value> <unit>` lines. Target: gateway + adapter add <= 5 ms to TTFT p50.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc as triton
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from bench_transport import DECODE, PREFILL, STEP_MODEL, step_inputs
from sluice_stack import Stack, StackPorts

MODEL = "smollm2-135m-instruct"
# A short raw prompt: prefill time varies by tens of ms on a shared CPU, so a long prompt would
# drown the few milliseconds each hop adds. The same text goes through every path.
PROMPT = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
AUTH = (("authorization", "Bearer sk-sluice-demo"),)

Sample = tuple[float, float]  # (ttft seconds, decode tokens per second)
# A chunk's text, and on the last chunk the completion's tokens (None before).
Chunk = tuple[str, int | None]
# The adapter's defaults: rounds of up to MAX_ROUND_STEPS (the 1 s round target allows all 64 at
# this engine's pace), steps sharing a response for up to STREAM_INTERVAL_S.
ROUND_STEPS, STREAM_INTERVAL_MS = 64, 50


def measure(path: Callable[[], Iterable[Chunk]]) -> Sample:
    """Times one request of `path`: the clock starts before the path builds and sends anything."""
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    for text, completion_tokens in path():  # every path builds its request and starts its call in here, on the clock
        if text:
            arrivals.append(time.perf_counter() - started)
        tokens = completion_tokens or tokens
    decode_s = arrivals[-1] - arrivals[0]
    return arrivals[0], (tokens - 1) / decode_s if decode_s > 0 else 0.0


def triton_chunks(client: triton.InferenceServerClient, max_tokens: int) -> Iterable[Chunk]:
    # A generator: the stream is opened and the request built and sent only when `measure` iterates it.
    seq_id = random.getrandbits(62) + 1
    responses: queue.Queue[tuple[triton.InferResult | None, Exception | None]] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens}).encode()
        client.async_stream_infer(STEP_MODEL, step_inputs(PREFILL, [seq_id], [body], 1, STREAM_INTERVAL_MS))
        tokens = 0
        while True:
            result, error = responses.get(timeout=120)
            if result is None:
                raise SystemExit(f"the step model failed: {error}")
            tokens += int((result.as_numpy("TOKEN_ID") >= 0).sum())
            finished = any(bytes(f) for f in result.as_numpy("FINISH"))
            yield "".join(bytes(t).decode() for t in result.as_numpy("TEXT")), tokens if finished else None
            if finished:
                return
            if bool(result.as_numpy("ROUND_END")[0]):
                client.async_stream_infer(STEP_MODEL, step_inputs(DECODE, [seq_id], [b""], ROUND_STEPS, STREAM_INTERVAL_MS))
    finally:
        client.stop_stream()


def adapter_chunks(stub: inference_pb2_grpc.InferenceServiceStub, max_tokens: int) -> Iterable[Chunk]:
    # A generator, like triton_chunks: nothing is built or sent until `measure` iterates it.
    request = inference_pb2.GenerateRequest(model=MODEL, tenant="bench", prompt=PROMPT, sampling=types_pb2.SamplingParams(max_tokens=max_tokens))
    for response in stub.Generate(request, timeout=120):
        yield response.text, response.usage.completion_tokens if response.HasField("usage") else None


def gateway_chunks(stub: gateway_pb2_grpc.GatewayServiceStub, max_tokens: int) -> Iterable[Chunk]:
    # A generator, like triton_chunks: nothing is built or sent until `measure` iterates it.
    request = gateway_pb2.GenerateRequest(model=MODEL, prompt=PROMPT, sampling=types_pb2.SamplingParams(max_tokens=max_tokens))
    for response in stub.Generate(request, metadata=AUTH, timeout=120):
        yield response.text, response.usage.completion_tokens if response.HasField("usage") else None


def p50(values: list[float]) -> float:
    return statistics.median(values)


def _paired_p50(mine: list[Sample], base: list[Sample]) -> float:
    return p50([(m[0] - b[0]) * 1000 for m, b in zip(mine, base)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(run_dir=Path(run_dir), ports=StackPorts.ephemeral())
        print("starting the stack ...", flush=True)
        stack.start()
        try:
            client = triton.InferenceServerClient(stack.triton_grpc_address)
            adapter = inference_pb2_grpc.InferenceServiceStub(grpc.insecure_channel(stack.adapter_address))
            gateway = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_address))
            paths: dict[str, Callable[[], Iterable[Chunk]]] = {
                "triton": lambda: triton_chunks(client, args.max_tokens),
                "adapter": lambda: adapter_chunks(adapter, args.max_tokens),
                "gateway": lambda: gateway_chunks(gateway, args.max_tokens),
            }
            for path in paths.values():  # warm every channel and code path once
                measure(path)
            samples: dict[str, list[Sample]] = {name: [] for name in paths}
            for round_index in range(args.rounds):
                order = list(paths)
                random.Random(round_index).shuffle(order)
                for name in order:
                    samples[name].append(measure(paths[name]))
        finally:
            stack.stop()

    ttft = {name: p50([s[0] for s in values]) * 1000 for name, values in samples.items()}
    # Paired per round: each round ran every path back to back, so a difference cancels slow drift.
    paired = {
        "adapter": _paired_p50(samples["adapter"], samples["triton"]),
        "gateway": _paired_p50(samples["gateway"], samples["adapter"]),
        "gateway_plus_adapter": _paired_p50(samples["gateway"], samples["triton"]),
    }
    tps = {name: p50([s[1] for s in values]) for name, values in samples.items()}
    print(f"\n{args.rounds} rounds, {args.max_tokens} tokens each, one stream at a time\n")
    print(f"{'path':<10}{'TTFT p50 ms':>14}{'TTFT p90 ms':>14}{'decode tok/s p50':>18}")
    for name, values in samples.items():
        p90 = float(np.percentile([s[0] for s in values], 90)) * 1000
        print(f"{name:<10}{ttft[name]:>14.2f}{p90:>14.2f}{tps[name]:>18.1f}")
    print()
    for name in paths:
        print(f"BENCH path_{name}_ttft_p50 {ttft[name]:.2f} ms")
        print(f"BENCH path_{name}_tokens_per_s_p50 {tps[name]:.1f} tok/s")
    print(f"BENCH hop_adapter_ttft_overhead_p50 {paired['adapter']:.2f} ms")
    print(f"BENCH hop_gateway_ttft_overhead_p50 {paired['gateway']:.2f} ms")
    print(f"BENCH gateway_plus_adapter_ttft_overhead_p50 {paired['gateway_plus_adapter']:.2f} ms")


if __name__ == "__main__":
    main()
