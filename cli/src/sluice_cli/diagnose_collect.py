"""`sluice diagnose`: scrape every service's metrics over a window (optionally under a bounded probe
load it drives itself) and print, per hop, configured vs effective concurrency by Little's law,
where the time goes, and a verdict naming the hop that serializes. The analysis is diagnose.py;
this is its collection: HTTP scrapes, rate-limit's GetUsage, the probe's Generate streams.

    sluice diagnose                       observe live traffic for 10 s
    sluice diagnose --probe 8 --duration 15    8 concurrent streams through the gateway for 15 s
    sluice diagnose --metrics gateway=10.0.0.5:9101 --metrics inference-adapter=10.0.0.6:9102 ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from grpc_status import rpc_status
from google.rpc import error_details_pb2
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.ratelimit.v1 import ratelimit_pb2, ratelimit_pb2_grpc

from sluice_cli import diagnose as d
from sluice_cli.client import aio_channel, bearer_metadata

# Each service's metrics port as its config.py defaults it (libs/sluice-stack's StackPorts too).
DEFAULT_METRICS = {
    d.GATEWAY: "127.0.0.1:9101",
    d.ADAPTER: "127.0.0.1:9102",
    d.RATELIMIT: "127.0.0.1:9103",
    d.EVALLOG: "127.0.0.1:9104",
    d.TRITON: "127.0.0.1:9105",
    d.WORKER: "127.0.0.1:9106",
}
MAX_PROBE = 64
MAX_DURATION_S = 120.0
SCRAPE_TIMEOUT_S = 2.0
# The probe's streams start before the window opens, so that it measures a steady state, not a ramp.
WARMUP_S = 1.5
PROBE_PROMPT = "Write a long story about a river that flows through a city."


def _metrics_url(address: str) -> str:
    return address if address.startswith(("http://", "https://")) else f"http://{address}/metrics"


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
            return reply.read().decode()
    except OSError:
        return None


async def _scrape_all(urls: dict[str, str]) -> tuple[float, dict[str, str]]:
    """One scrape of every service that answers (in parallel threads: urllib blocks)."""
    names = list(urls)
    texts = await asyncio.gather(*(asyncio.to_thread(_fetch, urls[name]) for name in names))
    return time.monotonic(), {name: text for name, text in zip(names, texts, strict=True) if text is not None}


async def _budgets(stub: ratelimit_pb2_grpc.RateLimitServiceStub | None) -> list[d.BudgetSample] | None:
    """rate-limit's view of every (tenant, model) budget now; None when it cannot be asked."""
    if stub is None:
        return None
    try:
        reply = await stub.GetUsage(ratelimit_pb2.GetUsageRequest(), timeout=SCRAPE_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return None
    return [
        d.BudgetSample(
            usage.tenant,
            usage.model,
            ratelimit_pb2.Budget.Name(status.budget).removeprefix("BUDGET_").lower(),
            float(status.limit),
            float(status.limit - status.remaining),
        )
        for usage in reply.usage
        for status in usage.budgets
    ]


def _retry_after(error: grpc.aio.AioRpcError) -> float | None:
    """The RetryInfo a RESOURCE_EXHAUSTED carries, in seconds."""
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:
        return None
    for detail in status.details if status is not None else ():
        info = error_details_pb2.RetryInfo()
        if detail.Unpack(info):
            return info.retry_delay.ToNanoseconds() / 1e9
    return None


class Probe:
    """`clients` concurrent Generate streams through the gateway, each sent again as soon as it
    ends, until stopped; a RESOURCE_EXHAUSTED waits as its RetryInfo says (that wait is counted)."""

    def __init__(self, gateway: str, api_key: str, model: str, max_tokens: int, clients: int) -> None:
        self._gateway = gateway
        # Made in `start`: a grpc.aio channel belongs to the event loop it was made on.
        self._channel: grpc.aio.Channel | None = None
        self._metadata = bearer_metadata(api_key)
        self._request = gateway_pb2.GenerateRequest(
            model=model,
            messages=[types_pb2.ChatMessage(role="user", content=PROBE_PROMPT)],
            sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
        )
        self.stats = d.ProbeStats(clients=clients)
        self._tasks: list[asyncio.Task[None]] = []
        self._clients = clients
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self._channel = aio_channel(self._gateway)
        stub = gateway_pb2_grpc.GatewayServiceStub(self._channel)
        self._tasks = [asyncio.create_task(self._client(stub)) for _ in range(self._clients)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._channel is not None:
            await self._channel.close()
        self.stats.seconds = time.monotonic() - self._started

    async def _client(self, stub: gateway_pb2_grpc.GatewayServiceStub) -> None:
        while True:
            sent = time.monotonic()
            try:
                async for _ in stub.Generate(self._request, metadata=self._metadata, timeout=MAX_DURATION_S * 2):
                    pass
                self.stats.completed += 1
                error = None
            except grpc.aio.AioRpcError as failed:
                error = failed
            self.stats.call_s += time.monotonic() - sent
            if error is None:
                continue
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.stats.denied += 1
                await self._wait(_retry_after(error))
                continue
            code = error.code().name
            self.stats.errors[code] = self.stats.errors.get(code, 0) + 1
            # UNAVAILABLE and friends: a short pause, not a hot loop against a broken stack.
            await asyncio.sleep(0.5)

    async def _wait(self, retry_after: float | None) -> None:
        waited = time.monotonic()
        try:
            await asyncio.sleep(min(max(retry_after or 0.1, 0.01), 5.0))
        finally:
            self.stats.retry_wait_s += time.monotonic() - waited


async def collect(
    urls: dict[str, str],
    duration_s: float,
    interval_s: float,
    probe: Probe | None,
    ratelimit: str | None,
    record: Path | None = None,
) -> d.Report:
    """Scrapes every `interval_s` for `duration_s` (under the probe's load, when there is one)."""
    channel = aio_channel(ratelimit) if ratelimit else None
    stub = ratelimit_pb2_grpc.RateLimitServiceStub(channel) if channel is not None else None
    texts: dict[str, list[tuple[float, str]]] = {name: [] for name in urls}
    budgets: list[list[d.BudgetSample]] = []
    try:
        if probe is not None:
            probe.start()
            await asyncio.sleep(WARMUP_S)
        deadline = time.monotonic() + duration_s
        while True:
            round_started = time.monotonic()
            (at, found), usage = await asyncio.gather(_scrape_all(urls), _budgets(stub))
            for name, text in found.items():
                texts[name].append((at, text))
            if usage is not None:
                budgets.append(usage)
            if round_started >= deadline:
                break
            await asyncio.sleep(max(0.0, min(interval_s - (time.monotonic() - round_started), deadline - time.monotonic())))
    finally:
        if probe is not None:
            await probe.stop()
        if channel is not None:
            await channel.close()
    if record is not None:
        d.save_recording(record, texts, budgets, probe.stats if probe is not None else None)
    windows = {name: d.ServiceWindow(tuple(d.parse_scrape(text, at) for at, text in scraped)) for name, scraped in texts.items() if len(scraped) >= 2}
    unreachable = [name for name in urls if name not in windows]
    return d.analyze(windows, budgets, probe.stats if probe is not None else None, unreachable)


def _parse_metrics(values: list[str] | None) -> dict[str, str]:
    if not values:
        return {name: _metrics_url(address) for name, address in DEFAULT_METRICS.items()}
    urls = {}
    for value in values:
        name, sep, address = value.partition("=")
        if not sep or name not in d.SERVICES or not address:
            raise SystemExit(f"sluice diagnose: --metrics takes NAME=HOST:PORT with NAME one of {', '.join(d.SERVICES)}, got {value!r}")
        urls[name] = _metrics_url(address)
    return urls


def cmd_diagnose(args: argparse.Namespace) -> int:
    if not 0 <= args.probe <= MAX_PROBE:
        raise SystemExit(f"sluice diagnose: --probe must be in [0, {MAX_PROBE}], got {args.probe}")
    if not 1 <= args.duration <= MAX_DURATION_S:
        raise SystemExit(f"sluice diagnose: --duration must be in [1, {MAX_DURATION_S:.0f}] seconds, got {args.duration}")
    if not 0.1 <= args.interval <= args.duration:
        raise SystemExit(f"sluice diagnose: --interval must be in [0.1, --duration] seconds, got {args.interval}")
    if args.replay:
        windows, budgets, probe_stats = d.load_recording(Path(args.replay))
        return _print(d.analyze(windows, budgets, probe_stats), args.json)
    urls = _parse_metrics(args.metrics)
    probe = None
    if args.probe:
        if not args.api_key:
            raise SystemExit("sluice diagnose: --probe needs an API key: pass --api-key or set SLUICE_API_KEY")
        probe = Probe(args.gateway, args.api_key, args.model, args.max_tokens, args.probe)
    record = Path(args.record) if args.record else None
    report = asyncio.run(collect(urls, args.duration, args.interval, probe, args.ratelimit or None, record))
    if len(report.unreachable) == len(urls):
        print("sluice diagnose: no service's metrics could be read: " + ", ".join(urls.values()))
        return 1
    return _print(report, args.json)


def _print(report: d.Report, as_json: bool) -> int:
    print(json.dumps(report.as_dict(), indent=2) if as_json else d.render(report))
    return 0


def add_diagnose_parser(commands: Any) -> None:
    diagnose = commands.add_parser("diagnose", help="where a fan-out serializes: configured vs effective concurrency per hop (Little's law)")
    diagnose.add_argument(
        "--probe",
        type=int,
        default=0,
        metavar="N",
        help=f"drive N concurrent Generate streams through the gateway during the window (at most {MAX_PROBE}; default 0: observe live traffic)",
    )
    diagnose.add_argument("--duration", type=float, default=10.0, help=f"the measured window in seconds (at most {MAX_DURATION_S:.0f}; default 10)")
    diagnose.add_argument("--interval", type=float, default=0.5, help="seconds between scrapes (gauge samples; default 0.5)")
    diagnose.add_argument("--model", default="smollm2-135m-instruct", help="the probe's model")
    diagnose.add_argument("--max-tokens", type=int, default=16, help="the probe's max_tokens per stream (default 16)")
    diagnose.add_argument(
        "--metrics",
        action="append",
        metavar="NAME=HOST:PORT",
        help="a service's metrics endpoint, repeatable; given, it replaces the defaults (every service on 127.0.0.1 at its default metrics port)",
    )
    diagnose.add_argument(
        "--ratelimit",
        default=os.environ.get("SLUICE_RATELIMIT_URL", "127.0.0.1:50071"),
        help="rate-limit's gRPC address, asked for its budgets (GetUsage); empty: not asked",
    )
    diagnose.add_argument("--json", action="store_true", help="the report as JSON")
    diagnose.add_argument("--record", default="", metavar="DIR", help="also write every scrape to DIR (for --replay)")
    diagnose.add_argument("--replay", default="", metavar="DIR", help="analyze what --record wrote to DIR; scrape nothing")
    diagnose.set_defaults(func=cmd_diagnose)
