"""The offline GPU kit's packing and checks (bench/gpu/kit.py); `python3 bench/gpu/kit.py prove`
runs the kit itself, which needs its CUDA build (many minutes)."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest

from gpu import kit

MiB = 2**20


@pytest.fixture(autouse=True)
def _a_fresh_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """kit.DEADLINE counts from the module's import (a device command's start): each test its own."""
    monkeypatch.setattr(kit, "DEADLINE", kit.Deadline(kit.DEADLINE_S))


def test_every_load_fits_the_budget_and_the_model_parts_add_up() -> None:
    wheels = [kit.Entry("llama_cpp_python.whl", 30 * MiB), kit.Entry("numpy.whl", 14 * MiB), kit.Entry("gguf.whl", MiB // 10)]
    model = 98 * MiB + 12345
    placed, parts = kit.pack(wheels, model, budget=57 * MiB)
    loads: dict[int, int] = {}
    for entry in [*placed, *parts]:
        loads[entry.load] = loads.get(entry.load, 0) + entry.size
    assert all(size <= 57 * MiB for size in loads.values()), loads
    assert sum(p.size for p in parts) == model
    assert sorted(loads) == [1, 2, 3]  # 142.1 MiB in 57 MiB loads: three, none wasted
    assert [p.name for p in parts] == [f"{kit.MODEL}.part{i}" for i in range(1, len(parts) + 1)]


def test_the_kit_as_built_packs_into_three_loads() -> None:
    """The sizes in docs/contributors/benchmarks.md (the CUDA wheel 42.3 MiB, the engine's wheels
    24.6, the 98 MB model) in loads of 56.6 MiB: 160.7 MiB is three loads, not the four that filling
    only the last wheel's load made (42.3 / 56.6 / 56.6 / ~5): the model's parts take the first
    load's room too."""
    wheels = [kit.Entry(name, int(mib * MiB)) for name, mib in [
        ("llama_cpp_python.whl", 42.3), ("numpy.whl", 17.2), ("tokenizers.whl", 3.24), ("llguidance.whl", 2.93),
        ("pyyaml.whl", 0.77), ("jinja2.whl", 0.13), ("gguf.whl", 0.11), ("tqdm.whl", 0.08), ("prometheus_client.whl", 0.06),
        ("typing_extensions.whl", 0.04), ("diskcache.whl", 0.04), ("markupsafe.whl", 0.02),
    ]]  # fmt: skip
    model, budget = 98_362_432, int(56.6 * MiB)
    placed, parts = kit.pack(wheels, model, budget)
    loads: dict[int, int] = {}
    for entry in [*placed, *parts]:
        loads[entry.load] = loads.get(entry.load, 0) + entry.size
    assert sorted(loads) == [1, 2, 3], {k: round(v / MiB, 1) for k, v in loads.items()}
    assert all(size <= budget for size in loads.values())
    assert sum(p.size for p in parts) == model and {w.name for w in placed} == {w.name for w in wheels}
    assert len({p.load for p in parts}) == len(parts)  # one part a load


def test_a_wheel_over_a_whole_load_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match="big.whl"):
        kit.pack([kit.Entry("big.whl", 70 * MiB)], MiB, budget=57 * MiB)


