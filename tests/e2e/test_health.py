"""Every long-running service answers gRPC health, reflection and Prometheus metrics."""

from __future__ import annotations

import os
import subprocess
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from sluice_stack import REPO_ROOT


@pytest.mark.parametrize(
    ("service", "full_name"),
    [("gateway", "sluice.gateway.v1.GatewayService"), ("inference-adapter", "sluice.inference.v1.InferenceService")],
)
def test_health_reflection_and_metrics(stack, service, full_name) -> None:
    address = stack.gateway_address if service == "gateway" else stack.adapter_address
    with grpc.insecure_channel(address) as channel:
        for name in ("", full_name, "liveness"):  # "liveness": what the Kubernetes liveness probes ask
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        assert full_name in [s.name for s in answer.list_services_response.service]
    with urllib.request.urlopen(stack.metrics_url(service), timeout=5) as reply:
        assert b"sluice_rpc_requests_total" in reply.read()


def test_cli_generate_and_health(stack) -> None:
    env = {
        **os.environ,
        "SLUICE_GATEWAY_URL": stack.gateway_address,
        "SLUICE_ADAPTER_URL": stack.adapter_address,
        "SLUICE_RATELIMIT_URL": stack.ratelimit_address,
        "SLUICE_EVALLOG_URL": stack.evallog_address,
        "SLUICE_GATEWAY_WORKER_URL": stack.job_worker_address,
        "SLUICE_TRITON_HTTP_URL": f"127.0.0.1:{stack.ports.triton_http}",
        "SLUICE_API_KEY": "sk-sluice-demo",
    }
    sluice = str(REPO_ROOT / "bin" / "sluice")
    generated = subprocess.run(
        [sluice, "generate", "Which city is the capital of France?", "--max-tokens", "20", "-v"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0, generated.stderr
    assert "Paris" in generated.stdout
    assert "FINISH_REASON_" in generated.stderr
    health = subprocess.run([sluice, "health"], env=env, capture_output=True, text=True, timeout=60)
    assert health.returncode == 0, health.stdout + health.stderr
    # Every service is listed, each at the stack's address, and every one is SERVING.
    services = ("gateway", "inference-adapter", "rate-limit", "evaluation-logging", "job-worker", "triton")
    lines = {line.split()[0]: line.split() for line in health.stdout.splitlines() if line.strip()}
    assert set(lines) == set(services), health.stdout
    assert lines["rate-limit"][1] == stack.ratelimit_address and lines["evaluation-logging"][1] == stack.evallog_address
    assert all(lines[name][-1] == "SERVING" for name in services), health.stdout
    assert health.stdout.count("SERVING") == len(services)
