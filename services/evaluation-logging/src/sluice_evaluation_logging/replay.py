"""`sluice-evallog-replay` (python -m sluice_evaluation_logging.replay): move dead-lettered events back.

Each message is republished to the events exchange with its original routing key (routed to a
queue and confirmed) before it is acked off the dead-letter queue, so a crash mid-replay duplicates
at worst, and evaluation-logging stores each event id once. A message whose copy no queue takes
stays in the dead-letter queue, and the replay says so and exits 1. Reads SLUICE_EVALLOG_AMQP_URL and
SLUICE_EVALLOG_AMQP_PREFIX like the service.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from urllib.parse import urlsplit

import aio_pika
from aio_pika.exceptions import AMQPError, ChannelNotFoundEntity

from sluice_common.amqp import DEAD_REASON_HEADER, DEFAULT_AMQP_URL, EventTopology, ReplayIncomplete, replay_dead_letters


async def _peek(url: str, queue_name: str, limit: int) -> list[str]:
    """Reasons of the first `limit` dead letters, left in the queue."""
    lines: list[str] = []
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(queue_name, ensure=True)
        held = []
        for _ in range(limit):
            message = await queue.get(no_ack=False, fail=False, timeout=10)
            if message is None:
                break
            held.append(message)
            reason = str((message.headers or {}).get(DEAD_REASON_HEADER, "(no reason: dead-lettered by the broker)"))
            lines.append(f"{message.message_id or '-'}\t{reason}")
        for message in held:
            await message.nack(requeue=True)
    return lines


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _without_credentials(url: str) -> str:
    """The broker's URL for an error line: never its user and password."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(the URL given)"
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _problem(exc: BaseException, url: str) -> str:
    """One line for what stopped the replay; the password kept out should the error quote the URL."""
    if isinstance(exc, ChannelNotFoundEntity):
        text = f"{exc.args[0] if exc.args else exc} (is --prefix / SLUICE_EVALLOG_AMQP_PREFIX the service's?)"
    else:
        text = f"cannot use RabbitMQ at {_without_credentials(url)}: {exc or type(exc).__name__}"
    try:
        password = urlsplit(url).password
    except ValueError:
        password = None
    return text.replace(password, "***") if password else text


def main() -> None:
    parser = argparse.ArgumentParser(prog="sluice-evallog-replay", description=__doc__.splitlines()[0])
    parser.add_argument("--amqp-url", default=os.environ.get("SLUICE_EVALLOG_AMQP_URL", DEFAULT_AMQP_URL))
    parser.add_argument("--prefix", default=os.environ.get("SLUICE_EVALLOG_AMQP_PREFIX", "sluice"))
    parser.add_argument("--limit", type=_limit, default=None, help="replay (or --list) at most this many")
    parser.add_argument("--list", action="store_true", help="only show the dead letters and their reasons")
    args = parser.parse_args()
    topology = EventTopology(args.prefix)
    # The error line below says what failed; aiormq would log it a second time on its own.
    logging.getLogger("aiormq").setLevel(logging.CRITICAL)
    try:
        if args.list:
            for line in asyncio.run(_peek(args.amqp_url, topology.completions_dead_queue, args.limit or 100)):
                print(line)
            return
        count = asyncio.run(replay_dead_letters(args.amqp_url, topology.completions_dead_queue, topology.events_exchange, limit=args.limit))
    except ReplayIncomplete as exc:
        raise SystemExit(
            f"sluice-evallog-replay: replayed {exc.replayed} message(s) from {topology.completions_dead_queue} to"
            f" {topology.events_exchange}; {exc} (is the evaluation-logging queue declared and bound?)"
        ) from None
    except (AMQPError, OSError, TimeoutError, ValueError) as exc:  # ValueError: a URL that does not parse
        raise SystemExit(f"sluice-evallog-replay: {_problem(exc, args.amqp_url)}") from None
    except KeyboardInterrupt:
        raise SystemExit("sluice-evallog-replay: interrupted (each message is acked only once its copy is confirmed)") from None
    print(f"replayed {count} message(s) from {topology.completions_dead_queue} to {topology.events_exchange}")


if __name__ == "__main__":
    main()
