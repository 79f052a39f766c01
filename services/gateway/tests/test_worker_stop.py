"""The job worker stops within a bound while RabbitMQ is unreachable: the real broker, reached
through a TCP proxy the test cuts (or freezes).

On the robust connection, cancelling a consumer during a broker outage waited for the reconnection:
a SIGTERM then never reached the rows' drain, the heartbeats' drop, nor (after stop()) the flush
that spills the completion events to disk, and Kubernetes killed the pod with the events in memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import types
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import pytest

from sluice_common.amqp import JobTopology
from sluice_common.config import load_config
from sluice_common.supervision import Supervisor
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs.store import JobStore
from sluice_gateway.jobs.worker import CONSUMER_CANCEL_TIMEOUT_S, JobWorker

AMQP_URL = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")
# What stop() may still wait for with the broker away: its connection's close (bounded at 5 s).
CONNECTION_CLOSE_S = 5.0


class BrokerProxy:
    """A TCP proxy to the broker that can be cut (every connection reset: the broker is gone) or
    frozen (connections stay open, nothing passes: a broker or network that stopped answering)."""

    def __init__(self) -> None:
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.frozen = False

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        broker = urlsplit(AMQP_URL)
        upstream_reader, upstream_writer = await asyncio.open_connection(broker.hostname, broker.port or 5672)
        self.writers += [writer, upstream_writer]
        asyncio.ensure_future(self._pipe(reader, upstream_writer))
        asyncio.ensure_future(self._pipe(upstream_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            while data := await reader.read(65536):
                if not self.frozen:
                    writer.write(data)
                    await writer.drain()
        writer.close()

    def cut(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()

    def freeze(self) -> None:
        self.frozen = True


def _worker_behind(port: int, prefix: str, store: JobStore) -> JobWorker:
    """A job worker that reaches the broker through the proxy on `port`, its topology under `prefix`."""
    broker = urlsplit(AMQP_URL)
    settings = {"TENANTS_FILE": TENANTS, "AMQP_URL": f"amqp://{broker.username}:{broker.password}@127.0.0.1:{port}/", "AMQP_PREFIX": prefix}
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}{name}": value for name, value in settings.items()})
    return JobWorker(config.shared, config.worker, types.SimpleNamespace(path=None), store)  # type: ignore[arg-type]


@pytest.mark.parametrize("outage", ["cut", "frozen"])
async def test_stop_during_a_broker_outage_still_drains_and_drops_heartbeats(store: JobStore, outage: str) -> None:
    proxy = BrokerProxy()
    prefix = f"test-stop-{uuid.uuid4().hex[:8]}"
    job_worker = _worker_behind(await proxy.start(), prefix, store)
    dropped: list[str] = []
    drop_heartbeats = store.drop_heartbeats

    async def recording_drop(worker: str) -> int:
        dropped.append(worker)
        return await drop_heartbeats(worker)

    store.drop_heartbeats = recording_drop  # type: ignore[method-assign]
    try:
        await job_worker.start(Supervisor())
        proxy.cut() if outage == "cut" else proxy.freeze()
        await asyncio.sleep(0.5)  # the connection has seen the broker go (cut) or not (frozen)
        started = time.monotonic()
        await asyncio.wait_for(job_worker.stop(1.0), 30)
        elapsed = time.monotonic() - started
    finally:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await JobTopology(prefix).delete(await connection.channel())
    # The cancels waited CONSUMER_CANCEL_TIMEOUT_S at most (cut: not at all), then the rest of stop() ran.
    bound = CONNECTION_CLOSE_S + 1.0 + (CONSUMER_CANCEL_TIMEOUT_S if outage == "frozen" else 0.0)
    assert elapsed < bound, f"stop() took {elapsed:.1f} s"
    assert dropped == [job_worker.worker_id]


async def test_the_broker_gauge_says_when_the_worker_lost_its_broker(store: JobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Health stays SERVING while the robust connection reconnects: sluice_jobs_worker_broker_connected
    (and its alert) is what tells an operator that no row is consumed."""
    from prometheus_client import REGISTRY

    from sluice_gateway.jobs import store as states

    monkeypatch.setattr(states, "HEARTBEAT_S", 0.05)
    proxy = BrokerProxy()
    prefix = f"test-gauge-{uuid.uuid4().hex[:8]}"
    job_worker = _worker_behind(await proxy.start(), prefix, store)
    gauge = lambda: REGISTRY.get_sample_value("sluice_jobs_worker_broker_connected")  # noqa: E731
    try:
        await job_worker.start(Supervisor())
        assert gauge() == 1
        proxy.cut()
        deadline = time.monotonic() + 5
        while gauge() != 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert gauge() == 0
        await asyncio.wait_for(job_worker.stop(1.0), 30)
    finally:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            await JobTopology(prefix).delete(await connection.channel())
