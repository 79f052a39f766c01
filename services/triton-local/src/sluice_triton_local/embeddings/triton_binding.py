"""Serves a sentence encoder from triton-local's real Triton (through PyTriton).

The model speaks interface.py's TEXT -> EMBEDDING, TOKENS, UNTRUNCATED_TOKENS, one Triton request
per adapter micro-batch.

Triton does no batching of its own here (`batching=False`): the adapter's micro-batcher already
sends each request as a whole batch.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

import numpy as np

from sluice_triton_local.embeddings.interface import INPUT_NAME, OUTPUT_NAME, TOKENS_NAME, UNTRUNCATED_TOKENS_NAME, decode_texts
from sluice_triton_local.embeddings.minilm import EMBEDDING_DIM, EncodedTexts
from sluice_triton_local.metrics import EMBED_BATCH, EMBED_SECONDS, EMBED_TEXTS


class Encoder(Protocol):
    def encode_counted(self, texts: list[str]) -> EncodedTexts:
        """float32 [n, dim] vectors, and int [n] token counts after and before truncation, from one
        tokenization pass."""
        ...


class EmbeddingModel:
    """The inference callable PyTriton calls; one encoder forward per Triton request."""

    def __init__(self, encoder: Encoder, dim: int = EMBEDDING_DIM) -> None:
        self._encoder = encoder
        self._dim = dim
        # Requests run one at a time: each forward already fills the BLAS threads, and
        # concurrent forwards would only oversubscribe them.
        self._lock = threading.Lock()

    def __call__(self, requests: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        responses = []
        for request in requests:
            texts = decode_texts(request[INPUT_NAME])
            with self._lock:
                started = time.perf_counter()
                if texts:
                    vectors, counts, untruncated = self._encoder.encode_counted(texts)
                else:
                    vectors, counts, untruncated = np.zeros((0, self._dim), np.float32), np.zeros(0, np.int32), np.zeros(0, np.int32)
                EMBED_SECONDS.observe(time.perf_counter() - started)
            EMBED_TEXTS.inc(len(texts))
            EMBED_BATCH.observe(len(texts))
            responses.append(
                {
                    OUTPUT_NAME: np.ascontiguousarray(vectors, dtype=np.float32).reshape(len(texts), self._dim),
                    TOKENS_NAME: np.ascontiguousarray(counts, dtype=np.int32).reshape(len(texts)),
                    UNTRUNCATED_TOKENS_NAME: np.ascontiguousarray(untruncated, dtype=np.int32).reshape(len(texts)),
                }
            )
        return responses


def bind_embedding_model(triton: Any, name: str, encoder: Encoder) -> None:
    from pytriton.model_config import ModelConfig, Tensor

    dim = int(getattr(encoder, "dim", EMBEDDING_DIM))
    triton.bind(
        model_name=name,
        infer_func=EmbeddingModel(encoder, dim),
        inputs=[Tensor(name=INPUT_NAME, dtype=bytes, shape=(-1,))],
        outputs=[
            Tensor(name=OUTPUT_NAME, dtype=np.float32, shape=(-1, dim)),
            Tensor(name=TOKENS_NAME, dtype=np.int32, shape=(-1,)),
            Tensor(name=UNTRUNCATED_TOKENS_NAME, dtype=np.int32, shape=(-1,)),
        ],
        # The adapter does the batching: every request already is a whole micro-batch.
        config=ModelConfig(batching=False, max_batch_size=0),
        strict=True,
    )
