"""llama.cpp's own HTTP server (`llama-server`), the peer `make bench-peer` compares the stack with.

Built from the llama.cpp source inside the llama-cpp-python sdist of the version triton-local locks
(services/triton-local/uv.lock), so both sides run the same llama.cpp: the sdist uv unpacked in its
cache when `make setup` built the bindings, else the one `pip download` fetches from the registry.
The bindings' portable x86-64 flags, only the `llama-server` target, about 8 minutes on 2 cores. The binary lands in .llama-server/<version>/ (git-ignored) and is reused.

  python bench/llama_server.py build   build it unless present; print its path
  python bench/llama_server.py path    print its path (exit 1 when not built)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

# The standard library only: `make llama-server` needs no environment.
REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "llama-cpp-python"
HOME = REPO_ROOT / ".llama-server"
LOCK = REPO_ROOT / "services" / "triton-local" / "uv.lock"
# The instruction set of the bindings `make setup` builds (the Makefile's CMAKE_ARGS, which a test
# holds to these), so both sides of bench-peer run the same kernels. Not AVX-512: this machine's CPU
# has none, and a binary built with it dies with "Illegal instruction".
GGML_FLAGS = [
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
]  # fmt: skip
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary, nothing from the build folder at run time
    *GGML_FLAGS,
    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build tries to download the web UI (no network here)
]  # fmt: skip


def locked_version() -> str:
    """The llama-cpp-python version triton-local's lock file pins."""
    packages = tomllib.loads(LOCK.read_text())["package"]
    return next(p["version"] for p in packages if p["name"] == PACKAGE)


def binary_path(version: str) -> Path:
    return HOME / version / "llama-server"


def uv_cache_dir() -> Path:
    if os.environ.get("UV_CACHE_DIR"):
        return Path(os.environ["UV_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "uv"


def cached_source(version: str) -> Path | None:
    """vendor/llama.cpp of the sdist uv unpacked when it built the bindings, if still there."""
    pattern = f"sdists-v*/pypi/{PACKAGE}/{version}/*/src/vendor/llama.cpp/CMakeLists.txt"
    found = sorted(uv_cache_dir().glob(pattern))
    return found[0].parent if found else None


def downloaded_source(version: str, scratch: Path) -> Path:
    """The sdist from the registry, unpacked into scratch: its vendor/llama.cpp."""
    subprocess.run(
        ["python3", "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={version}", "-d", str(scratch)],
        check=True,
    )
    archive = next(scratch.glob("llama_cpp_python-*.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(scratch, filter="data")
    return next(scratch.glob("llama_cpp_python-*/vendor/llama.cpp"))


def build(version: str) -> Path:
    """Compile llama-server (cmake, 2 jobs) unless already built; return the binary."""
    binary = binary_path(version)
    if binary.is_file():
        return binary
    with tempfile.TemporaryDirectory() as scratch:
        source = cached_source(version) or downloaded_source(version, Path(scratch))
        build_dir = HOME / f"build-{version}"
        print(f"building llama-server {version} from {source} (about 8 minutes on 2 cores) ...", flush=True)
        started = time.monotonic()
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja", *CMAKE_FLAGS], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j2"], check=True)
        binary.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(build_dir / "bin" / "llama-server", binary)
        shutil.rmtree(build_dir)
        print(f"built {binary} in {time.monotonic() - started:.0f} s", flush=True)
    return binary


def main(argv: list[str]) -> int:
    version = locked_version()
    if argv[1:] == ["build"]:
        print(build(version))
        return 0
    if argv[1:] == ["path"]:
        print(binary_path(version))
        return 0 if binary_path(version).is_file() else 1
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
