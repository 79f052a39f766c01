"""The second variant of the chat model that triton-local serves beside it, so that `sluice eval`
compares two real models: the same GGUF re-quantized (Q4_1 -> Q4_0 by default) with llama.cpp's
own quantizer, made once into a cache directory and reused on later starts (~0.5 s for 135M here).

The file name carries the quantization and a digest of the source file's path, size and mtime,
so a changed source makes a new file; it is written to a temporary name and renamed, so two
processes starting at once (replicas, parallel test stacks) never read a half-written file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
from pathlib import Path

# llama.cpp's llama_ftype values for the quantizations worth a variant (llama.h).
QUANTIZATIONS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_M": 12, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}


class QuantizeError(RuntimeError):
    pass


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/sluice/triton-local, else ~/.cache/sluice/triton-local."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "triton-local"


def variant_path(source: Path, quantization: str, cache_dir: Path) -> Path:
    stat = source.stat()
    digest = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # SmolLM2-135M-Instruct.Q4_1 -> SmolLM2-135M-Instruct
    return cache_dir / f"{stem}.{quantization}.{digest}.gguf"


def quantize(source: Path, target: Path, quantization: str, threads: int) -> None:
    """llama.cpp's llama_model_quantize, allowed to re-quantize an already quantized file."""
    import llama_cpp as lc

    from sluice_triton_local.engine.llamacpp_model import init_backend_once

    init_backend_once()  # llama.cpp's log to warnings only: the quantizer reports every tensor
    if quantization not in QUANTIZATIONS:
        raise QuantizeError(f"unknown quantization {quantization!r}; one of {', '.join(QUANTIZATIONS)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    params = lc.llama_model_quantize_default_params()
    params.ftype = QUANTIZATIONS[quantization]
    params.allow_requantize = True
    params.nthread = threads
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    os.close(handle)
    try:
        code = lc.llama_model_quantize(str(source).encode(), partial.encode(), ctypes.byref(params))
        if code != 0:
            raise QuantizeError(f"llama_model_quantize({source} -> {quantization}) failed with code {code}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def ensure_variant(source: Path, quantization: str, cache_dir: Path, threads: int) -> tuple[Path, bool]:
    """The variant's GGUF file, made now if it is not cached yet; and whether it was made now."""
    target = variant_path(source, quantization, cache_dir)
    if target.is_file():
        return target, False
    quantize(source, target, quantization, threads)
    return target, True
