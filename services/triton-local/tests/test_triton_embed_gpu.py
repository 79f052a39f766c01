"""The GPU embedding ensemble of the official Triton image (deploy/triton/models/minilm_embed_gpu,
minilm_tokenize, minilm_onnx), checked without Triton and without a GPU: the configs parsed with
Triton's own protobuf schema (tritonclient's model_config_pb2), the ensemble's wiring checked as
Triton checks it at load time, and the whole pipeline run step by step as the ensemble maps it
(the tokenizer's model.py with a stand-in for triton_python_backend_utils, the ONNX graph with
onnxruntime on the CPU) against the numpy encoder."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from google.protobuf import text_format
from conftest import MINILM_TEXTS as TEXTS
from conftest import ONNX_MAX_ABS_DIFF as MAX_ABS_DIFF
from tritonclient.grpc import model_config_pb2 as mc

from sluice_triton_local.embeddings import EMBEDDING_DIM, MiniLMEncoder
from sluice_triton_local.embeddings.interface import INPUT_NAME, OUTPUT_NAME, TOKENIZE_OUTPUTS, TOKENS_NAME, UNTRUNCATED_TOKENS_NAME

MODELS = Path(__file__).resolve().parents[3] / "deploy" / "triton" / "models"
ENSEMBLE, TOKENIZE, ONNX_MODEL = "minilm_embed_gpu", "minilm_tokenize", "minilm_onnx"

ONNX_TYPES = {onnx.TensorProto.INT64: mc.TYPE_INT64, onnx.TensorProto.FLOAT: mc.TYPE_FP32}
NUMPY_TYPES = {np.dtype(np.int64): mc.TYPE_INT64, np.dtype(np.int32): mc.TYPE_INT32, np.dtype(np.float32): mc.TYPE_FP32}

Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def load_config(name: str) -> mc.ModelConfig:
    return text_format.Parse((MODELS / name / "config.pbtxt").read_text(), mc.ModelConfig())


@pytest.fixture(scope="module")
def configs() -> dict[str, mc.ModelConfig]:
    return {name: load_config(name) for name in (ENSEMBLE, TOKENIZE, ONNX_MODEL)}


# -- the ensemble's wiring, as Triton validates it (core: ensemble_utils.cc) -----------------


@dataclass(frozen=True)
class Signature:
    """An ensemble tensor as some model declares it."""

    data_type: int
    dims: tuple[int, ...]
    full_dims: tuple[int, ...]  # with the batch dimension, when the declaring model batches
    origin: str

    @classmethod
    def of(cls, tensor: mc.ModelInput | mc.ModelOutput, model: mc.ModelConfig) -> Signature:
        dims = tuple(tensor.dims)
        return cls(tensor.data_type, dims, (-1, *dims) if model.max_batch_size > 0 else dims, model.name)

    def conflict(self, other: Signature) -> str | None:
        """Triton's rule: same data type; dims equal up to -1 wildcards, either as declared or
        with the batch dimension (a batching and a non-batching model may share a tensor)."""
        if self.data_type != other.data_type:
            mine, theirs = mc.DataType.Name(self.data_type), mc.DataType.Name(other.data_type)
            return f"{mine} from {self.origin} vs {theirs} from {other.origin}"
        if not (dims_agree(self.dims, other.dims) or dims_agree(self.full_dims, other.full_dims)):
            return f"shape {list(self.full_dims)} from {self.origin} vs {list(other.full_dims)} from {other.origin}"
        return None


def dims_agree(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b))


def _step_problems(step: mc.ModelEnsembling.Step, model: mc.ModelConfig, available: dict[str, Signature]) -> list[str]:
    """One step's maps against its model's config; adds what it produces to `available`."""
    problems = []
    inputs = {tensor.name: tensor for tensor in model.input}
    for key, tensor in step.input_map.items():
        if key not in inputs:
            problems.append(f"{model.name} has no input {key!r}")
        elif tensor not in available:
            problems.append(f"{model.name}'s {key} reads {tensor!r}, which no ensemble input or earlier step provides")
        elif conflict := available[tensor].conflict(Signature.of(inputs[key], model)):
            problems.append(f"{tensor}: {conflict}")
    unmapped = [name for name, tensor in inputs.items() if name not in step.input_map and not tensor.optional]
    problems += [f"{model.name}'s input {name} is not mapped" for name in unmapped]
    outputs = {tensor.name: tensor for tensor in model.output}
    for key, tensor in step.output_map.items():
        if key not in outputs:
            problems.append(f"{model.name} has no output {key!r}")
        elif tensor in available:
            problems.append(f"{tensor!r} is written twice (again by {model.name})")
        else:
            available[tensor] = Signature.of(outputs[key], model)
    return problems


def ensemble_problems(ensemble: mc.ModelConfig, models: dict[str, mc.ModelConfig]) -> list[str]:
    """Everything wrong with the ensemble's wiring: [] when every step's inputs come from the
    ensemble's inputs or an earlier step, and names, data types and shapes agree throughout."""
    available = {tensor.name: Signature.of(tensor, ensemble) for tensor in ensemble.input}
    problems = []
    for step in ensemble.ensemble_scheduling.step:
        if step.model_name not in models:
            problems.append(f"step model {step.model_name!r} is not in the repository")
            continue
        model = models[step.model_name]
        if 0 < model.max_batch_size < ensemble.max_batch_size:
            problems.append(f"{model.name} batches up to {model.max_batch_size}, the ensemble up to {ensemble.max_batch_size}")
        problems += _step_problems(step, model, available)
    for tensor in ensemble.output:
        if tensor.name not in available:
            problems.append(f"ensemble output {tensor.name!r} is produced by no step")
        elif conflict := available[tensor.name].conflict(Signature.of(tensor, ensemble)):
            problems.append(f"{tensor.name}: {conflict}")
    return problems


