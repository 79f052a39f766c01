"""The offline GPU kit: `make bench-gpu` on a borrowed GPU machine that has no network, a few minutes
and at most 64 MiB of carried files per command.

Here (an ordinary machine with nvcc 13, the registry, `make setup` done):

  python3 bench/gpu/kit.py build    # .gpukit/load-1 ... load-N, each small enough to carry in one run

builds llama-cpp-python with CUDA for sm_90 alone (the H200) into a wheel, downloads the wheels the step
engine imports (versions from triton-local's uv.lock, for the device's Python), and splits the GGUF
file into parts, packing them all into as few loads as fit (three today). On the GPU machine, one command
per load, back to back while it stays warm (30 s after each), each carrying its load (`.gpukit/load-K`),
the same command each time (the device image need not have make):

  if command -v make >/dev/null; then make bench-gpu; else python3 bench/gpu/kit.py device; fi

`device` stages every load carried with the command (checked against the manifest, kept outside the
checkout); the command that completes the kit, whichever load it carries, then runs: it reassembles
the model, installs every wheel into a clean virtual environment with no index, finds the CUDA runtime
and cuBLAS the machine has, and runs bench_gpu. Where OUT names a folder (the device tool's), the whole
log goes to $OUT/bench-gpu.log and the BENCH lines alone to $OUT/bench-gpu-BENCH.txt as well. `stage K`
and `run` are its two halves. A device command ends itself within SLUICE_GPUKIT_DEADLINE_S (240 s,
under the device call's timeout_s of 300) with a line naming the phase it was in, exit 4, rather than
be stopped by the device tool with nothing said. Here, `prove` does all of that from the loads alone,
without a network (its own network namespace where it can), with no layers offloaded:

  python3 bench/gpu/kit.py prove

and `check`, before the device calls, that each load still fits one command beside the checkout as
it is now (the checkout grows; a kit built when it was smaller can be over), else build again:

  python3 bench/gpu/kit.py check

`online` is make bench-gpu's test where no kit was carried: without a network `make setup` cannot
run, so it exits 2 saying to carry the loads instead.

Standard library only: the device runs this with whatever python3 it has.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / ".gpukit"  # the loads (git-ignored; carried to the device one at a time)
BUILD = REPO / ".gpukit-build"  # the toolkit view, downloads and the wheel before packing (git-ignored)
HOME = Path(os.environ.get("SLUICE_GPUKIT_HOME", "/tmp/sluice-gpukit"))  # where a load is staged
MANIFEST = "kit.json"
CARRY_LIMIT = 64 * 2**20  # what one device command may carry, the working tree included
CARRY_MARGIN = 2 * 2**20
CUDA_ARCH = "90"  # the H200 (Hopper); one architecture keeps the build and the wheel small
PYTHON = (3, 12)  # the device's python3 (3.12.3, KINDS.md); the wheels are built for it
MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What bench/engine/gpu.py imports, beside the checkout's own sources (ENGINE_SOURCES, and bench/engine itself).
# Their dependencies that the engine never imports (huggingface-hub for tokenizers, requests for gguf)
# stay out: the kit installs with --no-deps, and `run` imports the engine before it benchmarks.
ENGINE_WHEELS = (
    "diskcache",
    "gguf",
    "jinja2",
    "llguidance",  # the engine's structured outputs (engine/constraints.py)
    "markupsafe",
    "numpy",
    "prometheus-client",  # shared_engine's metrics: the step protocol's side of bench_gpu
    "pyyaml",
    "tokenizers",
    "tqdm",
    "typing-extensions",
)
ENGINE_SOURCES = ("services/triton-local/src", "libs/sluice-common/src")
GPU_BENCH = "bench/engine/gpu.py"  # what `run` runs (make bench-gpu's script), from the carried checkout
# The Makefile's portable CPU flags (AVX2: a CPU side that runs on any x86-64 host) and CUDA for sm_90.
# No libcuda (the driver) is needed to link with GGML_CUDA_NO_VMM: a build machine has no driver.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON "
    "-DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF "
    "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF "
    f"-DLLAMA_BUILD_SERVER=OFF -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCH}"
)
CUDA_SONAMES = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")


LOG_NAME, BENCH_NAME = "bench-gpu.log", "bench-gpu-BENCH.txt"  # under $OUT: what comes back beside the output's tail
# A device command's own time limit, well under the timeout_s the docs give the device call (300):
# the kit stops itself and says in which phase, where the tool would stop it with nothing said.
DEADLINE_S = float(os.environ.get("SLUICE_GPUKIT_DEADLINE_S", "240"))
DEADLINE_EXIT = 4
BENCH_GRACE_S = 15  # the bench's own deadline comes this much earlier: its threads' tracebacks first
# Lines of a traceback (Python's, or faulthandler's at the bench's deadline): not the bench's phase.
TRACEBACK_HEADS = ("Traceback", "Timeout (", "Thread 0x", "Current thread 0x", "File ")
OFFLINE_EXIT = 2
DEVICE_COMMAND = "if command -v make >/dev/null; then make bench-gpu; else python3 bench/gpu/kit.py device; fi"


class Log:
    """Where OUT names a folder (the device tool empties it before a command and returns its files),
    every line of a device command: the whole log, and its BENCH lines alone. Written a line at a
    time, so a command stopped at its time limit still leaves what it printed."""

    def __init__(self) -> None:
        self.files: list[TextIO] = []  # [the whole log, the BENCH lines]

    def open(self, folder: str) -> None:
        if folder and not self.files and Path(folder).is_dir():
            self.files = [(Path(folder) / name).open("a") for name in (LOG_NAME, BENCH_NAME)]

    def write(self, line: str) -> None:
        for f in self.files[:1] + (self.files[1:] if line.startswith("BENCH ") else []):
            f.write(line if line.endswith("\n") else line + "\n")
            f.flush()


LOG = Log()


class DeadlinePassed(Exception):
    pass


class Deadline:
    """A device command's overall deadline, counted from the process's start, and the phase it is
    in: the line it ends with names that phase."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.phase = "starting"

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def enter(self, phase: str) -> None:
        """Raises DeadlinePassed (in the phase before) when no time is left for this one."""
        if self.left() <= 0:
            raise DeadlinePassed
        self.phase = phase

    def passed(self) -> str:
        return (
            f"deadline: {self.seconds:.0f} s (SLUICE_GPUKIT_DEADLINE_S) passed in phase: {self.phase}; stopped, exit {DEADLINE_EXIT} "
            "(a fresh call reruns it: the staged loads stay while the machine is warm)"
        )


