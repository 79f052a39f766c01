"""The similarity evaluators' Embedder: the adapter's InferenceService.Embed over gRPC.

Every call asks for truncation (vLLM's `truncate_prompt_tokens` -1): a prompt, output or reference
longer than the embedding model's maximum input (all-MiniLM-L6-v2: 256 tokens) is embedded from its
first tokens, as the scores always were, where the adapter refuses such a text (INVALID_ARGUMENT)
to a caller that does not ask, and one long text would fail the whole call of a claim's events.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from sluice.common.v1 import types_pb2
from sluice.inference.v1 import inference_pb2, inference_pb2_grpc

from sluice_common.channels import open_channel
from sluice_common.config import ClientTLS
from sluice_evaluation_logging.evaluators.base import EmbeddingsTimedOut, EmbeddingsUnavailable

# vLLM's truncate_prompt_tokens value for "cut each text at the model's maximum input".
TRUNCATE_TO_THE_MODELS_MAXIMUM = -1
# The adapter does not serve embeddings: waiting would not help.
_NOT_SERVED = (grpc.StatusCode.UNIMPLEMENTED,)
# The adapter (or its backend) cannot answer now (down, or its queue is full): try again later.
_NOT_NOW = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# No answer within the deadline: maybe later, maybe only for fewer texts per call (the caller decides).
_TOO_SLOW = (grpc.StatusCode.DEADLINE_EXCEEDED,)


class AdapterEmbedder:
    def __init__(self, adapter_url: str, model: str, timeout_s: float, tls: ClientTLS | None = None) -> None:
        self._channel = open_channel(adapter_url, tls)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)
        self._model = model
        self._timeout_s = timeout_s

    async def embed(self, texts: Sequence[str]) -> list[list[float]]:
        request = inference_pb2.EmbedRequest(
            request_id="evallog-similarity",
            tenant="sluice-evallog",
            model=self._model,
            inputs=list(texts),
            priority_class=types_pb2.PRIORITY_CLASS_BULK,  # background work: never ahead of users
            truncate_prompt_tokens=TRUNCATE_TO_THE_MODELS_MAXIMUM,
        )
        try:
            response = await self._stub.Embed(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _NOT_SERVED:
                raise EmbeddingsUnavailable(exc.code().name, retryable=False) from None
            if exc.code() in _TOO_SLOW:
                raise EmbeddingsTimedOut(exc.code().name) from None
            if exc.code() in _NOT_NOW:
                raise EmbeddingsUnavailable(exc.code().name, retryable=True) from None
            raise
        if len(response.embeddings) != len(texts):
            raise ValueError(f"Embed returned {len(response.embeddings)} vectors for {len(texts)} inputs")
        return [list(embedding.values) for embedding in response.embeddings]

    async def close(self) -> None:
        await self._channel.close()
