"""The OpenAI HTTP front under the gateway's server TLS (SLUICE_GATEWAY_TLS_*): started as
`__main__` starts it, with real handshakes and certificates made here (pki.py)."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import trustme

from sluice_common.config import ServerTLS
from sluice_common.tenants import TenantDirectory, hash_api_key
from sluice_gateway.openai_front.http import OpenAIFront, start_http

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Our CA, a server certificate it signed for 127.0.0.1 and localhost, a client certificate it
    signed, and a stranger CA's client certificate (trustme, as tests/e2e/test_tls.py): paths by name."""
    folder = tmp_path_factory.mktemp("pki")
    ca, stranger = trustme.CA(), trustme.CA()
    files = {"ca": str(folder / "ca.crt")}
    ca.cert_pem.write_to_path(files["ca"])
    for name, authority, identities in (
        ("server", ca, ("127.0.0.1", "localhost")),
        ("client", ca, ("client.example",)),
        ("rogue", stranger, ("client.example",)),
    ):
        issued = authority.issue_cert(*identities)
        files[f"{name}_cert"], files[f"{name}_key"] = str(folder / f"{name}.crt"), str(folder / f"{name}.key")
        Path(files[f"{name}_cert"]).write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
        issued.private_key_pem.write_to_path(files[f"{name}_key"])
    return files


async def _front(tls: ServerTLS, tmp_path: Path) -> AsyncIterator[int]:
    tenants_file = tmp_path / "tenants.toml"
    tenants_file.write_text(f'[[tenants]]\nname = "acme"\napi_key_sha256 = "{hash_api_key(KEY)}"\n')
    path = SimpleNamespace(models=SimpleNamespace(models=[]))  # /v1/models reads only the catalog
    front = OpenAIFront(TenantDirectory.from_file(tenants_file), path)  # type: ignore[arg-type]
    http = await start_http(front, "127.0.0.1", 0, 4096, 1.0, tls=tls)
    try:
        yield http.port
    finally:
        await http.stop()


def _client(pki: dict[str, str], who: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=pki["ca"])
    if who is not None:
        context.load_cert_chain(pki[f"{who}_cert"], pki[f"{who}_key"])
    return context


async def _models(url: str, client: ssl.SSLContext | None = None) -> int | str:
    """The status of GET /v1/models with the tenant's key, or the error that stopped it."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"{url}/v1/models", headers=AUTH, ssl=client if client is not None else True) as reply:
                if reply.status == 200:
                    assert (await reply.json())["object"] == "list"
                return reply.status
    except (aiohttp.ClientError, OSError) as exc:
        return type(exc).__name__


async def test_http_front_speaks_the_grpc_ports_tls_only(pki, tmp_path: Path) -> None:
    async for port in _front(ServerTLS(pki["server_cert"], pki["server_key"]), tmp_path):
        assert await _models(f"https://localhost:{port}", _client(pki)) == 200
        assert await _models(f"http://127.0.0.1:{port}") != 200  # the bearer key is never taken in plaintext
        assert await _models(f"https://localhost:{port}") != 200  # the system roots do not know our CA


async def test_http_front_with_a_client_ca_requires_a_client_certificate_it_signed(pki, tmp_path: Path) -> None:
    async for port in _front(ServerTLS(pki["server_cert"], pki["server_key"], pki["ca"]), tmp_path):
        assert await _models(f"https://localhost:{port}", _client(pki, "client")) == 200
        assert await _models(f"https://localhost:{port}", _client(pki)) != 200  # no client certificate
        assert await _models(f"https://localhost:{port}", _client(pki, "rogue")) != 200  # a stranger CA's
        assert await _models(f"http://127.0.0.1:{port}") != 200
