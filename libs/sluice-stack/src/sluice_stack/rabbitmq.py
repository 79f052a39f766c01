"""Makes sure a RabbitMQ broker is reachable for a local run: the one SLUICE_AMQP_URL names when it is
set (never started here), otherwise 127.0.0.1:5672, starting the installed rabbitmq-server if needed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from urllib.parse import urlsplit

# The variable the launcher (sluice_stack.launcher.Stack.amqp_url) hands every service as its AMQP URL.
AMQP_URL_ENV = "SLUICE_AMQP_URL"
LOCAL_HOST = "127.0.0.1"
AMQP_PORT = 5672
AMQPS_PORT = 5671

HOW_TO_GET_ONE = (
    "RabbitMQ is not reachable at {host}:{port} and no rabbitmq-server is installed.\n"
    "  Debian/Ubuntu: sudo apt-get install rabbitmq-server && sudo rabbitmq-server -detached\n"
    "  macOS:         brew install rabbitmq && brew services start rabbitmq\n"
    f"  Or point {AMQP_URL_ENV} at an existing broker (amqp://user:password@host:5672/)."
)


def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def broker_address(amqp_url: str) -> tuple[str, int]:
    """(host, port) of an AMQP URL (amqp:// defaults to 5672, amqps:// to 5671); ValueError when it
    is no such URL."""
    parts = urlsplit(amqp_url)
    if parts.scheme not in ("amqp", "amqps"):
        raise ValueError(f"{AMQP_URL_ENV} must be an amqp:// or amqps:// URL, got scheme {parts.scheme!r}")
    port = parts.port  # raises ValueError for a port that is not a number in range
    return parts.hostname or "localhost", port or (AMQPS_PORT if parts.scheme == "amqps" else AMQP_PORT)


def ensure_rabbitmq(amqp_url: str | None = None, wait_s: float = 60.0) -> str:
    """Returns a one-line status; raises RuntimeError with instructions when there is no broker.

    `amqp_url` (SLUICE_AMQP_URL's value): its host and port are probed, and nothing is started, for
    the broker is someone else's. None or empty: 127.0.0.1:5672, and the installed rabbitmq-server is
    started (detached) when nothing listens there."""
    if amqp_url:
        try:
            host, port = broker_address(amqp_url)
        except ValueError as exc:
            raise RuntimeError(f"{AMQP_URL_ENV} is not a usable AMQP URL: {exc}") from None
        if reachable(host, port):
            return f"RabbitMQ reachable at {host}:{port} ({AMQP_URL_ENV})"
        raise RuntimeError(
            f"RabbitMQ is not reachable at {host}:{port}, the broker {AMQP_URL_ENV} names (no local broker is started while it is set)"
        )
    host, port = LOCAL_HOST, AMQP_PORT
    if reachable(host, port):
        return f"RabbitMQ reachable at {host}:{port}"
    server = shutil.which("rabbitmq-server")
    if server is None:
        raise RuntimeError(HOW_TO_GET_ONE.format(host=host, port=port))
    subprocess.run([server, "-detached"], check=False, capture_output=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if reachable(host, port):
            return f"started the local RabbitMQ ({server}) at {host}:{port}"
        time.sleep(1)
    raise RuntimeError(f"started {server} but {host}:{port} did not open within {wait_s:.0f}s")