DEADLINE = Deadline(DEADLINE_S)


def say(*parts: object) -> None:
    line = " ".join(["gpukit:", *map(str, parts)])
    print(line, flush=True)
    LOG.write(line)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# -- packing: files into loads that each fit one device command -------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str  # the file's name in a load and once staged
    size: int
    load: int = 0


MIN_PART = 2**20  # a load's room under this takes no model part (unless the model's rest fits it)


def pack(wheels: list[Entry], model_size: int, budget: int) -> tuple[list[Entry], list[Entry]]:
    """Wheels first, largest first, each into the first load with room for it (a wheel is never
    split); then the model in parts that fill every load's room in turn, the wheels' loads first,
    before a new load starts. Returns (wheels with their load, model parts with theirs, in the
    model's order): as few loads as the budget allows, each device command's start being minutes."""
    if budget < MIN_PART:
        raise SystemExit(f"gpukit: {budget / 2**20:.1f} MiB left for a load: the checkout alone is near the 64 MiB a command carries")
    used: list[int] = []  # bytes in each load so far
    placed = []
    for wheel in sorted(wheels, key=lambda w: (-w.size, w.name)):
        if wheel.size > budget:
            raise SystemExit(f"gpukit: {wheel.name} ({wheel.size / 2**20:.1f} MiB) alone is over a load's {budget / 2**20:.1f} MiB")
        k = next((k for k, size in enumerate(used) if size + wheel.size <= budget), len(used))
        if k == len(used):
            used.append(0)
        used[k] += wheel.size
        placed.append(Entry(wheel.name, wheel.size, k + 1))
    parts, left, k = [], model_size, 0
    while left:
        if k == len(used):
            used.append(0)
        room = budget - used[k]
        if used[k] and room < min(MIN_PART, left):  # not worth a part: the next load
            k += 1
            continue
        size = min(room, left)
        parts.append(Entry(f"{MODEL}.part{len(parts) + 1}", size, k + 1))
        used[k] += size
        left -= size
        k += 1
    return placed, parts


