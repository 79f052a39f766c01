"""Which tenant a caller is: the same tenants file and API-key hashes as the gateway."""

from __future__ import annotations

import hashlib
import hmac
import tomllib
from pathlib import Path

from sluice_common.errors import Unauthenticated

_BEARER = "bearer "


class TenantKeys:
    def __init__(self, tenant_by_key_hash: dict[str, str]) -> None:
        self._by_hash = tenant_by_key_hash

    @classmethod
    def from_file(cls, path: Path) -> TenantKeys:
        with path.open("rb") as handle:
            document = tomllib.load(handle)
        by_hash: dict[str, str] = {}
        for index, entry in enumerate(document.get("tenants", [])):
            name, key_hash = entry.get("name"), str(entry.get("api_key_sha256", "")).lower()
            if not name or len(key_hash) != 64:
                raise ValueError(f"{path}: tenants[{index}] needs a name and a 64-hex-digit api_key_sha256")
            by_hash[key_hash] = str(name)
        if not by_hash:
            raise ValueError(f"{path}: no [[tenants]] entries")
        return cls(by_hash)

    def authenticate(self, authorization: str | None) -> str:
        """The tenant name for an `authorization: Bearer <key>` value."""
        if not authorization:
            raise Unauthenticated("missing `authorization: Bearer <api key>` metadata")
        if not authorization.lower().startswith(_BEARER) or not authorization[len(_BEARER) :].strip():
            raise Unauthenticated("the authorization metadata must be `Bearer <api key>`")
        presented = hashlib.sha256(authorization[len(_BEARER) :].strip().encode()).hexdigest()
        found = ""
        for key_hash, tenant in self._by_hash.items():
            if hmac.compare_digest(key_hash, presented):
                found = tenant
        if not found:
            raise Unauthenticated("invalid API key")
        return found
