"""Generate passthrough: the adapter in front of a real Triton model that batches by itself.

triton-local serves `smollm2_generate` with the vLLM backend's interface (decoupled
`text_input` -> streamed `text_output`); the adapter detects it from the model's inputs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from conftest import auth, chat, scrape, wait_for, waiting_requests
from sluice_stack import Stack, StackPorts

IN_FLIGHT = 2


@pytest.fixture(scope="module")
def passthrough(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("passthrough"),
        ports=StackPorts.ephemeral(),
        extra_env={
            "inference-adapter": {
                "SLUICE_ADAPTER_TRITON_MODEL": "smollm2_generate",
                "SLUICE_ADAPTER_MAX_IN_FLIGHT": str(IN_FLIGHT),
            }
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def stub(passthrough: Stack) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(passthrough.gateway_address))


def test_adapter_detected_the_generate_interface(passthrough: Stack) -> None:
    log = passthrough.service("inference-adapter").log_path.read_text()
    assert '"protocol": "generate"' in log


def test_streams_an_answer_through_the_decoupled_model(stub) -> None:
    responses = list(stub.Generate(chat("Which city is the capital of France?", 24), metadata=auth(), timeout=120))
    chunks = [r.text for r in responses if r.text]
    assert "Paris" in "".join(chunks)
    assert len(chunks) >= 3
    assert responses[-1].finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
    assert responses[-1].usage.completion_tokens == len(chunks)


def test_cancel_closes_the_triton_stream(stub, passthrough: Stack) -> None:
    """The adapter's side of cancellation: the Triton stream is closed and its place freed.

    A real vLLM or TensorRT-LLM backend frees the sequence when its stream is cancelled
    (`response_sender.is_cancelled()`); triton-local's decoupled model cannot see that,
    because PyTriton 0.7 does not pass Triton's request cancellation to Python callables.
    """
    adapter = passthrough.metrics_url("inference-adapter")
    cancelled_before = scrape(adapter, "sluice_adapter_cancellations_total", '{reason="cancelled"}')
    call = stub.Generate(chat("Write a very long essay about the sea.", 60), metadata=auth(), timeout=120)
    for index, _ in enumerate(call):
        if index == 4:
            assert scrape(adapter, "sluice_adapter_kv_slots_in_use") == 1
            break
    call.cancel()
    deadline = time.monotonic() + 5
    while scrape(adapter, "sluice_adapter_kv_slots_in_use") != 0:
        assert time.monotonic() < deadline, "the adapter kept the cancelled stream open"
        time.sleep(0.05)
    assert scrape(adapter, "sluice_adapter_cancellations_total", '{reason="cancelled"}') == cancelled_before + 1


def test_in_flight_bound_and_priority_order(stub, passthrough: Stack) -> None:
    triton = passthrough.metrics_url("triton-local")
    adapter = passthrough.metrics_url("inference-adapter")
    wait_for(lambda: scrape(triton, "sluice_triton_local_active_slots") == 0, "earlier tests' sequences to end", timeout_s=30)
    first_token_at: dict[str, float] = {}
    finish: dict[str, gateway_pb2.GenerateResponse] = {}
    peak = {"slots": 0.0}
    stop_sampling = threading.Event()

    def sample() -> None:
        while not stop_sampling.is_set():
            peak["slots"] = max(peak["slots"], scrape(triton, "sluice_triton_local_active_slots"))
            time.sleep(0.05)

    def run(name: str, request: gateway_pb2.GenerateRequest) -> None:
        for response in stub.Generate(request, metadata=auth(), timeout=180):
            if response.text and name not in first_token_at:
                first_token_at[name] = time.monotonic()
            if response.finish_reason:
                finish[name] = response

    def start(name: str, request: gateway_pb2.GenerateRequest) -> threading.Thread:
        thread = threading.Thread(target=run, args=(name, request))
        thread.start()
        return thread

    sampler = threading.Thread(target=sample)
    sampler.start()
    # long0 ends long before long1, so one place frees at a time: the interactive request takes it,
    # and a bulk one can only follow once the interactive stream has ended.
    story = "Tell me a long story about a dragon."
    threads = [start("long0", chat(story, 96)), start("long1", chat(story, 256))]
    wait_for(lambda: len(first_token_at) == IN_FLIGHT, "both long streams to take the engine's places", timeout_s=60)
    threads += [start(f"bulk{i}", chat("Say hi.", 3, types_pb2.PRIORITY_CLASS_BULK)) for i in range(3)]
    wait_for(lambda: waiting_requests(adapter) == {"interactive": 0, "bulk": 3}, "the bulk requests to queue", timeout_s=30, poll_s=0.02)
    threads.append(start("interactive", chat("Say hi.", 3)))
    # One scrape showing all four waiting at once: from here the adapter's choice, not arrival order,
    # decides who goes next. If a long stream ended first this never shows: make them longer.
    wait_for(lambda: waiting_requests(adapter) == {"interactive": 1, "bulk": 3}, "all four later requests waiting together", timeout_s=30, poll_s=0.02)
    for thread in threads:
        thread.join(timeout=180)
    stop_sampling.set()
    sampler.join()
    assert peak["slots"] <= IN_FLIGHT
    assert [finish[f"long{i}"].usage.completion_tokens for i in range(2)] == [96, 256], "a long stream stopped early"
    assert all(first_token_at["interactive"] < first_token_at[f"bulk{i}"] for i in range(3))

