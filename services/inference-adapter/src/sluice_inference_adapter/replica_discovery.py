"""Which Triton replicas the adapter should talk to: fixed endpoints, and the pods behind DNS names.

SLUICE_ADAPTER_TRITON_URLS holds entries of two kinds:

  - `host:port`: one fixed replica, named by the entry as written;
  - `dns:///name:port`: every address `name` resolves to (A and AAAA, through the system
    resolver), each one replica at `port`, named `<ip>:<port>` (`[<ip>]:<port>` for IPv6, the
    form a gRPC target takes). On Kubernetes, `name` is a headless Service: one address per
    ready pod.

Names are resolved again every TRITON_RESOLVE_INTERVAL_S. A lookup that fails, or that answers
no address at all, keeps the addresses that name had: a DNS blip or a rollout's empty moment
must not drop every replica at once. Only an answer that names other addresses changes the set.
This module decides; replica_pool.ReplicaPool adds, drains and removes replicas accordingly.
No grpc here: the resolver is a plain function, injected in tests.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from sluice_inference_adapter import metrics

log = structlog.stdlib.get_logger("sluice.discovery")

DNS_SCHEME = "dns:///"

# (name, port) -> the addresses it resolves to now; raises OSError when the lookup fails.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class Target:
    """One entry of TRITON_URLS."""

    host: str
    port: int
    # True: the replicas are the addresses `host` resolves to; False: `host:port` is the replica.
    dns: bool

    @property
    def text(self) -> str:
        return f"{DNS_SCHEME}{self.host}:{self.port}" if self.dns else f"{self.host}:{self.port}"


def parse_target(entry: str) -> Target:
    """`host:port` or `dns:///name:port` (raises ValueError with what is wrong)."""
    dns = entry.startswith(DNS_SCHEME)
    rest = entry[len(DNS_SCHEME) :] if dns else entry
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r} is neither host:port nor {DNS_SCHEME}name:port")
    if dns and (host.startswith("[") or "/" in host):
        raise ValueError(f"{entry!r}: a {DNS_SCHEME} entry names a DNS name, not an address")
    return Target(host, int(port), dns)


def replica_address(ip: str, port: int) -> str:
    """The replica's name and gRPC target: `ip:port`, with IPv6 addresses in brackets."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def system_resolver(name: str, port: int) -> list[str]:
    """Every address the system resolver gives for `name` (A and AAAA, /etc/hosts included)."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class PoolControl(Protocol):
    """What discovery needs of the replica pool."""

    @property
    def names(self) -> set[str]:
        """Every replica's name, draining ones included."""
        ...

    def is_draining(self, name: str) -> bool: ...

    def add(self, url: str) -> None: ...

    def drain(self, name: str) -> None: ...

    def undrain(self, name: str) -> None: ...


@dataclass(frozen=True)
class Changes:
    add: list[str] = field(default_factory=list)
    drain: list[str] = field(default_factory=list)
    undrain: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.add or self.drain or self.undrain)


def diff(pool: PoolControl, wanted: set[str]) -> Changes:
    """What to do so that the pool serves from `wanted`: new addresses are added, a draining
    replica whose address came back is undrained, and replicas no longer named are drained."""
    names = pool.names
    return Changes(
        add=sorted(wanted - names),
        drain=sorted(n for n in names - wanted if not pool.is_draining(n)),
        undrain=sorted(n for n in names & wanted if pool.is_draining(n)),
    )


class Discovery:
    """Resolves the targets into replica addresses, remembering each name's last good answer."""

    def __init__(self, targets: list[Target], resolver: Resolver = system_resolver) -> None:
        self._targets = targets
        self._resolver = resolver
        self._last: dict[Target, set[str]] = {}

    @property
    def dynamic(self) -> bool:
        """Some entry is a DNS name, so the set can change while the adapter runs."""
        return any(t.dns for t in self._targets)

    async def resolve(self) -> set[str]:
        """The replica addresses now; may be empty only while no name has ever resolved."""
        wanted: set[str] = set()
        for target in self._targets:
            wanted |= await self._resolve(target) if target.dns else {target.text}
        return wanted

    async def _resolve(self, target: Target) -> set[str]:
        previous = self._last.get(target, set())
        try:
            ips = await self._resolver(target.host, target.port)
        except (OSError, UnicodeError) as exc:  # socket.gaierror (NXDOMAIN, no server) is an OSError
            metrics.DISCOVERY_FAILURES.labels(target=target.text, reason="error").inc()
            log.warning("discovery_failed", target=target.text, error=str(exc), keeping=sorted(previous))
            return previous
        addresses = {replica_address(_plain_ip(ip), target.port) for ip in ips}
        if not addresses:
            metrics.DISCOVERY_FAILURES.labels(target=target.text, reason="empty").inc()
            log.warning("discovery_empty", target=target.text, keeping=sorted(previous))
            return previous
        self._last[target] = addresses
        return addresses

    async def apply(self, pool: PoolControl, *more: PoolControl) -> Changes:
        """One round: resolve once, then add, undrain and drain replicas in each pool (the main
        model's, and each extra model's on the same replicas). Returns the first pool's changes."""
        wanted = await self.resolve()
        first, *_ = [_apply(p, diff(p, wanted)) for p in (pool, *more)]
        return first

    async def run(self, pools: list[PoolControl], interval_s: float) -> None:
        """Re-resolves for ever (started under the supervisor, so a bug restarts it)."""
        while True:
            await asyncio.sleep(interval_s)
            await self.apply(*pools)


def _apply(pool: PoolControl, changes: Changes) -> Changes:
    for url in changes.add:
        pool.add(url)
    for name in changes.undrain:
        pool.undrain(name)
    for name in changes.drain:
        pool.drain(name)
    return changes


def _plain_ip(ip: str) -> str:
    """Drops nothing a gRPC target needs, but normalizes the spelling (::0001 and ::1 are one replica)."""
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:  # a scoped IPv6 address (fe80::1%eth0): kept as the resolver wrote it
        return ip
