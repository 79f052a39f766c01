from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_common.config import ClientTLS, ConfigError, ServerConfig, load_config, nested, require


@dataclass(frozen=True)
class ExampleConfig(ServerConfig):
    port: int = 1234
    ratio: float = 0.5
    name: str = "x"
    enabled: bool = False
    path: Path = Path("/tmp")
    hosts: tuple[str, ...] = ()
    optional_limit: int | None = None

    def __post_init__(self) -> None:
        require(0 <= self.ratio <= 1, f"EX_RATIO must be in [0, 1], got {self.ratio}")


def test_defaults_when_nothing_is_set() -> None:
    config = load_config(ExampleConfig, "EX_", environ={})
    assert config.port == 1234 and config.host == "127.0.0.1" and config.log_json is None


def test_each_type_is_parsed() -> None:
    config = load_config(
        ExampleConfig,
        "EX_",
        environ={
            "EX_PORT": "99",
            "EX_RATIO": "0.25",
            "EX_ENABLED": "yes",
            "EX_PATH": "/var/x",
            "EX_HOSTS": "a:1, b:2",
            "EX_OPTIONAL_LIMIT": "7",
            "EX_LOG_JSON": "false",
        },
    )
    assert (config.port, config.ratio, config.enabled) == (99, 0.25, True)
    assert config.path == Path("/var/x") and config.hosts == ("a:1", "b:2")
    assert config.optional_limit == 7 and config.log_json is False


def test_every_bad_variable_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(ExampleConfig, "EX_", environ={"EX_PORT": "eighty", "EX_ENABLED": "maybe"})
    message = str(caught.value)
    assert "EX_PORT='eighty' is not an integer" in message
    assert "EX_ENABLED='maybe' is not a boolean" in message


def test_range_checks_become_config_errors() -> None:
    with pytest.raises(ConfigError, match=r"EX_RATIO must be in \[0, 1\], got 3.0"):
        load_config(ExampleConfig, "EX_", environ={"EX_RATIO": "3"})


def test_config_is_frozen() -> None:
    config = load_config(ExampleConfig, "EX_", environ={})
    with pytest.raises(AttributeError):
        config.port = 1  # type: ignore[misc]


@dataclass(frozen=True)
class Required:
    url: str


def test_missing_required_variable() -> None:
    with pytest.raises(ConfigError, match="REQ_URL is required but not set"):
        load_config(Required, "REQ_", environ={})


def test_shared_shutdown_grace_sets_every_service_and_a_service_variable_overrides_it() -> None:
    assert load_config(ExampleConfig, "EX_", environ={}).shutdown_grace_s == 60.0
    shared = {"SLUICE_SHUTDOWN_GRACE_S": "45"}
    assert load_config(ExampleConfig, "EX_", environ=shared).shutdown_grace_s == 45.0
    both = {**shared, "EX_SHUTDOWN_GRACE_S": "7"}
    assert load_config(ExampleConfig, "EX_", environ=both).shutdown_grace_s == 7.0


def test_a_bad_shared_value_is_reported_under_its_own_name() -> None:
    with pytest.raises(ConfigError, match="SLUICE_SHUTDOWN_GRACE_S='soon'"):
        load_config(ExampleConfig, "EX_", environ={"SLUICE_SHUTDOWN_GRACE_S": "soon"})


# ---- blocks: nested settings, each from its own prefix


@dataclass(frozen=True)
class Limits:
    window: int = 10
    ratio: float = 0.5

    def __post_init__(self) -> None:
        require(self.window >= 1, f"NEST_LIMITS_WINDOW must be >= 1, got {self.window}")


@dataclass(frozen=True)
class NestedConfig:
    url: str = "127.0.0.1:1"
    peer_tls: ClientTLS = nested(ClientTLS)
    limits: Limits = nested(Limits)
    flat: Limits = nested(Limits, env="FLAT_")


