"""Client channels between Sluice services: one per target per process, reused by every call."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from sluice_common.config import ClientTLS
from sluice_common.tracing import client_interceptors

# The largest response a Sluice client reads (gRPC's own default is 4 MiB): the services' channels
# and the `sluice` CLI's.
MAX_RECEIVE_MESSAGE_BYTES = 64 * 1024 * 1024
# A page of a listing (QueryRecords, ListJobResults) stops short of this many bytes of rows, so that
# a client with gRPC's default 4 MiB receive limit (grpcurl, any language's plain channel) reads
# every page; a single row larger than this still comes, alone in its page.
PAGE_BYTES = 3 * 1024 * 1024

_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),
    # A replica back from a restart is used again within 2 s (the default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Calls spread over every address the name resolves to (a Kubernetes headless Service: every
    # pod, or "ipv4:host:a,host:b"), instead of pinning all of them to the first one; and only to
    # the addresses whose health says SERVING: a replica that drains for a rolling restart (or is
    # still starting) gets no new calls while its accepted ones finish.
    (
        "grpc.service_config",
        json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": ""}}),
    ),
)


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as file:
        return file.read()


def channel_credentials(tls: ClientTLS) -> grpc.ChannelCredentials:
    """TLS credentials from PEM files: the CA that signs the server (system roots when empty) and,
    for mutual TLS, this service's certificate and key."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file),
        certificate_chain=_read(tls.cert_file),
    )


def open_channel(target: str, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """A plaintext channel, or a TLS one (mutual when `tls` carries a certificate and key)."""
    # A CLIENT span per call, its trace context in the metadata, while tracing is on.
    interceptors = client_interceptors() or None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=_OPTIONS, interceptors=interceptors)
    options: tuple[tuple[str, int | str], ...] = _OPTIONS
    if tls.server_name:
        options = (*options, ("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(target, channel_credentials(tls), options=options, interceptors=interceptors)


async def wait_for_replica(channel: grpc.aio.Channel, within_s: float) -> None:
    """Returns once the channel has a replica to call (READY), or after `within_s` (the call then
    fails UNAVAILABLE as it would have). A rolling restart's window: one replica is back and serving,
    but this channel has not reconnected to it yet (up to the 2 s backoff) when the next replica turns
    NOT_SERVING to drain, so a call made then would fail at once with "all backends failing"."""
    state = channel.get_state(try_to_connect=True)
    if state is grpc.ChannelConnectivity.READY:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(within_s):
            while state is not grpc.ChannelConnectivity.READY:
                await channel.wait_for_state_change(state)
                state = channel.get_state(try_to_connect=True)


T = TypeVar("T")


def within_page_bytes(rows: Sequence[T], page_size: int, size_of: Callable[[T], int]) -> list[T]:
    """A listing's page: `page_size` rows at most, and within PAGE_BYTES unless its first row alone
    is not (keyset tokens continue after its last row wherever it stops)."""
    page: list[T] = []
    total = 0
    for row in rows[:page_size]:
        total += size_of(row)
        if page and total > PAGE_BYTES:
            break
        page.append(row)
    return page
