"""`make bench-gpu`: the step engine on an NVIDIA GPU against the same engine on the CPU, in
triton-local's environment (or the offline kit's, bench/gpu/kit.py run):

  services/triton-local/.venv/bin/python bench/engine/gpu.py

Needs llama-cpp-python built with CUDA (`CMAKE_ARGS="-DGGML_CUDA=on"`, see
bench/gpu/kit.py, which builds one to carry to a GPU machine) and a CUDA device that llama.cpp sees; without them it prints one
line saying which is missing and exits with NO_GPU (3).

Two StepEngines on the same GGUF, each with max(BATCHES) KV slots: one with every layer on the
GPU (gpu_layers=-1), one on the CPU alone (gpu_layers=0, BENCH_THREADS threads, default the
CPUs it can keep busy). For each batch size both run the same greedy chat prompts (row i gets PROMPTS[i]): one
step prefills the batch (timed too: prompt tokens/s), then DECODE_STEPS decode steps, the decode clock around those alone;
best of BENCH_ROUNDS a side. Prints per batch

  BENCH gpu batch=8 decode_tok_s=... cpu_decode_tok_s=... ratio=... greedy_identical=true (8/8 rows) prefill_tok_s=... cpu_prefill_tok_s=...

and, where rows differ, the first token index at which each does: GPU and CPU kernels add in
other orders, so a near-tie between two tokens can go either way and the rows part from there.

Then the same greedy rows through the step protocol on the GPU engine (step_protocol.start_round on a
SharedEngine, as both Triton models call it, the responses taken from a queue: what the adapter
drives, less the Triton hop, which `make bench-transport` measures) in rounds of k engine steps, for
each k of BENCH_ROUND_STEPS (1: a round trip per token; 64: the adapter's MAX_ROUND_STEPS default),
a round's steps sharing a response for up to BENCH_STREAM_INTERVAL_MS (50: the adapter's
STREAM_INTERVAL_S default; 0: a response per step), and each batch of BATCHES up to 32, against
the engine stepped directly at the same batch, on the same (engine) thread. The two alternate, the
engine alone then the protocol, BENCH_ROUNDS pairs for each setting, each pair's ratio its own:

  BENCH gpu_protocol_in_process batch=8 round_steps=64 ahead=false interval_ms=50 tok_s=... engine_tok_s=... ratio=... (pairs ..., ...; min ..., max ...) greedy_identical=true (8/8 rows)

tok_s and engine_tok_s are each side's best; ratio is the median of the pairs' ratios, each pair's
and their range in the parenthesis. Both clocks start and stop at the same points: the engine
alone's after its prefill step and after its last decode step; the protocol's at the engine-thread
calls that answer its first response (the prefill's) and the response that ends its last row.
greedy_identical counts the rows whose tokens equal the engine's own in every pair. In process:
these figures leave out the Triton hop (deploy/triton's Python backend is not measured on a GPU by
this script).

A protocol round that answers nothing, or an engine-alone run that does not end, within
BENCH_GPU_RESPONSE_TIMEOUT_S (60) has hung: the bench says so and exits 1. BENCH_GPU_DEADLINE_S (the
offline kit sets it, under its own deadline) ends the whole bench with every thread's traceback,
which names the phase it was in, and exit 1.

BENCH_GPU_DRY_RUN=1 is the offline kit's proof on a machine with no GPU (bench/gpu/kit.py prove):
the CUDA build must still be the one loaded, but the "GPU" side offloads no layers, so both sides'
figures are the CPU's and the lines say so.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np

from decode import greedy_decode  # this folder's decode.py (a script's folder is on sys.path)
from sluice_common.cgroup import usable_cpus
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.model_files import gguf_path
from sluice_triton_local.shared_engine import SharedEngine
from sluice_triton_local.step_protocol import DECODE, PREFILL, RELEASE, round_inputs, start_round

NO_GPU = 3
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "1,8,32,64").split(",")]
DECODE_STEPS = int(os.environ.get("BENCH_STEPS", "64"))
ROUNDS = int(os.environ.get("BENCH_ROUNDS", "2"))
# The CPUs this process can keep busy (a container CPU limit lowers its cores): more engine threads
# than that spin at every barrier and would handicap the CPU side of the comparison.
THREADS = int(os.environ.get("BENCH_THREADS", "0")) or usable_cpus()[0]
DRY_RUN = os.environ.get("BENCH_GPU_DRY_RUN", "") not in ("", "0")
ROUND_STEPS = [int(k) for k in os.environ.get("BENCH_ROUND_STEPS", "1,8,64").split(",")]
STREAM_INTERVAL_MS = int(os.environ.get("BENCH_STREAM_INTERVAL_MS", "50"))
PROTOCOL_MAX_BATCH = 32
# A protocol round that answers nothing, or an engine-alone run that does not end, for this long has
# hung: well under the device call's timeout, so that the bench says so before the call is stopped.
RESPONSE_TIMEOUT_S = float(os.environ.get("BENCH_GPU_RESPONSE_TIMEOUT_S", "60"))
DEADLINE_S = float(os.environ.get("BENCH_GPU_DEADLINE_S", "0"))  # 0: none (the kit sets one)
PROMPT_ROOM = 192  # positions a slot keeps for its templated prompt (the longest of PROMPTS: 44 tokens)

_TOPICS = (
    "a dragon and a knight",
    "the printing press",
    "how bread rises",
    "a lighthouse keeper's year",
    "the water cycle",
    "a journey across the Sahara",
    "the steam engine",
    "the life of honeybees",
    "a city on Mars",
    "the first computers",
    "a storm at sea",
    "how vaccines work",
    "a chess tournament",
    "the migration of whales",
    "an old clockmaker",
    "how volcanoes form",
)
_ASKS = (
    "Write a long story about {}.",
    "Explain {} in detail, step by step.",
    "Write a long essay on {}.",
    "Describe {} to a curious child, at length.",
)
PROMPTS = [ask.format(topic) for ask in _ASKS for topic in _TOPICS]  # 64, one per row


def ratio(value: float, baseline: float) -> float:
    """value / baseline; nan where the baseline measured nothing (no division by zero)."""
    return value / baseline if baseline else float("nan")


@dataclass(frozen=True)
class Side:
    decode_tok_s: float
    tokens: list[list[int]]  # per row, the prefill's token first
    prefill_tok_s: float = 0.0  # the prefill step's prompt tokens/s (0: not measured)


@dataclass(frozen=True)
class Comparison:
    batch: int
    gpu: Side
    cpu: Side

    def divergence(self) -> dict[int, int]:
        """Row -> the first token index where the GPU's and the CPU's greedy tokens differ."""
        out = {}
        for row, (g, c) in enumerate(zip(self.gpu.tokens, self.cpu.tokens)):
            if g != c:
                out[row] = next((i for i, (a, b) in enumerate(zip(g, c)) if a != b), min(len(g), len(c)))
        return out

    def line(self) -> str:
        same = self.batch - len(self.divergence())
        return (
            f"BENCH gpu batch={self.batch} decode_tok_s={self.gpu.decode_tok_s:.1f} "
            f"cpu_decode_tok_s={self.cpu.decode_tok_s:.1f} ratio={ratio(self.gpu.decode_tok_s, self.cpu.decode_tok_s):.2f} "
            f"greedy_identical={str(same == self.batch).lower()} ({same}/{self.batch} rows) "
            f"prefill_tok_s={self.gpu.prefill_tok_s:.0f} cpu_prefill_tok_s={self.cpu.prefill_tok_s:.0f}"
        )


def run_side(engine: StepEngine, batch: int, steps: int, rounds: int) -> Side:
    prompts = [engine.apply_chat_template([("user", p)]) for p in PROMPTS[:batch]]
    runs = [greedy_decode(engine, prompts, steps) for _ in range(rounds)]
    if changed := sum(tokens != runs[0][1] for _, tokens, _ in runs):
        # CUDA kernels need not be deterministic (atomics, split reductions); a near tie then goes
        # either way from one run to the next. Said, not fatal: the first round's tokens compare.
        print(f"  greedy tokens changed between rounds at batch {batch} on one engine ({changed} of {rounds} rounds)", flush=True)
    return Side(max(tok_s for tok_s, _, _ in runs), runs[0][1], max(prefill for _, _, prefill in runs))


def compare(gpu: StepEngine, cpu: StepEngine, batch: int, steps: int = DECODE_STEPS, rounds: int = ROUNDS) -> Comparison:
    return Comparison(batch, run_side(gpu, batch, steps, rounds), run_side(cpu, batch, steps, rounds))


@dataclass(frozen=True)
class ProtocolRun:
    batch: int
    round_steps: int
    pairs: tuple[tuple[Side, Side], ...]  # (the protocol, the engine alone) measured one after the other
    ahead: bool = False  # each round sent at the first response of the one before, to follow it
    interval_ms: int = 0  # how long a round's steps may wait to share a response

    @property
    def protocol(self) -> Side:
        return max((p for p, _ in self.pairs), key=lambda side: side.decode_tok_s)

    @property
    def engine(self) -> Side:
        return max((e for _, e in self.pairs), key=lambda side: side.decode_tok_s)

    def ratios(self) -> list[float]:
        """Each pair's protocol tokens/s over the engine alone's, measured beside it."""
        return [ratio(p.decode_tok_s, e.decode_tok_s) for p, e in self.pairs]

    def identical_rows(self) -> int:
        """Rows whose protocol tokens equal the engine alone's in every pair."""
        return sum(all(p.tokens[row] == e.tokens[row] for p, e in self.pairs) for row in range(self.batch))

    def line(self) -> str:
        ratios, same = self.ratios(), self.identical_rows()
        spread = f" (pairs {', '.join(f'{r:.2f}' for r in ratios)}; min {min(ratios):.2f}, max {max(ratios):.2f})" if len(ratios) > 1 else ""
        return (
            f"BENCH gpu_protocol_in_process batch={self.batch} round_steps={self.round_steps} ahead={str(self.ahead).lower()} interval_ms={self.interval_ms} "
            f"tok_s={self.protocol.decode_tok_s:.1f} "
            f"engine_tok_s={self.engine.decode_tok_s:.1f} ratio={statistics.median(ratios):.2f}{spread} "
            f"greedy_identical={str(same == self.batch).lower()} ({same}/{self.batch} rows)"
        )


