"""The gateway's settings: one set of SLUICE_GATEWAY_* variables read into blocks (shared, front,
worker; a ClientTLS per peer), every problem of every block listed at one start."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_common.config import ClientTLS, ConfigError, load_config
from sluice_gateway.config import ENV_PREFIX, GatewayConfig

TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def load(**settings: str) -> GatewayConfig:
    return load_config(GatewayConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in {"TENANTS_FILE": TENANTS, **settings}.items()})


def test_each_variable_lands_in_its_block() -> None:
    config = load(
        HTTP_PORT="8080", WORKER_PORT="6000", WORKER_PREFETCH="9", JOBS_MAX_ROWS="7",
        RATELIMIT_TLS="true", ADAPTER_TLS_CA_FILE=TENANTS, ADAPTER_TLS_SERVER_NAME="adapter.svc",
    )  # fmt: skip
    assert (config.front.http_port, config.worker.port, config.worker.prefetch, config.shared.jobs_max_rows) == (8080, 6000, 9, 7)
    assert config.port == 50051 and config.shared.tenants_file == Path(TENANTS)
    assert config.shared.adapter_tls.for_channel() == ClientTLS(ca_file=TENANTS, server_name="adapter.svc")
    assert config.shared.ratelimit_tls.for_channel() == ClientTLS(enabled=True)
    assert load().shared.adapter_tls.for_channel() is None and load().shared.ratelimit_tls.for_channel() is None


def test_a_bad_tls_setting_is_named_by_its_full_variable() -> None:
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}RATELIMIT_TLS_KEY_FILE=/no/key.pem is not a readable file"):
        load(RATELIMIT_TLS_CERT_FILE=TENANTS, RATELIMIT_TLS_KEY_FILE="/no/key.pem")
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}ADAPTER_TLS_CERT_FILE and {ENV_PREFIX}ADAPTER_TLS_KEY_FILE go together"):
        load(ADAPTER_TLS_CERT_FILE=TENANTS)


def test_the_problems_of_every_block_are_listed_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        load(
            ADAPTER_TLS_CA_FILE="/no/ca.pem", RATELIMIT_TLS="maybe", HTTP_PORT="70000", WORKER_ROW_ATTEMPTS="many",
        )  # fmt: skip
    message = str(caught.value)
    for problem in (
        f"{ENV_PREFIX}ADAPTER_TLS_CA_FILE=/no/ca.pem is not a readable file",
        f"{ENV_PREFIX}RATELIMIT_TLS='maybe' is not a boolean",
        f"{ENV_PREFIX}HTTP_PORT must be in [-1, 65535]",
        f"{ENV_PREFIX}WORKER_ROW_ATTEMPTS='many' is not an integer",
    ):
        assert problem in message
    # A block with a value that does not parse is not built, so its range checks wait for the next
    # start; those of blocks that parsed are listed together.
    with pytest.raises(ConfigError) as caught:
        load(HTTP_PORT="70000", WORKER_PREFETCH="0", JOBS_MAX_ROWS="0")
    message = str(caught.value)
    assert all(f"{ENV_PREFIX}{name}" in message for name in ("HTTP_PORT", "WORKER_PREFETCH", "JOBS_MAX_ROWS"))
