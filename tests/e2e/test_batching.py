"""Continuous batching in the adapter, against the real Triton and model (issue 3's acceptance)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import auth, chat, scrape_samples, scrape_total, wait_for, waiting_requests
from sluice_stack import Stack, StackPorts

PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the moon.",
    "What is two plus two?",
]

SLOTS = "sluice_adapter_kv_slots_in_use"


def text_of(stub, request, key: str = "sk-sluice-demo") -> str:
    return "".join(r.text for r in stub.Generate(request, metadata=auth(key), timeout=180))


def in_threads(jobs: list) -> None:
    threads = [threading.Thread(target=job) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)


def test_greedy_outputs_under_batching_match_the_same_requests_alone(gateway) -> None:
    alone = [text_of(gateway, chat(p, 16)) for p in PROMPTS]
    batched: dict[int, str] = {}

    def run(index: int) -> None:
        time.sleep(0.15 * index)  # staggered: later ones join a batch that is already decoding
        batched[index] = text_of(gateway, chat(PROMPTS[index], 16))

    in_threads([lambda i=i: run(i) for i in range(len(PROMPTS))])
    assert [batched[i] for i in range(len(PROMPTS))] == alone


def test_a_short_request_finishes_before_long_ones_that_started_first(gateway) -> None:
    finished: dict[str, float] = {}
    started = threading.Event()

    def long(name: str) -> None:
        for response in gateway.Generate(chat("Write a long story about a dragon.", 60), metadata=auth(), timeout=180):
            if response.text:
                started.set()
        finished[name] = time.monotonic()

    def short() -> None:
        started.wait(60)
        text_of(gateway, chat("Say hi.", 3))
        finished["short"] = time.monotonic()

    in_threads([lambda: long("long1"), lambda: long("long2"), short])
    assert finished["short"] < min(finished["long1"], finished["long2"])


def test_a_cancelled_stream_frees_its_slot_within_one_step(gateway, stack, record_property: Callable[[str, object], None]) -> None:
    """The adapter's promise: a sequence whose caller cancels is in no step planned after it hears of
    it. The cancelled call goes to the adapter itself: through the gateway, its forwarding of the
    cancel (another process, and on a busy box one more wait for a core) adds steps that are not the
    adapter's (3 were seen beside a busy process); test_cancellation covers that path."""
    metrics = stack.metrics_url("inference-adapter")
    steady_started = threading.Event()
    stop = threading.Event()

    def steady() -> None:
        for response in gateway.Generate(chat("Write a long poem about the sea.", 80), metadata=auth(), timeout=180):
            if response.text:
                steady_started.set()
            if stop.is_set():
                break

    def steps_of_two() -> float:
        """Steps the adapter ran with both sequences in them, counted by the adapter itself."""
        steps, steps_of_one = scrape_samples(metrics, ("sluice_adapter_batch_size_count", ""), ("sluice_adapter_batch_size_bucket", '{le="1.0"}'))
        return steps - steps_of_one

    thread = threading.Thread(target=steady)
    thread.start()
    assert steady_started.wait(60)
    essay = chat("Write a long essay about mountains.", 80)
    request = inference_pb2.GenerateRequest(tenant="demo", model=essay.model, messages=essay.messages, sampling=essay.sampling)
    with grpc.insecure_channel(stack.adapter_address) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=180)
        for index, _ in enumerate(call):
            if index == 2:
                break
        assert scrape_total(metrics, SLOTS) == 2
        at_cancel = steps_of_two()
        call.cancel()
        wait_for(lambda: scrape_total(metrics, SLOTS) == 1, "the cancelled sequence's slot to be freed", poll_s=0.005)
    shared = steps_of_two() - at_cancel
    record_property("steps_shared_after_cancel", shared)
    # Both sequences shared at most the step in flight when the cancel arrived and one more.
    assert shared <= 2
    stop.set()
    thread.join(timeout=120)


# -- a deliberately tiny adapter: one sequence per batch, six waiting places --------------


