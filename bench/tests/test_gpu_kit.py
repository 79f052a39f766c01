"""The offline GPU kit's packing and checks (bench/gpu/kit.py); `python3 bench/gpu/kit.py prove`
runs the kit itself, which needs its CUDA build (many minutes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from gpu import kit

MiB = 2**20


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
    monkeypatch.setattr(kit, "install", lambda _: venv)
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