_protocol_seq_ids = count(50_000)


def protocol_decode(engine: SharedEngine, prompts: list[str], decode_steps: int, round_steps: int, ahead: bool = False, interval_ms: int = 0) -> Side:
    """greedy_decode's load (one prefill, then up to `decode_steps` greedy tokens a row) through the
    step protocol in rounds of `round_steps` engine steps, each round asked for when the last ended,
    or (`ahead`) sent at the first response of the round before to follow it (FOLLOWS_ROUND), as the
    adapter's SLUICE_ADAPTER_ROUNDS_AHEAD does. The clock runs between the engine thread's calls
    that answer the first response (the prefill's, answered at once after the prefill step) and the
    response that ends the last row: where greedy_decode's clock starts and stops, not when this
    thread gets to read them."""
    # A response, whether it is its round's last and when the engine's thread answered it; or the
    # error of a round that failed before its last (on the engine's thread, outside a step's rows:
    # held in the round's Future, not answered).
    responses: queue.Queue[tuple[dict[str, np.ndarray], bool, float] | BaseException] = queue.Queue()
    answer = lambda outputs, last: responses.put((outputs, last, time.perf_counter()))  # noqa: E731

    def failed(done: Future[None]) -> None:
        if not done.cancelled() and (error := done.exception()) is not None:
            responses.put(error)  # else the loop below would wait RESPONSE_TIMEOUT_S for a response that never comes

    def send(inputs: dict[str, np.ndarray]) -> None:
        start_round(engine, inputs, answer).add_done_callback(failed)

    ids = [next(_protocol_seq_ids) for _ in prompts]
    bodies = [json.dumps({"messages": [["user", p]], "max_tokens": decode_steps + 1, "temperature": 0}).encode() for p in prompts]
    send(round_inputs(PREFILL, ids, bodies, round_steps, stream_interval_ms=interval_ms))
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    live, started, ended, followed = set(ids), 0.0, 0.0, False
    while live:
        try:
            item = responses.get(timeout=RESPONSE_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no step protocol response in {RESPONSE_TIMEOUT_S:.0f} s ({len(live)} rows still running)") from None
        if isinstance(item, BaseException):
            raise item  # the round's own error, with its traceback on the engine's thread
        outputs, last, answered = item
        started = started or answered
        for seq_id, token, finish, error in zip(outputs["ROW_SEQ_ID"], outputs["TOKEN_ID"], outputs["FINISH"], outputs["ERROR"]):
            if int(seq_id) not in live:  # a round sent ahead answers "not running" for one that ended
                continue
            if finish not in (b"", b"stop", b"length"):
                raise RuntimeError(f"sequence {seq_id} ended {finish.decode()}: {error.decode()}")
            if token >= 0:
                tokens[int(seq_id)].append(int(token))
            if finish:
                live.discard(int(seq_id))
                ended = answered
        if ahead and not last and live and not followed:
            send(round_inputs(DECODE, sorted(live), [b""] * len(live), round_steps, follows=True, stream_interval_ms=interval_ms))
            followed = True
        elif last and followed:
            followed = False  # the round sent ahead runs now
        elif last and live:
            send(round_inputs(DECODE, sorted(live), [b""] * len(live), round_steps, stream_interval_ms=interval_ms))
    elapsed = ended - started
    start_round(engine, round_inputs(RELEASE, ids, [b""] * len(ids), 1), lambda *_: None).result(timeout=RESPONSE_TIMEOUT_S)
    decoded = sum(len(row) - 1 for row in tokens.values())  # the prefill's token is before the clock
    return Side(decoded / max(elapsed, 1e-9), [tokens[i] for i in ids])


def engine_alone(shared: SharedEngine, engine: StepEngine, batch: int, steps: int = DECODE_STEPS) -> Side:
    """greedy_decode on `engine` (the one `shared` wraps) stepped directly, on the shared engine's own
    thread, where the protocol's steps run: one OpenMP team for both sides (see SharedEngine), so
    neither pays for the other's."""
    prompts = [engine.apply_chat_template([("user", p)]) for p in PROMPTS[:batch]]
    work = shared._owner.submit(greedy_decode, engine, prompts, steps, counted=False)
    try:
        tok_s, tokens, prefill = work.result(timeout=RESPONSE_TIMEOUT_S)
    except TimeoutError:
        raise TimeoutError(f"the engine alone did not end {steps} steps at batch {batch} in {RESPONSE_TIMEOUT_S:.0f} s") from None
    return Side(tok_s, tokens, prefill)


def protocol_run(
    shared: SharedEngine,
    engine: StepEngine,
    batch: int,
    round_steps: int,
    steps: int = DECODE_STEPS,
    rounds: int = ROUNDS,
    ahead: bool = False,
    interval_ms: int = 0,
) -> ProtocolRun:
    """`rounds` pairs, each the engine alone then the protocol on the same rows, back to back (A, B,
    A, B, ...): each protocol figure against the engine's measured beside it, not minutes before."""
    pairs = []
    for _ in range(rounds):
        alone = engine_alone(shared, engine, batch, steps)
        pairs.append((protocol_decode(shared, PROMPTS[:batch], steps, round_steps, ahead, interval_ms), alone))
    return ProtocolRun(batch, round_steps, tuple(pairs), ahead, interval_ms)


def engines(batches: list[int], steps: int, threads: int, gpu_layers: int = -1) -> tuple[StepEngine, StepEngine]:
    """(the GPU side, the CPU side), each with a KV slot for every row of the largest batch.
    gpu_layers=0 puts both on the CPU (what the tests do)."""
    slots, context = max(batches), PROMPT_ROOM + steps
    # No prefix cache: every round prefills its prompts in full (its prefill figure), as the first did.
    gpu = StepEngine(gguf_path(), slots, context, engine="llamacpp", threads=threads, gpu_layers=gpu_layers, prefix_cache=False)
    cpu = StepEngine(gguf_path(), slots, context, engine="llamacpp", threads=threads, gpu_layers=0, prefix_cache=False)
    return gpu, cpu


def kv_cache_line(engine: StepEngine) -> str:
    c = engine.config
    per_position = c.n_layers * 2 * c.n_kv_heads * c.head_dim * 2  # K and V, f16
    total = per_position * engine.max_slots * engine.context_length
    return (
        f"KV cache a side: {engine.max_slots} slots x {engine.context_length} positions x "
        f"{per_position / 1024:.1f} KiB = {total / 2**20:.0f} MiB (f16)"
    )


# -- is there a GPU to run on? ------------------------------------------------


def gpu_devices() -> list[str]:
    """llama.cpp's GPU devices (name, description, memory), from ggml's device registry."""
    import llama_cpp

    libggml = ctypes.CDLL(str(_lib_dir(llama_cpp) / "libggml.so"))
    libggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    libggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    libggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(libggml, name).restype = ctypes.c_char_p
        getattr(libggml, name).argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    libggml.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    found = []
    for i in range(libggml.ggml_backend_dev_count()):
        dev = libggml.ggml_backend_dev_get(i)
        if libggml.ggml_backend_dev_type(dev) != 1:  # GGML_BACKEND_DEVICE_TYPE_GPU
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        libggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(
            f"{libggml.ggml_backend_dev_name(dev).decode()} ({libggml.ggml_backend_dev_description(dev).decode()}, "
            f"{free.value / 2**30:.0f} of {total.value / 2**30:.0f} GiB free)"
        )
    return found


def cuda_build_line() -> str:
    """Which llama.cpp this process loaded: the kit's proof that its CUDA build is the one in use."""
    import llama_cpp

    cuda_libs = cuda_libraries()
    return (
        f"llama-cpp-python {llama_cpp.__version__} from {_lib_dir(llama_cpp).parent}: "
        f"{'CUDA build (' + ', '.join(cuda_libs) + ')' if cuda_libs else 'CPU build'}, "
        f"GPU offload supported: {bool(llama_cpp.llama_supports_gpu_offload())}, "
        f"GPU devices: {'; '.join(gpu_devices()) or 'none'}"
    )


def gpu_missing() -> str:
    """Why this environment cannot run the bench on an NVIDIA GPU; "" when it can."""
    import llama_cpp

    if not cuda_libraries():
        return (
            f"bench-gpu: llama-cpp-python here is a CPU build (no libggml-cuda in {_lib_dir(llama_cpp)}); build it with CUDA: "
            'uv cache clean llama-cpp-python && rm -rf services/triton-local/.venv && CMAKE_ARGS="-DGGML_CUDA=on" make setup '
            "(or carry the offline kit that `make bench-gpu-kit` builds: bench/gpu/kit.py)"
        )
    if not llama_cpp.llama_supports_gpu_offload() or not any(d.startswith("CUDA") for d in gpu_devices()):
        return f"bench-gpu: llama-cpp-python is a CUDA build but llama.cpp sees no CUDA device ({_nvidia_smi()})"
    return ""


def cuda_libraries() -> list[str]:
    """The CUDA backend's library files in llama-cpp-python's lib folder (none in a CPU build)."""
    import llama_cpp

    return sorted(p.name for p in _lib_dir(llama_cpp).glob("libggml-cuda*"))


def _lib_dir(llama_cpp_module: object) -> Path:
    return Path(llama_cpp_module.__file__).parent / "lib"  # type: ignore[attr-defined]


def _nvidia_smi() -> str:
    if not shutil.which("nvidia-smi"):
        return "no nvidia-smi: no NVIDIA driver on this machine"
    proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=False)
    return "nvidia-smi -L: " + ((proc.stdout or proc.stderr).strip().replace("\n", "; ") or f"exit {proc.returncode}")


