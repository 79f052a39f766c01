"""TLS for a service's HTTP listeners: an `ssl.SSLContext` from the same `ServerTLS` as its gRPC port.

`server_ssl_context` is what an HTTP server (aiohttp's `TCPSite(ssl_context=...)`, asyncio's
`start_server(ssl=...)`) takes: TLS 1.2 or later, the service's certificate and key, and, with a
client CA, mutual TLS (a client without a certificate that CA signed fails the handshake), as
`server.server_credentials` sets up the gRPC port. Like it, the files are re-read on the next
handshake after any of them changes, so a renewed certificate is served without a restart.
"""

from __future__ import annotations

import os
import ssl

import structlog

from sluice_common.config import ServerTLS

log = structlog.stdlib.get_logger("sluice.tls")


def _load(tls: ServerTLS) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.client_ca_file:
        context.load_verify_locations(cafile=tls.client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def server_ssl_context(tls: ServerTLS) -> ssl.SSLContext:
    """A server context from `tls`'s PEM files (OSError or ssl.SSLError when they do not load).

    Every handshake starts on the returned context; its ClientHello callback (called with or
    without SNI) moves the connection to a context loaded from the files as they are now when any
    of them changed since the last load. A file that fails to load (half written: key and cert out
    of step) keeps the previous context and is tried again on the next handshake.
    """
    paths = [p for p in (tls.cert_file, tls.key_file, tls.client_ca_file) if p]

    def stamp() -> tuple[int, ...]:
        return tuple(os.stat(p).st_mtime_ns for p in paths)

    state = {"stamp": stamp()}
    front = _load(tls)
    current = {"context": front}

    def on_client_hello(connection: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _context: ssl.SSLContext) -> None:
        try:
            now = stamp()
            if now != state["stamp"]:
                current["context"] = _load(tls)
                state["stamp"] = now
                log.info("tls_reloaded", cert_file=tls.cert_file, listener="http")
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            log.warning("tls_reload_failed", error=str(exc), listener="http")
        if current["context"] is not front:
            connection.context = current["context"]

    front.sni_callback = on_client_hello
    return front