def carried_tree_bytes() -> int:
    """What travels with every device command besides the carried load: tracked and untracked files
    that git does not ignore."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    return sum((REPO / n.decode()).stat().st_size for n in names if n and (REPO / n.decode()).is_file())


# -- build (here) -------------------------------------------------------------------------------------


def kit_python() -> str:
    """A python3.12 to build with (the wheel must install on the device's)."""
    want = "python{}.{}".format(*PYTHON)
    candidates = [os.environ.get("GPUKIT_PYTHON", ""), shutil.which(want) or ""]
    candidates += sorted(str(p) for p in Path.home().glob(f".pyenv/versions/{PYTHON[0]}.{PYTHON[1]}.*/bin/python3"))
    for candidate in filter(None, candidates):
        check = [candidate, "-c", f"import sys; sys.exit(sys.version_info[:2] != {PYTHON})"]
        if subprocess.run(check, capture_output=True).returncode == 0:  # a pyenv shim of another version says so
            return candidate
    raise SystemExit(f"gpukit: no {want} here (GPUKIT_PYTHON=...): the kit's wheels are for the device's Python {want}")


def cuda_toolkit() -> Path:
    for root in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(map(str, Path("/usr/local").glob("cuda-*")))]:
        if root and (Path(root) / "bin" / "nvcc").exists():
            return Path(root)
    raise SystemExit("gpukit: no CUDA toolkit (bin/nvcc under CUDA_HOME, /usr/local/cuda or /usr/local/cuda-*)")


def toolkit_with_cublas(python: str) -> Path:
    """The toolkit itself where it has cuBLAS; else a view of it (links) with the cuBLAS wheel's headers
    and libraries added: the pip-assembled CUDA 13 here has nvcc and the runtime but no cuBLAS."""
    toolkit = cuda_toolkit()
    if (toolkit / "include" / "cublas_v2.h").exists():
        return toolkit
    extra = BUILD / "cublas"
    if not (extra / "nvidia" / "cu13" / "include" / "cublas_v2.h").exists():
        say("this toolkit has no cuBLAS: taking it from the nvidia-cublas 13.0 wheel")
        subprocess.run(
            [python, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(extra), "nvidia-cublas>=13.0,<13.1"],
            check=True,
        )
        wheel = next(extra.glob("nvidia_cublas-*.whl"))
        subprocess.run(["unzip", "-q", "-o", str(wheel), "nvidia/cu13/*", "-d", str(extra)], check=True)
        wheel.unlink()
    view = BUILD / "cuda"
    shutil.rmtree(view, ignore_errors=True)
    view.mkdir(parents=True)
    for entry in toolkit.iterdir():
        if entry.name not in ("include", "lib64"):
            (view / entry.name).symlink_to(entry.resolve())
    for sub, added in (("include", extra / "nvidia/cu13/include"), ("lib64", extra / "nvidia/cu13/lib")):
        (view / sub).mkdir()
        for source in [*(toolkit / sub).iterdir(), *added.iterdir()]:
            (view / sub / source.name).symlink_to(source.resolve())
    for soname in ("libcublas.so.13", "libcublasLt.so.13"):  # the link-time names
        (view / "lib64" / soname.removesuffix(".13")).symlink_to(soname)
    return view


def build_llama_wheel(python: str, out: Path) -> Path:
    version = lock_versions(["llama-cpp-python"])["llama-cpp-python"]
    toolkit = toolkit_with_cublas(python)
    nvcc = toolkit / "bin" / "nvcc"
    env = dict(
        os.environ,
        CMAKE_ARGS=f"{CMAKE_ARGS} -DCUDAToolkit_ROOT={toolkit} -DCMAKE_CUDA_COMPILER={nvcc}",
        CUDACXX=str(nvcc),
        CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1),
        PIP_NO_CACHE_DIR="1",  # else pip reuses a wheel it built with other flags
    )
    say(f"building llama-cpp-python {version} with CUDA for sm_{CUDA_ARCH} (many minutes on 2 cores) ...")
    t0 = time.monotonic()
    subprocess.run(
        [python, "-m", "pip", "wheel", "-q", "--no-deps", "--no-binary=llama-cpp-python", "-w", str(out), f"llama-cpp-python=={version}"],
        env=env,
        check=True,
    )
    wheel = next(out.glob("llama_cpp_python-*.whl"))
    listing = subprocess.run(["unzip", "-l", str(wheel)], capture_output=True, text=True, check=True).stdout
    if "libggml-cuda" not in listing:
        raise SystemExit(f"gpukit: {wheel.name} has no libggml-cuda: the CUDA build did not happen")
    say(f"built {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB) in {time.monotonic() - t0:.0f} s")
    slim_wheel(wheel)
    say(f"slimmed to {wheel.stat().st_size / 2**20:.1f} MiB (each library once)")
    return wheel


