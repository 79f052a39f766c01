"""How every `sluice` command reaches a service: its channel (sync, or grpc.aio for diagnose's
concurrent probe), its stub, and the tenant's API key as `authorization: Bearer <key>` metadata.

Channels are plaintext unless SLUICE_TLS_CA_FILE, SLUICE_TLS_CERT_FILE/SLUICE_TLS_KEY_FILE or
SLUICE_TLS=true are set (SLUICE_TLS_SERVER_NAME overrides the name checked against the server's
certificate): the same TLS settings a service's client channels take, so the CLI can reach a
gateway started with SLUICE_GATEWAY_TLS_CERT_FILE.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from typing import TypeVar

import grpc
from sluice.gateway.v1 import gateway_pb2_grpc

from sluice_common.channels import MAX_RECEIVE_MESSAGE_BYTES, channel_credentials
from sluice_common.config import ClientTLS

Metadata = tuple[tuple[str, str], ...]
Stub = TypeVar("Stub")
T = TypeVar("T")
ENV_PREFIX = "SLUICE_TLS_"


class NoAPIKey(Exception):
    """No API key was given; the message says how to give one."""


def bearer_metadata(api_key: str, how_to_give_one: str = "pass --api-key or set SLUICE_API_KEY") -> Metadata:
    """The call metadata carrying the tenant's key; NoAPIKey when there is none."""
    if not api_key:
        raise NoAPIKey(f"no API key: {how_to_give_one}")
    return (("authorization", f"Bearer {api_key}"),)


def command_metadata(args: argparse.Namespace) -> Metadata:
    """A gateway command's metadata from its --api-key; no key ends the command saying how to give one."""
    try:
        return bearer_metadata(args.api_key)
    except NoAPIKey as missing:
        raise SystemExit(f"sluice: {missing}") from None


def gateway_stub(args: argparse.Namespace) -> gateway_pb2_grpc.GatewayServiceStub:
    """The gateway at the command's --gateway."""
    return stub(gateway_pb2_grpc.GatewayServiceStub, args.gateway)


def tls_from_env(env: Mapping[str, str] = os.environ) -> ClientTLS | None:
    """The channels' TLS from SLUICE_TLS_*; None (plaintext) when none is set."""
    return ClientTLS.from_settings(
        env.get(f"{ENV_PREFIX}CA_FILE", ""),
        env.get(f"{ENV_PREFIX}CERT_FILE", ""),
        env.get(f"{ENV_PREFIX}KEY_FILE", ""),
        env.get(f"{ENV_PREFIX}SERVER_NAME", ""),
        env_prefix=ENV_PREFIX,
        enabled=env.get("SLUICE_TLS", "").strip().lower() in ("1", "true", "yes", "on"),
    )


def _options(tls: ClientTLS | None) -> tuple[tuple[str, int | str], ...]:
    # The services' own receive limit: a page of results (long outputs, logprobs) can be over
    # gRPC's default 4 MiB.
    receive = (("grpc.max_receive_message_length", MAX_RECEIVE_MESSAGE_BYTES),)
    return (*receive, ("grpc.ssl_target_name_override", tls.server_name)) if tls is not None and tls.server_name else receive


def channel(address: str, tls: ClientTLS | None = None) -> grpc.Channel:
    """A blocking channel to `address` (TLS from the environment unless given)."""
    tls = tls if tls is not None else tls_from_env()
    if tls is None:
        return grpc.insecure_channel(address, options=_options(tls))
    return grpc.secure_channel(address, channel_credentials(tls), options=_options(tls))


def aio_channel(address: str, tls: ClientTLS | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to `address`; made inside the event loop that uses it."""
    tls = tls if tls is not None else tls_from_env()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(tls))
    return grpc.aio.secure_channel(address, channel_credentials(tls), options=_options(tls))


def stub(make: Callable[[grpc.Channel], Stub], address: str) -> Stub:
    """A stub on a new channel to `address`, e.g. stub(GatewayServiceStub, args.gateway)."""
    return make(channel(address))


def bounded(parse: Callable[[str], T], valid: Callable[[T], bool], refusal: str) -> Callable[[str], T]:
    """An argparse type: the text parsed and checked, else refused with `refusal` naming the text."""

    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{refusal}, got {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"{refusal}, got {text!r}")
        return value

    return convert
