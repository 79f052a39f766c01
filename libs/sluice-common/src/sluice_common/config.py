"""Configuration read once from the environment into a frozen dataclass.

Each service declares a frozen dataclass; `load_config` fills every field from
`<PREFIX><FIELD_NAME_UPPER>` and reports every bad or missing value at once, so an
operator fixes a deployment in one pass instead of one crash per variable.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """One or more environment variables are missing or malformed."""


def _parse(raw: str, kind: Any) -> Any:
    if kind is str:
        return raw
    if kind is int:
        return int(raw)
    if kind is float:
        return float(raw)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        raise ValueError("expected one of true/false/1/0/yes/no/on/off")
    if kind is Path:
        return Path(raw)
    origin = typing.get_origin(kind)
    if origin is tuple:
        (item_kind, _ellipsis) = typing.get_args(kind)
        return tuple(_parse(item.strip(), item_kind) for item in raw.split(",") if item.strip())
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        inner = [arg for arg in typing.get_args(kind) if arg is not type(None)]
        return None if raw == "" else _parse(raw, inner[0])
    raise TypeError(f"unsupported config field type {kind!r}")


def _describe(kind: Any) -> str:
    return {int: "an integer", float: "a number", bool: "a boolean"}.get(kind, f"a {getattr(kind, '__name__', kind)}")


def env_name(prefix: str, field_name: str) -> str:
    return f"{prefix}{field_name.upper()}"


# Settings one variable sets for every service at once (a per-service variable still overrides):
# the drain grace must agree with the pods' terminationGracePeriodSeconds, so it is set in one place.
SHARED_SETTINGS = {"shutdown_grace_s": "SLUICE_SHUTDOWN_GRACE_S"}


def load_config(cls: type[T], prefix: str, environ: Mapping[str, str] | None = None) -> T:
    """Builds `cls` from the environment; raises ConfigError naming every bad variable."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    problems: list[str] = []
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = env_name(prefix, field.name)
        if name not in environ and environ.get(SHARED_SETTINGS.get(field.name, "")) is not None:
            name = SHARED_SETTINGS[field.name]
        raw = environ.get(name)
        if raw is None:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                problems.append(f"{name} is required but not set")
            continue
        try:
            values[field.name] = _parse(raw, hints[field.name])
        except ValueError as exc:
            problems.append(f"{name}={raw!r} is not {_describe(hints[field.name])} ({exc})")
    if problems:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    try:
        return cls(**values)
    except ValueError as exc:  # __post_init__ checks of ranges and combinations
        raise ConfigError(f"invalid configuration: {exc}") from exc


def require(condition: bool, message: str) -> None:
    """For __post_init__ range checks; the message names the variable and the allowed range."""
    if not condition:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Settings every gRPC service has; each service's config subclasses it."""

    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    log_level: str = "INFO"
    log_json: bool | None = None
    # On SIGTERM: NOT_SERVING at once, then accepted streams and rows get this long to finish
    # (a p99 stream fits), then what is owed is flushed. SLUICE_SHUTDOWN_GRACE_S sets every service's.
    shutdown_grace_s: float = 60.0
    # TLS, off by default. Cert and key (PEM files) turn TLS on for this server's clients; a client
    # CA on top makes it mutual: a client must present a certificate signed by that CA.
    # The files are re-read when they change (certificate rotation without a restart).
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""

    def server_tls(self, prefix: str = "") -> ServerTLS | None:
        """The TLS settings of this server, None when TLS is off; ConfigError when they do not fit."""
        return ServerTLS.from_settings(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file, f"{prefix}TLS_")


def _check_files(settings: Mapping[str, str]) -> list[str]:
    return [f"{name}={path} is not a readable file" for name, path in settings.items() if path and not os.access(path, os.R_OK)]


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """PEM files for a TLS server; with `client_ca_file` the server requires client certificates."""

    cert_file: str
    key_file: str
    client_ca_file: str = ""

    @classmethod
    def from_settings(cls, cert_file: str, key_file: str, client_ca_file: str, env_prefix: str = "") -> ServerTLS | None:
        names = {f"{env_prefix}CERT_FILE": cert_file, f"{env_prefix}KEY_FILE": key_file}
        if not (cert_file or key_file or client_ca_file):
            return None
        problems = [f"{name} must be set with the others" for name, value in names.items() if not value]
        problems += _check_files({**names, f"{env_prefix}CLIENT_CA_FILE": client_ca_file})
        if problems:
            raise ConfigError("invalid TLS configuration: " + "; ".join(problems))
        return cls(cert_file, key_file, client_ca_file)


@dataclasses.dataclass(frozen=True)
class ClientTLS:
    """PEM files for a TLS channel to another service.

    `ca_file` verifies the server (empty: the system's roots); `cert_file` and `key_file` are this
    service's identity for mutual TLS; `server_name` overrides the name checked against the server's
    certificate (when the address is not a name the certificate carries).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    @classmethod
    def from_settings(
        cls, ca_file: str, cert_file: str, key_file: str, server_name: str = "", env_prefix: str = "", enabled: bool = False
    ) -> ClientTLS | None:
        """None (plaintext) unless `enabled` or any file is set; ConfigError when they do not fit."""
        if not (enabled or ca_file or cert_file or key_file):
            return None
        problems = []
        if bool(cert_file) != bool(key_file):
            problems.append(f"{env_prefix}CERT_FILE and {env_prefix}KEY_FILE go together")
        problems += _check_files({f"{env_prefix}CA_FILE": ca_file, f"{env_prefix}CERT_FILE": cert_file, f"{env_prefix}KEY_FILE": key_file})
        if problems:
            raise ConfigError("invalid TLS configuration: " + "; ".join(problems))
        return cls(ca_file, cert_file, key_file, server_name)

    @classmethod
    def for_peer(cls, config: object, peer: str, env_prefix: str) -> ClientTLS | None:
        """The channel TLS a config declares for one peer with the fields `<peer>_tls`,
        `<peer>_tls_ca_file`, `<peer>_tls_cert_file`, `<peer>_tls_key_file`, `<peer>_tls_server_name`."""
        field = lambda name: getattr(config, f"{peer}_tls{name}")  # noqa: E731
        return cls.from_settings(
            field("_ca_file"),
            field("_cert_file"),
            field("_key_file"),
            field("_server_name"),
            env_prefix=f"{env_prefix}{peer.upper()}_TLS_",
            enabled=field(""),
        )
