"""Helpers for the engine benchmarks' tests (run in triton-local's environment, see ../pytest.ini)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """One of this folder's scripts in a fresh process of this interpreter, with one BLAS thread
    (BLAS threads are fixed at numpy's import)."""
    environ = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], env=environ, capture_output=True, text=True, timeout=600, check=False)


def run_bench(script: str, *args: str) -> dict[str, Any]:
    """The JSON stats of a benchmark script's last output line."""
    proc = run_script(script, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
