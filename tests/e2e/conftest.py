"""The real stack, started once per test session: triton-local, inference-adapter, gateway."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from otlp_receiver import OtlpReceiver, start_receiver, tracing_env
from sluice_stack import Stack, StackPorts

DEMO_KEY = "sk-sluice-demo"
MODEL = "smollm2-135m-instruct"
EMBEDDING_MODEL = "all-minilm-l6-v2"


# The services of the shared stack that export traces (test_tracing): every one with Sluice's tracing.
TRACED_SERVICES = ("gateway", "job-worker", "inference-adapter", "rate-limit", "evaluation-logging")


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver the shared stack exports its traces to (started before the stack)."""
    receiver = start_receiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, otlp_receiver: OtlpReceiver) -> Iterator[Stack]:
    run_dir = Path(os.environ.get("SLUICE_TEST_RUN_DIR", tmp_path_factory.mktemp("stack")))
    # Tracing on, but only requests that bring a sampled traceparent are recorded (otlp_receiver).
    extra_env = {service: tracing_env(otlp_receiver.endpoint) for service in TRACED_SERVICES}
    # Its own exchange and queue names, so that parallel runs never consume each other's events.
    stack = Stack(run_dir=run_dir, ports=StackPorts.ephemeral(), amqp_prefix=f"sluice-e2e-{uuid.uuid4().hex[:8]}", extra_env=extra_env)
    stack.start(timeout_s=300)
    yield stack
    stack.stop()
    delete_amqp_topology(stack.amqp_url, stack.amqp_prefix)


def delete_amqp_topology(url: str, prefix: str) -> None:
    """Removes the session's exchanges and queues from the shared broker."""
    import asyncio

    import aio_pika
    from sluice_common.amqp import EventTopology, JobTopology

    async def delete() -> None:
        connection = await aio_pika.connect(url, timeout=5)
        async with connection:
            await EventTopology(prefix).delete(await connection.channel())
            await JobTopology(prefix).delete(await connection.channel())

    try:
        asyncio.run(delete())
    except Exception:  # noqa: BLE001 - best effort: a leftover prefix only costs broker memory
        pass


@pytest.fixture(scope="session")
def gateway_channel(stack: Stack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield channel


@pytest.fixture(scope="session")
def gateway(gateway_channel: grpc.Channel) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(gateway_channel)


def chat(question: str, max_tokens: int, priority: int = types_pb2.PRIORITY_CLASS_INTERACTIVE) -> gateway_pb2.GenerateRequest:
    """A one-message chat request."""
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
        priority_class=priority,
    )


def auth(key: str = DEMO_KEY) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def scrape(url: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus metric, 0 when absent."""
    return scrape_samples(url, (name, labels))[0]


def scrape_samples(url: str, *samples: tuple[str, str]) -> list[float]:
    """Samples ((name, labels) each) of one and the same scrape: figures that must agree with each
    other (a histogram's count and one of its buckets) cannot come from two scrapes a step apart."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    values = []
    for name, labels in samples:
        match = re.search(rf"^{re.escape(name)}{re.escape(labels) if labels else ''}\s+([0-9.eE+-]+)$", text, re.M)
        values.append(float(match.group(1)) if match else 0.0)
    return values


@contextlib.contextmanager
def read_store(stack: Stack, file_name: str) -> Iterator[sqlite3.Connection]:
    """A read-only connection to one of the stack's SQLite stores (jobs.sqlite3, evallog.sqlite3),
    closed afterwards: what a service stored, checked beside what its API says."""
    db = sqlite3.connect(f"file:{stack.run_dir / file_name}?mode=ro", uri=True, timeout=30)
    try:
        yield db
    finally:
        db.close()


def waiting_requests(adapter_metrics_url: str) -> dict[str, int]:
    """The adapter's waiting requests per priority class over all its replicas, from one scrape."""
    with urllib.request.urlopen(adapter_metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    found = re.findall(r'^sluice_adapter_waiting_requests\{priority="(\w+)",replica="[^"]*"\} ([0-9.]+)$', text, re.M)
    return {priority: int(sum(float(v) for p, v in found if p == priority)) for priority in ("interactive", "bulk")}


def scrape_total(url: str, name: str) -> float:
    """A metric summed over all its label sets (a per-replica gauge, for the adapter as a whole)."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)$", text, re.M))


def wait_for(condition: Callable[[], bool], what: str = "the condition", timeout_s: float = 10.0, poll_s: float = 0.05) -> None:
    """Polls `condition` until it holds; fails naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(poll_s)
