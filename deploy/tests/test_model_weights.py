"""The vLLM model loads on the vLLM releases Triton ships now, and its weights reach the pods that
serve it the way a stock cluster can: no ReadOnlyMany claim (most block storage cannot provide one,
and nothing could fill it through itself); a per-pod volume filled by an init container from a
configurable source; and pods that do not serve vLLM mount nothing."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath

import pytest

import config_vars
from manifests import DEPLOY, OVERLAYS, adapter_config, find, render, triton_workloads, workloads

VLLM_MODEL = DEPLOY / "triton" / "models" / "smollm2_vllm"
UPSTREAM_SAMPLE = config_vars.ROOT / "tests" / "fixtures" / "upstream" / "vllm_backend_sample_model_json.json"
# Engine arguments Sluice sets beyond upstream's sample: the context the adapter is told
# (SLUICE_ADAPTER_CONTEXT_LENGTH) and the batch the adapter's MAX_IN_FLIGHT must fit in.
OWN_ENGINE_ARGS = {"max_model_len", "max_num_seqs"}


def engine_args() -> dict:
    return json.loads((VLLM_MODEL / "1" / "model.json").read_text())


def test_vllm_model_json_has_upstreams_sample_keys_at_a_named_release() -> None:
    """The keys of vllm_backend's own sample model.json at its release r26.01 (the fixture names the
    commit), plus only OWN_ENGINE_ARGS: `disable_log_requests`, in the sample up to r25.08, is
    refused by newer vLLM releases and must not come back."""
    sample = json.loads(UPSTREAM_SAMPLE.read_text())
    assert "r26.01" in sample["_source"]
    ours = engine_args()
    assert set(sample["model_json"]) <= set(ours), f"missing upstream's {set(sample['model_json']) - set(ours)}"
    assert set(ours) - set(sample["model_json"]) == OWN_ENGINE_ARGS
    assert isinstance(ours["gpu_memory_utilization"], float) and isinstance(ours["enforce_eager"], bool)


def loaded_models(container: dict) -> set[str]:
    return {a.split("=", 1)[1] for a in container.get("args", []) if a.startswith("--load-model=")}


def _covering_mount(container: dict, path: str) -> dict | None:
    """The container's volume mount that holds `path`, if one does."""
    mounts = [m for m in container.get("volumeMounts", []) if PurePosixPath(path).is_relative_to(m["mountPath"])]
    return max(mounts, key=lambda m: len(m["mountPath"]), default=None)


def assert_filled_per_pod(pod: dict, container: dict, path: str) -> None:
    """`path` lies on a per-pod volume (emptyDir or a generic ephemeral volume) that an init
    container of the same pod mounts writable and fills from a configurable source (WEIGHTS_SOURCE)."""
    mount = _covering_mount(container, path)
    assert mount is not None, f"{container['name']}: nothing is mounted at {path}"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert "emptyDir" in volume or "ephemeral" in volume, f"{volume['name']}: not a per-pod volume: {volume}"
    fillers = [
        init
        for init in pod.get("initContainers", [])
        for m in init.get("volumeMounts", [])
        if m["name"] == volume["name"] and not m.get("readOnly", False)
    ]
    assert fillers, f"no init container fills the volume {volume['name']}"
    for init in fillers:
        assert "WEIGHTS_SOURCE" in {e["name"] for e in init.get("env", [])} and "$WEIGHTS_SOURCE" in " ".join(init["command"])


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> list[dict]:
    return render(request.param)


def test_no_claim_needs_read_only_many(docs) -> None:
    for claim in find(docs, "PersistentVolumeClaim"):
        assert "ReadOnlyMany" not in claim["spec"]["accessModes"], f"{claim['metadata']['name']}: most storage cannot provide it"
    for workload in workloads(docs):
        for template in workload["spec"].get("volumeClaimTemplates", []):
            assert "ReadOnlyMany" not in template["spec"]["accessModes"]


def test_triton_pods_mount_weights_only_where_they_serve_vllm(docs) -> None:
    weights_path = engine_args()["model"]
    for workload in triton_workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"]:
            mount = _covering_mount(container, weights_path)
            if "smollm2_vllm" in loaded_models(container):
                assert mount is not None and mount.get("readOnly") is True
                assert_filled_per_pod(pod, container, weights_path)
            else:
                assert mount is None, f"{workload['metadata']['name']}: mounts vLLM weights it does not serve"
                assert not any("persistentVolumeClaim" in v for v in pod.get("volumes", []))


def test_gpu_vllm_overlay_serves_vllm_with_its_chat_template() -> None:
    docs = render("gpu-vllm")
    (triton,) = triton_workloads(docs)
    (container,) = triton["spec"]["template"]["spec"]["containers"]
    assert "smollm2_vllm" in loaded_models(container) and container["image"].startswith("sluice/triton-vllm:")
    config = adapter_config(docs)
    assert config["SLUICE_ADAPTER_TRITON_MODEL"] == "smollm2_vllm"
    assert config["SLUICE_ADAPTER_TRITON_EMBEDDING_MODEL"] in loaded_models(container)
    (adapter,) = [w for w in workloads(docs) if w["metadata"]["name"] == "inference-adapter"]
    pod = adapter["spec"]["template"]["spec"]
    (adapter_container,) = pod["containers"]
    assert_filled_per_pod(pod, adapter_container, config["SLUICE_ADAPTER_CHAT_TEMPLATE"])
    assert Path(config["SLUICE_ADAPTER_CHAT_TEMPLATE"]).name == "tokenizer_config.json"
