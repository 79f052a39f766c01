"""gateway settings, from SLUICE_GATEWAY_* environment variables."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sluice_common.config import ServerConfig, require

ENV_PREFIX = "SLUICE_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    port: int = 50051
    metrics_port: int = 9101
    adapter_url: str = "127.0.0.1:50061"
    # TOML file of tenants and their hashed API keys (see config/tenants.example.toml).
    tenants_file: Path = Path("")
    # How often the model list is re-read from the adapter.
    models_refresh_s: float = 30.0
    # How long startup waits for the adapter to list its models.
    adapter_wait_s: float = 300.0

    def __post_init__(self) -> None:
        require(str(self.tenants_file) not in ("", "."), f"{ENV_PREFIX}TENANTS_FILE is required: the TOML file of tenants")
        require(self.tenants_file.is_file(), f"{ENV_PREFIX}TENANTS_FILE={self.tenants_file} does not exist")
