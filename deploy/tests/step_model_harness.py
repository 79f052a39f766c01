"""Runs deploy/triton/models/smollm2_step/1/model.py outside Triton, with a stand-in for
`triton_python_backend_utils`, through one prefill and decodes to the end. Run it with
triton-local's interpreter (it has the engine's dependencies); prints the answer as JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "deploy" / "triton" / "models" / "smollm2_step"


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor]) -> None:
        self.outputs = {t.name: t.array for t in output_tensors}


class Request:
    def __init__(self, **inputs: np.ndarray) -> None:
        self.inputs = inputs


pb_utils = types.ModuleType("triton_python_backend_utils")
pb_utils.Tensor = Tensor
pb_utils.InferenceResponse = InferenceResponse
pb_utils.get_input_tensor_by_name = lambda request, name: Tensor(name, request.inputs[name])
sys.modules["triton_python_backend_utils"] = pb_utils


def config_as_triton_gives_it() -> str:
    """The parameters of config.pbtxt, in the JSON shape Triton passes to initialize()."""
    text = (MODEL_DIR / "config.pbtxt").read_text()
    import re

    params = dict(re.findall(r'key: "(\w+)", value: \{ string_value: "([^"]*)" \}', text))
    return json.dumps({"name": "smollm2_step", "parameters": {k: {"string_value": v} for k, v in params.items()}})


def main() -> None:
    spec = importlib.util.spec_from_file_location("step_model", MODEL_DIR / "1" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": config_as_triton_gives_it()})
    prefill = json.dumps({"messages": [["user", "Which city is the capital of France?"]], "max_tokens": 12}).encode()
    request = lambda action, raw=b"": Request(  # noqa: E731
        ACTION=np.array([action], dtype=np.int32), SEQ_ID=np.array([7], dtype=np.int64), REQUEST=np.array([raw], dtype=np.object_)
    )
    (response,) = model.execute([request(1, prefill)])
    text, finish = response.outputs["TEXT"][0].decode(), response.outputs["FINISH"][0].decode()
    while not finish:
        (response,) = model.execute([request(2)])
        text += response.outputs["TEXT"][0].decode()
        finish = response.outputs["FINISH"][0].decode()
    model.execute([request(3)])
    model.finalize()
    print(json.dumps({"text": text, "finish": finish, "completion_tokens": int(response.outputs["COMPLETION_TOKENS"][0])}))


if __name__ == "__main__":
    main()
