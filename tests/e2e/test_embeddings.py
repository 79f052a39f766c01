"""Embeddings through gateway and adapter into triton-local's all-MiniLM-L6-v2, micro-batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from sluice.gateway.v1 import gateway_pb2

from conftest import EMBEDDING_MODEL, auth, read_store, scrape, wait_for


def embed(gateway, texts: list[str]) -> np.ndarray:
    reply = gateway.Embed(gateway_pb2.EmbedRequest(model=EMBEDDING_MODEL, inputs=texts), metadata=auth(), timeout=60)
    assert reply.model == EMBEDDING_MODEL and reply.request_id
    return np.array([list(e.values) for e in reply.embeddings], dtype=np.float32)


def test_vectors_are_normalized_384d_and_mean_something(gateway) -> None:
    vectors = embed(gateway, ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."])
    assert vectors.shape == (3, 384)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.2


def test_concurrent_requests_share_batches_and_keep_their_order(gateway, stack) -> None:
    metrics = stack.metrics_url("inference-adapter")
    for _ in range(5):
        # evaluation-logging embeds a sample of completions through the same adapter: measure while
        # it has nothing to score and takes in nothing new, else measure again.
        wait_for(lambda: evallog_backlog(stack)[1] == 0, "evaluation-logging's deferred scores", timeout_s=60)
        quiet_before = evallog_backlog(stack)
        batches_before = scrape(metrics, "sluice_adapter_embed_batch_texts_count")
        texts_before = scrape(metrics, "sluice_adapter_embed_batch_texts_sum")
        alone = {i: embed(gateway, [f"sentence number {i}"])[0] for i in range(16)}
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda i: embed(gateway, [f"sentence number {i}"])[0], range(16)))
        batches = scrape(metrics, "sluice_adapter_embed_batch_texts_count") - batches_before
        texts = scrape(metrics, "sluice_adapter_embed_batch_texts_sum") - texts_before
        if quiet_before[1] == 0 and evallog_backlog(stack) == quiet_before:
            break
    else:
        raise AssertionError("evaluation-logging never stayed quiet for one measurement")
    # Same vector whether batched with others or sent alone.
    for i, vector in enumerate(together):
        assert np.allclose(vector, alone[i], atol=1e-5)
    assert texts == 32
    # The 16 sequential calls took 16 batches; the 16 concurrent ones shared fewer.
    assert batches < 32


def evallog_backlog(stack) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(records stored, deferred scores still to compute) in evaluation-logging's SQLite store."""
    with read_store(stack, "evallog.sqlite3") as db:
        records = db.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        pending = db.execute("SELECT COUNT(*) FROM pending_scores").fetchone()[0]
    return records, pending


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


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [(dict(model=EMBEDDING_MODEL, inputs=[]), "inputs"), (dict(model="smollm2-135m-instruct", inputs=["x"]), "model")],
)
def test_embedding_validation(gateway, request_kwargs, field) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        gateway.Embed(gateway_pb2.EmbedRequest(**request_kwargs), metadata=auth(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(field)
