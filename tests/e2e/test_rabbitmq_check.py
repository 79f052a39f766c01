"""`make run`'s broker check (sluice_stack.rabbitmq): with SLUICE_AMQP_URL set it probes that URL's
host and port and starts nothing; unset, it probes 127.0.0.1:5672 and may start the installed
rabbitmq-server. No broker and no stack: the probe and the start are replaced."""

from __future__ import annotations

import pytest

from sluice_stack import rabbitmq


@pytest.fixture()
def probes(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """Records every probe (answering from `up`) and every rabbitmq-server start."""
    seen: dict[str, list] = {"probed": [], "started": [], "up": []}

    def reachable(host: str, port: int, timeout_s: float = 1.0) -> bool:
        seen["probed"].append((host, port))
        return (host, port) in seen["up"]

    def run(args, **_: object) -> None:  # type: ignore[no-untyped-def]
        seen["started"].append(args)
        seen["up"].append((rabbitmq.LOCAL_HOST, rabbitmq.AMQP_PORT))

    monkeypatch.setattr(rabbitmq, "reachable", reachable)
    monkeypatch.setattr(rabbitmq.subprocess, "run", run)
    monkeypatch.setattr(rabbitmq.shutil, "which", lambda name: f"/usr/sbin/{name}")
    return seen


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("amqp://user:secret@broker.example:5673/vhost", ("broker.example", 5673)),
        ("amqp://guest:guest@rabbit/", ("rabbit", 5672)),
        ("amqps://user:secret@broker.example/", ("broker.example", 5671)),
        ("amqp://[::1]:5672/", ("::1", 5672)),
    ],
)
def test_broker_address_is_the_urls_host_and_port(url: str, address: tuple[str, int]) -> None:
    assert rabbitmq.broker_address(url) == address


def test_a_set_url_is_probed_and_nothing_is_started(probes: dict[str, list]) -> None:
    probes["up"].append(("broker.example", 5673))
    status = rabbitmq.ensure_rabbitmq("amqp://user:secret@broker.example:5673/")
    assert probes["probed"] == [("broker.example", 5673)] and not probes["started"]
    assert "broker.example:5673" in status and "secret" not in status


def test_a_set_url_that_is_down_fails_without_starting_a_local_broker(probes: dict[str, list]) -> None:
    with pytest.raises(RuntimeError, match="broker.example:5672") as raised:
        rabbitmq.ensure_rabbitmq("amqp://user:secret@broker.example/", wait_s=0.1)
    assert probes["probed"] == [("broker.example", 5672)] and not probes["started"]
    assert "secret" not in str(raised.value)


def test_a_url_that_is_not_amqp_is_refused(probes: dict[str, list]) -> None:
    with pytest.raises(RuntimeError, match="SLUICE_AMQP_URL"):
        rabbitmq.ensure_rabbitmq("http://broker.example:5672/")
    assert not probes["probed"] and not probes["started"]


@pytest.mark.parametrize("url", [None, ""])
def test_unset_probes_the_local_default_and_starts_the_installed_server(probes: dict[str, list], url: str | None) -> None:
    status = rabbitmq.ensure_rabbitmq(url, wait_s=5)
    assert probes["probed"][0] == ("127.0.0.1", 5672)
    assert probes["started"] == [["/usr/sbin/rabbitmq-server", "-detached"]]
    assert status.startswith("started the local RabbitMQ")
