"""Two adapters share two triton-locals' KV slots (issue 13): together their batch bounds (2 x 8)
are twice what the replicas hold (2 x 4). A prefill that finds its replica full waits (the step
model answers "busy", the adapter retries it), it never fails; a killed adapter's sequences are
released once nobody has stepped them for the slot lease."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, scrape, scrape_total, wait_for
from sluice_stack import ServiceProcess, Stack, StackPorts

SLOTS_PER_REPLICA = 4
LEASE_S = 5.0
# One engine thread each: two llama.cpp processes with a thread per core spin against each other.
TRITON_ENV = {
    "SLUICE_TRITON_LOCAL_MAX_SLOTS": str(SLOTS_PER_REPLICA),
    "SLUICE_TRITON_LOCAL_SLOT_LEASE_S": str(LEASE_S),
    "SLUICE_TRITON_LOCAL_THREADS": "1",
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, list[tuple[ServiceProcess, str, str]]]]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("shared-slots"),
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_triton_replicas=1,
        extra_env={
            "triton-local": TRITON_ENV,
            "triton-local-2": TRITON_ENV,
            "inference-adapter": {"SLUICE_ADAPTER_MAX_BATCH_SIZE": "8", "SLUICE_ADAPTER_PROBE_INTERVAL_S": "0.5"},
        },
    )
    stack.start()
    first = (stack.service("inference-adapter"), stack.adapter_address, stack.metrics_url("inference-adapter"))
    adapters = [first, stack.add_adapter("inference-adapter-2")]
    yield stack, adapters
    stack.stop()


def question(index: int, max_tokens: int) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=f"shared-{index}",
        tenant="demo",
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=f"Name {index + 2} animals that live in the sea.")],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens),
    )


def generate(address: str, request: inference_pb2.GenerateRequest) -> tuple[str, int]:
    """The whole text and the finish reason (raises grpc.RpcError)."""
    with grpc.insecure_channel(address) as channel:
        responses = list(inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=180))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def test_sixteen_streams_over_two_adapters_all_complete_with_their_solo_text(shared) -> None:  # type: ignore[no-untyped-def]
    stack, adapters = shared
    addresses = [address for _, address, _ in adapters]
    solo = {i: generate(addresses[0], question(i, 24)) for i in range(16)}
    full_before = sum(scrape_total(url, "sluice_adapter_engine_full_total") for _, _, url in adapters)
    results: dict[int, object] = {}

    def run(index: int) -> None:
        try:
            results[index] = generate(addresses[index % 2], question(index, 24))
        except grpc.RpcError as error:
            results[index] = f"{error.code().name}: {error.details()}"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert {i: results.get(i) for i in range(16)} == solo
    # The adapters' bounds (16) exceed the replicas' slots (8): the engines did turn prefills away.
    assert sum(scrape_total(url, "sluice_adapter_engine_full_total") for _, _, url in adapters) > full_before


def test_a_killed_adapters_slots_come_back_within_the_lease(shared) -> None:  # type: ignore[no-untyped-def]
    stack, adapters = shared
    (survivor, survivor_address, _), (victim, victim_address, _) = adapters
    owner = f'{{owner="{socket.gethostname()}/{victim.process.pid}"}}'
    tritons = [stack.metrics_url(name) for name in stack.triton_ports]
    outcomes: dict[str, list[str]] = {"victim": [], "survivor": []}

    def run(side: str, address: str, index: int) -> None:
        try:
            outcomes[side].append("ok" if generate(address, question(index, 160))[0] else "empty")
        except grpc.RpcError as error:
            outcomes[side].append(error.code().name)

    victims = [threading.Thread(target=run, args=("victim", victim_address, i)) for i in range(6)]
    for thread in victims:
        thread.start()
    wait_for(lambda: sum(scrape(url, "sluice_triton_local_slots_by_owner", owner) for url in tritons) >= 4,
             "the victim adapter to hold slots", timeout_s=60, poll_s=0.1)  # fmt: skip
    survivors = [threading.Thread(target=run, args=("survivor", survivor_address, 100 + i)) for i in range(6)]
    for thread in survivors:
        thread.start()
    victim.kill()
    killed_at = time.monotonic()
    wait_for(lambda: sum(scrape(url, "sluice_triton_local_slots_by_owner", owner) for url in tritons) == 0,
             "the dead adapter's slots to be released", timeout_s=LEASE_S + 10, poll_s=0.1)  # fmt: skip
    released_after = time.monotonic() - killed_at
    for thread in victims + survivors:
        thread.join(timeout=300)
    assert outcomes["victim"] == ["UNAVAILABLE"] * 6
    assert outcomes["survivor"] == ["ok"] * 6
    assert released_after <= LEASE_S + 5
    assert sum(scrape(url, "sluice_triton_local_slots_reclaimed_total") for url in tritons) >= 1