def test_a_block_reads_its_fields_from_its_prefix_and_its_switch_from_its_name() -> None:
    assert load_config(NestedConfig, "NEST_", environ={}).peer_tls.for_channel() is None
    config = load_config(
        NestedConfig,
        "NEST_",
        environ={"NEST_PEER_TLS": "yes", "NEST_PEER_TLS_SERVER_NAME": "peer.svc", "NEST_LIMITS_WINDOW": "3", "NEST_FLAT_RATIO": "0.1"},
    )
    assert config.peer_tls == ClientTLS(server_name="peer.svc", enabled=True) and config.peer_tls.for_channel() is config.peer_tls
    assert (config.limits.window, config.limits.ratio, config.flat.window, config.flat.ratio) == (3, 0.5, 10, 0.1)


def test_a_bad_value_in_a_block_is_named_by_its_full_variable() -> None:
    with pytest.raises(ConfigError, match="NEST_PEER_TLS_CA_FILE=/no/such/ca.pem is not a readable file"):
        load_config(NestedConfig, "NEST_", environ={"NEST_PEER_TLS_CA_FILE": "/no/such/ca.pem"})
    with pytest.raises(ConfigError, match="NEST_PEER_TLS='maybe' is not a boolean"):
        load_config(NestedConfig, "NEST_", environ={"NEST_PEER_TLS": "maybe"})


def test_the_problems_of_every_block_are_listed_at_once(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("not checked here")
    environ = {
        "NEST_PEER_TLS_CERT_FILE": str(cert),  # without its key
        "NEST_LIMITS_WINDOW": "0",  # the block's own range check
        "NEST_FLAT_RATIO": "half",  # not a number
        "NEST_LIMITS_RATIO": "x",
    }
    with pytest.raises(ConfigError) as caught:
        load_config(NestedConfig, "NEST_", environ=environ)
    message = str(caught.value)
    assert "NEST_PEER_TLS_CERT_FILE and NEST_PEER_TLS_KEY_FILE go together" in message
    assert "NEST_FLAT_RATIO='half' is not a number" in message
    assert "NEST_LIMITS_RATIO='x' is not a number" in message
    environ["NEST_LIMITS_RATIO"] = "0.2"
    with pytest.raises(ConfigError) as caught:
        load_config(NestedConfig, "NEST_", environ=environ)
    message = str(caught.value)
    assert "NEST_LIMITS_WINDOW must be >= 1, got 0" in message and "NEST_PEER_TLS_CERT_FILE and NEST_PEER_TLS_KEY_FILE go together" in message
    assert "NEST_FLAT_RATIO='half' is not a number" in message


@dataclass(frozen=True)
class Checked:
    low: int = 1
    high: int = 10
    step: float = 0.5

    def __post_init__(self) -> None:
        require(self.low >= 1, f"CHK_LOW must be >= 1, got {self.low}")
        require(self.low <= self.high, f"CHK_LOW must be <= CHK_HIGH, got {self.low} and {self.high}")
        require(self.step > 0, f"CHK_STEP must be > 0, got {self.step}")
        object.__setattr__(self, "steps", int((self.high - self.low) / self.step))  # trusts the checks: step 0 divides by zero


def test_every_range_check_of_a_block_is_listed_at_once() -> None:
    assert load_config(Checked, "CHK_", environ={}).steps == 18  # type: ignore[attr-defined]
    with pytest.raises(ConfigError) as caught:
        load_config(Checked, "CHK_", environ={"CHK_LOW": "0", "CHK_HIGH": "-1", "CHK_STEP": "0"})
    assert str(caught.value) == (
        "invalid configuration: CHK_LOW must be >= 1, got 0; CHK_LOW must be <= CHK_HIGH, got 0 and -1; CHK_STEP must be > 0, got 0.0"
    )


def test_outside_load_config_a_failed_check_raises_at_once() -> None:
    with pytest.raises(ValueError, match=r"^CHK_LOW must be >= 1, got 0$"):
        Checked(low=0)
