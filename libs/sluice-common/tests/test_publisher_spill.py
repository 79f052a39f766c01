"""ConfirmingPublisher's spill file is written and read off the event loop: a slow disk delays the
spill, never the loop that serves streams, and nothing submitted is lost."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
from prometheus_client import Histogram

from sluice_common import amqp_publisher
from sluice_common.amqp_publisher import ConfirmingPublisher, OutgoingMessage, PublisherMetrics
from sluice_common.loop_lag import LAG_BUCKETS, LoopLagMonitor
from sluice_common.supervision import Supervisor, stop_tasks

SLOW_FSYNC_S = 0.5
# A submit or a loop that waited for the disk would take a whole fsync: half of one bounds what a
# busy 2-core machine's scheduling adds, far from what the disk would.
ON_TIME_S = SLOW_FSYNC_S / 2
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/"  # refused: the publisher keeps reconnecting, the spill goes on


async def _no_topology(channel: object) -> None:
    return None


def _publisher(spill: Path | None, outbox_max: int = 2) -> tuple[ConfirmingPublisher, PublisherMetrics]:
    metrics = PublisherMetrics.get(f"test_spill_{uuid.uuid4().hex[:8]}")
    return ConfirmingPublisher(NO_BROKER, "sluice-test.events", _no_topology, metrics, outbox_max=outbox_max, spill_path=spill), metrics


def _message(i: int) -> OutgoingMessage:
    return OutgoingMessage(f"event {i}".encode(), "completion.v1", f"event-{i}")


@pytest.fixture
def slow_disk(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """fsync takes SLOW_FSYNC_S, as on a loaded disk; records the thread each one ran on."""
    threads: list[str] = []
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        threads.append(threading.current_thread().name)
        time.sleep(SLOW_FSYNC_S)
        real_fsync(fd)

    monkeypatch.setattr(amqp_publisher.os, "fsync", slow_fsync)
    return threads


async def test_a_slow_disk_does_not_stall_the_loop_and_every_message_reaches_the_file(tmp_path: Path, slow_disk: list[str]) -> None:
    spill = tmp_path / "events.spill"
    publisher, metrics = _publisher(spill)
    monitor = LoopLagMonitor(0.005, Histogram("test_spill_loop_lag_seconds", "test", buckets=LAG_BUCKETS, registry=None), keep=10_000)
    supervisor = Supervisor()
    lag = supervisor.start("loop-lag", monitor.run)
    publisher.start(supervisor)
    try:
        for i in range(40):  # beyond the outbox of 2, while earlier spills are still on the slow disk
            t0 = time.perf_counter()
            publisher.submit(_message(i))
            assert time.perf_counter() - t0 < ON_TIME_S, "submit waited for the disk"
            await asyncio.sleep(0.01)
        deadline = time.monotonic() + 30
        while metrics.spilled._value.get() < 38:
            assert time.monotonic() < deadline, f"spilled {metrics.spilled._value.get()} of 38"
            await asyncio.sleep(0.05)
        assert publisher.pending == 2  # the outbox's two wait for a broker; nothing else is in memory
        assert slow_disk and all(name.startswith("spill:") for name in slow_disk), slow_disk
        # The spills took SLOW_FSYNC_S each on the disk thread; the loop meanwhile ran on time.
        assert len(slow_disk) >= 2
        assert monitor.quantile(1.0) < ON_TIME_S, f"loop lag max {monitor.quantile(1.0) * 1000:.0f} ms while the disk was slow"
    finally:
        await publisher.stop(0.1)
        await stop_tasks(lag)
    lines = spill.read_text().splitlines()
    assert sorted(OutgoingMessage.from_json_line(line).message_id for line in lines) == sorted(f"event-{i}" for i in range(40))
    assert metrics.dropped._value.get() == 0


async def test_stop_writes_what_is_still_owed_after_the_spill_in_progress(tmp_path: Path, slow_disk: list[str]) -> None:
    spill = tmp_path / "events.spill"
    publisher, metrics = _publisher(spill)
    publisher.start()
    for i in range(6):
        publisher.submit(_message(i))
    await asyncio.sleep(0.05)  # the spill task has taken its batch to the disk thread
    await publisher.stop(0.1)
    ids = [OutgoingMessage.from_json_line(line).message_id for line in spill.read_text().splitlines()]
    assert sorted(ids) == sorted(f"event-{i}" for i in range(6)) and len(ids) == 6
    assert publisher.pending == 0 and metrics.dropped._value.get() == 0


async def test_without_a_spill_file_what_the_outbox_cannot_hold_is_counted_dropped(tmp_path: Path) -> None:
    publisher, metrics = _publisher(None)
    for i in range(5):
        publisher.submit(_message(i))
    assert publisher.pending == 2 and metrics.dropped._value.get() == 3


BROKER = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


async def test_a_stop_during_a_slow_read_of_the_spill_file_puts_every_message_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session reads the spill file back (off the loop) when the broker is up; a stop that cancels
    it mid-read must not lose what the read took off the disk."""
    import aio_pika

    spill = tmp_path / "events.spill"
    spill.write_text("".join(_message(i).to_json_line() for i in range(20)))
    exchange = f"sluice-test-spill-{uuid.uuid4().hex[:8]}"

    async def declare(channel: aio_pika.abc.AbstractChannel) -> None:
        await channel.declare_exchange(exchange, aio_pika.ExchangeType.DIRECT, auto_delete=True)

    reading = threading.Event()
    read_spill = ConfirmingPublisher._read_spill

    def slow_read(self: ConfirmingPublisher, room: int) -> tuple[list[OutgoingMessage], int]:
        reading.set()
        time.sleep(0.5)  # a slow disk: the stop below lands while this runs
        return read_spill(self, room)

    monkeypatch.setattr(ConfirmingPublisher, "_read_spill", slow_read)
    metrics = PublisherMetrics.get(f"test_spill_{uuid.uuid4().hex[:8]}")
    publisher = ConfirmingPublisher(BROKER, exchange, declare, metrics, outbox_max=100, spill_path=spill)
    publisher.start()
    deadline = time.monotonic() + 20
    while not reading.is_set():
        assert time.monotonic() < deadline, "the publisher never read its spill file (is RabbitMQ up?)"
        await asyncio.sleep(0.01)
    await publisher.stop(0)
    ids = sorted(OutgoingMessage.from_json_line(line).message_id for line in spill.read_text().splitlines())
    assert ids == sorted(f"event-{i}" for i in range(20))
    assert metrics.dropped._value.get() == 0 and publisher.pending == 0