def _kit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Two loads of a small made-up kit under tmp_path/.gpukit, staged into tmp_path/home."""
    monkeypatch.setattr(kit, "KIT", tmp_path / ".gpukit")
    monkeypatch.setattr(kit, "HOME", tmp_path / "home")
    model = b"GGUF" + bytes(range(256)) * 40
    files = []
    for load, (name, data) in enumerate([("a.whl", b"wheel"), (f"{kit.MODEL}.part1", model[:5000]), (f"{kit.MODEL}.part2", model[5000:])]):
        path = kit.KIT / f"load-{min(load, 1) + 1}" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        files.append({"name": name, "size": len(data), "load": min(load, 1) + 1, "sha256": kit.sha256(path),
                      "kind": "wheel" if name.endswith(".whl") else "model-part"})  # fmt: skip
    model_path = tmp_path / "model"
    model_path.write_bytes(model)
    manifest = {"loads": 2, "files": files, "cuda_sonames": [], "model": {"name": kit.MODEL, "size": len(model), "sha256": kit.sha256(model_path)}}
    for load in (1, 2):
        (kit.KIT / f"load-{load}" / kit.MANIFEST).write_text(json.dumps(manifest))
    return manifest


def test_staging_says_what_is_still_missing_and_the_model_reassembles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = _kit(tmp_path, monkeypatch)
    kit.stage(argparse.Namespace(load=1))
    assert kit.missing_loads(manifest) == [2]
    kit.stage(argparse.Namespace(load=2))
    assert kit.missing_loads(manifest) == []
    assert kit.sha256(kit.assemble_model(manifest)) == manifest["model"]["sha256"]


def test_make_bench_gpu_stages_each_carried_load_and_runs_once_the_kit_is_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    _kit(tmp_path, monkeypatch)
    runs: list[argparse.Namespace] = []
    monkeypatch.setattr(kit, "run", lambda args: runs.append(args) or 0)
    shutil.move(kit.KIT, tmp_path / "loads")
    with pytest.raises(SystemExit, match="no load carried and none staged"):
        kit.device(argparse.Namespace(dry_run=False))
    kit.KIT.mkdir()
    shutil.move(tmp_path / "loads" / "load-1", kit.KIT / "load-1")  # the first command carries load 1 alone
    assert kit.device(argparse.Namespace(dry_run=False)) == 0 and runs == []
    assert "not run yet: loads [2] of 2 still to stage: carry .gpukit/load-2" in capsys.readouterr().out
    shutil.move(tmp_path / "loads" / "load-2", kit.KIT / "load-2")  # the next carries load 2; load 1 is still there
    assert kit.device(argparse.Namespace(dry_run=False)) == 0 and len(runs) == 1
    assert "load 1 was staged already" in capsys.readouterr().out
    shutil.rmtree(kit.KIT)  # run again on the warm machine, carrying nothing
    assert kit.device(argparse.Namespace(dry_run=False)) == 0 and len(runs) == 2


def test_the_device_log_goes_under_out_with_the_bench_lines_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kit, "LOG", kit.Log())
    kit.LOG.open(str(tmp_path))
    kit.say("staged")
    kit.LOG.write("BENCH gpu batch=1 decode_tok_s=1.0\n")
    kit.LOG.write("  GPU and CPU greedy tokens part: row 0 at token 3\n")
    assert (tmp_path / kit.LOG_NAME).read_text().splitlines() == [
        "gpukit: staged",
        "BENCH gpu batch=1 decode_tok_s=1.0",
        "  GPU and CPU greedy tokens part: row 0 at token 3",
    ]
    assert (tmp_path / kit.BENCH_NAME).read_text() == "BENCH gpu batch=1 decode_tok_s=1.0\n"


def test_run_sends_the_bench_output_to_the_terminal_and_under_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    manifest = _kit(tmp_path, monkeypatch)
    for load in (1, 2):
        kit.stage(argparse.Namespace(load=load))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = tmp_path / "bench.py"
    script.write_text("import sys\nprint('warming up')\nprint('BENCH gpu batch=1 decode_tok_s=2.0')\nprint('oops', file=sys.stderr)\nsys.exit(5)\n")
    monkeypatch.setattr(kit, "install", lambda *_, **__: venv)
    monkeypatch.setattr(kit, "cuda_library_dirs", lambda *_: [])
    monkeypatch.setattr(kit, "GPU_BENCH", str(script))
    monkeypatch.setattr(kit, "LOG", kit.Log())
    out = tmp_path / "out"
    out.mkdir()
    kit.LOG.open(str(out))
    assert manifest["loads"] == 2 and kit.run(argparse.Namespace(dry_run=False)) == 5
    log = (out / kit.LOG_NAME).read_text()
    assert "warming up\nBENCH gpu batch=1 decode_tok_s=2.0\n" in log and "oops" in log and "bench_gpu exited 5" in log
    assert (out / kit.BENCH_NAME).read_text() == "BENCH gpu batch=1 decode_tok_s=2.0\n"
    assert "BENCH gpu batch=1 decode_tok_s=2.0" in capsys.readouterr().out


def test_a_load_damaged_in_the_carry_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _kit(tmp_path, monkeypatch)
    (kit.KIT / "load-2" / f"{kit.MODEL}.part2").write_bytes(b"x" * 10)
    with pytest.raises(SystemExit, match="part2 in load 2 does not match"):
        kit.stage(argparse.Namespace(load=2))


def test_cuda_libraries_are_found_in_a_named_folder_or_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "libcudart.so.13").write_bytes(b"")
    assert str(tmp_path) in kit.cuda_library_dirs(["libcudart.so.13"], [str(tmp_path)])
    with pytest.raises(SystemExit, match="libsluice-nothing.so.99"):
        kit.cuda_library_dirs(["libsluice-nothing.so.99"], [str(tmp_path)])


def test_the_wheel_keeps_each_loaded_library_once_with_a_record_to_match(tmp_path: Path) -> None:
    import base64
    import hashlib
    import zipfile

    wheel = tmp_path / "llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
    as_built = {
        "llama_cpp/__init__.py": b"", "llama_cpp/lib/libllama.so": b"L", "llama_cpp/lib/libllama.so.0": b"L",
        "llama_cpp/lib/libllama.so.0.5.0": b"L", "llama_cpp/lib/libggml.so": b"G", "llama_cpp/lib/libggml.so.0": b"G",
        "llama_cpp/lib/libggml-cuda.so": b"C" * 100, "llama_cpp/lib/libggml-cuda.so.0": b"C" * 100,
        "llama_cpp/lib/libggml-cuda.so.0.25.3": b"C" * 100, "lib/libggml-cuda.so.0": b"C" * 100, "include/ggml.h": b"h",
        "llama_cpp_python-0.3.36.dist-info/METADATA": b"Name: llama-cpp-python",
        "llama_cpp_python-0.3.36.dist-info/RECORD": b"stale",
    }  # fmt: skip
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in as_built.items():
            out.writestr(name, data)
    kit.slim_wheel(wheel)
    with zipfile.ZipFile(wheel) as slim:
        names = set(slim.namelist())
        record = slim.read("llama_cpp_python-0.3.36.dist-info/RECORD").decode().splitlines()
        contents = {n: slim.read(n) for n in names}
    assert [n for n in names if "libggml-cuda" in n] == ["llama_cpp/lib/libggml-cuda.so.0"]
    assert {"llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml.so", "llama_cpp/__init__.py"} <= names
    assert not any(n.startswith(("lib/", "include/")) or n.endswith(".0.5.0") for n in names), names
    for line in record[:-1]:
        name, digest, size = line.split(",")
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(contents[name]).digest()).rstrip(b"=").decode()
        assert int(size) == len(contents[name])
    assert {line.split(",")[0] for line in record} == names


# -- make bench-gpu with no kit carried: no network, no setup ---------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _make_tree(tmp_path: Path) -> Path:
    """The Makefile and kit.py alone in a folder of their own, as a checkout with nothing built."""
    import shutil

    tree = tmp_path / "checkout"
    (tree / "bench" / "gpu").mkdir(parents=True)
    shutil.copy(REPO / "Makefile", tree / "Makefile")
    shutil.copy(REPO / "bench" / "gpu" / "kit.py", tree / "bench" / "gpu" / "kit.py")
    return tree


def _make(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os
    import shutil

    if not shutil.which("make"):
        pytest.skip("no make here")
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("MAKE", "MFLAGS")) and k not in ("PYTHON", "SLUICE_GPUKIT_HOME")}
    environ.update(SLUICE_GPUKIT_HOME=str(tree / "staged"), **env)
    return subprocess.run(["make", "--no-print-directory", *args], cwd=tree, env=environ, capture_output=True, text=True, timeout=60)


def test_make_bench_gpu_without_a_kit_checks_the_network_before_setup_and_with_one_runs_the_kit(tmp_path: Path) -> None:
    tree = _make_tree(tmp_path)
    plan = _make(tree, "-n", "bench-gpu").stdout.splitlines()
    assert plan[0] == "python3 bench/gpu/kit.py online", plan[:3]
    assert any("uv sync --locked" in line for line in plan[1:])  # setup comes after (make setup)
    (tree / ".gpukit" / "load-1").mkdir(parents=True)  # a load carried
    plan = _make(tree, "-n", "bench-gpu").stdout.splitlines()
    assert "python3 bench/gpu/kit.py device" in plan and not any("uv sync" in line or "kit.py online" in line for line in plan), plan
    (tree / ".gpukit-build").mkdir()  # the machine that built the kit: its path is the networked one
    assert _make(tree, "-n", "bench-gpu").stdout.splitlines()[0] == "python3 bench/gpu/kit.py online"


def test_make_bench_gpu_with_no_network_and_no_kit_exits_2_saying_to_carry_the_loads(tmp_path: Path) -> None:
    """The real make and kit.py, the package index an address that refuses (no network): it stops
    before make setup (whose first step, installing uv, would retry and fail about something else)."""
    tree = _make_tree(tmp_path)
    proc = _make(tree, "bench-gpu", UV_DEFAULT_INDEX=f"http://127.0.0.1:{_closed_port()}/simple")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "gpukit: no network and no kit carried: carry .gpukit/load-K (make bench-gpu-kit builds them)" in proc.stdout
    assert "== libs/sluice-protos" not in proc.stdout and not (tree / ".tools").exists()  # make setup never started


def test_the_network_check_reads_the_index_setup_uses_and_gives_up_after_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket
    import time

    assert kit.index_address({}) == ("pypi.org", 443)
    assert kit.index_address({"UV_DEFAULT_INDEX": "http://mirror.local:3141/root/pypi"}) == ("mirror.local", 3141)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert kit.reachable(server.getsockname(), timeout=5)
    assert not kit.reachable(("127.0.0.1", _closed_port()), timeout=5)
    # A name lookup that hangs (no network, no resolver answering) is not waited for past the timeout.
    monkeypatch.setattr(kit.socket, "create_connection", lambda *_, **__: time.sleep(30))
    t0 = time.monotonic()
    assert not kit.reachable(("pypi.org", 443), timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_online_says_what_to_carry_and_exits_2_without_a_network(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(kit, "reachable", lambda *_: False)
    assert kit.online(argparse.Namespace()) == 2
    assert "no network and no kit carried: carry .gpukit/load-K (make bench-gpu-kit builds them)" in capsys.readouterr().out
    monkeypatch.setattr(kit, "reachable", lambda *_: True)
    assert kit.online(argparse.Namespace()) == 0 and capsys.readouterr().out == ""


# -- the device command's deadline ----------------------------------------------------------------------


def _staged_bench(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, script_text: str) -> Path:
    """The made-up kit staged, a venv whose python is this one, `script_text` as the bench; its log
    under tmp_path/out, returned."""
    import sys

    _kit(tmp_path, monkeypatch)
    for load in (1, 2):
        kit.stage(argparse.Namespace(load=load))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = tmp_path / "bench.py"
    script.write_text(script_text)
    monkeypatch.setattr(kit, "install", lambda *_, **__: venv)
    monkeypatch.setattr(kit, "cuda_library_dirs", lambda *_: [])
    monkeypatch.setattr(kit, "GPU_BENCH", str(script))
    monkeypatch.setattr(kit, "LOG", kit.Log())
    out = tmp_path / "out"
    out.mkdir()
    kit.LOG.open(str(out))
    return out / kit.LOG_NAME


def test_a_bench_that_hangs_is_stopped_at_the_deadline_with_a_line_naming_its_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    log = _staged_bench(
        tmp_path,
        monkeypatch,
        "import os, time\nprint('deadline', os.environ['BENCH_GPU_DEADLINE_S'], flush=True)\n"
        "print('BENCH gpu batch=8 decode_tok_s=2.0', flush=True)\ntime.sleep(60)\n",
    )
    monkeypatch.setattr(kit, "DEADLINE", kit.Deadline(3))
    t0 = time.monotonic()
    assert kit.run(argparse.Namespace(dry_run=False)) == kit.DEADLINE_EXIT
    assert time.monotonic() - t0 < 20
    text = log.read_text()
    assert "deadline 1\n" in text  # the bench's own deadline, under the kit's, at least 1 s
    last = text.strip().splitlines()[-1]
    assert last.startswith("gpukit: deadline: 3 s (SLUICE_GPUKIT_DEADLINE_S) passed in phase: the bench")
    assert "after its line: BENCH gpu batch=8 decode_tok_s=2.0" in last


def test_a_bench_past_its_own_deadline_leaves_its_tracebacks_and_the_kit_names_its_phase(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu.py arms faulthandler at BENCH_GPU_DEADLINE_S, before the kit's watchdog: where it hung."""
    log = _staged_bench(
        tmp_path,
        monkeypatch,
        "import faulthandler, os, time\nfaulthandler.dump_traceback_later(float(os.environ['BENCH_GPU_DEADLINE_S']), exit=True)\n"
        "print('BENCH gpu batch=8 decode_tok_s=2.0', flush=True)\n\ndef protocol_decode():\n    time.sleep(60)\n\nprotocol_decode()\n",
    )
    monkeypatch.setattr(kit, "DEADLINE", kit.Deadline(10))
    assert kit.run(argparse.Namespace(dry_run=False)) == kit.DEADLINE_EXIT
    text = log.read_text()
    assert "Timeout (" in text and "in protocol_decode" in text  # the bench's own tracebacks
    assert (
        text.strip()
        .splitlines()[-1]
        .startswith(
            "gpukit: deadline: 10 s (SLUICE_GPUKIT_DEADLINE_S) passed in phase: the bench (bench/engine/gpu.py), after its line: BENCH gpu batch=8"
        )
    )


