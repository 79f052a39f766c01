"""What a model behind Triton's vLLM backend streams: one GeneratedChunk per response, read from the
backend's outputs by triton_backend.TritonGenerateBackend and relayed by passthrough.PassthroughScheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GeneratedChunk:
    """One streamed response of the engine."""

    text: str
    # Tokens generated since the previous response.
    output_tokens: int
    # The prompt's tokens, as the engine counted them (None when this response does not say).
    input_tokens: int | None
    # None while the sequence runs; then the engine's reason: "stop", "length" or "abort".
    finish_reason: str | None
    # The tokens' log-probabilities in the chat shape (sluice_common.logprobs), when asked for.
    logprobs: tuple[dict[str, Any], ...] = ()
