"""Client channels between Sluice services: one per target per process, reused by every call."""

from __future__ import annotations

import grpc

_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)


def open_channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=_OPTIONS)
