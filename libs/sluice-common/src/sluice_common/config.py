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
from contextvars import ContextVar
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


# A field's metadata key naming its variable (or, for a block, its variables' prefix) after the
# parent's prefix, where the field's name does not say it.
ENV = "env"


def nested(cls: type[T], env: str | None = None) -> T:
    """A block of settings inside a config: its fields read from `<prefix><env><FIELD>`, `env`
    being the field's name upper-cased with "_" unless given ("" keeps the parent's prefix)."""
    return dataclasses.field(default_factory=cls, metadata={ENV: env})  # type: ignore[return-value]


def block_switch(default: bool = False) -> bool:
    """A block's on/off flag, read from the block's own name: ADAPTER_TLS for ADAPTER_TLS_*."""
    return dataclasses.field(default=default, metadata={ENV: ""})  # type: ignore[return-value]


# While load_config builds a block, `require` adds each failed check here instead of raising at the
# first, so that every range problem of a block is listed at once too.
_failed_checks: ContextVar[list[str] | None] = ContextVar("failed_checks", default=None)


# Settings one variable sets for every service at once (a per-service variable still overrides):
# the drain grace must agree with the pods' terminationGracePeriodSeconds, so it is set in one place.
SHARED_SETTINGS = {"shutdown_grace_s": "SLUICE_SHUTDOWN_GRACE_S"}


def load_config(cls: type[T], prefix: str, environ: Mapping[str, str] | None = None) -> T:
    """Builds `cls` from the environment; raises ConfigError naming every bad variable.

    A field whose type is a dataclass is a block (see `nested`), loaded from its own prefix. Every
    block is checked, each by its `__post_init__` and, when it has one, `env_problems(prefix)`
    (for checks whose messages need the variables' names), so the problems of every block are
    listed at once; a block with a problem leaves the blocks around it unbuilt and their own
    cross-block checks for the next start."""
    environ = os.environ if environ is None else environ
    problems: list[str] = []
    config = _load(cls, prefix, environ, problems)
    if problems or config is None:
        raise ConfigError("invalid configuration: " + "; ".join(problems))
    return config


def _load(cls: type[T], prefix: str, environ: Mapping[str, str], problems: list[str]) -> T | None:
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    complete = True
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        kind = hints[field.name]
        env = field.metadata.get(ENV)
        if dataclasses.is_dataclass(kind):
            block = _load(kind, prefix + (f"{field.name.upper()}_" if env is None else env), environ, problems)  # type: ignore[arg-type]
            complete = complete and block is not None
            values[field.name] = block
            continue
        name = env_name(prefix, field.name) if env is None else f"{prefix}{env}".removesuffix("_")
        if name not in environ and environ.get(SHARED_SETTINGS.get(field.name, "")) is not None:
            name = SHARED_SETTINGS[field.name]
        raw = environ.get(name)
        if raw is None:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                problems.append(f"{name} is required but not set")
                complete = False
            continue
        try:
            values[field.name] = _parse(raw, kind)
        except ValueError as exc:
            problems.append(f"{name}={raw!r} is not {_describe(kind)} ({exc})")
            complete = False
    if not complete:
        return None
    failed: list[str] = []
    collecting = _failed_checks.set(failed)
    try:
        config = cls(**values)
    except Exception as exc:  # __post_init__ checks of ranges and combinations
        # After a failed check, code that trusted it may fail in its own way: the checks say why.
        if not failed and not isinstance(exc, ValueError):
            raise
        problems.extend(failed or [str(exc)])
        return None
    finally:
        _failed_checks.reset(collecting)
    if failed:
        problems.extend(failed)
        return None
    check = getattr(config, "env_problems", None)
    more: list[str] = check(prefix) if check is not None else []
    problems.extend(more)
    return None if more else config


def require(condition: bool, message: str) -> None:
    """For __post_init__ range checks; the message names the variable and the allowed range. Raises
    ValueError, except while load_config builds the block: then the check is listed with the
    block's others and load_config raises once, naming them all."""
    if not condition:
        failed = _failed_checks.get()
        if failed is None:
            raise ValueError(message)
        failed.append(message)


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Settings every long-running process has: where it binds, its logs and its drain grace. A
    role whose ports are settings of its own (the gateway's job worker) subclasses this one."""

    host: str = "127.0.0.1"
    log_level: str = "INFO"
    log_json: bool | None = None
    # On SIGTERM: NOT_SERVING at once, then accepted streams and rows get this long to finish
    # (a p99 stream fits), then what is owed is flushed. SLUICE_SHUTDOWN_GRACE_S sets every service's.
    shutdown_grace_s: float = 60.0


CONNECTION_AGE_ENV = "SLUICE_MAX_CONNECTION_AGE_S"


@dataclasses.dataclass(frozen=True)
class ConnectionAge:
    """How long a client's connection to any Sluice gRPC server lives before the server asks it to
    reconnect (GOAWAY): one shared variable, SLUICE_MAX_CONNECTION_AGE_S, read by the server
    bootstrap itself (server.create_server; 0 turns it off). Clients resolve the service's name
    again when they reconnect, so a replica added later gets a share of their new calls within
    about this long; the calls in flight finish on the old connection (server.connection_age_options)."""

    max_connection_age_s: float = 120.0

    def __post_init__(self) -> None:
        require(self.max_connection_age_s >= 0, f"{CONNECTION_AGE_ENV} must be >= 0 (0: off), got {self.max_connection_age_s}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> ConnectionAge:
        return load_config(cls, "SLUICE_", environ)


@dataclasses.dataclass(frozen=True)
class ServerConfig(ServiceConfig):
    """Settings every gRPC service has beside those: its ports and server TLS; each service's
    config subclasses it."""

    port: int = 0
    metrics_port: int = 0
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
    """PEM files for a TLS channel to another service; a config's block per peer (see `nested`).

    `ca_file` verifies the server (empty: the system's roots); `cert_file` and `key_file` are this
    service's identity for mutual TLS; `server_name` overrides the name checked against the server's
    certificate (when the address is not a name the certificate carries). TLS is on when `enabled`
    (the block's own variable, e.g. ADAPTER_TLS) or any file is set.
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    enabled: bool = block_switch()

    @property
    def in_use(self) -> bool:
        return bool(self.enabled or self.ca_file or self.cert_file or self.key_file)

    def for_channel(self) -> ClientTLS | None:
        """What `open_channel` takes: these settings when TLS is on, None (plaintext) when off."""
        return self if self.in_use else None

    def env_problems(self, env_prefix: str = "") -> list[str]:
        """What does not fit, each naming its variable `<env_prefix>CA_FILE`... (none when off)."""
        if not self.in_use:
            return []
        problems = []
        if bool(self.cert_file) != bool(self.key_file):
            problems.append(f"{env_prefix}CERT_FILE and {env_prefix}KEY_FILE go together")
        files = {f"{env_prefix}CA_FILE": self.ca_file, f"{env_prefix}CERT_FILE": self.cert_file, f"{env_prefix}KEY_FILE": self.key_file}
        return problems + _check_files(files)

    @classmethod
    def from_settings(
        cls, ca_file: str, cert_file: str, key_file: str, server_name: str = "", env_prefix: str = "", enabled: bool = False
    ) -> ClientTLS | None:
        """None (plaintext) unless `enabled` or any file is set; ConfigError when they do not fit."""
        tls = cls(ca_file, cert_file, key_file, server_name, enabled)
        problems = tls.env_problems(env_prefix)
        if problems:
            raise ConfigError("invalid TLS configuration: " + "; ".join(problems))
        return tls.for_channel()
