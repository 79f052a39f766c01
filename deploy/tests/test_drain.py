"""Every pod drains before Kubernetes kills it: a preStop sleep while endpoints and DNS drop it, the
services' drain grace (one setting, SLUICE_SHUTDOWN_GRACE_S from the ConfigMap sluice-shutdown),
then time to flush, all inside terminationGracePeriodSeconds. Triton pods drain in the preStop
sleep itself: once Triton has SIGTERM it answers nothing, so the sequences it holds finish before."""

from __future__ import annotations

import pytest

import config_vars
from manifests import OVERLAYS, adapter_config, configmap_data, container_environment, render, triton_workloads, workloads

SHARED_GRACE = config_vars.SHARED_VARIABLES["shutdown_grace_s"]
SHUTDOWN_CONFIGMAP = "sluice-shutdown"
FLUSH_S = 10  # after the grace: events, acks and logs still owed are flushed
# The job worker's stop around its rows' grace (sluice_gateway.jobs.worker.serve, JobWorker.stop),
# each part at its bound, as in a broker outage: the NOT_SERVING notice (sluice_common.server's
# NOT_SERVING_NOTICE_S, 0.5 s) and its consumers' cancels (CONSUMER_CANCEL_TIMEOUT_S, 2 s) before
# the grace; its AMQP connection's close (5 s) and the publishers' flush (PUBLISHER_FLUSH_S, 6 s,
# then the completion events are spilled to disk) after it: more than FLUSH_S.
JOB_WORKER_AROUND_GRACE_S = 0.5 + 2.0 + 5.0 + 6.0
ENDPOINTS_S = 5  # the least preStop sleep: endpoints and DNS drop a terminating pod asynchronously
# How often adapters re-resolve dns:///triton:8001: the adapter's default (its config field
# triton_resolve_interval_s), unless the manifests set SLUICE_ADAPTER_TRITON_RESOLVE_INTERVAL_S.
DEFAULT_TRITON_RESOLVE_INTERVAL_S = 10.0


@pytest.fixture(scope="module", params=OVERLAYS)
def docs(request: pytest.FixtureRequest) -> list[dict]:
    return render(request.param)


def pod_containers(docs: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every long-running container of every pod template."""
    return [(w, c) for w in workloads(docs) for c in w["spec"]["template"]["spec"]["containers"]]


def label(workload: dict, container: dict) -> str:
    return f"{workload['kind']}/{workload['metadata']['name']} container {container['name']}"


def shutdown_configmap(docs: list[dict]) -> str:
    """The rendered (hash-suffixed) name of the ConfigMap sluice-shutdown."""
    (name,) = [name for name in configmap_data(docs) if name.startswith(f"{SHUTDOWN_CONFIGMAP}-")]
    return name


def grace_s(docs: list[dict], container: dict) -> float:
    """The drain grace this container's process reads: its service's own <PREFIX>SHUTDOWN_GRACE_S
    when set (it overrides), else the shared variable, as sluice_common's load_config resolves them."""
    environment = container_environment(docs, container)
    service = container["image"].split(":")[0].removeprefix("sluice/")
    own = [v for v, shared in config_vars.shared_variables(service).items() if shared == SHARED_GRACE] if service in config_vars.SERVICES else []
    name = next((v for v in own if v in environment), SHARED_GRACE)
    assert environment.get(name) is not None, f"container {container['name']} gets no {SHARED_GRACE}"
    return float(environment[name])


def prestop_sleep_s(container: dict) -> int:
    return container.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)


def test_the_grace_is_set_once_for_every_service(docs) -> None:
    data = configmap_data(docs)
    setting_it = sorted(name for name, values in data.items() if SHARED_GRACE in values)
    assert setting_it == [shutdown_configmap(docs)], f"{SHARED_GRACE} set in {setting_it}"
    overrides = sorted(
        f"{name}: {variable}"
        for name, values in data.items()
        for variable in values
        if variable.endswith("_SHUTDOWN_GRACE_S") and variable != SHARED_GRACE
    )
    overrides += sorted(
        f"{label(w, c)}: {env['name']}" for w, c in pod_containers(docs) for env in c.get("env", []) if env["name"].endswith("SHUTDOWN_GRACE_S")
    )
    assert not overrides, f"the grace is set once, in {SHUTDOWN_CONFIGMAP}: {overrides}"


def test_every_pod_loads_the_shutdown_configmap_and_sleeps_before_sigterm(docs) -> None:
    name = shutdown_configmap(docs)
    for workload, container in pod_containers(docs):
        sources = [s["configMapRef"]["name"] for s in container.get("envFrom", []) if "configMapRef" in s]
        assert name in sources, f"{label(workload, container)} does not load {SHUTDOWN_CONFIGMAP}"
        assert prestop_sleep_s(container) >= ENDPOINTS_S, f"{label(workload, container)}: preStop sleep < {ENDPOINTS_S} s"


def around_grace_s(workload: dict) -> float:
    """What a pod's stop takes beside its preStop sleep and its drain grace, at most."""
    return JOB_WORKER_AROUND_GRACE_S if workload["metadata"]["name"] == "job-worker" else FLUSH_S


def test_termination_grace_covers_prestop_drain_and_flush(docs) -> None:
    for workload, container in pod_containers(docs):
        needed = prestop_sleep_s(container) + grace_s(docs, container) + around_grace_s(workload)
        period = workload["spec"]["template"]["spec"].get("terminationGracePeriodSeconds", 30)
        assert period >= needed, f"{label(workload, container)}: terminationGracePeriodSeconds {period} < {needed}"


def test_triton_pods_finish_their_sequences_before_sigterm(docs) -> None:
    resolve_s = float(adapter_config(docs).get("SLUICE_ADAPTER_TRITON_RESOLVE_INTERVAL_S", DEFAULT_TRITON_RESOLVE_INTERVAL_S))
    tritons = triton_workloads(docs)
    assert tritons
    for workload in tritons:
        for container in workload["spec"]["template"]["spec"]["containers"]:
            needed = ENDPOINTS_S + resolve_s + grace_s(docs, container)
            assert prestop_sleep_s(container) >= needed, (
                f"{label(workload, container)}: preStop sleep {prestop_sleep_s(container)} s < {needed} s"
                " (endpoints + the adapters' re-resolve + a stream's grace)"
            )