# The libraries' names that are loaded: by Python (llama_cpp loads libllama.so, bench_gpu libggml.so)
# and by the dynamic linker (each library's SONAME, lib*.so.0).
LOADED_LIBRARY = re.compile(r"^llama_cpp/lib/(libllama\.so|libggml\.so|lib[\w-]+\.so\.0)$")


def slim_wheel(wheel: Path) -> None:
    """A zip holds no symbolic links, so the wheel carries every library three times over (libX.so,
    .so.0, .so.0.25.3) and again outside the package (lib/, include/: CMake's install, unused):
    libggml-cuda alone six times, 250 MB. Keeps each loaded name once, with a RECORD to match."""
    kept: list[tuple[str, bytes]] = []
    with zipfile.ZipFile(wheel) as source:
        for name in source.namelist():
            in_package = name.startswith("llama_cpp/") and (not name.startswith("llama_cpp/lib/") or LOADED_LIBRARY.match(name))
            if (in_package or ".dist-info/" in name) and not name.endswith("/RECORD"):
                kept.append((name, source.read(name)))
    record = next(n for n, _ in kept if n.endswith(".dist-info/METADATA")).replace("METADATA", "RECORD")
    lines = [f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}" for n, data in kept]
    kept.append((record, ("\n".join([*lines, f"{record},,"]) + "\n").encode()))
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for name, data in kept:
            out.writestr(name, data)
    slim.replace(wheel)


def lock_versions(names: list[str]) -> dict[str, str]:
    import tomllib

    lock = tomllib.loads((REPO / "services/triton-local/uv.lock").read_text())
    versions = {p["name"]: p["version"] for p in lock["package"]}
    return {n: versions[n] for n in names}


def download_engine_wheels(python: str, out: Path) -> None:
    pins = [f"{n}=={v}" for n, v in lock_versions(list(ENGINE_WHEELS)).items()]
    # pip matches each manylinux version exactly: the device (glibc 2.39) runs wheels up to 2_39 (llguidance is 2_31).
    tags = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
    platform_args = [a for tag in tags for a in ("--platform", tag)]
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "{}.{}".format(*PYTHON),
            "--implementation",
            "cp",
            *platform_args,
            "-d",
            str(out),
            *pins,
        ],
        check=True,
    )