def main() -> int:
    print(cuda_build_line(), flush=True)
    if DRY_RUN:
        if not cuda_libraries():
            print("bench-gpu: BENCH_GPU_DRY_RUN proves the CUDA build, but this llama-cpp-python is a CPU build", file=sys.stderr)
            return NO_GPU
        print("DRY RUN (BENCH_GPU_DRY_RUN=1): no layers offloaded, both sides' figures are the CPU's", flush=True)
    elif missing := gpu_missing():
        print(missing, file=sys.stderr)
        return NO_GPU
    gpu, cpu = engines(BATCHES, DECODE_STEPS, THREADS, gpu_layers=0 if DRY_RUN else -1)
    print(kv_cache_line(cpu), flush=True)
    print(
        f"batches {BATCHES}, {DECODE_STEPS} greedy decode steps after one prefill step, best of {ROUNDS} rounds a side; "
        f"CPU side {THREADS} threads ...",
        flush=True,
    )
    compare(gpu, cpu, 1, steps=4, rounds=1)  # warm up both (CUDA kernels load on first use)
    dry = " (dry run: both sides on the CPU)" if DRY_RUN else ""
    for batch in BATCHES:
        result = compare(gpu, cpu, batch)
        print(result.line() + dry, flush=True)
        if diverged := result.divergence():
            rows = ", ".join(f"row {row} at token {index}" for row, index in sorted(diverged.items()))
            print(f"  GPU and CPU greedy tokens part: {rows}", flush=True)
    shared = SharedEngine(gpu)
    print(
        f"the step protocol on the GPU engine in process (no Triton hop: not the Triton path's cost, which this does not measure),"
        f" rounds of {ROUND_STEPS} steps, a response at most every {STREAM_INTERVAL_MS} ms ...",
        flush=True,
    )
    print(f"each setting: {ROUNDS} pairs of the engine alone then the protocol, on the engine's thread ...", flush=True)
    engine_alone(shared, gpu, 1, 4)  # untimed: both sides' first steps on the engine's thread
    protocol_decode(shared, PROMPTS[:1], 4, 1)
    for batch in (b for b in BATCHES if b <= PROTOCOL_MAX_BATCH):
        for round_steps in ROUND_STEPS:
            # A round of one step has no later step to send the next one during.
            for ahead in (False, True) if round_steps > 1 else (False,):
                run = protocol_run(shared, gpu, batch, round_steps, ahead=ahead, interval_ms=STREAM_INTERVAL_MS)
                print(run.line() + (" (dry run: on the CPU)" if DRY_RUN else ""), flush=True)
    return 0


def script() -> None:
    """main(), with BENCH_GPU_DEADLINE_S armed; on an error, its traceback and exit 1 at once: an
    engine thread stuck in a step (what a TimeoutError here reports) would keep the interpreter from
    exiting, and the device call would run on to its own timeout, saying nothing more."""
    if DEADLINE_S > 0:
        print(f"deadline: {DEADLINE_S:.0f} s (BENCH_GPU_DEADLINE_S), then every thread's traceback and exit 1", flush=True)
        faulthandler.dump_traceback_later(DEADLINE_S, exit=True)
    try:
        code = main()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    script()
