"""The adapters find the Triton pods through DNS: a StatefulSet behind the headless Service `triton`
that lists only ready pods, and `SLUICE_ADAPTER_TRITON_URLS=dns:///triton:8001`; and one adapter
replica never runs more sequences than one Triton pod holds slots for."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import config_vars
from manifests import (
    DEPLOY,
    OVERLAYS,
    TRITON_SERVICE,
    adapter_config,
    container_environment,
    find,
    render,
    triton_service,
    triton_workloads,
)

STEP_MODELS = DEPLOY / "triton" / "models"


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> list[dict]:
    return render(request.param)


def test_triton_is_a_statefulset_behind_a_headless_service(docs) -> None:
    service = triton_service(docs)["spec"]
    assert service["clusterIP"] == "None", "headless: the name resolves to every pod"
    assert service.get("publishNotReadyAddresses") is False, "only ready pods are in DNS"
    (statefulset,) = triton_workloads(docs)
    assert statefulset["kind"] == "StatefulSet"
    assert statefulset["spec"]["serviceName"] == TRITON_SERVICE
    for container in statefulset["spec"]["template"]["spec"]["containers"]:
        assert "readinessProbe" in container, f"{container['name']}: without one a starting pod would be in DNS"
    assert find(docs, "PodDisruptionBudget", statefulset["metadata"]["name"])


def test_adapter_resolves_every_triton_pod(docs) -> None:
    url = adapter_config(docs)["SLUICE_ADAPTER_TRITON_URLS"]
    match = re.fullmatch(r"dns:///([a-z0-9-]+):(\d+)", url)
    assert match, f"SLUICE_ADAPTER_TRITON_URLS={url}: expected dns:///<headless service>:<port>"
    name, port = match.group(1), int(match.group(2))
    assert name == TRITON_SERVICE
    ports = {p["port"]: p for p in triton_service(docs)["spec"]["ports"]}
    assert port in ports and ports[port]["targetPort"] == "grpc", f"{port} is not the Service's gRPC port"
    container_ports = {
        p["name"]: p["containerPort"] for w in triton_workloads(docs) for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]
    }
    # Headless: DNS gives pod addresses, so the port dialled is the container's own.
    assert container_ports["grpc"] == port


def step_model_slots(container: dict, environment: dict[str, str | None], step_model: str) -> int:
    """KV slots one Triton pod holds for the adapter's step model."""
    if container["image"].split(":")[0] == "sluice/triton-local":
        slots = environment.get("SLUICE_TRITON_LOCAL_MAX_SLOTS") or config_vars.service_variables("triton-local")["SLUICE_TRITON_LOCAL_MAX_SLOTS"]
        return int(slots)
    # The official Triton image: the model repository is deploy/triton/models; the config variant
    # the server reads is chosen by --model-config-name (configs/<name>.pbtxt), else config.pbtxt.
    args = container.get("args", [])
    names = [a.split("=", 1)[1] for a in args if a.startswith("--model-config-name=")]
    assert f"--load-model={step_model}" in args, f"Triton does not load the adapter's step model {step_model}"
    config: Path = STEP_MODELS / step_model / (f"configs/{names[0]}.pbtxt" if names else "config.pbtxt")
    (slots,) = re.findall(r'key: "MAX_SLOTS", value: \{ string_value: "(\d+)" \}', config.read_text())
    return int(slots)


def vllm_max_num_seqs(model: str) -> int | None:
    """vLLM's max_num_seqs for a model behind Triton's vLLM backend; None for any other model."""
    folder = STEP_MODELS / model
    if not (folder / "config.pbtxt").is_file() or 'backend: "vllm"' not in (folder / "config.pbtxt").read_text():
        return None
    return int(json.loads((folder / "1" / "model.json").read_text())["max_num_seqs"])


def test_one_adapter_batch_fits_in_one_triton_pod(docs) -> None:
    config = adapter_config(docs)
    max_num_seqs = vllm_max_num_seqs(config["SLUICE_ADAPTER_TRITON_MODEL"])
    if max_num_seqs is not None:
        # A vLLM model batches by itself: the streams one adapter holds open per pod fit its batch.
        in_flight = int(config["SLUICE_ADAPTER_MAX_IN_FLIGHT"])
        assert in_flight <= max_num_seqs, f"SLUICE_ADAPTER_MAX_IN_FLIGHT {in_flight} > vLLM's max_num_seqs {max_num_seqs}"
        for workload in triton_workloads(docs):
            (container,) = workload["spec"]["template"]["spec"]["containers"]
            assert f"--load-model={config['SLUICE_ADAPTER_TRITON_MODEL']}" in container.get("args", [])
        return
    batch = int(config["SLUICE_ADAPTER_MAX_BATCH_SIZE"])
    for workload in triton_workloads(docs):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        slots = step_model_slots(container, container_environment(docs, container), config["SLUICE_ADAPTER_TRITON_MODEL"])
        assert batch <= slots, f"SLUICE_ADAPTER_MAX_BATCH_SIZE {batch} > {slots} slots per {workload['metadata']['name']} pod"
