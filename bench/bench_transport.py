"""`make bench-transport`: what the step protocol's round trip through Triton costs, PyTriton
(triton-local, as `make run` serves it) against Triton's own Python backend (deploy/triton's
smollm2_step model, as the image serves it) against no Triton at all (the engine in process).

Three sides, the same engine code and settings (2 threads, prefix cache off, greedy, one prompt),
every server up the whole run, the sides alternated in each round (order reversed in even rounds):

  engine          bench/engine/step_rounds.py: step_protocol.start_round on a SharedEngine in its
                  own process, the responses taken from a queue: the engine's own pace
  pytriton        triton-local (python -m sluice_triton_local): the engine in triton-local's
                  process behind PyTriton's proxy (its Python backend stub <-> ZMQ and shared
                  memory <-> the model's process), the tritonserver binary the nvidia-pytriton
                  wheel ships
  python-backend  that same tritonserver with deploy/triton/models/smollm2_step (Triton's Python
                  backend: the engine inside the stub process, no proxy), triton-local's
                  environment as the stub's interpreter

For each load (BATCHES sequences at once, TOKENS tokens each, STEPS engine steps per round, as the
adapter's MAX_ROUND_STEPS default) a client sends the prefill, then a decode request per round over
one gRPC stream (tritonclient, as the adapter does). The clock starts at the first response (the
prefill's) and stops at the last token; tokens/s counts decode tokens. CPU ms per token: the CPU
time of the serving process tree (tritonserver, its stubs, triton-local) over the load, per decode
token: what a token costs the machine, which the rest of a stack on the same cores pays for.

Prints per load and side tokens/s (best round) and CPU ms per token (median), then
  BENCH transport_pytriton_vs_engine_batch<B>         tokens/s ratio
  BENCH transport_python_backend_vs_engine_batch<B>   tokens/s ratio
  BENCH transport_pytriton_cpu_ms_per_token_batch<B>  minus the engine's own
  BENCH transport_python_backend_cpu_ms_per_token_batch<B>  minus the engine's own
BENCH_ROUNDS (3), BENCH_BATCHES (1,8), BENCH_TOKENS (96), BENCH_STEPS (8), BENCH_RUN_DIR (logs).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from sluice_stack import REPO_ROOT

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "3"))
BATCHES = [int(b) for b in os.environ.get("BENCH_BATCHES", "1,8").split(",")]
TOKENS = int(os.environ.get("BENCH_TOKENS", "96"))
STEPS = int(os.environ.get("BENCH_STEPS", "8"))
THREADS = 2
TRITON_LOCAL = REPO_ROOT / "services" / "triton-local"
PYTHON = TRITON_LOCAL / ".venv" / "bin" / "python"
STEP_MODEL = "smollm2_step"
PROMPT = "Write a long story about a dragon and a knight who become friends."  # step_rounds.PROMPT
PREFILL, DECODE, RELEASE = 1, 2, 3
SIDES = ("engine", "pytriton", "python-backend")


@dataclass(frozen=True)
class Result:
    tokens: int
    seconds: float
    cpu_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_seconds / self.tokens


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and all its descendants (/proc, user + system)."""
    children: dict[int, list[int]] = {}
    for line in subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


# --- the servers ---------------------------------------------------------------------------------


def python_info() -> dict[str, str]:
    script = "import json, sys, sysconfig; print(json.dumps({'version': f'{sys.version_info[0]}.{sys.version_info[1]}', 'libdir': sysconfig.get_config_var('LIBDIR')}))"
    return json.loads(subprocess.run([str(PYTHON), "-c", script], capture_output=True, text=True, check=True).stdout)


