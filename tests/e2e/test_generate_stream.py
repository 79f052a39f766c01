"""A completion streamed from a gRPC client through gateway and adapter to a real Triton."""

from __future__ import annotations

import time

import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import MODEL, auth

from sluice_stack import VARIANT_MODEL


def chat(question: str, max_tokens: int = 24, **sampling: object) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=question)],
        sampling=types_pb2.SamplingParams(max_tokens=max_tokens, **sampling),
    )


def test_streams_paris_as_it_is_made(gateway) -> None:
    started = time.perf_counter()
    arrivals, texts, responses = [], [], []
    for response in gateway.Generate(chat("Which city is the capital of France?"), metadata=auth(), timeout=120):
        responses.append(response)
        if response.text:
            arrivals.append(time.perf_counter() - started)
            texts.append(response.text)
    answer = "".join(texts)
    assert "Paris" in answer
    # The first token comes ahead of the rest, not in one piece at the end (a short greedy answer
    # from a cached prompt can be made within two stream intervals, so it may come in two pieces).
    assert len(arrivals) >= 2
    assert arrivals[-1] - arrivals[0] > 0.02
    final = responses[-1]
    assert final.finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
    assert all(r.finish_reason == types_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    assert final.usage.prompt_tokens > 10
    assert final.usage.completion_tokens >= len(texts)
    assert final.usage.total_tokens == final.usage.prompt_tokens + final.usage.completion_tokens
    assert 0 < final.timings.time_to_first_token_ms <= final.timings.total_time_ms
    assert len({r.request_id for r in responses}) == 1 and responses[0].request_id


def test_a_long_answer_streams_in_pieces(gateway) -> None:
    """Steps of a round share a response for up to the adapter's stream interval (50 ms): 48
    tokens take several intervals even on a quiet box (an engine step is 7 ms or more here), so
    they arrive in several pieces, not in one at the end."""
    started = time.perf_counter()
    arrivals = []
    for response in gateway.Generate(chat("Write a long essay about the history of Rome.", max_tokens=48), metadata=auth(), timeout=120):
        if response.text:
            arrivals.append(time.perf_counter() - started)
    assert len(arrivals) >= 3
    assert arrivals[-1] - arrivals[0] > 0.1


def test_max_tokens_ends_with_length(gateway) -> None:
    responses = list(gateway.Generate(chat("Write a long essay about the history of Rome.", max_tokens=5), metadata=auth(), timeout=60))
    assert responses[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert responses[-1].usage.completion_tokens == 5


def test_raw_prompt_and_stop_sequence(gateway) -> None:
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        prompt="<|im_start|>user\nList three colors, one per line.<|im_end|>\n<|im_start|>assistant\n",
        sampling=types_pb2.SamplingParams(max_tokens=40, stop=["\n"]),
    )
    responses = list(gateway.Generate(request, metadata=auth(), timeout=60))
    text = "".join(r.text for r in responses)
    assert "\n" not in text
    assert responses[-1].finish_reason == types_pb2.FINISH_REASON_STOP


def test_seeded_sampling_is_reproducible(gateway) -> None:
    def run(seed: int) -> str:
        request = chat("Tell me a short story.", max_tokens=12, temperature=1.0, seed=seed)
        return "".join(r.text for r in gateway.Generate(request, metadata=auth(), timeout=60))

    assert run(7) == run(7)


def test_request_id_follows_the_request(gateway, stack) -> None:
    call = gateway.Generate(chat("Hi", max_tokens=2), metadata=(*auth(), ("x-request-id", "e2e-rid-42")), timeout=60)
    list(call)
    assert ("x-request-id", "e2e-rid-42") in call.initial_metadata()
    deadline = time.monotonic() + 5
    while "e2e-rid-42" not in stack.service("inference-adapter").log_path.read_text():
        assert time.monotonic() < deadline, "the adapter never logged the gateway's request id"
        time.sleep(0.1)
    assert "e2e-rid-42" in stack.service("gateway").log_path.read_text()


def test_list_models(gateway) -> None:
    response = gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=auth(), timeout=10)
    models = {m.name: m for m in response.models}
    # The stack also serves triton-local's Q4_0 variant of the model as a second one (sluice eval).
    assert set(models) == {MODEL, VARIANT_MODEL, "all-minilm-l6-v2"}
    generation, embedding = models[MODEL], models["all-minilm-l6-v2"]
    for model in (generation, models[VARIANT_MODEL]):
        assert model.kind == types_pb2.MODEL_KIND_GENERATION
        assert model.context_length == 2048 and 0 < model.max_output_tokens < model.context_length
    assert embedding.kind == types_pb2.MODEL_KIND_EMBEDDING and embedding.embedding_dimensions == 384
    assert embedding.context_length == 256  # all-MiniLM-L6-v2's maximum input (SLUICE_ADAPTER_EMBEDDING_CONTEXT_LENGTH)


def test_an_unknown_job_is_not_found(gateway) -> None:
    # The job RPCs are served since issue 6 (tests in test_jobs.py).
    try:
        gateway.GetJob(gateway_pb2.GetJobRequest(job_id="x"), metadata=auth(), timeout=10)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
    else:
        raise AssertionError("GetJob answered")
