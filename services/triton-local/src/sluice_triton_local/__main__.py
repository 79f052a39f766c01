"""`python -m sluice_triton_local`: load SmolLM2, warm it up, serve it from a real Triton."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import MutableMapping
from typing import TYPE_CHECKING

import structlog

from sluice_common.cgroup import usable_cpus
from sluice_common.config import ConfigError, load_config
from sluice_common.log import configure_logging
from sluice_triton_local.config import ENV_PREFIX, TritonLocalConfig
from sluice_triton_local.metrics import ENGINE_THREADS, USABLE_CPUS, serve_metrics
from sluice_triton_local.model_files import smollm2_gguf

# Rounds a llama.cpp thread spins at a barrier before it sleeps, without adaptive threads
# (default_thread_waits says why).
DEFAULT_SPINCOUNT = 1000

if TYPE_CHECKING:
    from sluice_triton_local.engine.step_engine import StepEngine
    from sluice_triton_local.shared_engine import SharedEngine

log = structlog.stdlib.get_logger("sluice.triton_local")


def main() -> None:
    try:
        config = load_config(TritonLocalConfig, ENV_PREFIX)
    except ConfigError as exc:
        print(f"triton-local: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    configure_logging("triton-local", config.log_level, config.log_json)
    # One BLAS thread is faster for these small matrices on a few cores (measured), and BLAS
    # reads this when numpy is first imported: hence the imports below, not at the top.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    default_thread_waits(os.environ, config.adaptive_threads)
    default_tensor_transport(os.environ)
    from pytriton.triton import Triton, TritonLifecyclePolicy

    from sluice_triton_local.embeddings import MiniLMEncoder
    from sluice_triton_local.embeddings.triton_binding import bind_embedding_model
    from sluice_triton_local.generate_model import SelfBatchingGenerator, bind_generate_model
    from sluice_triton_local.server import bind_step_model, exit_when_tritonserver_exits, fix_python_backend_library_path, triton_config
    from sluice_triton_local.shared_engine import SharedEngine, warm_up

    fix_python_backend_library_path()

    report_threads(config)
    started = time.perf_counter()
    gguf_path = config.gguf_path or str(smollm2_gguf())
    step_engine = step_engine_for(config, gguf_path, config.max_slots)
    engine = SharedEngine(step_engine)
    answer = warm_up(engine)  # on the engine's own thread, like every later step
    variant = start_variant(config, gguf_path, engine)
    encoder = MiniLMEncoder()
    encoder.encode(["warm-up"])
    log.info(
        "model_loaded",
        gguf=gguf_path,
        engine=config.engine,
        threads=config.engine_threads(),
        prefix_cache_host_mib=step_engine.host_store_capacity_bytes // 2**20,
        seconds=round(time.perf_counter() - started, 1),
        warmup_answer=answer,
    )
    if (
        config.prefix_cache
        and f"{ENV_PREFIX}PREFIX_CACHE_HOST_MIB" in os.environ
        and config.prefix_cache_host_mib
        and not step_engine.host_store_capacity_bytes
    ):
        log.warning(
            "prefix_cache_host_store_ignored",
            reason=f"the {config.engine} engine cannot save a slot's cells: {ENV_PREFIX}PREFIX_CACHE_HOST_MIB={config.prefix_cache_host_mib} keeps nothing",
        )
    serve_metrics(config.metrics_port, config.host, config.max_slots)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # The models go into a local model store and tritonserver loads them all at its start, side by
    # side, instead of one after another through its repository API (PyTriton's default).
    triton = Triton(
        config=triton_config(config), triton_lifecycle_policy=TritonLifecyclePolicy(launch_triton_on_startup=False, local_model_store=True)
    )
    exit_when_tritonserver_exits(triton, stop, config.triton_log_file)
    with triton:
        bind_step_model(triton, config.step_model_name, engine)
        bind_generate_model(triton, config.generate_model_name, SelfBatchingGenerator(engine, config.max_slots, owner=config.generate_model_name))
        bind_embedding_model(triton, config.embedding_model_name, encoder)
        if variant is not None:
            bind_step_model(triton, config.variant_model_name, variant)
        triton.run()
        log.info(
            "ready",
            grpc=f"{config.host}:{config.grpc_port}",
            models=[config.step_model_name, config.generate_model_name, config.embedding_model_name]
            + ([config.variant_model_name] if variant is not None else []),
            metrics_port=config.metrics_port,
            seconds=round(time.perf_counter() - started, 1),
        )
        stop.wait()
        log.info("shutting_down")
    log.info("stopped")


def default_thread_waits(environ: MutableMapping[str, str], adaptive_threads: bool) -> None:
    """How llama.cpp's OpenMP threads wait at a step's barriers, unless the operator said.

    With adaptive threads (the default): libgomp's own wait, as llama-server's, spinning ~ms before
    it sleeps. That is the fastest on a quiet box, and the governor (engine/thread_governor.py) steps
    with fewer threads while another process takes cores, where a long spin would stall every step.
    On one 2-core VM (engine alone, batch 1, ms a token): libgomp's default 13.6, 1,000 spins 16.8,
    10,000 16.4, 100 40; on an earlier one 9.5-11.6, 11.2-13.0, -, 17.5-19.9.

    Without them, every thread steps always, and a spin of 1,000 rounds (a few microseconds) keeps a
    busy box from stalling the steps: spinning long there failed all 32 streams of `make
    bench-threads` beside one busy process, and sleeping at once pays a wake-up at every barrier.
    libgomp reads this when llama.cpp first loads it, after this call.
    """
    if not adaptive_threads and "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", str(DEFAULT_SPINCOUNT))


def default_tensor_transport(environ: MutableMapping[str, str]) -> None:
    """How PyTriton moves tensors between Triton's Python backend stub and this process, unless the
    operator said: inline in its ZMQ messages (PYTRITON_NO_TENSORSTORE, which PyTriton reads on both
    sides; the stub inherits it through tritonserver) rather than through shared-memory blocks that a
    manager process of its own hands out. The step protocol's tensors are a few bytes a row, and the
    manager's IPC cost more than the copies it saves: at one stream (8-step rounds, two stacks
    alternated, prefix cache off) inline decoded 75.2 tok/s against 72.6 (each of 4 rounds ahead)
    and triton-local's process tree spent 20.96 CPU ms a token against 21.71; the largest tensors,
    an embedding batch's vectors, are a few hundred KB. Set it empty for the shared-memory store."""
    environ.setdefault("PYTRITON_NO_TENSORSTORE", "1")