def test_ensemble_speaks_the_adapters_embedding_interface(configs: dict[str, mc.ModelConfig]) -> None:
    ensemble = configs[ENSEMBLE]
    assert ensemble.platform == "ensemble" and ensemble.max_batch_size == 0
    assert [(t.name, t.data_type, list(t.dims)) for t in ensemble.input] == [(INPUT_NAME, mc.TYPE_STRING, [-1])]
    assert [(t.name, t.data_type, list(t.dims)) for t in ensemble.output] == [
        (OUTPUT_NAME, mc.TYPE_FP32, [-1, EMBEDDING_DIM]),
        (TOKENS_NAME, mc.TYPE_INT32, [-1]),
        (UNTRUNCATED_TOKENS_NAME, mc.TYPE_INT32, [-1]),
    ]


def test_ensemble_steps_connect(configs: dict[str, mc.ModelConfig]) -> None:
    assert [step.model_name for step in configs[ENSEMBLE].ensemble_scheduling.step] == [TOKENIZE, ONNX_MODEL]
    assert ensemble_problems(configs[ENSEMBLE], configs) == []


def _rename_onnx_input(ensemble: mc.ModelConfig) -> None:
    ensemble.ensemble_scheduling.step[1].input_map["attention_mask"] = "mask"


def _retype_tokens(ensemble: mc.ModelConfig) -> None:
    ensemble.output[1].data_type = mc.TYPE_INT64


def _swap_steps(ensemble: mc.ModelConfig) -> None:
    steps = list(ensemble.ensemble_scheduling.step)
    del ensemble.ensemble_scheduling.step[:]
    ensemble.ensemble_scheduling.step.extend(reversed(steps))


def _drop_embedding(ensemble: mc.ModelConfig) -> None:
    ensemble.ensemble_scheduling.step[1].output_map.pop("sentence_embedding")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (_rename_onnx_input, "'mask', which no ensemble input or earlier step provides"),
        (_retype_tokens, "TOKENS: TYPE_INT32 from minilm_tokenize vs TYPE_INT64"),
        (_swap_steps, "which no ensemble input or earlier step provides"),
        (_drop_embedding, "'EMBEDDING' is produced by no step"),
    ],
)
def test_the_wiring_check_catches_a_broken_ensemble(
    configs: dict[str, mc.ModelConfig], mutate: Callable[[mc.ModelConfig], None], expected: str
) -> None:
    broken = mc.ModelConfig()
    broken.CopyFrom(configs[ENSEMBLE])
    mutate(broken)
    assert any(expected in problem for problem in ensemble_problems(broken, configs)), ensemble_problems(broken, configs)