@pytest.fixture(scope="module")
def overloaded_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("overload"),
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_env={
            "inference-adapter": {
                "SLUICE_ADAPTER_MAX_BATCH_SIZE": "1",
                "SLUICE_ADAPTER_MAX_WAITING": "6",
                "SLUICE_ADAPTER_INTERACTIVE_RESERVED_SLOTS": "0",
            }
        },
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def overloaded(overloaded_stack: Stack) -> Iterator[gateway_pb2_grpc.GatewayServiceStub]:
    with grpc.insecure_channel(overloaded_stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def occupy(stub) -> Callable[[], None]:
    """A long stream that holds the only slot, started and producing tokens; returns its release.

    Far longer than any test needs: the tests release it once what they set up behind it is in place.
    """
    streaming = threading.Event()
    call = stub.Generate(chat("Write a long story about a river.", 1000), metadata=auth(), timeout=300)

    def run() -> None:
        try:
            for response in call:
                if response.text:
                    streaming.set()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.CANCELLED:
                raise

    thread = threading.Thread(target=run)
    thread.start()
    assert streaming.wait(60)

    def release() -> None:
        call.cancel()
        thread.join(timeout=60)

    return release


def test_the_queue_bound_rejects_with_retry_info(overloaded, overloaded_stack: Stack) -> None:
    release_blocker = occupy(overloaded)
    outcomes: list[grpc.RpcError | str] = []

    def queued() -> None:
        try:
            outcomes.append(text_of(overloaded, chat("Say hi.", 2)))
        except grpc.RpcError as error:
            outcomes.append(error)

    waiting = [threading.Thread(target=queued) for _ in range(6)]
    for thread in waiting:
        thread.start()
    adapter = overloaded_stack.metrics_url("inference-adapter")
    wait_for(lambda: waiting_requests(adapter) == {"interactive": 6, "bulk": 0}, "six requests waiting", timeout_s=30)
    with pytest.raises(grpc.RpcError) as caught:
        text_of(overloaded, chat("One too many.", 2))
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(error)
    retry = error_details_pb2.RetryInfo()
    assert any(detail.Unpack(retry) for detail in status.details)
    assert retry.retry_delay.ToNanoseconds() > 0
    release_blocker()
    for thread in waiting:
        thread.join(timeout=300)
    assert all(isinstance(o, str) for o in outcomes), "the six queued requests must all be served"


def test_interactive_before_bulk_and_tenants_take_turns(overloaded, overloaded_stack: Stack) -> None:
    release_blocker = occupy(overloaded)
    admitted: list[str] = []
    lock = threading.Lock()

    def run(name: str, request: gateway_pb2.GenerateRequest, key: str) -> None:
        for response in overloaded.Generate(request, metadata=auth(key), timeout=300):
            if response.text:
                with lock:
                    if name not in admitted:
                        admitted.append(name)

    plan = [(f"bulk{i}", chat("Say hi.", 2, types_pb2.PRIORITY_CLASS_BULK), "sk-sluice-demo") for i in range(2)]
    plan += [(f"noisy{i}", chat("Say hi.", 2), "sk-sluice-demo") for i in range(3)]
    plan += [("quiet", chat("Say hi.", 2), "sk-sluice-private")]
    threads = []
    for name, request, key in plan:  # queued in this order behind the blocker
        thread = threading.Thread(target=run, args=(name, request, key))
        thread.start()
        threads.append(thread)
        time.sleep(0.1)
    # One scrape showing all six waiting at once: from here the adapter's choice, not arrival order,
    # decides who goes next.
    adapter = overloaded_stack.metrics_url("inference-adapter")
    wait_for(lambda: waiting_requests(adapter) == {"interactive": 4, "bulk": 2}, "all six waiting together", timeout_s=30)
    release_blocker()
    for thread in threads:
        thread.join(timeout=300)
    # Every interactive request before any bulk one, although the bulk ones queued first.
    assert all(admitted.index(f"bulk{i}") > admitted.index("quiet") for i in range(2))
    assert max(admitted.index(f"noisy{i}") for i in range(3)) < min(admitted.index(f"bulk{i}") for i in range(2))
    # The quiet tenant's one request waits for one of the noisy tenant's three, not all of them.
    assert admitted.index("quiet") <= 1
