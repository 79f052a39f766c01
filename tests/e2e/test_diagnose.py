"""`sluice diagnose` against the real stack: a serialization planted at one hop (an adapter whose
batch holds one sequence) is named by the verdict with its numbers; the stack as configured, under
the same probe, is not said to serialize there."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import DEMO_KEY
from sluice_stack import Stack
from sluice_stack.launcher import REPO_ROOT

SLUICE = REPO_ROOT / "cli" / ".venv" / "bin" / "sluice"
# Small enough to keep the test short, long enough for ~20 completions at a batch of one.
PROBE = ["--probe", "4", "--duration", "8", "--max-tokens", "16"]


def diagnose(gateway: str, ratelimit: str, metrics: dict[str, str], record: Path) -> str:
    command = [str(SLUICE), "--gateway", gateway, "--api-key", DEMO_KEY, "diagnose", *PROBE, "--ratelimit", ratelimit]
    command += ["--record", str(record)]
    for name, url in metrics.items():
        command += ["--metrics", f"{name}={url}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)  # shown with -rA, and beside any failure
    return done.stdout


def verdict(output: str) -> str:
    found = re.findall(r"^verdict: (.*)$", output, re.M)
    assert len(found) == 1, output
    return found[0]


@pytest.fixture
def serial_path(stack: Stack) -> Iterator[tuple[str, str, str]]:
    """A second adapter whose batch holds one sequence (on the same Triton), and a gateway that
    routes to it: (gateway address, gateway metrics URL, adapter metrics URL)."""
    env = {"SLUICE_ADAPTER_MAX_BATCH_SIZE": "1", "SLUICE_ADAPTER_INTERACTIVE_RESERVED_SLOTS": "0"}
    adapter, adapter_address, adapter_metrics = stack.add_adapter("adapter-batch-1", env=env)
    try:
        gateway, gateway_address, gateway_metrics = stack.add_gateway("gateway-batch-1", env={"SLUICE_GATEWAY_ADAPTER_URL": adapter_address})
        try:
            yield gateway_address, gateway_metrics, adapter_metrics
        finally:
            gateway.stop()
    finally:
        adapter.stop()


def test_an_adapter_batch_of_one_is_the_hop_the_verdict_names(stack: Stack, serial_path: tuple[str, str, str], tmp_path: Path) -> None:
    gateway, gateway_metrics, adapter_metrics = serial_path
    output = diagnose(
        gateway,
        stack.ratelimit_address,
        {
            "gateway": gateway_metrics,
            "rate-limit": stack.metrics_url("rate-limit"),
            "inference-adapter": adapter_metrics,
            "triton-local": stack.metrics_url("triton-local"),
        },
        tmp_path / "scrapes",
    )
    said = verdict(output)
    assert said.startswith("inference-adapter serializes: effective concurrency "), output
    match = re.search(
        r"effective concurrency ([0-9.]+) of configured 1 \(MAX_BATCH_SIZE\); ([0-9.]+) requests in flight there; queue wait (\d+)% of its time", said
    )
    assert match is not None, output
    effective, in_flight, queued = float(match.group(1)), float(match.group(2)), int(match.group(3))
    # One sequence at a time while four streams wait their turn: most of a stream's time is queue.
    assert 0.8 <= effective <= 1.3, output
    assert in_flight >= 2.5, output
    assert queued >= 50, output
    # The table has a row per hop scraped, the probe line says what the clients saw.
    for hop in ("gateway", "rate-limit", "inference-adapter", "triton-local"):
        assert re.search(rf"^{hop}\s", output, re.M), output
    assert re.search(r"^probe: 4 concurrent Generate streams, [1-9]\d* completed", output, re.M), output


def test_the_stack_as_configured_does_not_serialize_at_the_adapter(stack: Stack, tmp_path: Path) -> None:
    output = diagnose(
        stack.gateway_address,
        stack.ratelimit_address,
        {name: stack.metrics_url(name) for name in ("gateway", "rate-limit", "inference-adapter", "triton-local")},
        tmp_path / "scrapes",
    )
    said = verdict(output)
    assert not said.startswith("inference-adapter serializes"), output
    row = re.search(r"^inference-adapter\s+([0-9.]+)\s.*?\s32\s+([0-9.]+)\s", output, re.M)
    assert row is not None, output
    # Four streams in a batch of 32: the bound is far from reached.
    assert float(row.group(2)) <= 8, output


@pytest.fixture
def ratelimited_path(stack: Stack, tmp_path: Path) -> Iterator[tuple[str, str, str, str]]:
    """A second rate-limit that lets the demo tenant hold one request in flight, and a gateway
    that asks it (the stack's adapter behind): (gateway address, its metrics URL, rate-limit's
    address, its metrics URL)."""
    limits = tmp_path / "limits.toml"
    limits.write_text("[tenants.demo]\nrequests_in_flight = 1\n")
    ratelimit, ratelimit_address, ratelimit_metrics = stack.add_ratelimit("rate-limit-in-flight-1", limits)
    try:
        gateway, gateway_address, gateway_metrics = stack.add_gateway("gateway-in-flight-1", env={"SLUICE_GATEWAY_RATELIMIT_URL": ratelimit_address})
        try:
            yield gateway_address, gateway_metrics, ratelimit_address, ratelimit_metrics
        finally:
            gateway.stop()
    finally:
        ratelimit.stop()


def test_a_requests_in_flight_budget_of_one_is_the_hop_the_verdict_names(
    stack: Stack, ratelimited_path: tuple[str, str, str, str], tmp_path: Path
) -> None:
    gateway, gateway_metrics, ratelimit, ratelimit_metrics = ratelimited_path
    output = diagnose(
        gateway,
        ratelimit,
        {
            "gateway": gateway_metrics,
            "rate-limit": ratelimit_metrics,
            "inference-adapter": stack.metrics_url("inference-adapter"),
            "triton-local": stack.metrics_url("triton-local"),
        },
        tmp_path / "scrapes",
    )
    said = verdict(output)
    match = re.fullmatch(
        r"rate-limit serializes: (\d+)% of Acquires denied \(denied by requests_in_flight \d+\); effective concurrency"
        r" ([0-9.]+) of configured 1 \(requests_in_flight of demo on smollm2-135m-instruct\); the probe's clients waited"
        r" to retry (\d+)% of their time",
        said,
    )
    assert match is not None, output
    # One of the four probe streams admitted at a time, the others told to come back in a second:
    # three denials a second beside the ~10 calls admitted (fewer denied the shorter the calls), and
    # the clients wait to retry most of their time.
    assert int(match.group(1)) >= 10, output
    assert 0.5 <= float(match.group(2)) <= 1.0, output
    assert int(match.group(3)) >= 50, output
    assert re.search(r"^probe: 4 concurrent Generate streams, [1-9]\d* completed, [1-9]\d* denied", output, re.M), output
