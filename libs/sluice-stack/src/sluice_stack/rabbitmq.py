"""Makes sure a RabbitMQ broker is reachable for a local run, starting the installed one if needed."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

HOW_TO_GET_ONE = (
    "RabbitMQ is not reachable at {host}:{port} and no rabbitmq-server is installed.\n"
    "  Debian/Ubuntu: sudo apt-get install rabbitmq-server && sudo rabbitmq-server -detached\n"
    "  macOS:         brew install rabbitmq && brew services start rabbitmq\n"
    "  Or point SLUICE_AMQP_URL at an existing broker."
)


def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def ensure_rabbitmq(host: str = "127.0.0.1", port: int = 5672, wait_s: float = 60.0) -> str:
    """Returns a one-line status; raises RuntimeError with instructions when there is no broker."""
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