async def test_stop_keeps_a_spill_batch_queued_behind_another_disk_operation(tmp_path: Path) -> None:
    """The spill task's write waited behind a slower disk operation when stop() cancelled the task:
    the cancelled write never ran and its batch, in neither the outbox nor the file, was lost
    without being counted dropped."""
    spill = tmp_path / "events.spill"
    publisher, metrics = _publisher(spill, outbox_max=2)
    publisher.start()
    publisher._disk.submit(time.sleep, 0.5)  # the disk thread busy (a slow read, say)
    for i in range(5):  # 2 in the outbox, 3 for the spill task, whose write queues behind the sleep
        publisher.submit(_message(i))
    await asyncio.sleep(0.1)
    await publisher.stop(0)
    ids = sorted(OutgoingMessage.from_json_line(line).message_id for line in spill.read_text().splitlines())
    assert ids == sorted(f"event-{i}" for i in range(5))
    assert metrics.dropped._value.get() == 0 and publisher.pending == 0


def test_a_torn_last_line_does_not_swallow_the_next_spilled_message(tmp_path: Path) -> None:
    """A crash mid-write leaves the file's last line without its newline: the next spill was appended
    to it, one unreadable line, and a whole message lost with the torn one."""
    spill = tmp_path / "events.spill"
    spill.write_text(_message(0).to_json_line() + _message(1).to_json_line()[:20])
    publisher, metrics = _publisher(spill)
    publisher._spill([_message(2)])
    loaded, left = publisher._read_spill(100)
    assert [m.message_id for m in loaded] == ["event-0", "event-2"] and left == 0
    assert metrics.dropped._value.get() == 1  # the torn one only


def test_a_read_after_a_crash_mid_read_takes_what_was_spilled_since_too(tmp_path: Path) -> None:
    """A crash mid-read leaves <spill>.loading; the next read took only that file and said nothing was
    left on disk, so what was spilled into <spill> after the restart waited for another spill or
    restart."""
    spill = tmp_path / "events.spill"
    loading = tmp_path / "events.spill.loading"
    loading.write_text(_message(0).to_json_line())
    spill.write_text(_message(1).to_json_line() + _message(2).to_json_line())
    publisher, _ = _publisher(spill)
    loaded, left = publisher._read_spill(100)
    assert [m.message_id for m in loaded] == ["event-0", "event-1", "event-2"] and left == 0
    assert not spill.exists() and not loading.exists()
    # With less room, what is not read stays on disk, counted, older messages first.
    loading.write_text(_message(0).to_json_line())
    spill.write_text(_message(1).to_json_line() + _message(2).to_json_line())
    loaded, left = publisher._read_spill(2)
    assert [m.message_id for m in loaded] == ["event-0", "event-1"] and left == 1
    assert [OutgoingMessage.from_json_line(line).message_id for line in spill.read_text().splitlines()] == ["event-2"]
