"""What bench/engine/gpu.py imports on the GPU machine comes from the offline kit alone: the wheels it
carries (bench/gpu/kit.py's ENGINE_WHEELS and the CUDA build of llama-cpp-python) and the sources the
checkout carries (ENGINE_SOURCES, and bench/engine itself). The kit installs its wheels with --no-deps
and the device has no network, so a module outside both fails only there, minutes into a borrowed
machine's time; here it fails `make test`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from types import ModuleType

from conftest import SCRIPTS

REPO = SCRIPTS.parents[1]

# In a fresh interpreter: gpu.py's module tree and llama_cpp's, then a batch-1 run of the engine alone
# and the step protocol on the CPU (2 steps, one engine), for what is imported only when used; then each top-level
# module outside the standard library that has a file (not Cython's runtime modules), with the
# distribution it comes from (None: none).
PROBE = """
import importlib.metadata, json, sys
import gpu, llama_cpp
engine = gpu.StepEngine(gpu.gguf_path(), 1, 64, engine="llamacpp", threads=1, gpu_layers=0, prefix_cache=False)
gpu.protocol_run(gpu.SharedEngine(engine), engine, 1, 2, steps=2, rounds=1)
gpu.cuda_build_line()
std = set(sys.stdlib_module_names) | set(sys.builtin_module_names)
dists = importlib.metadata.packages_distributions()
found = {}
for name, module in list(sys.modules.items()):
    if "." in name or name in std or name.startswith("_") and name[1:] in std:
        continue
    if getattr(module, "__file__", None) or list(getattr(module, "__path__", None) or []):
        found[name] = (dists.get(name) or [None])[0]
print(json.dumps(found))
"""


def load_kit() -> ModuleType:
    if "gpukit" in sys.modules:
        return sys.modules["gpukit"]
    spec = importlib.util.spec_from_file_location("gpukit", REPO / "bench" / "gpu" / "kit.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up (bench/engine's gpu.py shadows bench/gpu)
    spec.loader.exec_module(module)
    return module


def normalized(distribution: str) -> str:
    return distribution.lower().replace("_", "-").replace(".", "-")


def test_every_module_gpu_py_imports_is_in_the_kits_wheels_or_its_carried_sources() -> None:
    kit = load_kit()
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    carried_sources = {p.stem for src in kit.ENGINE_SOURCES for p in (REPO / src).iterdir() if p.is_dir() or p.suffix == ".py"}
    carried_sources |= {p.stem for p in SCRIPTS.glob("*.py")} | {"__main__"}
    wheels = {normalized(w) for w in (*kit.ENGINE_WHEELS, "llama-cpp-python")}
    outside = {
        name: distribution
        for name, distribution in imported.items()
        if name not in carried_sources and (distribution is None or normalized(distribution) not in wheels)
    }
    assert not outside, f"gpu.py imports these, which the kit neither carries as a wheel (ENGINE_WHEELS) nor as a source: {outside}"
    assert {"llama_cpp", "numpy", "sluice_triton_local", "sluice_common"} <= imported.keys()  # the probe saw the engine
