"""Helpers shared by triton-local's tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_bench(module: str, *args: str) -> dict[str, Any]:
    """Runs a bench module in a fresh process with one BLAS thread (BLAS threads are fixed at
    numpy's import) and returns the JSON stats of its last output line."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])
