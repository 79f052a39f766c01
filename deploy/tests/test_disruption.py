"""Workloads survive voluntary disruptions (node drains, upgrades): HPAs keep at least two replicas,
and every workload has one PodDisruptionBudget that lets a drain evict a pod at the fewest replicas
the workload may run (a budget that allows no eviction stalls the drain) yet keeps one available
whenever there are two or more."""

from __future__ import annotations

import math

import pytest

from manifests import OVERLAYS, find, render, selects, workloads


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> list[dict]:
    return render(request.param)


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def hpa_for(docs: list[dict], workload: dict) -> dict | None:
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        target = hpa["spec"]["scaleTargetRef"]
        if (target["kind"], target["name"]) == (workload["kind"], workload["metadata"]["name"]):
            return hpa
    return None


def fewest_replicas(docs: list[dict], workload: dict) -> int:
    hpa = hpa_for(docs, workload)
    return hpa["spec"]["minReplicas"] if hpa else workload["spec"].get("replicas", 1)


def scaled(value: int | str, replicas: int) -> int:
    """An IntOrString of a budget as the disruption controller reads it (percentages round up)."""
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(int(value[:-1]) * replicas / 100)
    return int(value)


def disruption(pdb: dict, replicas: int) -> tuple[int, int]:
    """(pods a drain may evict, pods kept available) of a budget over `replicas` healthy pods."""
    spec = pdb["spec"]
    if "minAvailable" in spec:
        kept = min(scaled(spec["minAvailable"], replicas), replicas)
    else:
        kept = max(replicas - scaled(spec["maxUnavailable"], replicas), 0)
    return replicas - kept, kept


def test_every_hpa_keeps_two_replicas_and_targets_a_workload(docs) -> None:
    names = {(w["kind"], w["metadata"]["name"]) for w in workloads(docs)}
    for hpa in find(docs, "HorizontalPodAutoscaler"):
        spec, name = hpa["spec"], hpa["metadata"]["name"]
        assert (spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"]) in names, f"HPA {name} targets nothing"
        assert spec["minReplicas"] >= 2, f"HPA {name}: minReplicas {spec['minReplicas']} < 2 (a drain would leave none)"
        assert spec["maxReplicas"] >= spec["minReplicas"], f"HPA {name}: maxReplicas < minReplicas"


def test_every_pdb_selects_exactly_one_workload(docs) -> None:
    for pdb in find(docs, "PodDisruptionBudget"):
        selected = [w["metadata"]["name"] for w in workloads(docs) if selects(pdb["spec"]["selector"], pod_labels(w))]
        assert len(selected) == 1, f"PodDisruptionBudget {pdb['metadata']['name']} selects {selected}"


def test_every_workload_has_a_budget_that_lets_a_drain_through(docs) -> None:
    for workload in workloads(docs):
        name = workload["metadata"]["name"]
        budgets = [p for p in find(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"], pod_labels(workload))]
        assert len(budgets) == 1, f"{name}: {len(budgets)} PodDisruptionBudgets select its pods"
        replicas = fewest_replicas(docs, workload)
        evictable, available = disruption(budgets[0], replicas)
        assert evictable >= 1, f"{name}: at {replicas} replicas its budget allows no eviction (a drain stalls)"
        if replicas >= 2:
            assert available >= 1, f"{name}: at {replicas} replicas its budget lets every pod go"
        if hpa_for(docs, workload):
            assert replicas >= 2