def model_file() -> Path:
    venv_python = REPO / "services/triton-local/.venv/bin/python"
    if not venv_python.exists():
        raise SystemExit("gpukit: run `make setup` first (the GGUF file comes from triton-local's environment)")
    code = "from sluice_triton_local.model_files import gguf_path; print(gguf_path())"
    return Path(subprocess.run([str(venv_python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def build(args: argparse.Namespace) -> int:
    python = kit_python()
    wheels_dir = BUILD / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    if not (built := list(wheels_dir.glob("llama_cpp_python-*.whl"))):
        build_llama_wheel(python, wheels_dir)
    elif built[0].stat().st_size > 100 * 2**20:  # built before it was slimmed
        slim_wheel(built[0])
    download_engine_wheels(python, wheels_dir)
    model = model_file()
    budget = CARRY_LIMIT - carried_tree_bytes() - CARRY_MARGIN
    wheels, parts = pack([Entry(w.name, w.stat().st_size) for w in sorted(wheels_dir.glob("*.whl"))], model.stat().st_size, budget)
    shutil.rmtree(KIT, ignore_errors=True)
    files = []
    for wheel in wheels:
        dest = KIT / f"load-{wheel.load}" / wheel.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(wheels_dir / wheel.name, dest)
        files.append({"name": wheel.name, "size": wheel.size, "load": wheel.load, "sha256": sha256(dest), "kind": "wheel"})
    with model.open("rb") as src:
        for part in parts:
            dest = KIT / f"load-{part.load}" / part.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(src.read(part.size))
            files.append({"name": part.name, "size": part.size, "load": part.load, "sha256": sha256(dest), "kind": "model-part"})
    loads = max(f["load"] for f in files)
    manifest = {
        "loads": loads,
        "python": list(PYTHON),
        "cuda_arch": CUDA_ARCH,
        "cmake_args": CMAKE_ARGS,
        "cuda_sonames": list(CUDA_SONAMES),
        "model": {"name": MODEL, "size": model.stat().st_size, "sha256": sha256(model)},
        "files": files,
    }
    for k in range(1, loads + 1):
        (KIT / f"load-{k}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    say(f"{len(files)} files in {loads} loads under {KIT}, each at most {budget / 2**20:.1f} MiB (64 MiB less the checkout):")
    for k in range(1, loads + 1):
        size = sum(f["size"] for f in files if f["load"] == k)
        then = ": the last, it runs the bench too" if k == loads else ""
        say(f'  device run {k}: carry [".gpukit/load-{k}"] ({size / 2**20:.1f} MiB), command: {DEVICE_COMMAND}{then}')
    say("before the device calls, once the checkout is as it will travel: python3 bench/gpu/kit.py check")
    return prove(args) if args.prove else 0


# -- stage and run (the device; `prove` here) ---------------------------------------------------------


def manifest_of(load_dir: Path) -> dict:
    path = load_dir / MANIFEST
    if not path.exists():
        raise SystemExit(f"gpukit: no {path}: carry the load (.gpukit/load-K) with this command")
    return json.loads(path.read_text())


def stage(args: argparse.Namespace) -> int:
    source = KIT / f"load-{args.load}"
    manifest = manifest_of(source)
    if (HOME / MANIFEST).exists() and json.loads((HOME / MANIFEST).read_text()) != manifest:
        say(f"another kit was staged in {HOME}: cleared")
        shutil.rmtree(HOME)
    HOME.mkdir(parents=True, exist_ok=True)
    for f in (f for f in manifest["files"] if f["load"] == args.load):
        dest = HOME / f["name"]
        shutil.copyfile(source / f["name"], dest)
        if sha256(dest) != f["sha256"]:
            raise SystemExit(f"gpukit: {f['name']} in load {args.load} does not match the manifest (a broken carry?)")
    shutil.copyfile(source / MANIFEST, HOME / MANIFEST)
    missing = missing_loads(manifest)
    say(f"load {args.load} of {manifest['loads']} staged in {HOME}" + (f"; still to stage: {missing}" if missing else "; every load is here"))
    return 0


def missing_loads(manifest: dict) -> list[int]:
    return sorted({f["load"] for f in manifest["files"] if not staged_ok(f)})


def staged_ok(f: dict) -> bool:
    path = HOME / f["name"]
    return path.exists() and path.stat().st_size == f["size"]


def assemble_model(manifest: dict) -> Path:
    model = HOME / manifest["model"]["name"]
    if not model.exists() or sha256(model) != manifest["model"]["sha256"]:
        with model.open("wb") as out:
            for part in (f for f in manifest["files"] if f["kind"] == "model-part"):
                out.write((HOME / part["name"]).read_bytes())
        if sha256(model) != manifest["model"]["sha256"]:
            raise SystemExit(f"gpukit: the reassembled {model.name} does not match the manifest")
    return model


def install(manifest: dict, timeout: float | None = None) -> Path:
    """A clean virtual environment with every carried wheel, from those files alone (no index), within
    `timeout` seconds in all (else subprocess.TimeoutExpired)."""
    end = time.monotonic() + timeout if timeout is not None else None

    def left() -> float | None:
        return None if end is None else max(end - time.monotonic(), 0.1)

    if sys.version_info[:2] != tuple(manifest["python"]):
        raise SystemExit(f"gpukit: the wheels are for Python {manifest['python']}, this is {sys.version.split()[0]}: run with python3.12")
    venv = HOME / "venv"
    wheels = [str(HOME / f["name"]) for f in manifest["files"] if f["kind"] == "wheel"]
    pip_args = ["install", "-q", "--no-index", "--no-deps", "--no-cache-dir", *wheels]
    if subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=False, timeout=left()).returncode == 0:
        subprocess.run([str(venv / "bin/python"), "-m", "pip", *pip_args], check=True, timeout=left())
    else:  # an interpreter without ensurepip (a distribution's python3 without its venv package)
        say("venv with pip failed: a venv without pip, filled by this interpreter's pip (--python)")
        subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True, timeout=left())
        subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin/python"), *pip_args], check=True, timeout=left())
    return venv


def cuda_library_dirs(sonames: list[str], extra: list[str]) -> list[str]:
    """Folders that hold the CUDA runtime and cuBLAS libraries the wheel's libggml-cuda needs: a CUDA
    toolkit's, or the nvidia-* wheels' of this machine's Python (PyTorch brings them)."""
    import site
    import sysconfig

    roots = [
        *extra,
        "/usr/local/cuda/lib64",
        *sorted(map(str, Path("/usr/local").glob("cuda*/lib64"))),
        *sorted(map(str, Path("/usr/local").glob("cuda*/targets/x86_64-linux/lib"))),
    ]
    for packages in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]}:
        roots += sorted(map(str, Path(packages).glob("nvidia/*/lib")))
    found: dict[str, str] = {}
    for soname in sonames:
        for root in roots:
            if (Path(root) / soname).exists():
                found[soname] = root
                break
    if missing := [s for s in sonames if s not in found and not in_ldconfig(s)]:
        raise SystemExit(f"gpukit: no {', '.join(missing)} in {roots} nor ldconfig's cache (SLUICE_GPUKIT_CUDA_LIBS=dir:dir adds folders)")
    return list(dict.fromkeys(found.values()))


def in_ldconfig(soname: str) -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout if shutil.which("ldconfig") else ""
    return soname in out


def carried_loads() -> list[int]:
    """The loads that travelled with this command (and any an earlier command on this machine left)."""
    found = (p.name.removeprefix("load-") for p in KIT.glob("load-*") if (p / MANIFEST).exists())
    return sorted(int(k) for k in found if k.isdigit())


def device(args: argparse.Namespace) -> int:
    """`make bench-gpu` on the GPU machine: stages each carried load not staged yet, then runs once
    every load is staged. A command that stages a load and leaves others to come exits 0."""
    carried = carried_loads()
    for k in carried:
        DEADLINE.enter(f"staging load {k}")
        mine = [f for f in manifest_of(KIT / f"load-{k}")["files"] if f["load"] == k]
        if (HOME / MANIFEST).exists() and manifest_of(KIT / f"load-{k}") == manifest_of(HOME) and all(map(staged_ok, mine)):
            say(f"load {k} was staged already")
        else:
            stage(argparse.Namespace(load=k))
    if not (HOME / MANIFEST).exists():
        raise SystemExit(
            "gpukit: no load carried and none staged: carry .gpukit/load-K with `make bench-gpu`, one a command "
            "(`make bench-gpu-kit` builds them; bench-gpu-networked is the path with a network and `make setup`)"
        )
    manifest = manifest_of(HOME)
    if missing := missing_loads(manifest):
        say(
            f"not run yet: loads {missing} of {manifest['loads']} still to stage: carry .gpukit/load-{missing[0]} with the next "
            "`make bench-gpu`, at once (the machine goes back 30 s after a command, and the staged loads with it)"
        )
        return 0 if carried else 2
    return run(args)


# -- online (make bench-gpu with no kit carried) -------------------------------------------------------

INDEX_TIMEOUT_S = 5.0


def index_address(environ: dict[str, str] | os._Environ[str]) -> tuple[str, int]:
    """The package index make setup (uv) would fetch from: UV_DEFAULT_INDEX, UV_INDEX_URL or
    PIP_INDEX_URL where set, else PyPI."""
    url = next((environ[k] for k in ("UV_DEFAULT_INDEX", "UV_INDEX_URL", "PIP_INDEX_URL") if environ.get(k)), "https://pypi.org/simple")
    parts = urlsplit(url)
    return parts.hostname or "pypi.org", parts.port or (80 if parts.scheme == "http" else 443)


def reachable(address: tuple[str, int], timeout: float = INDEX_TIMEOUT_S) -> bool:
    """Whether a TCP connection to `address` opens within `timeout` seconds, name lookup included
    (a lookup with no network can take longer than a connect's own timeout: it runs on a thread
    that is not waited for past the timeout)."""
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            opened.append(True)
        except OSError:
            pass

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout)
    return bool(opened)


