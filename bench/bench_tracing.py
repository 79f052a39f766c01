"""make bench-tracing: what OpenTelemetry tracing costs, on vs off side by side in one run.

One stack (tracing off in its gateway and adapter), plus a second gateway and adapter on the same
Triton with tracing on: every request sampled (the SDK's default parentbased_always_on), exported
over OTLP/HTTP with the batch processor to a sink in this process, as a deployment would export to
a collector. Rate-limit and evaluation-logging run with tracing on, sampling what their caller
sampled (parentbased_always_off for roots): the traced gateway's requests are traced end to end,
the other gateway's cost them a non-recording span per RPC.

Interleaved in every round (the order shuffled), so that noise on this shared machine hits both:
  single   one stream at a time: TTFT and decode tokens/s per stream (bench_path's clocks);
  batch    `--streams` concurrent streams: aggregate tokens/s over the batch's wall time, each
           stream's tokens the completion tokens its usage reports (the last count it carries, as
           bench_path's clocks read it); until 2026-12-07 it counted chunks carrying text, and with
           the adapter's 50 ms stream interval a chunk carries several tokens.
The two sides are different processes (the stack's gateway and adapter, and the added pair), which
may differ by themselves; `--swap` puts tracing on the stack's own pair and off on the added one,
so that a difference that follows the processes rather than the tracing shows.
Target (issue 26): tracing on costs at most 5% of tokens/s and 1 ms of TTFT p50.
Ends with `BENCH <name> <value> <unit>` lines.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
from sluice.gateway.v1 import gateway_pb2_grpc

from bench_path import Chunk, Sample, gateway_chunks, measure, p50
from sluice_stack import Stack, StackPorts


def start_sink() -> tuple[ThreadingHTTPServer, list[int]]:
    """An OTLP/HTTP endpoint that takes every export (200, empty ExportTraceServiceResponse) and
    counts the bytes: the exporter's work is real, the collector's is not measured."""
    received = [0, 0]  # requests, bytes

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            size = int(self.headers.get("Content-Length", 0))
            self.rfile.read(size)
            received[0] += 1
            received[1] += size
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, received


def otel_env(endpoint: str, sampler: str) -> dict[str, str]:
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": sampler,
    }


def completion_tokens(chunks: Iterable[Chunk]) -> int:
    """A stream's tokens: the last completion-token count it carries (the usage on its final chunk).

    A chunk is not a token: the adapter sends a round's steps together every 50 ms, several tokens a
    chunk, so counting chunks would hide a slowdown that makes each chunk carry more."""
    tokens = 0
    for _, count in chunks:
        tokens = count if count is not None else tokens
    return tokens


def batch_tokens_per_s(stub: gateway_pb2_grpc.GatewayServiceStub, streams: int, max_tokens: int, pool: ThreadPoolExecutor) -> float:
    """Aggregate completion tokens per second of `streams` concurrent streams, over the batch's wall time."""
    started = time.perf_counter()
    counts = list(pool.map(lambda _: completion_tokens(gateway_chunks(stub, max_tokens)), range(streams)))
    return sum(counts) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--swap", action="store_true", help="tracing on in the stack's own gateway and adapter, off in the added pair")
    args = parser.parse_args()

    sink, received = start_sink()
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    follower = otel_env(endpoint, "parentbased_always_off")
    traced = otel_env(endpoint, "parentbased_always_on")
    own = {"gateway": traced, "inference-adapter": traced} if args.swap else {}
    added = {"OTEL_TRACES_EXPORTER": "none"} if args.swap else traced
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(
            run_dir=Path(run_dir),
            ports=StackPorts.ephemeral(),
            extra_env={"rate-limit": follower, "evaluation-logging": follower, **own},
        )
        print("starting the stack ...", flush=True)
        stack.start()
        try:
            _, adapter_address, _ = stack.add_adapter("inference-adapter-2", env=added)
            _, gateway_address, _ = stack.add_gateway("gateway-2", env={**added, "SLUICE_GATEWAY_ADAPTER_URL": adapter_address})
            own_stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_address))
            added_stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway_address))
            stubs = {"off": added_stub, "on": own_stub} if args.swap else {"off": own_stub, "on": added_stub}
            paths: dict[str, Callable[[], Iterable[Chunk]]] = {
                name: (lambda stub=stub: gateway_chunks(stub, args.max_tokens)) for name, stub in stubs.items()
            }
            for path in paths.values():  # warm every channel and code path once
                measure(path)
            single: dict[str, list[Sample]] = {name: [] for name in paths}
            batch: dict[str, list[float]] = {name: [] for name in paths}
            with ThreadPoolExecutor(args.streams) as pool:
                for round_index in range(args.rounds):
                    order = list(paths)
                    random.Random(round_index).shuffle(order)
                    for name in order:
                        single[name].append(measure(paths[name]))
                    for name in order:
                        batch[name].append(batch_tokens_per_s(stubs[name], args.streams, args.max_tokens, pool))
            time.sleep(6)  # the batch processor's last export (OTEL_BSP_SCHEDULE_DELAY, 5 s by default)
        finally:
            stack.stop()
            sink.shutdown()

    ttft = {name: p50([s[0] for s in values]) * 1000 for name, values in single.items()}
    paired_ttft = p50([(on[0] - off[0]) * 1000 for on, off in zip(single["on"], single["off"])])
    tps = {name: p50([s[1] for s in values]) for name, values in single.items()}
    batch_tps = {name: p50(values) for name, values in batch.items()}
    arrangement = "on: the stack's own gateway and adapter" if args.swap else "on: the added gateway and adapter"
    print(f"\n{args.rounds} rounds, {args.max_tokens} tokens per stream; batch: {args.streams} concurrent streams; {arrangement}\n")
    print(f"{'tracing':<9}{'TTFT p50 ms':>13}{'tok/s p50 (1 stream)':>23}{f'tok/s p50 ({args.streams} streams)':>24}")
    for name in paths:
        print(f"{name:<9}{ttft[name]:>13.2f}{tps[name]:>23.1f}{batch_tps[name]:>24.1f}")
    print(f"\nexported: {received[0]} OTLP requests, {received[1] / 1e6:.2f} MB\n")
    for name in paths:
        print(f"BENCH tracing_{name}_ttft_p50 {ttft[name]:.2f} ms")
        print(f"BENCH tracing_{name}_tokens_per_s_p50 {tps[name]:.1f} tok/s")
        print(f"BENCH tracing_{name}_batch_tokens_per_s_p50 {batch_tps[name]:.1f} tok/s")
    print(f"BENCH tracing_ttft_overhead_p50 {paired_ttft:.2f} ms")
    print(f"BENCH tracing_tokens_per_s_change {(tps['on'] / tps['off'] - 1) * 100:.1f} %")
    print(f"BENCH tracing_batch_tokens_per_s_change {(batch_tps['on'] / batch_tps['off'] - 1) * 100:.1f} %")
    print(f"BENCH tracing_spans_exported_bytes {received[1]} bytes")


if __name__ == "__main__":
    main()
