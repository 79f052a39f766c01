"""make bench-embed-cache: the adapter's embedding cache on vs off, side by side in one run.

One stack (one triton-local serving all-MiniLM-L6-v2): its own adapter runs with the cache off
(SLUICE_ADAPTER_EMBED_CACHE_BYTES=0), a second adapter on the same Triton, started the same way
with the same settings, runs with the cache on under a budget (default 4 MiB: smaller than the
workload's distinct texts, so entries are evicted and the budget is what bounds memory).

The workload, identical for both: texts drawn from a pool of 50,000 distinct sentences (6-30
words) with a Zipf distribution, P(rank k) proportional to 1/k^0.9 (the rank order shuffled
against the pool, so popularity is not tied to length): 9,600 texts in 1,200 requests of 8, 8
requests in flight. About 49% of its texts repeat an earlier one (printed as
`embed_cache_repeat_rate`: the hit rate an unbounded cache would reach); the hit rate under the
budget is read from the cached adapter's metrics.

Resident memory: VmRSS of each adapter process (/proc/<pid>/status) after a warm-up and after
the workload. The workload runs in segments, each through both adapters in turn (who goes
first alternates), so that the shared machine's drifting load falls on both alike. The cached
adapter's growth must stay under its budget plus an allowance of
16 MiB for what serving alone grows (gRPC buffers, allocator arenas; the cache-off adapter's
growth under the same workload is printed beside it).

Ends with `BENCH <name> <value> <unit>` lines.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_stack import Stack, StackPorts

EMBEDDING_MODEL = "all-minilm-l6-v2"
ALLOWANCE_MB = 16.0
WORDS = (
    "river mountain sea forest city market engine signal garden window winter summer bridge "
    "station letter music light shadow stone paper silver copper harbour valley island road "
    "battery network cloud model token memory cache budget kernel thread queue batch vector "
    "question answer report invoice order customer payment refund delivery package warehouse "
    "doctor patient clinic record policy contract clause tenant lease price market share "
    "quickly slowly carefully always never often rarely early late today tomorrow yesterday "
    "red green blue small large ancient modern quiet loud bright dark warm cold simple complex "
    "reads writes sends holds opens closes starts stops finds keeps moves turns builds breaks"
).split()


def make_pool(size: int, rng: np.random.Generator) -> list[str]:
    pool: list[str] = []
    seen: set[str] = set()
    while len(pool) < size:
        words = rng.choice(WORDS, size=int(rng.integers(6, 31)))
        text = " ".join(words).capitalize() + "."
        if text not in seen:
            seen.add(text)
            pool.append(text)
    return pool


def make_workload(args: argparse.Namespace) -> tuple[list[list[str]], float]:
    """Requests of `args.batch` texts drawn Zipf(s) from the pool; and the repeat rate."""
    rng = np.random.default_rng(args.seed)
    pool = make_pool(args.pool, rng)
    weights = np.arange(1, args.pool + 1, dtype=np.float64) ** -args.zipf_s
    ranked = rng.permutation(args.pool)  # rank k -> pool index, not tied to length
    draws = ranked[rng.choice(args.pool, size=args.requests * args.batch, p=weights / weights.sum())]
    texts = [pool[i] for i in draws]
    repeat_rate = 1 - len(set(texts)) / len(texts)
    return [texts[i : i + args.batch] for i in range(0, len(texts), args.batch)], repeat_rate


async def drive(stub: inference_pb2_grpc.InferenceServiceStub, requests: list[list[str]], concurrency: int) -> float:
    """Seconds `requests` took, `concurrency` of them in flight; each answer is checked for size."""
    queue = iter(requests)

    async def worker() -> None:
        for texts in queue:
            reply = await stub.Embed(inference_pb2.EmbedRequest(model=EMBEDDING_MODEL, tenant="bench", inputs=texts), timeout=600)
            assert len(reply.embeddings) == len(texts)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name in names:
            values[name] = float(value)
    return values


CACHE_METRICS = tuple(f"sluice_adapter_embed_cache_{name}" for name in ("hits_total", "misses_total", "evictions_total", "bytes", "capacity_bytes"))


async def measure(off_address: str, on_address: str, off_pid: int, on_pid: int, metrics_url: str, args: argparse.Namespace) -> dict[str, float]:
    requests, repeat_rate = make_workload(args)
    warm_up = [[f"Warm-up sentence {i} outside the pool." for i in range(args.batch)]] * 2
    async with grpc.aio.insecure_channel(off_address) as off_channel, grpc.aio.insecure_channel(on_address) as on_channel:
        stubs = {"off": inference_pb2_grpc.InferenceServiceStub(off_channel), "on": inference_pb2_grpc.InferenceServiceStub(on_channel)}
        for stub in stubs.values():
            await drive(stub, warm_up, 1)  # channels set up, first batches allocated
        rss = {"off_before": rss_mb(off_pid), "on_before": rss_mb(on_pid)}
        before = scrape(metrics_url, CACHE_METRICS)
        print(f"workload: {len(requests)} requests x {args.batch} texts, repeat rate {repeat_rate:.3f}", flush=True)
        # The shared machine's load drifts: the workload runs in segments, each through both
        # adapters, taking turns at going first; each side's texts/s is its texts over its time.
        elapsed = {"off": 0.0, "on": 0.0}
        size = -(-len(requests) // args.segments)
        for number, offset in enumerate(range(0, len(requests), size)):
            segment = requests[offset : offset + size]
            for side in ("off", "on") if number % 2 == 0 else ("on", "off"):
                elapsed[side] += await drive(stubs[side], segment, args.concurrency)
            done = offset + len(segment)
            print(
                f"  {done}/{len(requests)} requests: off {done * args.batch / elapsed['off']:.1f} texts/s, on {done * args.batch / elapsed['on']:.1f} texts/s",
                flush=True,
            )
    texts = sum(len(t) for t in requests)
    off, on = texts / elapsed["off"], texts / elapsed["on"]
    rss |= {"off_after": rss_mb(off_pid), "on_after": rss_mb(on_pid)}
    after = scrape(metrics_url, CACHE_METRICS)
    counted = {f"workload_{name}": after[name] - before[name] for name in CACHE_METRICS if name.endswith("_total")}
    return {"off": off, "on": on, "repeat_rate": repeat_rate, **after, **counted, **{f"rss_{k}": v for k, v in rss.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mb", type=float, default=4.0, help="the cached adapter's EMBED_CACHE_BYTES, in MiB")
    parser.add_argument("--pool", type=int, default=50_000, help="distinct texts the workload draws from")
    parser.add_argument("--zipf-s", type=float, default=0.9, help="Zipf exponent of text popularity")
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=8, help="texts per request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--segments", type=int, default=6, help="turns the two adapters take at the workload")
    parser.add_argument("--seed", type=int, default=15)
    args = parser.parse_args()
    budget = int(args.budget_mb * 1024 * 1024)
    with tempfile.TemporaryDirectory() as run_dir:
        stack = Stack(
            run_dir=Path(run_dir),
            ports=StackPorts.ephemeral(),
            extra_env={"inference-adapter": {"SLUICE_ADAPTER_EMBED_CACHE_BYTES": "0"}},
        )
        print("starting the stack ...", flush=True)
        stack.start()
        try:
            cached, on_address, metrics_url = stack.add_adapter("inference-adapter-cached", env={"SLUICE_ADAPTER_EMBED_CACHE_BYTES": str(budget)})
            off = stack.service("inference-adapter")
            assert off.process is not None and cached.process is not None
            result = asyncio.run(measure(stack.adapter_address, on_address, off.process.pid, cached.process.pid, metrics_url, args))
        finally:
            stack.stop()
    hits = result["workload_sluice_adapter_embed_cache_hits_total"]
    misses = result["workload_sluice_adapter_embed_cache_misses_total"]
    evictions = result["workload_sluice_adapter_embed_cache_evictions_total"]
    growth_on = result["rss_on_after"] - result["rss_on_before"]
    growth_off = result["rss_off_after"] - result["rss_off_before"]
    budget_mb = budget / 2**20
    within = growth_on <= budget_mb + ALLOWANCE_MB
    print()
    print(f"BENCH embed_cache_texts_per_s_off {result['off']:.1f} texts/s")
    print(f"BENCH embed_cache_texts_per_s_on {result['on']:.1f} texts/s")
    print(f"BENCH embed_cache_speedup {result['on'] / result['off']:.2f} x")
    print(f"BENCH embed_cache_repeat_rate {result['repeat_rate']:.3f} (Zipf s={args.zipf_s} over {args.pool} texts: an unbounded cache's hit rate)")
    print(f"BENCH embed_cache_hit_rate {hits / (hits + misses):.3f} (of the workload's distinct texts per request, under the budget)")
    print(f"BENCH embed_cache_evictions {evictions:.0f} entries")
    print(f"BENCH embed_cache_bytes_in_use_mb {result['sluice_adapter_embed_cache_bytes'] / 2**20:.2f} MiB")
    print(f"BENCH embed_cache_budget_mb {budget_mb:.2f} MiB")
    print(f"BENCH embed_cache_rss_before_mb {result['rss_on_before']:.1f} MiB (cache off adapter: {result['rss_off_before']:.1f})")
    print(f"BENCH embed_cache_rss_after_mb {result['rss_on_after']:.1f} MiB (cache off adapter: {result['rss_off_after']:.1f})")
    print(f"BENCH embed_cache_rss_growth_off_mb {growth_off:.1f} MiB")
    print(
        f"BENCH embed_cache_rss_growth_mb {growth_on:.1f} MiB"
        f" ({'within' if within else 'OVER'} the budget {budget_mb:.1f} + allowance {ALLOWANCE_MB:.0f} MiB)"
    )
    if not within:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
