from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_common.config import ConfigError, ServerConfig, load_config, require


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
