"""Triton Python backend for the step protocol: the triton-local engine behind the official server.

The image (deploy/triton/Dockerfile) installs deploy/triton/requirements.txt and the
sluice_triton_local package source; this file only adapts Triton's request objects to `start_round`.
The model is decoupled: each request runs a round of engine steps on the engine's own thread, and
each step's response is sent as it is made through the request's response sender; `execute`
returns at once, so a release request reaches the engine while a round runs.
Where the engine runs is chosen at load from the instance Triton creates (`instance_group` in
config.pbtxt): KIND_CPU on the CPU cores, KIND_GPU with every layer on that instance's GPU. The
engine code is the same either way; only llama.cpp's build differs (CUDA for a GPU).
The engine's metrics (tokens, slots, prefix cache, steps: sluice_triton_local.metrics, the names
triton-local's model process serves) are served by this stub process itself on METRICS_PORT;
Triton's own metrics port carries only Triton's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils  # provided by Triton's Python backend

from sluice_common.cgroup import usable_cpus
from sluice_triton_local.engine.llamacpp_model import GpuOffloadUnavailable
from sluice_triton_local.engine.step_engine import StepEngine
from sluice_triton_local.metrics import serve_metrics
from sluice_triton_local.model_files import smollm2_gguf
from sluice_triton_local.shared_engine import SharedEngine, warm_up
from sluice_triton_local.step_protocol import INPUTS, OPTIONAL_INPUTS, OUTPUTS, RoundRejected, start_round

GPU_IMAGE_FIX = (
    "build the image with llama.cpp's CUDA build: docker build -f deploy/triton/Dockerfile --build-arg LLAMA_BUILD=cuda -t sluice/triton ."
)


@dataclass(frozen=True)
class Placement:
    """Where llama.cpp puts the model's layers."""

    gpu_layers: int  # 0: all on the CPU; -1: all on the GPU
    main_gpu: int | None  # the GPU (CUDA device index) holding them; None on the CPU


def placement(args: dict[str, str], engine: str) -> Placement:
    """The engine's device for the instance Triton is loading (args as given to initialize)."""
    kind = args.get("model_instance_kind", "CPU")
    if kind == "CPU":
        return Placement(gpu_layers=0, main_gpu=None)
    if kind != "GPU":
        raise ValueError(f"instance kind {kind!r} is not supported: use KIND_CPU or KIND_GPU in instance_group")
    if engine != "llamacpp":
        raise ValueError(f"ENGINE {engine!r} runs on the CPU only: use KIND_CPU, or ENGINE llamacpp for KIND_GPU")
    import llama_cpp  # only now: a CPU instance of the numpy engine needs no llama.cpp

    if not llama_cpp.llama_supports_gpu_offload():
        raise GpuOffloadUnavailable(
            f"instance {args.get('model_instance_name', '?')} is KIND_GPU (device"
            f" {args.get('model_instance_device_id', '?')}) but the installed llama-cpp-python was built"
            f" for the CPU only (llama_supports_gpu_offload() is false); {GPU_IMAGE_FIX}"
        )
    # Triton numbers devices as CUDA does in this process (same CUDA_VISIBLE_DEVICES), as llama.cpp does.
    return Placement(gpu_layers=-1, main_gpu=int(args["model_instance_device_id"]))


def _flag(params: dict[str, str], name: str, default: str) -> bool:
    """A "true" or "false" parameter; anything else is refused, not read as false."""
    value = params.get(name, default).strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f'parameter {name} must be "true" or "false", got {value!r}')
    return value == "true"


def instances(config: dict) -> int:
    """The instances Triton makes of the model: each group's count, on each of its GPUs for KIND_GPU."""
    return sum(
        int(group.get("count", 1)) * (len(group.get("gpus") or [0]) if group.get("kind") == "KIND_GPU" else 1)
        for group in config.get("instance_group", [])
    )


def metrics_port(config: dict, params: dict[str, str]) -> int:
    """METRICS_PORT, the port this instance serves the engine's metrics on (0: none). Each instance
    is a stub process of its own, with its own engine and metrics, and only one can listen on the
    port: with more than one instance (which would also split the KV slots), the port is refused."""
    port = int(params.get("METRICS_PORT", "9105"))
    if port and (count := instances(config)) > 1:
        raise ValueError(
            f"METRICS_PORT {port} is served by one instance, and instance_group makes {count}: use one"
            " instance (the KV slots live in it), or METRICS_PORT 0 to serve no engine metrics"
        )
    return port


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        engine = params.get("ENGINE", "llamacpp")
        where = placement(args, engine)
        max_slots = int(params.get("MAX_SLOTS", "8"))
        port = metrics_port(config, params)
        # Served from the start (as Triton's own metrics are), before the engine loads: a port taken
        # fails the load at once. The slot bound is set here; everything else as the engine steps.
        self.metrics_server = None
        if port:
            try:
                self.metrics_server = serve_metrics(port, "0.0.0.0", max_slots)
            except OSError as exc:
                raise OSError(f"the step model cannot serve its metrics on METRICS_PORT {port} (0: none): {exc}") from exc
        step_engine = StepEngine(
            params.get("GGUF_PATH") or str(smollm2_gguf()),
            max_slots=max_slots,
            max_context=int(params.get("MAX_CONTEXT", "2048")),
            slot_lease_s=float(params.get("SLOT_LEASE_S", "30")),
            prefix_cache=_flag(params, "PREFIX_CACHE", "true"),
            prefill_tokens_per_step=int(params.get("PREFILL_TOKENS_PER_STEP", "0")),
            host_prefix_bytes=int(params.get("PREFIX_CACHE_HOST_MIB", "0")) * 2**20,
            engine=engine,
            # 0: the CPUs the instance can keep busy, a container CPU limit included (more spinning
            # threads than CPUs stall every step: TritonLocalConfig.engine_threads).
            threads=int(params.get("THREADS", "0")) or usable_cpus()[0],
            gpu_layers=where.gpu_layers,
            main_gpu=where.main_gpu,
        )
        # Every step on one thread of its own, warm-up included (see SharedEngine: llama.cpp's
        # OpenMP team); that thread also serializes steps, as the KV slots are not thread-safe.
        self.engine = SharedEngine(step_engine)
        warm_up(self.engine)

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                done = start_round(self.engine, _inputs(request), lambda outputs, last, sender=sender: _send(sender, outputs, last))
            except RoundRejected as exc:
                _fail(sender, str(exc))
                continue
            done.add_done_callback(lambda f, sender=sender: f.exception() is not None and _fail(sender, f"the round failed: {f.exception()!r}"))
        return None

    def finalize(self) -> None:
        # The rounds already queued run to their end (their responses sent), then the engine's
        # thread stops and llama.cpp's memory is freed.
        self.engine.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()


def _inputs(request: object) -> dict:
    inputs = {name: pb_utils.get_input_tensor_by_name(request, name).as_numpy() for name, _ in INPUTS}
    for name, _ in OPTIONAL_INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def _send(sender: object, outputs: dict, last: bool) -> None:
    response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, outputs[name]) for name, _ in OUTPUTS])
    sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if last else 0)


def _fail(sender: object, message: str) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
