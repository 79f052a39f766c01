"""The gateway's settings: one set of SLUICE_GATEWAY_* variables read into blocks (shared, front,
worker; a ClientTLS per peer), each role loading the shared block and its own, every problem of
every block listed at one start."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_common.config import ClientTLS, ConfigError, load_config
from sluice_gateway.config import ENV_PREFIX, GatewayConfig, WorkerConfig

TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def environ(**settings: str) -> dict[str, str]:
    return {f"{ENV_PREFIX}{name}": value for name, value in {"TENANTS_FILE": TENANTS, **settings}.items()}


def load(**settings: str) -> GatewayConfig:
    return load_config(GatewayConfig, ENV_PREFIX, environ(**settings))


def load_worker(**settings: str) -> WorkerConfig:
    return load_config(WorkerConfig, ENV_PREFIX, environ(**settings))


def test_each_variable_lands_in_its_block() -> None:
    config = load(
        HTTP_PORT="8080", WORKER_PORT="6000", WORKER_PREFETCH="9", JOBS_MAX_ROWS="7",
        RATELIMIT_TLS="true", ADAPTER_TLS_CA_FILE=TENANTS, ADAPTER_TLS_SERVER_NAME="adapter.svc",
    )  # fmt: skip
    assert (config.front.http_port, config.shared.jobs_max_rows, config.port) == (8080, 7, 50051)
    worker = load_worker(HTTP_PORT="8080", WORKER_PORT="6000", WORKER_PREFETCH="9", JOBS_MAX_ROWS="7")
    assert (worker.worker.port, worker.worker.prefetch, worker.shared.jobs_max_rows) == (6000, 9, 7)
    assert config.shared.tenants_file == worker.shared.tenants_file == Path(TENANTS)
    assert config.shared.adapter_tls.for_channel() == ClientTLS(ca_file=TENANTS, server_name="adapter.svc")
    assert config.shared.ratelimit_tls.for_channel() == ClientTLS(enabled=True)
    assert load().shared.adapter_tls.for_channel() is None and load().shared.ratelimit_tls.for_channel() is None


def test_a_bad_tls_setting_is_named_by_its_full_variable() -> None:
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}RATELIMIT_TLS_KEY_FILE=/no/key.pem is not a readable file"):
        load(RATELIMIT_TLS_CERT_FILE=TENANTS, RATELIMIT_TLS_KEY_FILE="/no/key.pem")
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}ADAPTER_TLS_CERT_FILE and {ENV_PREFIX}ADAPTER_TLS_KEY_FILE go together"):
        load(ADAPTER_TLS_CERT_FILE=TENANTS)


def test_the_problems_of_every_block_are_listed_at_once() -> None:
    bad = dict(ADAPTER_TLS_CA_FILE="/no/ca.pem", RATELIMIT_TLS="maybe", HTTP_PORT="70000", WORKER_ROW_ATTEMPTS="many")
    shared = (f"{ENV_PREFIX}ADAPTER_TLS_CA_FILE=/no/ca.pem is not a readable file", f"{ENV_PREFIX}RATELIMIT_TLS='maybe' is not a boolean")
    with pytest.raises(ConfigError) as caught:
        load(**bad)
    message = str(caught.value)
    assert all(problem in message for problem in (*shared, f"{ENV_PREFIX}HTTP_PORT must be in [-1, 65535]"))
    assert "WORKER_" not in message  # the worker's settings are the worker's to check
    with pytest.raises(ConfigError) as caught:
        load_worker(**bad)
    message = str(caught.value)
    assert all(problem in message for problem in (*shared, f"{ENV_PREFIX}WORKER_ROW_ATTEMPTS='many' is not an integer"))
    assert "HTTP_PORT" not in message
    # A block with a value that does not parse is not built, so its range checks wait for the next
    # start; those of blocks that parsed are listed together, every failed check of each.
    with pytest.raises(ConfigError) as caught:
        load_worker(WORKER_PREFETCH="0", WORKER_ROW_ATTEMPTS="0", WORKER_DELIVERY_LIMIT="0", JOBS_MAX_ROWS="0", RATELIMIT_TIMEOUT_S="0")
    message = str(caught.value)
    names = ("WORKER_PREFETCH", "WORKER_ROW_ATTEMPTS", "WORKER_DELIVERY_LIMIT", "JOBS_MAX_ROWS", "RATELIMIT_TIMEOUT_S")
    assert all(f"{ENV_PREFIX}{name} must be" in message for name in names), message


def test_the_fronts_ports_and_server_tls_are_not_the_workers() -> None:
    """The worker's ports are WORKER_PORT and WORKER_METRICS_PORT and its health server has no TLS:
    the front's PORT, METRICS_PORT and TLS_* (which a shared environment sets for both roles) are
    neither read nor checked by it."""
    fronts = dict(PORT="not a port", METRICS_PORT="-", TLS_CERT_FILE="/no/cert.pem")
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}PORT='not a port' is not an integer"):
        load(**fronts)
    worker = load_worker(**fronts, WORKER_PORT="6000")
    assert worker.worker.port == 6000
    assert not any(hasattr(worker, name) for name in ("port", "metrics_port", "tls_cert_file", "server_tls"))


def test_the_job_message_bound_stays_under_the_brokers_default_max_message_size() -> None:
    """A job's message over RabbitMQ's max_message_size (16 MiB since 4.0) makes the broker close
    the channel: the size past which SubmitJob and POST /v1/batches refuse a job may not exceed it."""
    assert load().shared.jobs_max_message_bytes == 8 * 1024 * 1024
    assert load(JOBS_MAX_MESSAGE_BYTES="16777216").shared.jobs_max_message_bytes == 16 * 1024 * 1024
    for bad in ("16777217", "1023"):
        with pytest.raises(ConfigError, match=f"{ENV_PREFIX}JOBS_MAX_MESSAGE_BYTES must be in \\[1024, 16777216\\]"):
            load(JOBS_MAX_MESSAGE_BYTES=bad)