def online(args: argparse.Namespace) -> int:
    """make bench-gpu's first step where no kit was carried (its path is then make setup, which
    installs uv from the index): without a network that fails after retries with a message about
    something else; here it stops at once, saying to carry the kit."""
    address = index_address(os.environ)
    if reachable(address):
        return 0
    say(
        f"no network and no kit carried: carry .gpukit/load-K (make bench-gpu-kit builds them), one a command "
        f"({address[0]}:{address[1]} did not answer in {INDEX_TIMEOUT_S:.0f} s, and make setup needs it)"
    )
    return OFFLINE_EXIT


# -- check (here, before the device calls) ---------------------------------------------------------------


def check(args: argparse.Namespace) -> int:
    """Each built load, with the checkout as it is now, within what one device command carries
    (CARRY_LIMIT); the loads complete and as the manifest says. Exit 1, saying what to do, if not."""
    if not (KIT / "load-1" / MANIFEST).exists():
        raise SystemExit(f"gpukit: no kit built here ({KIT / 'load-1' / MANIFEST}): python3 bench/gpu/kit.py build (make bench-gpu-kit)")
    manifest = manifest_of(KIT / "load-1")
    tree = carried_tree_bytes()
    problems, report = [], []
    for k in range(1, manifest["loads"] + 1):
        load = KIT / f"load-{k}"
        if not (load / MANIFEST).exists():
            problems.append(f"load-{k} is missing")
            continue
        if manifest_of(load) != manifest:
            problems.append(f"load-{k}'s manifest is another kit's")
        for f in (f for f in manifest["files"] if f["load"] == k):
            if not (load / f["name"]).is_file() or (load / f["name"]).stat().st_size != f["size"]:
                problems.append(f"load-{k}/{f['name']} is missing or not its manifest's size")
        size = sum(p.stat().st_size for p in load.rglob("*") if p.is_file())
        total = size + tree
        report.append(f"load-{k} {size / 2**20:.1f} MiB + the checkout {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB")
        if total > CARRY_LIMIT:
            problems.append(f"load-{k} with the checkout is {total / 2**20:.1f} MiB, over the {CARRY_LIMIT / 2**20:.0f} MiB a device command carries")
    for line in report:
        say(line)
    if problems:
        for problem in problems:
            say(problem)
        say("re-run `python3 bench/gpu/kit.py build` (make bench-gpu-kit; the CUDA wheel is kept, not rebuilt) before the device calls")
        return 1
    say(f"{manifest['loads']} loads, each within {CARRY_LIMIT / 2**20:.0f} MiB beside the checkout as it is now: ready to carry")
    return 0


