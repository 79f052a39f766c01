"""Helpers and fixtures shared by triton-local's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnxruntime as ort
import pytest

from sluice_triton_local.embeddings.minilm import MiniLMEncoder


# The ONNX export against the numpy encoder (test_onnx_export.py, test_triton_embed_gpu.py).
# Measured: 2.3e-7 at most over these texts (onnxruntime 1.32, x86-64). The numpy encoder's erf
# is an approximation good to 1.5e-7 and the matmuls sum in another order: 1e-6 leaves room for
# other CPUs' kernels and stays far below a subtly wrong graph (measured: the tanh GELU instead
# of erf 2.3e-4, LayerNorm eps 1e-5 instead of 1e-12 1.5e-4).
ONNX_MAX_ABS_DIFF = 1e-6

MINILM_TEXTS = [
    "A man is eating food.",
    "hi",
    "Ünïcödé tëxt, 中文, and an emoji 🙂.",
    # Over 256 tokens: truncated by the tokenizer, so the graph sees 256 positions.
    "The quick brown fox jumps over the lazy dog. " * 40,
    "Two men pushed carts through the woods while a woman played the violin nearby.",
]


@pytest.fixture(scope="session")
def minilm_encoder() -> MiniLMEncoder:
    return MiniLMEncoder()


@pytest.fixture(scope="session")
def minilm_onnx_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 exported once per run by the command the image build runs (90 MB)."""
    from sluice_triton_local.embeddings.onnx_export import main

    path = tmp_path_factory.mktemp("minilm_onnx") / "1" / "model.onnx"
    main([str(path)])
    return path


@pytest.fixture(scope="session")
def minilm_onnx_session(minilm_onnx_path: Path) -> ort.InferenceSession:
    """onnxruntime on the CPU, two threads (the CI machines' cores; more would only contend)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(str(minilm_onnx_path), options, providers=["CPUExecutionProvider"])


def recorded_logits(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every forward pass's logits of a StepEngine from now on (the engine samples its rows from
    them), a copy of each, until the test ends."""
    seen: list[Any] = []
    forward = engine._model.forward

    def recording(items: list[Any], interruptible: bool = False) -> Any:
        out = forward(items, interruptible)
        seen.append(out.copy())
        return out

    monkeypatch.setattr(engine._model, "forward", recording)
    return seen