def start_pytriton(run_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    http, grpc_port, triton_metrics, metrics = free_ports(4)
    env = dict(
        os.environ,
        SLUICE_TRITON_LOCAL_HTTP_PORT=str(http), SLUICE_TRITON_LOCAL_GRPC_PORT=str(grpc_port),
        SLUICE_TRITON_LOCAL_TRITON_METRICS_PORT=str(triton_metrics), SLUICE_TRITON_LOCAL_METRICS_PORT=str(metrics),
        SLUICE_TRITON_LOCAL_VARIANT_MODEL_NAME="", SLUICE_TRITON_LOCAL_THREADS=str(THREADS),
        SLUICE_TRITON_LOCAL_PREFIX_CACHE="false",
        # A fixed team of threads with a brief spin, as on the other two sides: the transport is measured.
        SLUICE_TRITON_LOCAL_ADAPTIVE_THREADS="false",
    )  # fmt: skip
    with (run_dir / "triton-local.log").open("wb") as log:
        process = subprocess.Popen([str(PYTHON), "-m", "sluice_triton_local"], env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, f"127.0.0.1:{grpc_port}"


def start_python_backend(run_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """tritonserver with deploy/triton's step model on the Python backend (deploy/tests'
    test_triton_repository.py starts it the same way), its parameters set as the other sides'."""
    info = python_info()
    server_dir = next(TRITON_LOCAL.glob(".venv/lib/python3*/site-packages/pytriton/tritonserver"))
    backend = run_dir / "backends" / "python"
    backend.mkdir(parents=True, exist_ok=True)
    for item in (server_dir / "backends" / "python").iterdir():
        shutil.copy(item, backend)
    shutil.copy(server_dir / "python_backend_stubs" / info["version"] / "triton_python_backend_stub", backend)
    model = run_dir / "models" / STEP_MODEL
    shutil.copytree(REPO_ROOT / "deploy" / "triton" / "models" / STEP_MODEL, model, dirs_exist_ok=True)
    config = (model / "config.pbtxt").read_text()
    for key, value in (("THREADS", str(THREADS)), ("PREFIX_CACHE", "false"), ("MAX_SLOTS", "32")):
        config, replaced = _set_parameter(config, key, value)
        assert replaced, f"deploy/triton's {STEP_MODEL} config has no {key} parameter"
    (model / "config.pbtxt").write_text(config)
    http, grpc_port, metrics = free_ports(3)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        PATH=f"{PYTHON.parent}:{env['PATH']}",  # the stub's interpreter: triton-local's environment
        LD_LIBRARY_PATH=":".join([info["libdir"], str(server_dir.parent.parent / "nvidia_pytriton.libs")]),
        OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", GOMP_SPINCOUNT="1000",  # as triton-local sets them without adaptive threads
    )  # fmt: skip
    command = [
        str(server_dir / "bin" / "tritonserver"), f"--model-repository={run_dir / 'models'}", f"--backend-directory={run_dir / 'backends'}",
        *(f"--{kind}-address=127.0.0.1" for kind in ("http", "grpc", "metrics")),
        f"--http-port={http}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics}",
    ]  # fmt: skip
    with (run_dir / "tritonserver.log").open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    return process, f"127.0.0.1:{grpc_port}"


def _set_parameter(config: str, key: str, value: str) -> tuple[str, bool]:
    lines, replaced = [], False
    for line in config.splitlines():
        if line.startswith("parameters:") and f'key: "{key}"' in line:
            line, replaced = f'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}', True
        lines.append(line)
    return "\n".join(lines) + "\n", replaced


def wait_ready(process: subprocess.Popen[bytes], url: str, log: Path) -> grpcclient.InferenceServerClient:
    client = grpcclient.InferenceServerClient(url)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"a server exited with {process.returncode}; its log: {log}")
        try:
            if client.is_model_ready(STEP_MODEL):
                return client
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)
    raise SystemExit(f"{STEP_MODEL} not ready after 300 s; its log: {log}")


# --- the client ----------------------------------------------------------------------------------


def step_inputs(action: int, seq_ids: list[int], bodies: list[bytes], steps: int, stream_interval_ms: int = 0) -> list[grpcclient.InferInput]:
    """A step-protocol request's tensors over tritonclient (also bench-path's); STREAM_INTERVAL_MS
    only when given."""
    arrays = [
        ("ACTION", "INT32", np.full(len(seq_ids), action, np.int32)),
        ("SEQ_ID", "INT64", np.array(seq_ids, np.int64)),
        ("REQUEST", "BYTES", np.array(bodies, dtype=object)),
        ("STEPS", "INT32", np.array([steps], np.int32)),
    ]
    if stream_interval_ms:
        arrays.append(("STREAM_INTERVAL_MS", "INT32", np.array([stream_interval_ms], np.int32)))
    inputs = []
    for name, dtype, array in arrays:
        tensor = grpcclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class TritonSide:
    def __init__(self, process: subprocess.Popen[bytes], client: grpcclient.InferenceServerClient) -> None:
        self.process, self.client, self.ids = process, client, count(1)

    def run(self, batch: int, tokens: int, steps: int) -> Result:
        responses: queue.Queue[tuple[object, object]] = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        seq_ids = [next(self.ids) for _ in range(batch)]
        body = json.dumps({"messages": [["user", PROMPT]], "max_tokens": tokens, "temperature": 0}).encode()
        send = lambda action, ids, bodies, k: self.client.async_stream_infer(STEP_MODEL, step_inputs(action, ids, bodies, k))  # noqa: E731
        cpu = tree_cpu_seconds(self.process.pid)
        send(PREFILL, seq_ids, [body] * batch, steps)
        live, started, decoded = set(seq_ids), None, 0
        try:
            while live:
                result, error = responses.get(timeout=120)
                if error is not None:
                    raise SystemExit(f"the step model failed: {error}")
                if started is None:
                    started = time.perf_counter()
                else:
                    decoded += int((result.as_numpy("TOKEN_ID") >= 0).sum())
                live -= {int(s) for s, f in zip(result.as_numpy("ROW_SEQ_ID"), result.as_numpy("FINISH")) if f}
                if bool(result.as_numpy("ROUND_END")[0]) and live:
                    send(DECODE, sorted(live), [b""] * len(live), steps)
            seconds = time.perf_counter() - (started or time.perf_counter())
            cpu = tree_cpu_seconds(self.process.pid) - cpu
            send(RELEASE, seq_ids, [b""] * batch, 1)
            responses.get(timeout=60)
        finally:
            self.client.stop_stream()
        return Result(decoded, seconds, cpu)


