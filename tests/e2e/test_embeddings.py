"""Embeddings through gateway and adapter into triton-local's all-MiniLM-L6-v2, micro-batched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from sluice.gateway.v1 import gateway_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from conftest import EMBEDDING_MODEL, auth, scrape


def embed(gateway, texts: list[str]) -> np.ndarray:
    reply = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
    assert reply.model == EMBEDDING_MODEL and reply.request_id
    return np.array([list(e.values) for e in reply.embeddings], dtype=np.float32)


def test_vectors_are_normalized_384d_and_mean_something(gateway) -> None:
    vectors = embed(gateway, ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2


@contextlib.contextmanager
def own_adapter(stack, name: str, env: dict[str, str]) -> Iterator[tuple[inference_pb2_grpc.InferenceServiceStub, str]]:  # type: ignore[no-untyped-def]
    """An adapter of its own on the stack's Triton: nothing else (evaluation-logging's similarity
    scoring embeds through the stack's adapter) lands in its batches or its cache."""
    service, address, metrics = stack.add_adapter(name, env=env)
    try:
        with grpc.insecure_channel(address) as channel:
            yield inference_pb2_grpc.InferenceServiceStub(channel), metrics
    finally:
        service.stop()
        stack.services.remove(service)


@pytest.fixture(scope="module")
def uncached_adapter(stack) -> Iterator[tuple[inference_pb2_grpc.InferenceServiceStub, str]]:  # type: ignore[no-untyped-def]
    """Its cache off: the same text embedded twice is computed twice."""
    with own_adapter(stack, "adapter-uncached", {"SLUICE_ADAPTER_EMBED_CACHE_BYTES": "0"}) as adapter:
        yield adapter


@pytest.fixture(scope="module")
def cached_adapter(stack) -> Iterator[tuple[inference_pb2_grpc.InferenceServiceStub, str]]:  # type: ignore[no-untyped-def]
    """Its cache on, with the default budget."""
    with own_adapter(stack, "adapter-cached", {}) as adapter:
        yield adapter


def adapter_embed(adapter: inference_pb2_grpc.InferenceServiceStub, text: str) -> np.ndarray:
    reply = adapter.Embed(inference_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=[text], tenant="demo"), timeout=60)
    return np.array(list(reply.embeddings[0].values), dtype=np.float32)


def test_concurrent_requests_share_batches_and_keep_their_order(uncached_adapter) -> None:  # type: ignore[no-untyped-def]
    adapter, metrics = uncached_adapter
    batches_before = scrape(metrics, "sluice_adapter_embed_batch_texts_count")
    texts_before = scrape(metrics, "sluice_adapter_embed_batch_texts_sum")
    alone = {i: adapter_embed(adapter, f"sentence number {i}") for i in range(16)}
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda i: adapter_embed(adapter, f"sentence number {i}"), range(16)))
    batches = scrape(metrics, "sluice_adapter_embed_batch_texts_count") - batches_before
    texts = scrape(metrics, "sluice_adapter_embed_batch_texts_sum") - texts_before
    # Same vector whether batched with others or sent alone.
    for i, vector in enumerate(together):
        assert np.allclose(vector, alone[i], atol=1e-5)
    assert texts == 32
    # The 16 sequential calls took 16 batches; the 16 concurrent ones shared fewer.
    assert batches < 32


def test_a_repeated_text_is_answered_from_the_cache_with_the_same_vector(cached_adapter) -> None:  # type: ignore[no-untyped-def]
    adapter, metrics = cached_adapter
    text = "A cached sentence about the river Loire, embedded twice."

    def counts() -> tuple[float, float, float]:
        return tuple(scrape(metrics, name) for name in (  # type: ignore[return-value]
            "sluice_adapter_embed_cache_hits_total", "sluice_adapter_embed_cache_misses_total", "sluice_adapter_embed_batch_texts_sum"
        ))  # fmt: skip

    before = counts()
    first = adapter_embed(adapter, text)
    after_first = counts()
    second = adapter_embed(adapter, text)
    after_second = counts()
    assert np.array_equal(first, second)
    assert [b - a for a, b in zip(before, after_first)] == [0, 1, 1]  # a miss, computed by Triton
    assert [b - a for a, b in zip(after_first, after_second)] == [1, 0, 0]  # a hit, Triton not asked
    assert scrape(metrics, "sluice_adapter_embed_cache_bytes") > 0


def test_usage_counts_the_tokens_the_model_processed(gateway) -> None:
    short, long = "A man is eating food.", "The girl is carrying a baby on her back through the crowded market."

    def usage(texts: list[str]):
        reply = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
        assert reply.HasField("usage") and len(reply.embeddings) == len(texts)
        return reply.usage

    alone_short, alone_long, both = usage([short]), usage([long]), usage([short, long])
    # WordPiece: [CLS] a man is eating food . [SEP]
    assert alone_short.prompt_tokens == 8
    assert alone_long.prompt_tokens > alone_short.prompt_tokens
    assert both.prompt_tokens == alone_short.prompt_tokens + alone_long.prompt_tokens
    assert both.total_tokens == both.prompt_tokens and both.completion_tokens == 0


def test_an_input_over_the_models_256_tokens_is_refused_not_embedded_cut(gateway) -> None:
    """all-MiniLM-L6-v2 reads at most 256 tokens: a longer text was embedded cut to them and
    answered OK, its usage capped at 256. OpenAI and vLLM refuse it; so does Sluice now."""
    texts = ["A man is eating food.", "word " * 300]  # the second: 302 tokens with [CLS] and [SEP]
    with pytest.raises(grpc.RpcError) as caught:
        gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("inputs[1]: This model's maximum context length is 256 tokens. However, you requested 302 tokens")
    at_the_limit = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=["word " * 254]), metadata=auth(), timeout=60)
    assert at_the_limit.usage.prompt_tokens == 256 and len(at_the_limit.embeddings) == 1


def test_an_input_over_the_models_256_tokens_is_embedded_cut_when_the_request_asks(gateway) -> None:
    """vLLM's truncate_prompt_tokens -1 (evaluation-logging's similarity scoring sets it): the text
    is embedded from its first 256 tokens, usage counting those; the cut vector is not cached, so a
    request that does not ask is still refused the same text."""
    texts = ["A man is eating food.", "word " * 300]
    cut = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts, truncate_prompt_tokens=-1), metadata=auth(), timeout=60)
    assert cut.usage.prompt_tokens == 8 + 256 and len(cut.embeddings) == 2
    first_256 = embed(gateway, ["word " * 254])[0]  # [CLS], 254 words, [SEP]: what the cut kept
    np.testing.assert_allclose(np.array(cut.embeddings[1].values, dtype=np.float32), first_256, atol=1e-5)
    with pytest.raises(grpc.RpcError) as caught:
        gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("inputs[1]")
    with pytest.raises(grpc.RpcError) as caught:
        gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts, truncate_prompt_tokens=100), metadata=auth(), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("truncate_prompt_tokens")


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [(dict(model=EMBEDDING_MODEL, inputs=[]), "inputs"), (dict(model="smollm2-135m-instruct", inputs=["x"]), "model")],
)
def test_embedding_validation(gateway, request_kwargs, field) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        gateway.Embed(gateway_pb2.EmbedRequest(**request_kwargs), metadata=auth(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field)
