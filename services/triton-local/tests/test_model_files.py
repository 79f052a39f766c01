"""Where tests and benchmarks find the GGUF: the service's own setting first, else the wheel's file."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_triton_local.model_files import gguf_path, smollm2_gguf


def test_the_setting_wins_over_the_wheels_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    carried = tmp_path / "carried.gguf"  # the offline GPU kit's reassembled model, without its wheel
    monkeypatch.setenv("SLUICE_TRITON_LOCAL_GGUF_PATH", str(carried))
    assert gguf_path() == str(carried)
    monkeypatch.delenv("SLUICE_TRITON_LOCAL_GGUF_PATH")
    assert gguf_path() == str(smollm2_gguf()) and Path(gguf_path()).is_file()
