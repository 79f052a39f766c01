"""Two triton-local replicas behind one adapter: a replica killed under load loses no request
that had not streamed a token, and it is readmitted once it is back."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from conftest import MODEL, auth, scrape, wait_for
from sluice_stack import Stack, StackPorts

SECOND = "triton-local-2"


@pytest.fixture(scope="module")
def two_replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("replicas"),
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_triton_replicas=1,
        extra_env={"inference-adapter": {"SLUICE_ADAPTER_PROBE_INTERVAL_S": "0.5"}},
    )
    stack.start()
    yield stack
    stack.stop()


def healthy(stack: Stack, replica: str) -> float:
    return scrape(stack.metrics_url("inference-adapter"), "sluice_adapter_replica_healthy", f'{{replica="{stack.triton_address(replica)}"}}')


def run_stream(stub, index: int, outcomes: dict[int, tuple[int, str]]) -> None:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=f"Write a long story number {index} about a river.")],
        sampling=types_pb2.SamplingParams(max_tokens=40),
    )
    tokens = 0
    try:
        for response in stub.Generate(request, metadata=auth(), timeout=120):
            tokens += bool(response.text)
            if response.finish_reason == types_pb2.FINISH_REASON_ERROR:
                outcomes[index] = (tokens, "finish_reason_error")
        outcomes[index] = (tokens, "ok")
    except grpc.RpcError as error:
        outcomes[index] = (tokens, error.code().name)


def test_killed_replica_loses_no_request_without_tokens_and_is_readmitted(two_replicas: Stack) -> None:
    stack = two_replicas
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack.gateway_address))
    deadline = time.monotonic() + 30
    while not (healthy(stack, "triton-local") == 1 and healthy(stack, SECOND) == 1):
        assert time.monotonic() < deadline, "both replicas should be admitted before the load starts"
        time.sleep(0.2)
    outcomes: dict[int, tuple[int, str]] = {}
    threads = [threading.Thread(target=run_stream, args=(stub, i, outcomes)) for i in range(12)]
    for thread in threads:
        thread.start()
    # The kill must hit work in flight: wait until the second replica is running sequences.
    wait_for(lambda: scrape(stack.metrics_url(SECOND), "sluice_triton_local_active_slots") > 0, "replica 2 to take work", timeout_s=60)
    stack.service(SECOND).kill()
    for thread in threads:
        thread.join(timeout=180)
    assert len(outcomes) == 12
    for index, (tokens, result) in outcomes.items():
        if result != "ok":
            # Only a stream that had already sent tokens may fail, and then with UNAVAILABLE.
            assert tokens > 0 and result == "UNAVAILABLE", (index, tokens, result)
    assert sum(1 for _, result in outcomes.values() if result == "ok") >= 6
    # The kill hit work in flight: requests without tokens were moved to the surviving replica.
    moved = scrape(stack.metrics_url("inference-adapter"), "sluice_adapter_retries_total")
    failed_mid_stream = sum(1 for _, result in outcomes.values() if result != "ok")
    assert moved + failed_mid_stream > 0, outcomes

    deadline = time.monotonic() + 20
    while healthy(stack, SECOND) != 0:
        assert time.monotonic() < deadline, "the dead replica was never marked unhealthy"
        time.sleep(0.2)

    stack.service(SECOND).start()
    stack.service(SECOND).wait_ready(120)
    deadline = time.monotonic() + 30
    while healthy(stack, SECOND) != 1:
        assert time.monotonic() < deadline, "the replica was not readmitted after it came back"
        time.sleep(0.2)
    # Once readmitted it takes traffic again (least-loaded routing sends it a share).
    before = scrape(stack.metrics_url(SECOND), "sluice_triton_local_tokens_generated_total")
    more: dict[int, tuple[int, str]] = {}
    threads = [threading.Thread(target=run_stream, args=(stub, 100 + i, more)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert all(result == "ok" for _, result in more.values())
    assert scrape(stack.metrics_url(SECOND), "sluice_triton_local_tokens_generated_total") > before
