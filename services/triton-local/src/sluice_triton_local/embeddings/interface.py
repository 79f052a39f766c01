"""The tensors of Triton's embedding models, shared by every way triton-local's code serves them.

The adapter speaks one interface, whichever model serves it (PyTriton's numpy model in
triton_binding.py, the official image's ensemble deploy/triton/models/minilm_embed_gpu):

  input   TEXT       BYTES  [n]       UTF-8 texts (invalid bytes are replaced, not rejected)
  output  EMBEDDING  FP32   [n, 384]  L2-normalised sentence embeddings, in input order
  output  TOKENS     INT32  [n]       tokens each text was encoded to, as the model processed it
                                      ([CLS] and [SEP] included, after truncation to the model's
                                      max length): the adapter reports their sum as usage
  output  UNTRUNCATED_TOKENS  INT32  [n]  tokens each text encodes to before truncation: equal
                                      to TOKENS, but for a text longer than the model's max length
                                      (its TOKENS is then that max). The adapter refuses such a
                                      text (INVALID_ARGUMENT naming it, as OpenAI and vLLM refuse
                                      an input over the model's context) rather than answer for
                                      part of it

Only TEXT and EMBEDDING are required of a model: the adapter asks for TOKENS and
UNTRUNCATED_TOKENS only of a model that declares them (an operator's own model may report no
usage, and then no text is refused for its length: it is embedded as that model embeds it).

The GPU ensemble splits the work in two: a CPU tokenizer step (`tokenize_step`, run by
deploy/triton/models/minilm_tokenize) and the ONNX encoder, whose inputs are ENCODER_INPUTS.
Nothing here imports Triton, PyTriton or onnx: the Python backend imports it as it is.
"""

from __future__ import annotations

import numpy as np

from sluice_triton_local.embeddings.minilm import MiniLMTokenizer, pad_encodings

INPUT_NAME = "TEXT"
OUTPUT_NAME = "EMBEDDING"
TOKENS_NAME = "TOKENS"
UNTRUNCATED_TOKENS_NAME = "UNTRUNCATED_TOKENS"
# The ONNX encoder's inputs, in the names HF BERT exports use (INT64 [batch, sequence]).
ENCODER_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
TOKENIZE_OUTPUTS = (*ENCODER_INPUTS, TOKENS_NAME, UNTRUNCATED_TOKENS_NAME)


def decode_texts(values: np.ndarray) -> list[str]:
    """A Triton BYTES tensor (numpy object or bytes array) as Python strings."""
    texts = []
    for value in np.asarray(values).reshape(-1):
        if isinstance(value, (bytes, bytearray, np.bytes_)):
            texts.append(bytes(value).decode("utf-8", errors="replace"))
        else:
            texts.append(str(value))
    return texts


def tokenize_step(tokenizer: MiniLMTokenizer, text: np.ndarray) -> dict[str, np.ndarray]:
    """The tokenizer step's outputs for one TEXT tensor: the encoder's inputs, padded to the
    longest text, TOKENS (int32, what the adapter reports as usage) and UNTRUNCATED_TOKENS."""
    encodings = tokenizer.encodings(decode_texts(text))
    batch = pad_encodings(encodings)
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "token_type_ids": batch.token_type_ids,
        TOKENS_NAME: batch.counts,
        UNTRUNCATED_TOKENS_NAME: tokenizer.untruncated_counts(encodings),
    }