class EngineSide:
    def __init__(self) -> None:
        script = REPO_ROOT / "bench" / "engine" / "step_rounds.py"
        env = dict(os.environ, BENCH_THREADS=str(THREADS))
        self.process = subprocess.Popen([str(PYTHON), str(script)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None and json.loads(self.process.stdout.readline()).get("ready")

    def run(self, batch: int, tokens: int, steps: int) -> Result:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(f"{batch} {tokens} {steps}\n")
        self.process.stdin.flush()
        answer = json.loads(self.process.stdout.readline())
        return Result(answer["tokens"], answer["seconds"], answer["cpu_seconds"])


# --- the run -------------------------------------------------------------------------------------


def report(results: dict[tuple[str, int], list[Result]]) -> list[str]:
    lines = [f"{'batch':>5} {'side':<15} {'tok/s':>7} {'CPU ms/token':>13}"]
    best = lambda side, batch: max(r.tokens_per_s for r in results[(side, batch)])  # noqa: E731
    cpu = lambda side, batch: statistics.median(r.cpu_ms_per_token for r in results[(side, batch)])  # noqa: E731
    for batch in BATCHES:
        for side in SIDES:
            lines.append(f"{batch:>5} {side:<15} {best(side, batch):7.1f} {cpu(side, batch):13.2f}")
    lines.append("")
    for batch in BATCHES:
        for side, name in (("pytriton", "pytriton"), ("python-backend", "python_backend")):
            lines.append(f"BENCH transport_{name}_vs_engine_batch{batch} {best(side, batch) / best('engine', batch):.2f} x tokens/s")
            lines.append(
                f"BENCH transport_{name}_cpu_ms_per_token_batch{batch} {cpu(side, batch) - cpu('engine', batch):+.2f} ms over the engine's {cpu('engine', batch):.2f}"
            )
    return lines


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = Path(os.environ.get("BENCH_RUN_DIR") or scratch)
        run_dir.mkdir(parents=True, exist_ok=True)
        print("starting triton-local (PyTriton), tritonserver with deploy/triton's step model (Python backend) and the engine alone ...", flush=True)
        started: list[subprocess.Popen[bytes]] = []
        try:
            sides: dict[str, Callable[[int, int, int], Result]] = {}
            for side, start, log in (("pytriton", start_pytriton, "triton-local.log"), ("python-backend", start_python_backend, "tritonserver.log")):
                process, url = start(run_dir)
                started.append(process)
                sides[side] = TritonSide(process, wait_ready(process, url, run_dir / log)).run
            engine = EngineSide()
            started.append(engine.process)  # type: ignore[arg-type]
            sides["engine"] = engine.run
            for run in sides.values():
                run(1, 8, STEPS)  # warm: connections, first allocations
            results: dict[tuple[str, int], list[Result]] = {(side, batch): [] for side in SIDES for batch in BATCHES}
            for round_ in range(1, ROUNDS + 1):
                for batch in BATCHES:
                    for side in SIDES if round_ % 2 else SIDES[::-1]:
                        result = sides[side](batch, TOKENS, STEPS)
                        results[(side, batch)].append(result)
                        print(
                            f"round {round_} batch {batch} {side:<15} {result.tokens_per_s:6.1f} tok/s {result.cpu_ms_per_token:6.2f} CPU ms/token",
                            flush=True,
                        )
        finally:
            for process in started:
                process.terminate()
            for process in started:
                process.wait(timeout=60)
    print()
    print("\n".join(report(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
