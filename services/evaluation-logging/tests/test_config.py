"""evaluation-logging's TLS to the adapter: one ClientTLS block from SLUICE_EVALLOG_ADAPTER_TLS*."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_common.config import ClientTLS, ConfigError, load_config
from sluice_evaluation_logging.config import ENV_PREFIX, EvalLogConfig

TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def load(**settings: str) -> EvalLogConfig:
    return load_config(EvalLogConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in {"TENANTS_FILE": TENANTS, **settings}.items()})


def test_the_adapter_tls_block_is_off_by_default_and_read_from_its_prefix() -> None:
    assert load().adapter_tls.for_channel() is None
    config = load(ADAPTER_TLS="on", ADAPTER_TLS_CA_FILE=TENANTS, ADAPTER_TLS_SERVER_NAME="adapter.svc")
    assert config.adapter_tls.for_channel() == ClientTLS(ca_file=TENANTS, server_name="adapter.svc", enabled=True)


def test_a_bad_adapter_tls_setting_is_listed_with_the_other_problems() -> None:
    with pytest.raises(ConfigError) as caught:
        load(ADAPTER_TLS_KEY_FILE="/no/key.pem", PREFETCH="lots")
    message = str(caught.value)
    assert f"{ENV_PREFIX}ADAPTER_TLS_CERT_FILE and {ENV_PREFIX}ADAPTER_TLS_KEY_FILE go together" in message
    assert f"{ENV_PREFIX}ADAPTER_TLS_KEY_FILE=/no/key.pem is not a readable file" in message
    assert f"{ENV_PREFIX}PREFETCH='lots' is not an integer" in message


def test_score_completions_calls_in_flight_per_tenant_are_configurable_and_checked() -> None:
    assert load().score_max_concurrent_per_tenant == 2
    assert load(SCORE_MAX_CONCURRENT_PER_TENANT="5").score_max_concurrent_per_tenant == 5
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}SCORE_MAX_CONCURRENT_PER_TENANT must be in 1..1024, got 0"):
        load(SCORE_MAX_CONCURRENT_PER_TENANT="0")
