"""Issue 25 on the real stack: the sampling options reach the engine from every front (the OpenAI HTTP
API, the gRPC API, a bulk job row) and change what it samples; a logit_bias token outside the
model's vocabulary, which only the engine knows, comes back as a client error naming logit_bias."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import openai
import pytest
from google.protobuf import json_format
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack
from test_jobs import all_results, wait_job

# SmolLM2's token " banana" (a single token of its 49,152): a +100 bias makes it every token sampled.
BANANA = 21285
VOCABULARY = 49152
QUESTION = "Which city is the capital of France?"
STORY = "Tell me a short story about a lighthouse."


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def grpc_text(gateway: Any, sampling: types_pb2.SamplingParams, question: str = QUESTION) -> str:
    request = gateway_pb2.GenerateRequest(model=MODEL, messages=[types_pb2.ChatMessage(role="user", content=question)], sampling=sampling)
    return "".join(r.text for r in gateway.Generate(request, metadata=auth(), timeout=120))


def openai_text(client: openai.OpenAI, question: str = QUESTION, **options: Any) -> str:
    extra = {name: options.pop(name) for name in ("top_k", "min_p", "repetition_penalty") if name in options}
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}], extra_body=extra or None, **options)
    return reply.choices[0].message.content or ""


def test_logit_bias_forces_a_token_through_both_fronts(client: openai.OpenAI, gateway: Any) -> None:
    assert openai_text(client, max_tokens=4, temperature=0, logit_bias={str(BANANA): 100}) == " banana" * 4
    assert grpc_text(gateway, types_pb2.SamplingParams(max_tokens=4, logit_bias={BANANA: 100.0})) == " banana" * 4
    # Sampled rather than greedy, the bias still decides.
    assert openai_text(client, max_tokens=3, temperature=1.0, seed=5, logit_bias={str(BANANA): 100}) == " banana" * 3


def test_the_same_seed_gives_the_same_text_on_both_fronts(client: openai.OpenAI, gateway: Any) -> None:
    """Every option at once, sampled: the same seed answers the same text whichever front carries it
    (so each front maps each option the same way), and another seed another text."""
    options = dict(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, presence_penalty=0.5, frequency_penalty=0.25,
                   top_k=50, min_p=0.02, repetition_penalty=1.1)  # fmt: skip
    first = openai_text(client, STORY, **dict(options))
    assert first and openai_text(client, STORY, **dict(options)) == first
    sampling = types_pb2.SamplingParams(**options)  # type: ignore[arg-type]
    assert grpc_text(gateway, sampling, STORY) == first
    assert openai_text(client, STORY, **{**options, "seed": 4321}) != first


def test_the_same_seed_gives_the_same_text_alone_and_under_load(client: openai.OpenAI) -> None:
    """Issue 25's acceptance: a seeded sampled request answers the same text whether it runs alone
    (batch 1) or in a batch beside other sampled requests (each sequence draws from its own stream;
    llama.cpp's CPU logits do not depend on the batch)."""
    options = dict(max_tokens=24, temperature=1.0, seed=99)
    alone = openai_text(client, STORY, **dict(options))
    others = ["Describe a storm at sea.", "Write a recipe for bread.", "Explain how bees make honey.", "Tell a joke about cats.", "List five rivers."]
    with ThreadPoolExecutor(max_workers=len(others) + 1) as pool:
        busy = [pool.submit(openai_text, client, question, max_tokens=32, temperature=1.0) for question in others]
        under_load = pool.submit(openai_text, client, STORY, **dict(options))
        assert all(f.result() for f in busy)
    assert under_load.result() == alone


def test_penalties_change_what_greedy_decoding_repeats(client: openai.OpenAI) -> None:
    plain = openai_text(client, "Count from 1 to 10.", max_tokens=24, temperature=0)
    penalised = openai_text(client, "Count from 1 to 10.", max_tokens=24, temperature=0, repetition_penalty=1.5)
    assert plain.count("\n") >= 3 and penalised != plain


def test_a_token_outside_the_vocabulary_is_refused_naming_logit_bias(client: openai.OpenAI, gateway: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_text(client, max_tokens=2, logit_bias={str(VOCABULARY): 5})
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == "logit_bias" and str(VOCABULARY) in error["message"]  # type: ignore[index]
    with pytest.raises(grpc.RpcError) as refused:
        grpc_text(gateway, types_pb2.SamplingParams(max_tokens=2, logit_bias={VOCABULARY + 10: 5.0}))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    status = rpc_status.from_call(refused.value)  # type: ignore[arg-type]
    bad = error_details_pb2.BadRequest()
    assert status is not None and status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "sampling.logit_bias"
    # The engine is fine: the next request is served.
    assert grpc_text(gateway, types_pb2.SamplingParams(max_tokens=2, logit_bias={BANANA: 100.0})) == " banana" * 2


def test_out_of_range_options_are_refused_before_the_engine(client: openai.OpenAI, gateway: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_text(client, max_tokens=2, presence_penalty=2.5)
    assert caught.value.body["param"] == "presence_penalty"  # type: ignore[index]
    with pytest.raises(grpc.RpcError) as refused:
        grpc_text(gateway, types_pb2.SamplingParams(max_tokens=2, min_p=1.5))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.min_p" in refused.value.details()  # type: ignore[attr-defined]


def test_a_job_row_carries_the_options(gateway: Any) -> None:
    """A producer's JSON row (the proto's JSON mapping: logit_bias's keys are strings there too)."""
    job_id = f"sampling-{uuid.uuid4().hex[:6]}"
    job = json_format.ParseDict(
        {
            "job_id": job_id,
            "rows": [
                {"custom_id": "forced", "generate": {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                     "sampling": {"max_tokens": 3, "logit_bias": {str(BANANA): 100}}}},
                {"custom_id": "unknown-token", "generate": {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                                            "sampling": {"max_tokens": 3, "logit_bias": {str(VOCABULARY): 1}}}},
            ],
        },
        jobs_pb2.JobRequest(),
    )  # fmt: skip
    gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=job), metadata=auth(), timeout=10)
    assert wait_job(gateway, job_id).state == jobs_pb2.JOB_STATE_COMPLETED
    results = {r.custom_id: r for r in all_results(gateway, job_id)}
    assert results["forced"].output == " banana" * 3
    assert results["unknown-token"].error.code == "INVALID_ARGUMENT" and "logit_bias" in results["unknown-token"].error.message