def report_threads(config: TritonLocalConfig) -> None:
    """Logs and exports the engine's threads against the usable CPUs, warning when they exceed them."""
    cpus, source = usable_cpus()
    threads = config.engine_threads()
    ENGINE_THREADS.set(threads)
    USABLE_CPUS.set(cpus)
    if threads > cpus:
        log.warning(
            "engine_threads_exceed_cpus",
            threads=threads,
            usable_cpus=cpus,
            source=source,
            hint=f"every step will stall on threads waiting for a core: lower {ENV_PREFIX}THREADS to {cpus} or less"
            " (replicas sharing a host: their THREADS together at most its cores)",
        )
    else:
        log.info("engine_threads", threads=threads, usable_cpus=cpus, source=source)


def start_variant(config: TritonLocalConfig, gguf_path: str, main: SharedEngine) -> SharedEngine | None:
    """The second variant's engine (variant.py), with its own few slots, stepping on the main
    engine's thread; None when VARIANT_MODEL_NAME is empty."""
    if not config.variant_model_name:
        return None
    from pathlib import Path

    from sluice_triton_local.shared_engine import SharedEngine, warm_up
    from sluice_triton_local.variant import QuantizeError, ensure_variant

    started = time.perf_counter()
    try:
        path, made = ensure_variant(Path(gguf_path), config.variant_quantization, config.variant_cache_dir(), config.engine_threads())
    except (OSError, QuantizeError) as exc:
        # Refuse to start rather than serve without a model the adapter is configured to route to.
        print(
            f"triton-local: cannot make the {config.variant_quantization} variant in {config.variant_cache_dir()}"
            f" ({ENV_PREFIX}CACHE_DIR; {ENV_PREFIX}VARIANT_MODEL_NAME= turns it off): {exc}",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    engine = SharedEngine(step_engine_for(config, str(path), config.variant_slots), variant_of=main)
    answer = warm_up(engine)
    log.info(
        "variant_loaded",
        model=config.variant_model_name,
        gguf=str(path),
        made=made,
        quantization=config.variant_quantization,
        slots=config.variant_slots,
        seconds=round(time.perf_counter() - started, 1),
        warmup_answer=answer,
    )
    return engine


def step_engine_for(config: TritonLocalConfig, gguf_path: str, slots: int) -> StepEngine:
    """A step engine on one GGUF file with this process's engine settings."""
    from sluice_triton_local.engine.step_engine import StepEngine

    return StepEngine(
        gguf_path,
        max_slots=slots,
        max_context=config.max_context,
        slot_lease_s=config.slot_lease_s,
        prefix_cache=config.prefix_cache,
        host_prefix_bytes=config.prefix_cache_host_mib * 2**20,
        prefill_tokens_per_step=config.prefill_tokens_per_step,
        adaptive_threads=config.adaptive_threads,
        engine=config.engine,
        threads=config.engine_threads(),
        gpu_layers=config.gpu_layers,
    )


if __name__ == "__main__":
    main()
