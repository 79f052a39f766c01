"""`sluice-evallog-replay` when it cannot replay: one line naming what failed (never the URL's
password) and exit 1, not a traceback; the broker is the real RabbitMQ."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid

import aio_pika
import pytest

from conftest import AMQP_URL
from sluice_common.amqp import DEAD_REASON_HEADER, EventTopology


def replay(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sluice_evaluation_logging.replay", *argv], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # Nothing listens there: the broker is down.
        (["--amqp-url", "amqp://guest:s3cret@127.0.0.1:1/"], "cannot use RabbitMQ at amqp://127.0.0.1:1/: [Errno 111] Connect call failed"),
        (["--amqp-url", "amqp://guest:s3cret@127.0.0.1:5672/"], "cannot use RabbitMQ at amqp://127.0.0.1:5672/: ACCESS_REFUSED"),
        (["--amqp-url", "amqp://guest:s3cret@[::1"], "cannot use RabbitMQ at (the URL given): Invalid IPv6 URL"),
    ],
)
def test_a_broker_it_cannot_use_is_one_line_without_the_password(argv: list[str], said: str) -> None:
    done = replay(*argv)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "s3cret" not in done.stderr + done.stdout
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(f"sluice-evallog-replay: {said}")


@pytest.mark.parametrize("listing", [[], ["--list"]])
def test_a_dead_letter_queue_that_does_not_exist_is_named(listing: list[str]) -> None:
    prefix = f"sluice-missing-{uuid.uuid4().hex[:8]}"
    done = replay("--amqp-url", AMQP_URL, "--prefix", prefix, *listing)
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    assert f"NOT_FOUND - no {'queue' if listing else 'exchange'} '{prefix}." in done.stderr
    assert "SLUICE_EVALLOG_AMQP_PREFIX" in done.stderr


@pytest.mark.parametrize("limit", ["-1", "0", "many"])
def test_a_limit_below_one_is_refused_by_the_parser(limit: str) -> None:
    done = replay("--amqp-url", AMQP_URL, f"--limit={limit}")
    assert done.returncode == 2 and f"argument --limit: must be a whole number >= 1, got '{limit}'" in done.stderr


def test_a_message_that_routes_nowhere_stays_dead_and_the_replay_says_so() -> None:
    """A dead letter whose routing key no queue is bound to: replayed, the broker returns it; the
    replay must not ack it (it was lost while the tool printed "replayed") and must exit 1."""
    prefix = f"sluice-unroutable-{uuid.uuid4().hex[:8]}"
    topology = EventTopology(prefix)

    async def setup() -> None:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel(publisher_confirms=True)
            await topology.declare(channel)
            headers: dict[str, aio_pika.abc.FieldValue] = {DEAD_REASON_HEADER: "bad", "x-sluice-original-routing-key": "nothing.binds.this"}
            await channel.default_exchange.publish(aio_pika.Message(b"x", message_id="lost-1", headers=headers), topology.completions_dead_queue)

    async def left_and_teardown() -> int:
        connection = await aio_pika.connect(AMQP_URL)
        async with connection:
            channel = await connection.channel()
            count = (await channel.declare_queue(topology.completions_dead_queue, passive=True)).declaration_result.message_count
            await topology.delete(channel)
        return count or 0

    asyncio.run(setup())
    try:
        done = replay("--amqp-url", AMQP_URL, "--prefix", prefix)
    finally:
        left = asyncio.run(left_and_teardown())
    assert left == 1
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith("sluice-evallog-replay: replayed 0 message(s)") and "lost-1" in done.stderr and "nothing.binds.this" in done.stderr
