"""deploy/triton/models loaded the way the image loads it: by a real tritonserver and its Python backend.

The server is the one the nvidia-pytriton wheel ships (tritonserver 2.51, in triton-local's env),
started as the image's ENTRYPOINT starts it: `--model-control-mode=explicit`, loading
`smollm2_step` and `minilm_embed` from deploy/triton/models. The Python backend's interpreter runs
in deploy/triton/.venv, which `make setup` syncs from exactly deploy/triton/requirements.txt (the
list the Dockerfile installs), with the package source on sys.path through a `sluice.pth` as the
Dockerfile lays it out (the same COPY source). Requests go through tritonclient's gRPC client.

Differences from the image, on purpose or forced: Python 3.11 here (the 25.01 image has 3.12; the
pins are compiled for both), tritonserver 2.51 (the 25.01 image has 2.54), ports chosen free on
127.0.0.1, the step model's METRICS_PORT among them (the server loads a copy of the repository with
only that parameter changed, so that a triton-local on 9105 cannot clash with it). Not loaded here: `smollm2_vllm`, which needs the vLLM backend (only in the
*-vllm-python-py3 images; the wheel ships the Python backend alone). No GPU here: tritonserver
refuses a KIND_GPU instance itself, which is checked; the step model's own GPU selection is
checked by running its `placement` and `initialize` outside the server (see the GPU tests).
"""

from __future__ import annotations

import ast
import json
import os
import queue
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import config_vars

ROOT = config_vars.ROOT
TRITON_DIR = ROOT / "deploy" / "triton"
MODELS = TRITON_DIR / "models"
VENV_PYTHON = TRITON_DIR / ".venv" / "bin" / "python"
TRITON_LOCAL = ROOT / "services" / "triton-local"
TRITON_LOCAL_PYTHON = TRITON_LOCAL / ".venv" / "bin" / "python"
# The Dockerfile's COPY of the models' code, and the folder that stands for /opt/sluice here.
PACKAGE_COPY = "COPY services/triton-local/src/sluice_triton_local/ /opt/sluice/sluice_triton_local/"
PACKAGE_ROOT = TRITON_LOCAL / "src"
# The Dockerfile's COPY of the sluice_common modules the models use, into /opt/sluice/sluice_common/.
COMMON_MODULES = ("__init__.py", "cgroup.py", "errors.py", "sampling.py", "structured_outputs.py")
COMMON_COPY = "COPY " + " ".join(f"libs/sluice-common/src/sluice_common/{m}" for m in COMMON_MODULES) + " /opt/sluice/sluice_common/"
LOADED = ("smollm2_step", "minilm_embed")
READY_TIMEOUT_S = 120
# The step model's engine metrics port as config.pbtxt (and configs/gpu.pbtxt) sets it.
METRICS_PORT_LINE = 'parameters: { key: "METRICS_PORT", value: { string_value: "9105" } }'
# The last is over the model's 256 tokens: truncated, and UNTRUNCATED_TOKENS says by how much.
EMBED_TEXTS = ["Which city is the capital of France?", "Triton serves models over gRPC.", "ünïcode ✓", "word " * 300]


def _python_info(python: Path) -> dict[str, str]:
    script = "import json, site, sys, sysconfig; print(json.dumps({'version': f'{sys.version_info[0]}.{sys.version_info[1]}', 'libdir': sysconfig.get_config_var('LIBDIR'), 'site': site.getsitepackages()[0]}))"
    return json.loads(subprocess.run([str(python), "-c", script], capture_output=True, text=True, check=True).stdout)


def _pytriton_dir() -> Path:
    found = sorted(TRITON_LOCAL.glob(".venv/lib/python3*/site-packages/pytriton/tritonserver"))
    assert found, "services/triton-local/.venv has no nvidia-pytriton: run `make setup`"
    return found[0]


