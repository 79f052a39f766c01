"""Rolling restarts lose nothing (issue 13): a service told to stop (SIGTERM) turns NOT_SERVING,
takes no new work, lets the streams it accepted finish and flushes their completion events; the
launcher's keeper starts it again while the rest keep serving. An owner task that dies (a fault
injected into the scheduler) turns health NOT_SERVING at once and fails its waiting calls."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2_grpc
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import MODEL, auth, chat, read_store, wait_for
from sluice_stack import ServiceProcess, Stack
from sluice_stack.keeper import ServiceKeeper

STREAMS = 6
MAX_TOKENS = 64


@dataclass
class StreamRun:
    """One gateway stream on its own thread: its first token, its end, or its error."""

    index: int
    request_id: str = ""
    first_token: threading.Event = field(default_factory=threading.Event)
    finish_reason: int = 0
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, address: str) -> None:
        try:
            with grpc.insecure_channel(address) as channel:
                stub = gateway_pb2_grpc.GatewayServiceStub(channel)
                request = chat(f"Tell a long story about river number {self.index}.", MAX_TOKENS)
                for response in stub.Generate(request, metadata=auth(), timeout=240):
                    self.request_id = self.request_id or response.request_id
                    if response.text:
                        self.first_token.set()
                    if response.finish_reason:
                        self.finish_reason = response.finish_reason
        except grpc.RpcError as error:
            self.error = f"{error.code().name}: {error.details()}"
        finally:
            self.done.set()
            self.first_token.set()  # no token is coming: whoever waits for one reads `error`


def serves_a_stream(address: str) -> bool:
    """One short stream through the gateway ends with a finish reason."""
    run = StreamRun(0)
    run.run(address)
    return not run.error and run.finish_reason != 0


def start_streams(address: str, count: int = STREAMS) -> list[StreamRun]:
    runs = [StreamRun(index) for index in range(count)]
    for run in runs:
        threading.Thread(target=run.run, args=(address,), daemon=True).start()
    for run in runs:
        assert run.first_token.wait(120) and not run.error, f"stream {run.index} got no token: {run.error}"
    return runs


def stored_request_ids(stack: Stack, request_ids: set[str]) -> set[str]:
    with read_store(stack, "evallog.sqlite3") as db:
        marks = ",".join("?" * len(request_ids))
        return {row[0] for row in db.execute(f"SELECT request_id FROM records WHERE request_id IN ({marks})", tuple(request_ids))}


def serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def restart_with_keeper(service: ServiceProcess, address: str, said: list[str]) -> None:
    """The keeper sees the exit and starts the service again; it is SERVING once more."""
    keeper = ServiceKeeper([service], said.append, first_backoff_s=0.1)
    deadline = time.monotonic() + 240
    while not (service.process is not None and service.process.poll() is None and serving(address)):
        assert time.monotonic() < deadline, f"{service.name} did not come back:\n{service.log_tail()}"
        keeper.poll()
        time.sleep(0.2)
    keeper.poll()
    assert keeper.restarted[service.name] == 1
    assert any(f"{service.name} exited with code 0" in line for line in said), said


def assert_every_stream_finished_and_was_logged(stack: Stack, runs: list[StreamRun]) -> None:
    for run in runs:
        assert run.done.wait(240), f"stream {run.index} never ended"
    assert [run.error for run in runs if run.error] == []
    assert all(run.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH) for run in runs)
    request_ids = {run.request_id for run in runs}
    wait_for(lambda: stored_request_ids(stack, request_ids) == request_ids, "every completion event stored", timeout_s=90, poll_s=0.5)


@pytest.mark.parametrize("name", ["gateway", "inference-adapter"])
def test_sigterm_under_load_finishes_accepted_streams_and_loses_no_event(stack: Stack, name: str) -> None:
    service = stack.service(name)
    address = stack.gateway_address if name == "gateway" else stack.adapter_address
    runs = start_streams(stack.gateway_address)
    service.terminate()
    wait_for(lambda: not serving(address), f"{name} NOT_SERVING after SIGTERM", timeout_s=2)
    assert_every_stream_finished_and_was_logged(stack, runs)
    assert service.process is not None and service.process.wait(30) == 0, service.log_tail()
    said: list[str] = []
    restart_with_keeper(service, address, said)
    # The gateway's channel reconnects to a restarted adapter within its 2 s backoff.
    wait_for(lambda: serves_a_stream(stack.gateway_address), "a stream served after the restart", timeout_s=30, poll_s=0.5)


def test_a_killed_evaluation_logging_is_restarted_and_the_events_meanwhile_are_stored(stack: Stack) -> None:
    service = stack.service("evaluation-logging")
    service.kill()
    runs = start_streams(stack.gateway_address, 4)
    said: list[str] = []
    keeper = ServiceKeeper([service], said.append, first_backoff_s=0.1)
    wait_for(lambda: (keeper.poll(), serving(stack.evallog_address))[1], "evaluation-logging back", timeout_s=120, poll_s=0.2)
    assert any("evaluation-logging exited with code -9" in line for line in said), said
    assert_every_stream_finished_and_was_logged(stack, runs)


@pytest.fixture
def faulty_adapter(stack: Stack) -> Iterator[tuple[ServiceProcess, str]]:
    """A second adapter on the stack's Triton whose generation scheduler SIGUSR1 fails."""
    service, address, _ = stack.add_adapter("adapter-fault", env={"SLUICE_FAULT_INJECTION": "generation-scheduler"})
    yield service, address
    service.stop()
    stack.services.remove(service)


def test_a_scheduler_killed_by_a_fault_turns_health_not_serving_and_fails_its_calls(
    faulty_adapter, record_property: Callable[[str, object], None]
) -> None:  # type: ignore[no-untyped-def]
    service, address = faulty_adapter
    outcomes: list[str] = []
    first_tokens = threading.Semaphore(0)

    def generate(index: int) -> None:
        request = inference_pb2.GenerateRequest(
            request_id=f"fault-{index}", tenant="demo", model=MODEL,
            messages=[types_pb2.ChatMessage(role="user", content=f"Count slowly to {index + 200}.")],
            sampling=types_pb2.SamplingParams(max_tokens=400),
        )  # fmt: skip
        try:
            with grpc.insecure_channel(address) as channel:
                for response in inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, timeout=120):
                    if response.text and index not in seen:
                        seen.add(index)
                        first_tokens.release()
            outcomes.append("finished")
        except grpc.RpcError as error:
            outcomes.append(error.code().name)
            first_tokens.release()

    seen: set[int] = set()
    threads = [threading.Thread(target=generate, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert first_tokens.acquire(timeout=120)
    assert service.process is not None
    service.process.send_signal(signal.SIGUSR1)
    injected = time.monotonic()
    wait_for(lambda: not serving(address), "NOT_SERVING after the scheduler died", timeout_s=1.0, poll_s=0.02)
    for thread in threads:
        thread.join(5)
    record_property("streams_ended_s", round(time.monotonic() - injected, 3))
    assert outcomes == ["UNAVAILABLE"] * 3 and time.monotonic() - injected < 5
    wait_for(lambda: serving(address), "SERVING again once the scheduler restarted", timeout_s=30)
    assert "owner_task_died" in service.log_tail(200)
