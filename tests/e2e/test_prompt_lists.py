"""Issue 25 item 2 on the real stack: completions prompt lists and token-id prompts through the
official openai SDK (as vLLM's OpenAI server answers them) and the gRPC API, the engine's own
tokenizer and greedy decoding."""

from __future__ import annotations

import grpc
import openai
import pytest
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2

from conftest import DEMO_KEY, MODEL, auth
from sluice_stack import Stack

FRANCE = "The capital of France is"
# SmolLM2's tokenization of FRANCE (the engine's tokenizer, no BOS: a raw prompt gets none); the
# test checks it still is, by the text prompt's own prompt_tokens and greedy answer.
FRANCE_IDS = [504, 3575, 282, 4649, 314]
ONCE = "Once upon a time"
VOCAB_SIZE = 49152


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.openai_base_url, api_key=DEMO_KEY, max_retries=0, timeout=120)


def _greedy(client: openai.OpenAI, prompt: str | list[int]) -> tuple[str, int]:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.usage is not None
    return reply.choices[0].text, reply.usage.prompt_tokens


def test_a_prompt_list_gives_each_prompts_n_choices_in_order(client: openai.OpenAI) -> None:
    """vLLM's order: choice i x n + j is prompt i's choice j; greedy, each equals its prompt's
    single answer; the usage counts each prompt once and every choice's tokens."""
    singles = [_greedy(client, prompt) for prompt in (FRANCE, ONCE)]
    reply = client.completions.create(model=MODEL, prompt=[FRANCE, ONCE], n=2, max_tokens=8, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.text for c in reply.choices] == [singles[0][0], singles[0][0], singles[1][0], singles[1][0]]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage is not None and reply.usage.prompt_tokens == singles[0][1] + singles[1][1]
    assert 0 < reply.usage.completion_tokens <= 4 * 8


def test_a_streamed_prompt_list_with_echo_tags_every_chunk_with_its_choice(client: openai.OpenAI) -> None:
    singles = [_greedy(client, prompt)[0] for prompt in (FRANCE, ONCE)]
    stream = client.completions.create(
        model=MODEL, prompt=[FRANCE, ONCE], n=2, max_tokens=8, temperature=0, echo=True, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finished: set[int] = set()
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert texts == {0: FRANCE + singles[0], 1: FRANCE + singles[0], 2: ONCE + singles[1], 3: ONCE + singles[1]}
    assert finished == {0, 1, 2, 3} and usage is not None and usage.completion_tokens > 0


def test_a_token_id_prompt_is_prefilled_as_given(client: openai.OpenAI) -> None:
    as_text = _greedy(client, FRANCE)
    assert as_text[1] == len(FRANCE_IDS)  # the ids above are still the tokenizer's
    assert _greedy(client, FRANCE_IDS) == as_text
    # Ids that no text tokenizes to (the prompt twice over, as ids) are counted exactly too.
    text, prompt_tokens = _greedy(client, FRANCE_IDS * 2)
    assert prompt_tokens == 2 * len(FRANCE_IDS) and _greedy(client, FRANCE_IDS * 2) == (text, prompt_tokens)
    reply = client.completions.create(model=MODEL, prompt=[FRANCE_IDS, FRANCE_IDS[:3]], max_tokens=4, temperature=0)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(FRANCE_IDS) + 3
    assert [c.index for c in reply.choices] == [0, 1]


@pytest.mark.parametrize("prompt", [[1, VOCAB_SIZE], [[1], [VOCAB_SIZE + 7]]])
def test_a_token_id_outside_the_vocabulary_is_400_naming_prompt(client: openai.OpenAI, prompt: list) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert refused.value.status_code == 400
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "prompt" and "vocabulary" in body["message"], body


def test_too_many_prompts_are_400_naming_prompt(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=["x"] * 17, max_tokens=1)
    body = refused.value.body
    assert isinstance(body, dict) and body["param"] == "prompt", body


def test_grpc_takes_token_ids_and_refuses_an_id_outside_the_vocabulary(gateway) -> None:  # type: ignore[no-untyped-def]
    request = gateway_pb2.GenerateRequest(model=MODEL, prompt_token_ids=FRANCE_IDS, sampling=types_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    responses = list(gateway.Generate(request, metadata=auth(), timeout=120))
    assert responses[-1].finish_reason in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH)
    assert responses[-1].usage.prompt_tokens == len(FRANCE_IDS)
    text = "".join(r.text for r in responses)
    reply = gateway.Generate(gateway_pb2.GenerateRequest(
        model=MODEL, prompt=FRANCE, sampling=types_pb2.SamplingParams(max_tokens=8, temperature=0.0)
    ), metadata=auth(), timeout=120)  # fmt: skip
    assert "".join(r.text for r in reply) == text
    request.prompt_token_ids[1] = VOCAB_SIZE
    with pytest.raises(grpc.RpcError) as refused:
        list(gateway.Generate(request, metadata=auth(), timeout=120))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in (refused.value.details() or "")