def test_a_phase_before_the_bench_that_overruns_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    log = _staged_bench(tmp_path, monkeypatch, "print('never run')\n")
    monkeypatch.setattr(kit, "DEADLINE", kit.Deadline(0.5))
    monkeypatch.setattr(kit, "install", lambda *_, **__: time.sleep(1) or tmp_path / "venv")
    assert kit.run(argparse.Namespace(dry_run=False)) == kit.DEADLINE_EXIT
    assert (
        log.read_text().strip().splitlines()[-1].startswith("gpukit: deadline: 0 s (SLUICE_GPUKIT_DEADLINE_S) passed in phase: installing the wheels")
    )
    assert "never run" not in log.read_text()


def test_a_device_command_past_its_deadline_while_staging_says_so_and_exits_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import shutil
    import sys

    tree = _make_tree(tmp_path)
    _kit(tmp_path, monkeypatch)
    shutil.move(tmp_path / ".gpukit", tree / ".gpukit")
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, SLUICE_GPUKIT_DEADLINE_S="0", SLUICE_GPUKIT_HOME=str(tmp_path / "staged"), OUT=str(out))
    proc = subprocess.run([sys.executable, "bench/gpu/kit.py", "device"], cwd=tree, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == kit.DEADLINE_EXIT == 4, proc.stdout + proc.stderr
    assert "gpukit: deadline: 0 s (SLUICE_GPUKIT_DEADLINE_S) passed in phase: starting" in (out / kit.LOG_NAME).read_text()


def test_the_kits_deadline_is_under_the_device_calls_timeout_the_docs_give() -> None:
    import re

    docs = (REPO / "docs" / "contributors" / "benchmarks.md").read_text()
    timeout_s = int(re.search(r"`timeout_s` (\d+)", docs).group(1))  # type: ignore[union-attr]
    assert kit.DEADLINE_S + 30 <= timeout_s, (kit.DEADLINE_S, timeout_s)  # time left for the line and the files to come back


# -- check: each load beside the checkout as it is now ----------------------------------------------


def test_check_passes_loads_that_fit_beside_the_checkout_and_refuses_one_that_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _kit(tmp_path, monkeypatch)
    load_2 = sum(p.stat().st_size for p in (kit.KIT / "load-2").iterdir())
    monkeypatch.setattr(kit, "carried_tree_bytes", lambda: kit.CARRY_LIMIT - load_2)  # load 2 exactly fills a command
    assert kit.check(argparse.Namespace()) == 0
    assert "2 loads, each within 64 MiB beside the checkout as it is now" in capsys.readouterr().out
    monkeypatch.setattr(kit, "carried_tree_bytes", lambda: kit.CARRY_LIMIT - load_2 + 1)  # the checkout grew a byte
    assert kit.check(argparse.Namespace()) == 1
    out = capsys.readouterr().out
    assert "load-2 with the checkout is 64.0 MiB, over the 64 MiB a device command carries" in out and "load-1 with" not in out
    assert "re-run `python3 bench/gpu/kit.py build`" in out


def test_check_refuses_a_load_missing_or_not_as_its_manifest_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    monkeypatch.setattr(kit, "KIT", tmp_path / ".gpukit")
    with pytest.raises(SystemExit, match="no kit built here"):
        kit.check(argparse.Namespace())
    _kit(tmp_path, monkeypatch)
    monkeypatch.setattr(kit, "carried_tree_bytes", lambda: 0)
    (kit.KIT / "load-1" / "a.whl").write_bytes(b"wheel, longer")
    shutil.rmtree(kit.KIT / "load-2")
    assert kit.check(argparse.Namespace()) == 1
    out = capsys.readouterr().out
    assert "load-1/a.whl is missing or not its manifest's size" in out and "load-2 is missing" in out


def test_carried_tree_bytes_counts_this_checkout() -> None:
    assert 2**20 < kit.carried_tree_bytes() < kit.CARRY_LIMIT


# -- the kit's wheels against the lock ----------------------------------------------------------------


def test_every_engine_wheel_and_the_cuda_build_have_a_locked_version() -> None:
    """download_engine_wheels pins each of ENGINE_WHEELS at triton-local's uv.lock: a name the lock
    does not have (renamed, dropped) would fail only in `make bench-gpu-kit`, 40 minutes in."""
    versions = kit.lock_versions([*kit.ENGINE_WHEELS, "llama-cpp-python"])
    assert set(versions) == {*kit.ENGINE_WHEELS, "llama-cpp-python"} and all(versions.values())
