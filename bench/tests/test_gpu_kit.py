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
    manifest = {"loads": 2, "files": files, "model": {"name": kit.MODEL, "size": len(model), "sha256": kit.sha256(model_path)}}
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
