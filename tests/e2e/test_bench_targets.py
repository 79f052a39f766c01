"""Every `make bench-*` target still starts (issue 22, item 11): its script or module exists, imports
in the environment the Makefile runs it with and has a main(); the measuring scripts a bench starts
in triton-local's environment (bench/engine/*.py) import there too; a script with options parses --help.

Cheap (a few seconds, nothing started): it catches a bench broken at import or argument level
before anyone waits on a stack for it."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_stack import REPO_ROOT, Stack

MAKEFILE = REPO_ROOT / "Makefile"
# A recipe line that runs Python from a project's environment: a script or a module.
COMMAND = re.compile(r"^\t(?P<python>\S+/\.venv/bin/python) (?:-m (?P<module>[\w.]+)|(?P<script>\S+\.py))(?P<args>.*)$")
# A script a bench starts in triton-local's environment, e.g. [str(PYTHON), str(REPO_ROOT / "bench" / "engine" / "decode.py")].
STARTED_SCRIPT = re.compile(r'"bench"\s*/\s*"engine"\s*/\s*"(\w+\.py)"')
TRITON_LOCAL_PYTHON = "services/triton-local/.venv/bin/python"

# Run once per environment: imports each script (not as __main__) or module named on its command
# line ("script:<path>", "module:<name>", "started:<path>") and checks that a target has a main().
PROBE = """
import importlib, importlib.util, sys
for index, entry in enumerate(sys.argv[1:]):
    kind, name = entry.split(":", 1)
    if kind in ("script", "started"):
        sys.path.insert(0, name.rsplit("/", 1)[0])  # as `python path/to/script.py` has it
        spec = importlib.util.spec_from_file_location(f"bench_probe_{index}", name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        sys.path.pop(0)
    else:
        module = importlib.import_module(name)
    assert callable(getattr(module, "main", None)) or kind == "started", f"{name} has no main()"
    print("ok", entry, flush=True)
"""


@dataclass(frozen=True)
class BenchCommand:
    target: str
    python: str
    module: str | None
    script: str | None


def bench_commands() -> list[BenchCommand]:
    commands, target = [], ""
    for line in MAKEFILE.read_text().splitlines():
        if match := re.match(r"^(bench-[\w-]+):", line):
            target = match.group(1)
        elif not line.startswith("\t"):
            target = ""
        elif target and (command := COMMAND.match(line)):
            commands.append(BenchCommand(target, command["python"], command["module"], command["script"]))
    return commands


def bench_targets() -> set[str]:
    phony = next(line for line in MAKEFILE.read_text().splitlines() if line.startswith(".PHONY:"))
    return {name for name in phony.split()[1:] if name.startswith("bench-")}


def test_every_bench_target_runs_one_python_entry_point() -> None:
    commands = bench_commands()
    assert {c.target for c in commands} == bench_targets()
    assert len(commands) == len(bench_targets()), [c.target for c in commands]
    for command in commands:
        assert (REPO_ROOT / command.script).is_file() if command.script else command.module, command


def _probes() -> list[tuple[str, list[str]]]:
    """(what, command line) of every check: one interpreter per environment imports what runs in
    it, and each script with options is asked for --help."""
    imports: dict[str, list[str]] = {}
    probes: list[tuple[str, list[str]]] = []
    for command in bench_commands():
        python = str(REPO_ROOT / command.python)
        if command.script:
            path = REPO_ROOT / command.script
            source = path.read_text()
            imports.setdefault(python, []).append(f"script:{path}")
            started = [f"started:{REPO_ROOT / 'bench' / 'engine' / script}" for script in STARTED_SCRIPT.findall(source)]
            imports.setdefault(str(REPO_ROOT / TRITON_LOCAL_PYTHON), []).extend(started)
            if "parse_args(" in source:
                probes.append((f"{command.target} --help", [python, str(path), "--help"]))
        else:
            imports.setdefault(python, []).append(f"module:{command.module}")
    probes += [(f"imports in {python}", [python, "-c", PROBE, *dict.fromkeys(entries)]) for python, entries in imports.items()]
    return probes


def test_every_bench_script_imports_and_parses_its_arguments() -> None:
    probes = _probes()
    assert sum("started:" in arg for _, argv in probes for arg in argv) >= 3  # the engine benches are found
    missing = [argv[0] for _, argv in probes if not Path(argv[0]).exists()]
    if missing:
        pytest.fail(f"run `make setup` first: {sorted(set(missing))} missing")
    # All at once: each is an interpreter's start and imports, nothing more.
    running = [(what, subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
               for what, argv in probes]  # fmt: skip
    failed = []
    for what, process in running:
        output, _ = process.communicate(timeout=180)
        if process.returncode != 0:
            failed.append(f"{what} (exit {process.returncode}):\n{output[-2000:]}")
    assert not failed, "\n\n".join(failed)


def test_bench_path_drives_the_session_stacks_step_model_as_the_adapter_does(stack: Stack) -> None:
    """bench-path's Triton path speaks the step protocol to the real step model (it once called a
    decoupled model with client.infer, which Triton refuses, and nothing caught it): one greedy
    request through it, in bench's own environment, gives a first token and its decode tokens."""
    script = (
        "import json, sys\n"
        "sys.path.insert(0, 'bench')\n"
        "import bench_path, tritonclient.grpc as triton\n"
        "client = triton.InferenceServerClient(sys.argv[1])\n"
        "chunks = list(bench_path.triton_chunks(client, 8))\n"
        "ttft, tokens_per_s = bench_path.measure(lambda: bench_path.triton_chunks(client, 8))\n"
        "print(json.dumps({'chunks': chunks, 'ttft': ttft, 'tokens_per_s': tokens_per_s}))\n"
    )
    python = REPO_ROOT / "bench" / ".venv" / "bin" / "python"
    done = subprocess.run([str(python), "-c", script, stack.triton_grpc_address], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    texts, finals = [text for text, _ in result["chunks"]], [tokens for _, tokens in result["chunks"] if tokens is not None]
    assert "".join(texts), result
    assert finals == [8], result  # the last chunk carries the engine's count: max_tokens, greedy from "Hi!"
    assert result["ttft"] > 0 and result["tokens_per_s"] > 0, result