def _backends(tmp: Path, server_dir: Path, python_version: str) -> Path:
    """A backend directory as PyTriton makes one: the Python backend plus the stub built for the
    interpreter's version (the wheel keeps one stub per Python version beside the backend)."""
    python_backend = tmp / "backends" / "python"
    python_backend.mkdir(parents=True)
    for item in (server_dir / "backends" / "python").iterdir():
        if item.is_file():  # not __pycache__, which `make setup` compiles there
            shutil.copy(item, python_backend)
    stub = server_dir / "python_backend_stubs" / python_version / "triton_python_backend_stub"
    assert stub.is_file(), f"nvidia-pytriton ships no Python backend stub for Python {python_version}"
    shutil.copy(stub, python_backend)
    return tmp / "backends"


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Server:
    """One tritonserver process on free ports, its log in a file."""

    def __init__(self, backends: Path, env: dict[str, str], log: Path, *extra: str, repository: Path = MODELS) -> None:
        self.http, self.grpc, self.metrics = _free_ports(3)
        self.log = log
        command = [
            str(_pytriton_dir() / "bin" / "tritonserver"),
            f"--model-repository={repository}",
            "--model-control-mode=explicit",
            f"--backend-directory={backends}",
            *(f"--{kind}-address=127.0.0.1" for kind in ("http", "grpc", "metrics")),
            f"--http-port={self.http}",
            f"--grpc-port={self.grpc}",
            f"--metrics-port={self.metrics}",
            *extra,
        ]
        with log.open("w") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout: float) -> grpcclient.InferenceServerClient:
        client = grpcclient.InferenceServerClient(self.url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"tritonserver exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if client.is_server_ready():
                    return client
            except Exception:  # not listening yet
                pass
            time.sleep(0.25)
        pytest.fail(f"tritonserver not ready after {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def test_the_copied_sluice_common_modules_need_no_other() -> None:
    """The image holds only COMMON_MODULES of sluice_common: one of them importing another module
    of it fails the models' load (seen when `clip` moved to errors.py), long before a server starts."""
    source = ROOT / "libs" / "sluice-common" / "src" / "sluice_common"
    for module in COMMON_MODULES:
        for node in ast.walk(ast.parse((source / module).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sluice_common."):
                needed = node.module.split(".")[1] + ".py"
                assert needed in COMMON_MODULES, f"{module} imports {node.module}: add {needed} to the Dockerfile's COPY and COMMON_MODULES"


@pytest.fixture(scope="module")
def backend_env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The backend directory and the server's environment, with the Python backend's interpreter
    in deploy/triton/.venv (requirements.txt) and the package source laid out as in the image."""
    assert VENV_PYTHON.exists(), "deploy/triton/.venv is missing: run `make setup`"
    dockerfile = (TRITON_DIR / "Dockerfile").read_text()
    assert PACKAGE_COPY in dockerfile and COMMON_COPY in dockerfile and "/opt/sluice > " in dockerfile and "sluice.pth" in dockerfile
    info = _python_info(VENV_PYTHON)
    # The image's .pth names /opt/sluice, which holds sluice_triton_local/ and sluice_common/ with
    # only the copied modules: here, the package's COPY source and a folder with just those modules.
    common = tmp_path_factory.mktemp("opt-sluice")
    (common / "sluice_common").mkdir()
    for module in COMMON_MODULES:
        shutil.copy(ROOT / "libs" / "sluice-common" / "src" / "sluice_common" / module, common / "sluice_common" / module)
    Path(info["site"], "sluice.pth").write_text(f"{PACKAGE_ROOT}\n{common}\n")
    server_dir = _pytriton_dir()
    env = dict(os.environ)
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(name, None)
    env.update(
        # The stub embeds Python and finds its prefix from `python3` on PATH: the venv's (as
        # PyTriton does). It links a system libpython3.11: this interpreter's must win (the
        # libpython fix of services/triton-local's server.py); the wheel's own libraries after it.
        PATH=f"{VENV_PYTHON.parent}:{env['PATH']}",
        LD_LIBRARY_PATH=":".join(filter(None, [info["libdir"], str(server_dir.parent.parent / "nvidia_pytriton.libs"), env.get("LD_LIBRARY_PATH")])),
        OMP_NUM_THREADS="1",  # as the Dockerfile's ENV
        OPENBLAS_NUM_THREADS="1",
    )
    return _backends(tmp_path_factory.mktemp("triton"), server_dir, info["version"]), env


@pytest.fixture(scope="module")
def step_metrics_port() -> int:
    """The free port the step model serves its engine metrics on here (its METRICS_PORT)."""
    (port,) = _free_ports(1)
    return port


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory, step_metrics_port: int) -> Path:
    """deploy/triton/models, copied with only the step model's METRICS_PORT changed (to a free port)."""
    copy = tmp_path_factory.mktemp("models") / "models"
    shutil.copytree(MODELS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    config = copy / "smollm2_step" / "config.pbtxt"
    text = config.read_text()
    assert text.count(METRICS_PORT_LINE) == 1, "config.pbtxt serves the engine metrics on 9105"
    config.write_text(text.replace(METRICS_PORT_LINE, METRICS_PORT_LINE.replace('"9105"', f'"{step_metrics_port}"')))
    return copy


@pytest.fixture(scope="module")
def triton_server(backend_env: tuple[Path, dict[str, str]], repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    backends, env = backend_env
    log = tmp_path_factory.mktemp("triton-log") / "tritonserver.log"
    server = Server(backends, env, log, *(f"--load-model={name}" for name in LOADED), repository=repository)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def triton(triton_server: Server) -> Iterator[grpcclient.InferenceServerClient]:
    client = triton_server.wait_ready(READY_TIMEOUT_S)
    yield client
    client.close()


# ---- the step model ----------------------------------------------------------------------------


STEP_OUTPUTS = ("ROW_SEQ_ID", "TOKEN_ID", "TEXT", "FINISH", "PROMPT_TOKENS", "COMPLETION_TOKENS", "CACHED_TOKENS", "ERROR", "LOGPROBS")


def _round(client: grpcclient.InferenceServerClient, rows: list[tuple[int, int, bytes]], steps: int = 1) -> list[list[dict[str, object]]]:
    """One request to the decoupled step model over a gRPC stream: each response's rows (a
    response per engine step), until the one marked ROUND_END."""
    inputs = []
    for name, values, datatype in (
        ("ACTION", np.array([a for a, _, _ in rows], dtype=np.int32), "INT32"),
        ("SEQ_ID", np.array([s for _, s, _ in rows], dtype=np.int64), "INT64"),
        ("REQUEST", np.array([r for _, _, r in rows], dtype=np.object_), "BYTES"),
        ("STEPS", np.array([steps], dtype=np.int32), "INT32"),
    ):
        tensor = grpcclient.InferInput(name, list(values.shape), datatype)
        tensor.set_data_from_numpy(values)
        inputs.append(tensor)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("smollm2_step", inputs)
        responses = []
        while True:
            result, error = answers.get(timeout=120)
            assert error is None, error
            columns = {name: result.as_numpy(name) for name in STEP_OUTPUTS}
            responses.append(
                [
                    {k: (bytes(v[i]).decode() if isinstance(v[i], (bytes, np.bytes_)) else int(v[i])) for k, v in columns.items()}
                    for i in range(len(columns["ROW_SEQ_ID"]))
                ]
            )
            if bool(result.as_numpy("ROUND_END")[0]):
                return responses
    finally:
        client.stop_stream()


def _step(client: grpcclient.InferenceServerClient, action: int, request: bytes = b"", seq_id: int = 7) -> dict[str, object]:
    (response,) = _round(client, [(action, seq_id, request)])
    (row,) = response
    return row


def test_loaded_models_are_ready_on_the_cpu(triton: grpcclient.InferenceServerClient) -> None:
    for name in LOADED:
        assert triton.is_model_ready(name), name
        config = triton.get_model_config(name, as_json=True)["config"]
        assert [group["kind"] for group in config["instance_group"]] == ["KIND_CPU"], name


def test_step_model_prefills_and_decodes_to_the_end(triton: grpcclient.InferenceServerClient) -> None:
    prefill = json.dumps({"messages": [["user", "Which city is the capital of France?"]], "max_tokens": 16}).encode()
    first = _step(triton, 1, prefill)
    assert not first["ERROR"], first
    assert first["TOKEN_ID"] >= 0 and first["TEXT"] and first["PROMPT_TOKENS"] > 0, first
    text, row = first["TEXT"], first
    while not row["FINISH"]:
        row = _step(triton, 2)
        assert row["TOKEN_ID"] >= 0 and not row["ERROR"], row
        text += row["TEXT"]
    assert row["FINISH"] in ("stop", "length") and 0 < row["COMPLETION_TOKENS"] <= 16, row
    assert "Paris" in text, text
    assert _step(triton, 3)["FINISH"] == "", "release answers an empty row"


def test_step_model_answers_logprobs_when_asked(triton: grpcclient.InferenceServerClient) -> None:
    """LOGPROBS (declared in config.pbtxt): OpenAI's chat entry as JSON for a row that asked, empty otherwise."""
    asked = json.dumps({"messages": [["user", "Say hi."]], "max_tokens": 1, "logprobs": 3}).encode()
    plain = json.dumps({"messages": [["user", "Say hi."]], "max_tokens": 1}).encode()
    (rows,) = _round(triton, [(1, 11, asked), (1, 12, plain)])
    entry = json.loads(rows[0]["LOGPROBS"])
    assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3, entry
    values = [t["logprob"] for t in entry["top_logprobs"]]
    assert values == sorted(values, reverse=True) and entry["top_logprobs"][0]["token"] == entry["token"], entry
    assert rows[1]["LOGPROBS"] == "", rows[1]


def test_step_model_runs_a_round_of_steps_per_request(triton: grpcclient.InferenceServerClient) -> None:
    """A round of 8 steps: 8 responses of one token each, as the engine makes them, the last marked;
    a sequence that ends ends the round early."""
    prefill = json.dumps({"messages": [["user", "Write a short poem about rivers."]], "max_tokens": 100}).encode()
    responses = _round(triton, [(1, 9, prefill)], steps=8)
    assert len(responses) == 8 and all(len(rows) == 1 and rows[0]["ROW_SEQ_ID"] == 9 for rows in responses)
    assert [rows[0]["COMPLETION_TOKENS"] for rows in responses] == list(range(1, 9))
    assert all(rows[0]["TOKEN_ID"] >= 0 and not rows[0]["FINISH"] for rows in responses)
    full = _round(triton, [(2, 9, b"")], steps=64)
    assert len(full) == 64 and full[-1][0]["COMPLETION_TOKENS"] == 72 and not full[-1][0]["FINISH"]
    short = _round(triton, [(2, 9, b"")], steps=64)
    assert len(short) == 28 and short[-1][0]["FINISH"] == "length" and short[-1][0]["COMPLETION_TOKENS"] == 100


def test_step_model_reuses_a_cached_prompt_prefix(triton: grpcclient.InferenceServerClient) -> None:
    """The prefix cache (PREFIX_CACHE "true"): the same prompt again prefills only its last token,
    says so in CACHED_TOKENS, and answers the same greedy text."""
    prefill = json.dumps({"messages": [["system", "You only ever answer with one word."], ["user", "Name a colour."]], "max_tokens": 6}).encode()
    answers = []
    for seq_id in (21, 22):
        rounds = _round(triton, [(1, seq_id, prefill)], steps=8)
        answers.append(("".join(rows[0]["TEXT"] for rows in rounds), rounds[0][0]))
        assert rounds[-1][0]["FINISH"], rounds[-1]
    (cold_text, cold), (warm_text, warm) = answers
    assert cold["CACHED_TOKENS"] == 0 and warm["CACHED_TOKENS"] == warm["PROMPT_TOKENS"] - 1, (cold, warm)
    assert warm_text == cold_text


def test_step_model_rejects_a_bad_row_as_invalid(triton: grpcclient.InferenceServerClient) -> None:
    row = _step(triton, 9, seq_id=8)
    assert row["FINISH"] == "invalid" and "unknown ACTION" in row["ERROR"], row


def _scrape(port: int) -> dict[str, float]:
    """The samples of a Prometheus /metrics page on 127.0.0.1, by name with its labels as written."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}


def test_step_model_serves_the_engine_metrics_on_its_metrics_port(
    triton: grpcclient.InferenceServerClient, triton_server: Server, step_metrics_port: int
) -> None:
    """The engine records its metrics in the model's stub process, which serves them on METRICS_PORT
    with the names triton-local's model process serves (the rules, the dashboard and `sluice
    diagnose` read them); Triton's own metrics port has none of them."""
    before = _scrape(step_metrics_port)
    assert before["sluice_triton_local_max_slots"] == 8, "MAX_SLOTS of config.pbtxt"
    prefill = json.dumps({"messages": [["user", "Write a short poem about rivers."]], "max_tokens": 5}).encode()
    responses = _round(triton, [(1, 31, prefill)], steps=8)
    assert responses[-1][0]["FINISH"] == "length" and responses[-1][0]["COMPLETION_TOKENS"] == 5, responses[-1]
    after = _scrape(step_metrics_port)
    tokens = "sluice_triton_local_tokens_generated_total"
    assert after[tokens] - before[tokens] == 5, (before[tokens], after[tokens])
    assert after["sluice_triton_local_active_slots"] == 0, "the finished sequence gave its slot back"
    assert after["sluice_triton_local_step_seconds_count"] > before["sluice_triton_local_step_seconds_count"]
    lookups = [f'sluice_triton_local_prefix_cache_lookups_total{{result="{result}"}}' for result in ("hit", "miss")]
    assert sum(after[name] - before[name] for name in lookups) == 1, "one prefill, a hit or a miss"
    assert not [name for name in _scrape(triton_server.metrics) if name.startswith("sluice_")], "Triton's port carries only Triton's"


# ---- the embedding model -----------------------------------------------------------------------


def _reference_embeddings(texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """triton-local's numpy encoder, run in triton-local's own environment."""
    script = (
        "import json, sys; from sluice_triton_local.embeddings import MiniLMEncoder;"
        " v, c, u = MiniLMEncoder().encode_counted(json.loads(sys.argv[1]));"
        " print(json.dumps({'vectors': v.tolist(), 'counts': c.tolist(), 'untruncated': u.tolist()}))"
    )
    assert TRITON_LOCAL_PYTHON.exists(), "services/triton-local/.venv is missing: run `make setup`"
    done = subprocess.run([str(TRITON_LOCAL_PYTHON), "-c", script, json.dumps(texts)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    return np.array(out["vectors"], dtype=np.float32), np.array(out["counts"], dtype=np.int32), np.array(out["untruncated"], dtype=np.int32)


def test_embedding_model_has_the_interface_the_adapter_calls(triton: grpcclient.InferenceServerClient) -> None:
    """services/inference-adapter's TritonEmbedBackend: TEXT in; EMBEDDING, TOKENS and UNTRUNCATED_TOKENS out."""
    metadata = triton.get_model_metadata("minilm_embed", as_json=True)
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["inputs"]] == [("TEXT", "BYTES", ["-1"])]
    outputs = {t["name"]: (t["datatype"], t["shape"]) for t in metadata["outputs"]}
    assert outputs == {"EMBEDDING": ("FP32", ["-1", "384"]), "TOKENS": ("INT32", ["-1"]), "UNTRUNCATED_TOKENS": ("INT32", ["-1"])}


def test_embedding_model_equals_triton_local_encoder(triton: grpcclient.InferenceServerClient) -> None:
    texts = np.array([t.encode() for t in EMBED_TEXTS], dtype=np.object_)
    tensor = grpcclient.InferInput("TEXT", [len(EMBED_TEXTS)], "BYTES")
    tensor.set_data_from_numpy(texts)
    names = ("EMBEDDING", "TOKENS", "UNTRUNCATED_TOKENS")
    result = triton.infer("minilm_embed", [tensor], outputs=[grpcclient.InferRequestedOutput(n) for n in names])
    vectors, tokens, untruncated = (result.as_numpy(name) for name in names)
    assert vectors.dtype == np.float32 and vectors.shape == (len(EMBED_TEXTS), 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    expected_vectors, expected_tokens, expected_untruncated = _reference_embeddings(EMBED_TEXTS)
    np.testing.assert_allclose(vectors, expected_vectors, atol=1e-5)
    assert tokens.dtype == np.int32 and tokens.tolist() == expected_tokens.tolist()
    assert untruncated.dtype == np.int32 and untruncated.tolist() == expected_untruncated.tolist()


# ---- the step model on a GPU -------------------------------------------------------------------


def test_gpu_config_variant_is_what_triton_loads_with_model_config_name(backend_env, tmp_path: Path) -> None:
    """`--model-config-name=gpu` (the gpu overlay, compose) makes Triton read the step model's
    configs/gpu.pbtxt: a KIND_GPU instance on GPU 0, which this GPU-less server refuses before the
    model runs (without the variant, the same command loads the KIND_CPU config.pbtxt)."""
    backends, env = backend_env
    server = Server(backends, env, tmp_path / "gpu.log", "--load-model=smollm2_step", "--model-config-name=gpu")
    try:
        server.process.wait(timeout=60)
    finally:
        server.stop()
    assert server.process.returncode != 0
    assert "of model smollm2_step specifies invalid or unsupported gpu id 0" in server.log_tail()


GPU_SELECTION = r"""
import json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # Triton's triton_python_backend_utils.py; the model's folder
import llama_cpp
import model

cpu = model.placement({"model_instance_kind": "CPU", "model_instance_device_id": "0"}, "llamacpp")
assert cpu == model.Placement(gpu_layers=0, main_gpu=None), cpu

gpu_args = {"model_instance_kind": "GPU", "model_instance_device_id": "1", "model_instance_name": "smollm2_step_0_0",
            "model_config": open(sys.argv[3]).read()}
assert not llama_cpp.llama_supports_gpu_offload(), "this check expects the CPU build of llama.cpp"
try:
    model.TritonPythonModel().initialize(gpu_args)  # the load Triton would run on a GPU node
except model.GpuOffloadUnavailable as exc:
    load_error = str(exc)
else:
    raise AssertionError("a KIND_GPU instance loaded on a CPU build of llama.cpp")

try:
    model.placement(gpu_args, "numpy")
except ValueError as exc:
    numpy_error = str(exc)

# A true or false parameter is read as written, and anything else refused rather than read as false.
assert model._flag({}, "PREFIX_CACHE", "true") is True
assert model._flag({"PREFIX_CACHE": " False "}, "PREFIX_CACHE", "true") is False
try:
    model._flag({"PREFIX_CACHE": "1"}, "PREFIX_CACHE", "true")
except ValueError as exc:
    assert 'PREFIX_CACHE must be "true" or "false"' in str(exc), exc
else:
    raise AssertionError("PREFIX_CACHE=1 was accepted")

# The GPU branch itself, with llama.cpp answering as a CUDA build does (no GPU here to run one).
llama_cpp.llama_supports_gpu_offload = lambda: True
gpu = model.placement(gpu_args, "llamacpp")
print(json.dumps({"load_error": load_error, "numpy_error": numpy_error, "gpu": [gpu.gpu_layers, gpu.main_gpu]}))
"""


def test_step_model_on_kind_gpu_fails_to_load_on_a_cpu_build_and_names_the_fix(tmp_path: Path) -> None:
    """model.py's device selection, in the image's environment with Triton's own
    triton_python_backend_utils module: the tritonserver here cannot create a KIND_GPU instance."""
    config = MODELS / "smollm2_step" / "configs" / "gpu.pbtxt"
    as_json = json.dumps({"name": "smollm2_step", "parameters": {"ENGINE": {"string_value": "llamacpp"}}})
    config_file = tmp_path / "model_config.json"
    config_file.write_text(as_json)
    assert "kind: KIND_GPU" in config.read_text()
    done = subprocess.run(
        [str(VENV_PYTHON), "-c", GPU_SELECTION, str(_pytriton_dir() / "backends" / "python"), str(MODELS / "smollm2_step" / "1"), str(config_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "KIND_GPU (device 1)" in out["load_error"] and "--build-arg LLAMA_BUILD=cuda" in out["load_error"], out
    assert "KIND_CPU" in out["numpy_error"], out
    assert out["gpu"] == [-1, 1], "KIND_GPU puts every layer on the instance's device"


METRICS_PORT_CHECKS = r"""
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]  # Triton's triton_python_backend_utils.py; the model's folder
import model

one = {"instance_group": [{"count": 1, "kind": "KIND_CPU", "gpus": []}]}
assert model.metrics_port(one, {"METRICS_PORT": "9105"}) == 9105
assert model.metrics_port(one, {}) == 9105, "config.pbtxt's value when the parameter is left out"
two_gpus = {"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]}
assert model.instances(two_gpus) == 2 and model.instances({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]}) == 2
for config in (two_gpus, {"instance_group": [{"count": 2, "kind": "KIND_CPU", "gpus": []}]}):
    assert model.metrics_port(config, {"METRICS_PORT": "0"}) == 0
    try:
        model.metrics_port(config, {"METRICS_PORT": "9105"})
    except ValueError as exc:
        assert "instance_group makes 2" in str(exc) and "METRICS_PORT 0" in str(exc), exc
    else:
        raise AssertionError(f"two instances would both bind METRICS_PORT: {config}")
print("ok")
"""


def test_step_model_serves_its_metrics_port_from_one_instance_only(backend_env) -> None:
    """Each instance is a stub process with its own engine and metrics, and one port: with two
    instances (KIND_CPU count 2, or KIND_GPU on two GPUs) METRICS_PORT is refused, 0 is not
    (backend_env: the image's sys.path, sluice_common included)."""
    done = subprocess.run(
        [str(VENV_PYTHON), "-c", METRICS_PORT_CHECKS, str(_pytriton_dir() / "backends" / "python"), str(MODELS / "smollm2_step" / "1")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(PACKAGE_ROOT)},
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
