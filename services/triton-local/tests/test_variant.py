"""The second variant: SmolLM2's GGUF re-quantized once into the cache, then served beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_triton_local.config import TritonLocalConfig
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.shared_engine import greedy_text
from sluice_triton_local.model_files import smollm2_gguf
from sluice_triton_local.variant import QuantizeError, ensure_variant, quantize, variant_path


@pytest.fixture(scope="module")
def variant(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, made = ensure_variant(smollm2_gguf(), "Q4_0", tmp_path_factory.mktemp("cache"), threads=2)
    assert made
    return path


def greedy(path: Path, question: str, max_tokens: int = 24) -> str:
    return greedy_text(StepEngine(str(path), max_slots=1, max_context=256, threads=2), question, max_tokens)


def test_made_once_then_reused_and_named_by_quantization(variant: Path) -> None:
    assert variant.name.startswith("SmolLM2-135M-Instruct.Q4_0.") and variant.suffix == ".gguf"
    assert variant.stat().st_size > 50_000_000
    again, made = ensure_variant(smollm2_gguf(), "Q4_0", variant.parent, threads=2)
    assert again == variant and not made
    assert not list(variant.parent.glob("*.partial"))  # written under a temporary name, then renamed
    assert variant_path(smollm2_gguf(), "Q8_0", variant.parent) != variant


def test_the_variant_is_a_different_model_that_still_answers(variant: Path) -> None:
    """Re-quantized weights: still a working chat model, but not the same bits, so an A/B is real."""
    assert variant.read_bytes()[:4] == b"GGUF" and variant.stat().st_size != smollm2_gguf().stat().st_size
    answer = greedy(variant, "Which city is the capital of France?")
    assert "Paris" in answer, answer


def test_unknown_quantization_and_unwritable_cache_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(QuantizeError, match="unknown quantization"):
        quantize(smollm2_gguf(), tmp_path / "x.gguf", "Q9_9", threads=1)
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with pytest.raises(OSError):
        ensure_variant(smollm2_gguf(), "Q4_0", blocked / "cache", threads=1)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="VARIANT_QUANTIZATION"):
        TritonLocalConfig(variant_quantization="Q9_9")
    with pytest.raises(ValueError, match="VARIANT_MODEL_NAME"):
        TritonLocalConfig(variant_model_name="smollm2_step")
    with pytest.raises(ValueError, match="VARIANT_SLOTS"):
        TritonLocalConfig(variant_slots=0)
    assert TritonLocalConfig(cache_dir="/x/y").variant_cache_dir() == Path("/x/y")


def test_the_variant_steps_on_the_main_engine_thread_and_counts_its_tokens_apart(variant: Path) -> None:
    from sluice_triton_local import metrics
    from sluice_triton_local.shared_engine import SharedEngine, warm_up

    main = SharedEngine(StepEngine(str(smollm2_gguf()), max_slots=1, max_context=256, threads=2))
    second = SharedEngine(StepEngine(str(variant), max_slots=1, max_context=256, threads=2), variant_of=main)
    main_before = metrics.TOKENS_GENERATED._value.get()
    variant_before = metrics.VARIANT_TOKENS_GENERATED._value.get()
    assert "Paris" in warm_up(second)
    assert metrics.VARIANT_TOKENS_GENERATED._value.get() > variant_before
    assert metrics.TOKENS_GENERATED._value.get() == main_before  # the main model's counters stay its own
    assert second._owner is main._owner  # one step thread: one OpenMP team on the cores
