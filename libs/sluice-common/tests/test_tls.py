"""`server_ssl_context`: real TLS handshakes on a local port, with throwaway certificates (trustme)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from sluice_common.config import ServerTLS
from sluice_common.tls import server_ssl_context

REQUEST = b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
REPLY = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


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


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(REPLY)
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def _serve(context: ssl.SSLContext) -> AsyncIterator[int]:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0, ssl=context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def _client(pki: dict[str, str], who: str | None = None, ca: str | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca or pki["ca"])
    if who is not None:
        context.load_cert_chain(pki[f"{who}_cert"], pki[f"{who}_key"])
    return context


async def _exchange(port: int, client: ssl.SSLContext | None) -> bytes | str:
    """The server's reply to one request, or the error that ended it (TLS 1.3 sends a refused
    client certificate's alert after the client's handshake ended: it comes on the first read)."""
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="localhost" if client else None), 5
        )
        try:
            writer.write(REQUEST)
            await writer.drain()
            return await asyncio.wait_for(reader.read(), 5)
        finally:
            writer.close()
    except (OSError, asyncio.IncompleteReadError) as exc:
        return type(exc).__name__


def _served(reply: bytes | str) -> bool:
    return isinstance(reply, bytes) and reply.endswith(b"\r\n\r\nok")


async def test_server_tls_serves_a_client_that_trusts_its_ca_and_no_plaintext(pki) -> None:
    context = server_ssl_context(ServerTLS(pki["server_cert"], pki["server_key"]))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2 and context.verify_mode == ssl.CERT_NONE
    async for port in _serve(context):
        assert _served(await _exchange(port, _client(pki)))
        assert _served(await _exchange(port, _client(pki, "client")))  # a certificate is welcome, not needed
        plaintext = await _exchange(port, None)
        assert not _served(plaintext) and b"200 OK" not in (plaintext if isinstance(plaintext, bytes) else b"")
        assert not _served(await _exchange(port, _client(pki, ca=pki["rogue_cert"])))  # a client that trusts another CA


async def test_mutual_tls_refuses_a_client_without_a_certificate_its_ca_signed(pki) -> None:
    context = server_ssl_context(ServerTLS(pki["server_cert"], pki["server_key"], pki["ca"]))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2 and context.verify_mode == ssl.CERT_REQUIRED
    async for port in _serve(context):
        assert _served(await _exchange(port, _client(pki, "client")))
        assert not _served(await _exchange(port, _client(pki)))  # no client certificate
        assert not _served(await _exchange(port, _client(pki, "rogue")))  # one a stranger CA signed
        assert not _served(await _exchange(port, None))  # plaintext


async def test_renewed_certificate_files_are_served_without_a_restart(pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copyfile(pki["rogue_cert"], cert)  # first a certificate our CA did not sign
    shutil.copyfile(pki["rogue_key"], key)
    async for port in _serve(server_ssl_context(ServerTLS(str(cert), str(key), pki["ca"]))):
        before = await _exchange(port, _client(pki, "client"))
        shutil.copyfile(pki["server_cert"], cert)
        shutil.copyfile(pki["server_key"], key)
        after = await _exchange(port, _client(pki, "client"))
        after_without_certificate = await _exchange(port, _client(pki))  # mutual TLS holds on the new context
        key.write_text("half written")  # a key out of step with its certificate keeps the last pair
        meanwhile = await _exchange(port, _client(pki, "client"))
    assert not _served(before) and _served(after) and _served(meanwhile)
    assert not _served(after_without_certificate)


def test_files_that_do_not_load_fail_at_start(pki, tmp_path: Path) -> None:
    broken = tmp_path / "broken.pem"
    broken.write_text("not a certificate")
    with pytest.raises(ssl.SSLError):
        server_ssl_context(ServerTLS(str(broken), pki["server_key"]))