def test_step_models_run_where_they_should(configs: dict[str, mc.ModelConfig]) -> None:
    tokenize, encoder = configs[TOKENIZE], configs[ONNX_MODEL]
    assert tokenize.backend == "python" and [g.kind for g in tokenize.instance_group] == [mc.ModelInstanceGroup.KIND_CPU]
    assert (MODELS / TOKENIZE / "1" / "model.py").is_file()
    assert encoder.platform == "onnxruntime_onnx" and [g.kind for g in encoder.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
    # The .onnx file is built into the image, never committed; the version folder must exist
    # for the ensemble (Triton loads none without one).
    assert not list((MODELS / ONNX_MODEL).rglob("*.onnx"))
    assert (MODELS / ENSEMBLE / "1").is_dir()


def test_onnx_graph_matches_its_model_config(configs: dict[str, mc.ModelConfig], minilm_onnx_path: Path) -> None:
    config = configs[ONNX_MODEL]
    graph = onnx.load(str(minilm_onnx_path), load_external_data=False).graph

    def from_graph(value: onnx.ValueInfoProto) -> tuple[str, int, list[int]]:
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim]
        return value.name, ONNX_TYPES[value.type.tensor_type.elem_type], dims

    def from_config(tensor: mc.ModelInput | mc.ModelOutput) -> tuple[str, int, list[int]]:
        batch = [-1] if config.max_batch_size > 0 else []
        return tensor.name, tensor.data_type, batch + list(tensor.dims)

    assert [from_graph(v) for v in graph.input] == [from_config(t) for t in config.input]
    assert [from_graph(v) for v in graph.output] == [from_config(t) for t in config.output]


# -- the pipeline, run as the ensemble maps it -------------------------------------------------


def _stub_backend_utils() -> types.ModuleType:
    """The part of triton_python_backend_utils that minilm_tokenize's model.py uses: a request
    is a dict of input arrays, a tensor a (name, array) pair, a response a dict of arrays."""
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor = lambda name, array: (name, array)
    module.InferenceResponse = lambda output_tensors: dict(output_tensors)
    module.get_input_tensor_by_name = lambda request, name: types.SimpleNamespace(as_numpy=lambda: request[name])
    return module


@pytest.fixture
def tokenize_runner(monkeypatch: pytest.MonkeyPatch) -> Runner:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _stub_backend_utils())
    spec = importlib.util.spec_from_file_location("minilm_tokenize_model", MODELS / TOKENIZE / "1" / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": "{}"})

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        (response,) = model.execute([inputs])
        return response

    return run


def onnx_runner(session: ort.InferenceSession, config: mc.ModelConfig) -> Runner:
    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = [t.name for t in config.output]
        return dict(zip(names, session.run(names, {t.name: inputs[t.name] for t in config.input})))

    return run


def run_ensemble(ensemble: mc.ModelConfig, runners: dict[str, Runner], inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The ensemble's data flow: each step reads its input_map from the tensors so far and
    writes its output_map back (key: the step model's tensor, value: the ensemble's)."""
    tensors = dict(inputs)
    for step in ensemble.ensemble_scheduling.step:
        outputs = runners[step.model_name]({key: tensors[value] for key, value in step.input_map.items()})
        tensors.update({value: outputs[key] for key, value in step.output_map.items()})
    return {tensor.name: tensors[tensor.name] for tensor in ensemble.output}


def test_the_ensemble_pipeline_gives_the_numpy_encoders_answer(
    configs: dict[str, mc.ModelConfig],
    tokenize_runner: Runner,
    minilm_onnx_session: ort.InferenceSession,
    minilm_encoder: MiniLMEncoder,
) -> None:
    runners = {TOKENIZE: tokenize_runner, ONNX_MODEL: onnx_runner(minilm_onnx_session, configs[ONNX_MODEL])}
    text = np.array([t.encode() for t in TEXTS], dtype=np.object_)  # as the adapter sends TEXT
    outputs = run_ensemble(configs[ENSEMBLE], runners, {INPUT_NAME: text})

    expected, counts, untruncated = minilm_encoder.encode_counted(TEXTS)
    assert np.abs(outputs[OUTPUT_NAME] - expected).max() < MAX_ABS_DIFF
    assert outputs[TOKENS_NAME].tolist() == counts.tolist()
    assert outputs[UNTRUNCATED_TOKENS_NAME].tolist() == untruncated.tolist()
    assert (untruncated > counts).any()  # TEXTS has a text over the model's 256 tokens
    for tensor in configs[ENSEMBLE].output:
        assert NUMPY_TYPES[outputs[tensor.name].dtype] == tensor.data_type, tensor.name
        assert dims_agree(outputs[tensor.name].shape, tuple(tensor.dims)), tensor.name


def test_tokenizer_step_outputs_what_its_config_declares(configs: dict[str, mc.ModelConfig], tokenize_runner: Runner) -> None:
    outputs = tokenize_runner({INPUT_NAME: np.array([b"one text", "\u00e9t\u00e9 \xff".encode("latin-1")], dtype=np.object_)})
    declared = {t.name: t for t in configs[TOKENIZE].output}
    assert list(outputs) == list(TOKENIZE_OUTPUTS) == list(declared)
    for name, array in outputs.items():
        assert NUMPY_TYPES[array.dtype] == declared[name].data_type, name
        assert dims_agree(array.shape, tuple(declared[name].dims)), name