def run(args: argparse.Namespace) -> int:
    """Installs from the staged loads and runs bench_gpu, within DEADLINE: past it, the phase it was
    in said, exit DEADLINE_EXIT."""
    try:
        return run_phases(args, DEADLINE)
    except (DeadlinePassed, subprocess.TimeoutExpired):
        say(DEADLINE.passed())
        return DEADLINE_EXIT


def run_phases(args: argparse.Namespace, deadline: Deadline) -> int:
    t0 = time.monotonic()
    deadline.enter("checking the staged loads")
    manifest = json.loads((HOME / MANIFEST).read_text()) if (HOME / MANIFEST).exists() else None
    if manifest is None or (missing := missing_loads(manifest)):
        raise SystemExit(
            f"gpukit: loads not staged yet: {missing if manifest else 'all'} (python3 bench/gpu/kit.py stage K, carrying .gpukit/load-K)"
        )
    deadline.enter("reassembling the model")
    model = assemble_model(manifest)
    deadline.enter("installing the wheels")
    venv = install(manifest, timeout=max(deadline.left(), 0.1))
    deadline.enter("finding the CUDA libraries")
    extra = [d for d in os.environ.get("SLUICE_GPUKIT_CUDA_LIBS", "").split(":") if d]
    libs = cuda_library_dirs(manifest["cuda_sonames"], extra)
    deadline.enter("starting the bench")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(str(REPO / s) for s in ENGINE_SOURCES),
        SLUICE_TRITON_LOCAL_GGUF_PATH=str(model),
        LD_LIBRARY_PATH=os.pathsep.join([*libs, os.environ.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1",
        # The bench's own deadline first: it ends with every thread's traceback (where it hung).
        BENCH_GPU_DEADLINE_S=f"{max(deadline.left() - BENCH_GRACE_S, 1):.0f}",
    )
    if args.dry_run:
        env.setdefault("BENCH_BATCHES", "1,8")
        env.setdefault("BENCH_STEPS", "16")
        env["BENCH_GPU_DRY_RUN"] = "1"
    say(
        f"model reassembled, {len(manifest['files'])} files checked, wheels installed in {venv} ({time.monotonic() - t0:.0f} s); CUDA libraries from {libs or 'ldconfig'}"
    )
    # Its output line by line, to the terminal and to the log ($OUT), stderr in with it; stopped at
    # the deadline, its last line naming how far it got.
    with subprocess.Popen(
        [str(venv / "bin/python"), str(REPO / GPU_BENCH)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    ) as bench:
        assert bench.stdout is not None
        deadline.phase = "the bench (bench/engine/gpu.py), before its first line"
        watchdog = threading.Timer(max(deadline.left(), 0.1), bench.kill)
        watchdog.daemon = True
        watchdog.start()
        try:
            for line in bench.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                LOG.write(line)
                if line.strip() and not line[0].isspace() and not line.startswith(TRACEBACK_HEADS):
                    deadline.phase = f"the bench (bench/engine/gpu.py), after its line: {line.strip()[:200]}"
        finally:
            watchdog.cancel()
    # Killed by the watchdog, or ended by its own deadline (BENCH_GRACE_S before), its threads' tracebacks above.
    if bench.returncode != 0 and deadline.left() <= BENCH_GRACE_S:
        raise DeadlinePassed
    say(f"bench_gpu exited {bench.returncode} after {time.monotonic() - t0:.0f} s in all")
    return bench.returncode


def prove(args: argparse.Namespace) -> int:
    """Every step short of the GPU, here: what `make bench-gpu` runs on the device (`device`), into a
    fresh home: stage each load, install and run with no network (a network namespace of its own
    where `unshare -n` works) and no layers offloaded."""
    manifest_of(KIT / "load-1")  # the kit is built
    shutil.rmtree(HOME, ignore_errors=True)
    # This machine's cuBLAS is the build's download (the device has its own: PyTorch's, or a toolkit's).
    os.environ.setdefault("SLUICE_GPUKIT_CUDA_LIBS", str(BUILD / "cuda" / "lib64"))
    # The device's deadline is not this machine's: on 2 busy cores the dry run alone takes minutes.
    os.environ.setdefault("SLUICE_GPUKIT_DEADLINE_S", "1800")
    cmd = [kit_python(), str(Path(__file__).resolve()), "device", "--dry-run"]
    offline = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    say("running with no network: " + ("its own network namespace (unshare -n)" if offline else "pip --no-index only (unshare -n is refused here)"))
    return subprocess.run((["unshare", "-n"] if offline else []) + cmd, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    building = verbs.add_parser("build", help="here: build the kit into .gpukit/load-*")
    building.add_argument("--prove", action="store_true", help="then prove it (see prove)")
    building.set_defaults(func=build)
    staging = verbs.add_parser("stage", help="device: stage the carried load K")
    staging.add_argument("load", type=int)
    staging.set_defaults(func=stage)
    running = verbs.add_parser("run", help="device: install from the staged loads and run bench_gpu")
    running.add_argument("--dry-run", action="store_true", help="no layers offloaded (the proof without a GPU)")
    running.set_defaults(func=run)
    on_device = verbs.add_parser("device", help="device (make bench-gpu): stage the carried loads, then run once all are staged")
    on_device.add_argument("--dry-run", action="store_true", help="no layers offloaded (the proof without a GPU)")
    on_device.set_defaults(func=device)
    verbs.add_parser("prove", help="here: every step short of the GPU, offline").set_defaults(func=prove)
    verbs.add_parser("check", help="here: each load fits one device command beside the checkout as it is now").set_defaults(func=check)
    verbs.add_parser("online", help="make bench-gpu with no kit carried: exit 2 where the package index cannot be reached").set_defaults(func=online)
    args = parser.parse_args()
    if args.verb in ("stage", "run", "device", "online"):
        LOG.open(os.environ.get("OUT", ""))
    try:
        return args.func(args)
    except DeadlinePassed:  # staging (`run` says so itself)
        say(DEADLINE.passed())
        return DEADLINE_EXIT
    except SystemExit as stop:
        if isinstance(stop.code, str):
            LOG.write(stop.code)
        raise
    except subprocess.CalledProcessError as failed:  # pip's own output went to the terminal alone
        LOG.write(f"gpukit: {failed}")
        raise


if __name__ == "__main__":
    sys.exit(main())
