"""Tenants and their API keys, read once from a TOML file by the gateway and evaluation-logging alike.
Only SHA-256 hashes of keys are stored.

    [[tenants]]
    name = "acme"
    api_key_sha256 = "<sha256 hex of the key>"   # `sluice hash-key <key>` prints it
    text_logging = true                          # false: completions are logged without text
"""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from sluice_common import tracing
from sluice_common.errors import Unauthenticated
from sluice_common.utf8 import is_valid_text

_BEARER = "bearer "


@dataclass(frozen=True)
class Tenant:
    name: str
    text_logging: bool = True


def hash_api_key(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class CallMetadata(Protocol):
    """What `authorization` reads: a grpc.aio.ServicerContext (no grpc import here)."""

    def invocation_metadata(self) -> Iterable[tuple[str, str | bytes]] | None: ...


def authorization(context: CallMetadata) -> str | None:
    """The call's `authorization` metadata value (None when it has none), for `authenticate`.
    gRPC lower-cases metadata keys, so `Authorization` from a client arrives as this one."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return None


def bearer_key(authorization: str | None) -> str:
    """The API key in a `Bearer <key>` value (any case of `Bearer`); "" when there is none."""
    if not authorization or not authorization.lower().startswith(_BEARER):
        return ""
    return authorization[len(_BEARER) :].strip()


class TenantDirectory:
    def __init__(self, tenants_by_key_hash: dict[str, Tenant]) -> None:
        self._by_hash = tenants_by_key_hash

    @classmethod
    def from_file(cls, path: Path) -> TenantDirectory:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
        by_hash: dict[str, Tenant] = {}
        for index, entry in enumerate(document.get("tenants", [])):
            name, key_hash = entry.get("name"), str(entry.get("api_key_sha256", "")).lower()
            if not name or len(key_hash) != 64:
                raise ValueError(f"{path}: tenants[{index}] needs a name and a 64-hex-digit api_key_sha256")
            if key_hash in by_hash:
                # One key for two tenants would log in as whichever came last, silently.
                raise ValueError(
                    f"{path}: tenants[{index}] ({name}) has the api_key_sha256 of tenant {by_hash[key_hash].name}: keys are one per tenant"
                )
            by_hash[key_hash] = Tenant(name=name, text_logging=bool(entry.get("text_logging", True)))
        if not by_hash:
            raise ValueError(f"{path}: no [[tenants]] entries")
        return cls(by_hash)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key is in an `authorization: Bearer <key>` value (a span of its own
        while tracing is on: refused keys show in the trace as errors)."""
        with tracing.span("sluice.authenticate") as current:
            tenant = self._authenticate(authorization)
            if current is not None:
                current.set_attribute("sluice.tenant", tenant.name)
            return tenant

    def _authenticate(self, authorization: str | None) -> Tenant:
        if not authorization:
            raise Unauthenticated("missing `authorization: Bearer <api key>` metadata")
        key = bearer_key(authorization)
        if not key:
            raise Unauthenticated("the authorization metadata must be `Bearer <api key>`")
        if not is_valid_text(key):
            # Undecodable header bytes (aiohttp's surrogateescape): no key has them.
            raise Unauthenticated("invalid API key")
        presented = hash_api_key(key)
        for key_hash, tenant in self._by_hash.items():
            # Compare every entry in constant time so timing does not reveal a near match.
            if hmac.compare_digest(key_hash, presented):
                return tenant
        raise Unauthenticated("invalid API key")
