"""Timeouts that follow the load, on the real stack: the step timeout and the gateway's default
deadline move off their ceilings under real traffic, and a Triton that stops answering (its whole
process group stopped with SIGSTOP: a wedged server, not a crashed one) is cut off at about twice the
observed step p99, not at the 60 s ceiling, and taken out of routing."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from sluice.gateway.v1 import gateway_pb2_grpc

from conftest import auth, chat, scrape, wait_for
from sluice_stack import Stack, StackPorts

MODEL_LABEL = '{model="smollm2-135m-instruct"}'
STEP_FLOOR_S = 1.0
STEP_CEILING_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("timeouts"),
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_env={
            "inference-adapter": {
                "SLUICE_ADAPTER_STEP_TIMEOUT_FLOOR_S": str(STEP_FLOOR_S),
                "SLUICE_ADAPTER_STEP_TIMEOUT_S": str(STEP_CEILING_S),
                "SLUICE_ADAPTER_TIMEOUT_MIN_SAMPLES": "10",
                "SLUICE_ADAPTER_TIMEOUT_WINDOW": "200",
                "SLUICE_ADAPTER_PROBE_INTERVAL_S": "0.5",
            },
            "gateway": {"SLUICE_GATEWAY_DEFAULT_DEADLINE_MIN_SAMPLES": "5"},
        },
    )
    stack.start()
    yield stack
    stack.stop()


def healthy(stack: Stack) -> float:
    return scrape(stack.metrics_url("inference-adapter"), "sluice_adapter_replica_healthy", f'{{replica="{stack.triton_address("triton-local")}"}}')


def test_timeouts_follow_the_load_and_a_wedged_triton_is_cut_off_and_ejected(stack: Stack) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_address))
    adapter_metrics, gateway_metrics = stack.metrics_url("inference-adapter"), stack.metrics_url("gateway")
    assert scrape(adapter_metrics, "sluice_adapter_step_timeout_seconds", MODEL_LABEL) == STEP_CEILING_S

    # Real load, without client deadlines (so the gateway's default applies), one prefill per request.
    def warm(worker: int) -> None:
        for index in range(8):
            list(stub.Generate(chat(f"Say a word about rivers ({worker}.{index})", max_tokens=8), metadata=auth()))

    threads = [threading.Thread(target=warm, args=(worker,)) for worker in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    limit = scrape(adapter_metrics, "sluice_adapter_step_timeout_seconds", MODEL_LABEL)
    assert STEP_FLOOR_S <= limit < STEP_CEILING_S, limit
    default = scrape(gateway_metrics, "sluice_gateway_default_deadline_seconds", '{kind="generate"}')
    assert 30.0 <= default < 3600.0, default  # the floor: these answers are quick
    assert scrape(gateway_metrics, "sluice_gateway_default_deadline_p99_seconds", '{part="per_token"}') > 0

    # A stream under way when Triton wedges.
    outcome: dict[str, object] = {}

    def long_stream() -> None:
        tokens = 0
        try:
            for response in stub.Generate(chat("Tell me a long story about a river.", max_tokens=400), metadata=auth(), timeout=120):
                tokens += bool(response.text)
                outcome["tokens"] = tokens
            outcome["result"] = "ok"
        except grpc.RpcError as error:
            outcome["result"] = error.code().name
            outcome["details"] = error.details()
        outcome["ended_at"] = time.monotonic()

    thread = threading.Thread(target=long_stream)
    thread.start()
    wait_for(lambda: int(outcome.get("tokens", 0)) >= 3, "the stream's first tokens", timeout_s=30)  # type: ignore[call-overload]
    fired_before = scrape(adapter_metrics, "sluice_adapter_timeouts_total", '{kind="step"}')
    triton = stack.service("triton-local").process
    assert triton is not None
    stopped_at = time.monotonic()
    os.killpg(triton.pid, signal.SIGSTOP)
    try:
        thread.join(timeout=STEP_CEILING_S)
        assert outcome.get("result") == "UNAVAILABLE", outcome
        assert "did not answer a step within its timeout" in str(outcome["details"]), outcome
        waited = float(outcome["ended_at"]) - stopped_at  # type: ignore[arg-type]
        # About 2x the step p99 (the gauge read before the stall, or the floor), far from 60 s.
        assert waited < max(limit, STEP_FLOOR_S) * 3 + 2.0, (waited, limit)
        assert scrape(adapter_metrics, "sluice_adapter_timeouts_total", '{kind="step"}') >= fired_before + 1
        # The timed-out step and a failed probe: out of routing.
        wait_for(lambda: healthy(stack) == 0, "the wedged replica to be marked unhealthy", timeout_s=15)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(chat("Hi", max_tokens=4), metadata=auth(), timeout=10))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        # Triton may not come back from a SIGSTOP of its whole process group (its Python backend's
        # interprocess locks can time out on resume, and tritonserver aborts), so readmission is left
        # to test_replicas.py (a replica restarted); this only lets the stack stop cleanly.
        os.killpg(triton.pid, signal.SIGCONT)
