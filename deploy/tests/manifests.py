"""The Kubernetes overlays as `kubectl kustomize` renders them, and what their pods actually get."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import yaml

import config_vars

DEPLOY = config_vars.ROOT / "deploy"
BIN = Path(sys.executable).parent
OVERLAYS = ("dev", "gpu", "gpu-vllm")
WORKLOAD_KINDS = ("Deployment", "StatefulSet")


@functools.cache
def _rendered(overlay: str) -> str:
    result = subprocess.run([str(BIN / "kubectl"), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def render(overlay: str) -> list[dict]:
    """A fresh copy of the overlay's objects (rendered once per session)."""
    return [doc for doc in yaml.safe_load_all(_rendered(overlay)) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def workloads(docs: list[dict]) -> list[dict]:
    """Every object with a pod template that keeps pods running: Deployments and StatefulSets."""
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def workload(docs: list[dict], name: str) -> dict:
    (found,) = [d for d in workloads(docs) if d["metadata"]["name"] == name]
    return found


def configmap_data(docs: list[dict]) -> dict[str, dict[str, str]]:
    return {c["metadata"]["name"]: c.get("data", {}) for c in find(docs, "ConfigMap")}


def container_environment(docs: list[dict], container: dict) -> dict[str, str | None]:
    """The variables a container gets, as the kubelet builds them: envFrom ConfigMaps in order,
    then env (which wins). A value from a Secret or a field is None (not in the manifests)."""
    configmaps = configmap_data(docs)
    environment: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            environment.update(configmaps[source["configMapRef"]["name"]])
    for env in container.get("env", []):
        environment[env["name"]] = env.get("value")
    return environment


def selects(selector: dict, labels: dict) -> bool:
    """Whether a label selector (matchLabels only, as these manifests use) selects these labels."""
    assert set(selector) <= {"matchLabels"}, f"only matchLabels is understood here: {selector}"
    return selector["matchLabels"].items() <= labels.items()


TRITON_SERVICE = "triton"  # the headless Service the adapters resolve (dns:///triton:8001)


def triton_service(docs: list[dict]) -> dict:
    (service,) = find(docs, "Service", TRITON_SERVICE)
    return service


def triton_workloads(docs: list[dict]) -> list[dict]:
    """The workloads whose pods the Service `triton` selects."""
    selector = {"matchLabels": triton_service(docs)["spec"]["selector"]}
    return [w for w in workloads(docs) if selects(selector, w["spec"]["template"]["metadata"]["labels"])]


def adapter_config(docs: list[dict]) -> dict[str, str]:
    """The rendered inference-adapter-config ConfigMap's data."""
    return next(data for name, data in configmap_data(docs).items() if name.startswith("inference-adapter-config-"))
