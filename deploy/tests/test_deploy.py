"""deploy/ checked without a Docker engine or a cluster: Dockerfiles (hadolint and the rules of
issue 7), Kubernetes overlays rendered by `kubectl kustomize` and validated against the bundled
Kubernetes schemas, and every configuration variable set in the manifests (compose: test_compose.py)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import config_vars
from manifests import BIN, OVERLAYS, container_environment, find, render, workload, workloads

ROOT = config_vars.ROOT
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.33.0"
# The oldest Kubernetes the manifests run on, as deploy/README.md states it: the preStop `sleep`
# action is on by default from 1.30 (1.29 rejects it unless a feature gate is set).
MINIMUM_KUBERNETES_VERSION = "1.30"
GRPC_SERVICES = {  # name -> gRPC port
    "gateway": 50051,
    "inference-adapter": 50061,
    "rate-limit": 50071,
    "evaluation-logging": 50081,
}
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile")) + [DEPLOY / "triton" / "Dockerfile"]


# ---- Dockerfiles ---------------------------------------------------------------------------


def test_hadolint_passes_on_every_dockerfile() -> None:
    result = subprocess.run([str(BIN / "hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("service", [*GRPC_SERVICES, "triton-local"])
def test_service_image_follows_the_rules(service: str) -> None:
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    assert len(stages) >= 3, "uv, builder and final stages"
    builder, final = stages[-2], stages[-1]
    assert f"COPY services/{service}/ services/{service}/" in builder and "COPY libs/ libs/" in builder
    assert "uv sync --locked --no-dev --no-editable" in builder
    assert not re.search(r"\b(gcc|g\+\+|build-essential|clang|uv)\b", final.replace("/app/.venv", "")), "no compilers, no uv"
    assert re.search(r"^USER 10001", final, re.M)
    assert "HEALTHCHECK" in final
    package = config_vars.SERVICES[service]
    assert f'ENTRYPOINT ["python", "-m", "{package}"]' in final
    if service in GRPC_SERVICES:
        assert "sluice_common.healthcheck" in final, "health through grpc.health.v1"


# Variables an image may name besides its service's own: the shared ones, and the health check's.
NOT_A_SERVICE_SETTING = {*config_vars.SHARED_VARIABLES.values(), "SLUICE_HEALTHCHECK_SERVER_NAME"}


@pytest.mark.parametrize("service", [*GRPC_SERVICES, "triton-local"])
def test_image_variables_are_ones_its_service_reads(service: str) -> None:
    """Every SLUICE_ name in a service's Dockerfile (ENV, the HEALTHCHECK's prefix argument,
    comments) is spelled as the service reads it: a misspelt prefix (SLUICE_RATE_LIMIT_ for
    SLUICE_RATELIMIT_) is ignored at run time, and the image would listen on 127.0.0.1 only."""
    text = (DEPLOY / "docker" / f"{service}.Dockerfile").read_text()
    prefix = config_vars.env_prefix(service)
    known = set(config_vars.service_variables(service)) | NOT_A_SERVICE_SETTING
    names = set(re.findall(r"\bSLUICE_[A-Z0-9_]*", text))
    unknown = sorted(n for n in names if (n != prefix if n.endswith("_") else n not in known))
    assert not unknown, f"{service}.Dockerfile names {unknown}: {service} reads {prefix}* (config.py's ENV_PREFIX)"
    instructions = text.replace("\\\n", " ")
    environment = " ".join(re.findall(r"^ENV (.+)$", instructions, re.M))
    assert f"{prefix}HOST=0.0.0.0" in environment.split(), "listens on every interface in a container"
    healthcheck = re.search(r"^HEALTHCHECK .*$", instructions, re.M)
    assert healthcheck is not None
    if service in GRPC_SERVICES:
        assert f'"sluice_common.healthcheck", "{prefix}", "{GRPC_SERVICES[service]}"' in healthcheck.group(0)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists(dockerfile: Path) -> None:
    for line in re.findall(r"^COPY (?!--from)(.+?)(?:\s+\S+)$", dockerfile.read_text().replace("\\\n", " "), re.M):
        for source in line.split():
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source} does not exist"


def test_dockerignore_keeps_virtualenvs_out() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "**/.venv" in ignored and "node_modules" in ignored


# ---- Kubernetes ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict]]:
    return request.param, render(request.param)


def test_every_object_is_valid_against_the_kubernetes_schema(overlay) -> None:
    _, docs = overlay
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {'/'.join(map(str, exc.path))}")


def test_every_object_is_valid_on_the_documented_minimum_kubernetes(overlay) -> None:
    """A field newer than the minimum deploy/README.md states (the 1.33 schemas alone let one in)
    would be refused by an older cluster it says is supported."""
    _, docs = overlay
    assert f"Kubernetes {MINIMUM_KUBERNETES_VERSION} or later" in (DEPLOY / "README.md").read_text()
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, f"{MINIMUM_KUBERNETES_VERSION}.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {'/'.join(map(str, exc.path))}")


@pytest.mark.parametrize("service", GRPC_SERVICES)
def test_deployment_has_grpc_probes_resources_and_a_pdb(overlay, service: str) -> None:
    _, docs = overlay
    (deployment,) = find(docs, "Deployment", service)
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == GRPC_SERVICES[service], probe
    # Liveness asks sluice_common.server's LIVENESS_SERVICE (SERVING while the process can serve at
    # all); readiness asks "" (NOT_SERVING while starting, draining, or without a Triton replica):
    # a liveness probe on "" restarted every adapter while Triton was away.
    assert container["livenessProbe"]["grpc"].get("service") == "liveness"
    assert container["readinessProbe"]["grpc"].get("service", "") == ""
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and {"cpu", "memory"} <= set(container["resources"]["limits"])
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    (pdb,) = find(docs, "PodDisruptionBudget", service)
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]


# The workloads whose start-up waits for a dependency (NOT_SERVING on readiness meanwhile), and the
# variable that bounds that wait (0: for ever).
DEPENDENCY_WAITS = {
    "inference-adapter": "SLUICE_ADAPTER_BACKEND_WAIT_S",  # for Triton
    "gateway": "SLUICE_GATEWAY_ADAPTER_WAIT_S",  # for the adapter, which waits for Triton
    "job-worker": "SLUICE_GATEWAY_ADAPTER_WAIT_S",
}


def test_a_dependency_outage_at_start_up_neither_restarts_the_pod_nor_sends_it_traffic(overlay) -> None:
    """A pod started while its dependency is away (a cold GPU deploy: Triton's startup window is
    10 min, plus its image pull; an HPA scale-out or a rollout during an outage) waits for it, not
    ready. Its wait exited after 300 s and its startup probe asked readiness for 330 s: the pod
    crash-looped. The wait is unbounded, and the startup probe asks `liveness` (SERVING while the
    process can serve at all), so no window, however long, has to cover the outage."""
    name, docs = overlay
    for service, variable in DEPENDENCY_WAITS.items():
        (container,) = workload(docs, service)["spec"]["template"]["spec"]["containers"]
        assert container["startupProbe"]["grpc"].get("service") == "liveness", f"{name}: {service}'s startup probe asks readiness"
        assert container["readinessProbe"]["grpc"].get("service", "") == "", f"{name}: {service} must stay out of its Service while it waits"
        wait_s = container_environment(docs, container)[variable]
        assert wait_s is not None and float(wait_s) == 0, f"{name}: {service} gives up waiting after {variable}={wait_s}s and restarts"


def test_gateway_and_adapter_autoscale_on_gpu() -> None:
    """The gpu overlay autoscales; dev runs one replica of everything (its HPAs are deleted)."""
    docs = render("gpu")
    targets = {h["spec"]["scaleTargetRef"]["name"] for h in find(docs, "HorizontalPodAutoscaler")}
    assert {"gateway", "inference-adapter"} <= targets


def test_tenants_in_a_secret_and_limits_in_a_configmap(overlay) -> None:
    _, docs = overlay
    (tenants,) = [s for s in find(docs, "Secret") if s["metadata"]["name"].startswith("sluice-tenants")]
    assert "tenants.toml" in tenants["data"]
    (limits,) = [c for c in find(docs, "ConfigMap") if c["metadata"]["name"].startswith("sluice-limits")]
    assert "limits.toml" in limits["data"]
    mounted = {
        v.get("secret", {}).get("secretName") or v.get("configMap", {}).get("name")
        for d in find(docs, "Deployment")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
    }
    assert tenants["metadata"]["name"] in mounted and limits["metadata"]["name"] in mounted


def test_backing_services_are_referenced_not_written(overlay) -> None:
    _, docs = overlay
    names = {d["metadata"]["name"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert not names & {"rabbitmq", "redis", "postgres", "postgresql"}
    secrets = {
        env["valueFrom"]["secretKeyRef"]["name"]
        for d in find(docs, "Deployment")
        for c in d["spec"]["template"]["spec"]["containers"]
        for env in c.get("env", [])
        if "valueFrom" in env
    }
    assert secrets == {"sluice-rabbitmq-default-user", "sluice-redis", "sluice-pg-app"}


def test_triton_per_overlay() -> None:
    dev, gpu = render("dev"), render("gpu")
    local = workload(dev, "triton-local")
    assert "nvidia.com/gpu" not in str(local)
    triton = workload(gpu, "triton")
    (container,) = triton["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # The step model on the GPU (configs/gpu.pbtxt) needs the CUDA build of the image; the
    # embeddings on the GPU too (minilm_embed_gpu: the ONNX encoder), named to the adapter.
    assert container["args"] == ["--load-model=smollm2_step", "--load-model=minilm_embed_gpu", "--model-config-name=gpu"]
    assert container["image"].startswith("sluice/triton-cuda:")
    (adapter_config,) = [c for c in find(gpu, "ConfigMap") if c["metadata"]["name"].startswith("inference-adapter-config")]
    assert adapter_config["data"]["SLUICE_ADAPTER_TRITON_EMBEDDING_MODEL"] == "minilm_embed_gpu"
    for docs in (dev, gpu):
        assert find(docs, "Service", "triton"), "the adapters resolve dns:///triton:8001 in both overlays"


def variables_set(docs: list[dict], service: str) -> set[str]:
    """Variables the service's container gets (env and envFrom ConfigMaps/Secrets), a shared
    variable (SLUICE_SHUTDOWN_GRACE_S) counting as the service's own variable it sets."""
    names: set[str] = set()
    for container in workload(docs, service)["spec"]["template"]["spec"]["containers"]:
        names |= set(container_environment(docs, container))
    return names | {own for own, shared in config_vars.shared_variables(service).items() if shared in names}


@pytest.mark.parametrize("service", [*GRPC_SERVICES, "triton-local"])
def test_every_config_variable_is_set_in_the_manifests(overlay, service: str) -> None:
    name, docs = overlay
    if service == "triton-local" and name != "dev":
        # The gpu overlay runs the official Triton instead: triton-local must not be there.
        assert not [w for w in workloads(docs) if w["metadata"]["name"] == "triton-local"]
        return
    expected = set(config_vars.service_variables(service))
    present = variables_set(docs, service)
    assert not expected - present, f"{name}: {service} misses {sorted(expected - present)}"
    prefix = os.path.commonprefix(sorted(expected))
    unknown = {v for v in present if v.startswith(prefix) and v not in expected}
    assert not unknown, f"{name}: {service} sets variables its config does not read: {sorted(unknown)}"


# The documentation that names variables in tables: README.md and every page of the docs site
# (the configuration table moved from README.md to docs/operators/configuration.md).
CONFIGURATION_PAGE = ROOT / "docs" / "operators" / "configuration.md"


def table_variables(page: Path) -> set[str]:
    """Variables named in the table rows of one Markdown page."""
    rows = [line for line in page.read_text().splitlines() if line.lstrip().startswith("|")]
    return set(re.findall(r"\bSLUICE_[A-Z0-9_]+[A-Z0-9]\b", "\n".join(rows)))


def documented_variables() -> set[str]:
    """Variables named in the tables of README.md and of every page under docs/ (table rows only)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return set().union(*(table_variables(p) for p in pages if p.is_file() and ".venv" not in p.parts))


def test_every_variable_in_the_docs_tables_is_set_in_the_manifests() -> None:
    assert CONFIGURATION_PAGE.is_file() and table_variables(CONFIGURATION_PAGE), f"{CONFIGURATION_PAGE} lost its configuration table"
    documented = documented_variables()
    known = {v for s in config_vars.services_with_config() for v in config_vars.service_variables(s)}
    # Client-side variables (the `sluice` CLI) are not service settings.
    documented &= known | {v for v in documented if not v.startswith(("SLUICE_URL", "SLUICE_API_KEY"))}
    for overlay_name in OVERLAYS:
        docs = render(overlay_name)
        present = set().union(*(variables_set(docs, s) for s in GRPC_SERVICES))
        if overlay_name == "dev":
            present |= variables_set(docs, "triton-local")
        service_vars = {v for v in documented if v in known and not (v.startswith("SLUICE_TRITON_LOCAL_") and overlay_name != "dev")}
        assert not service_vars - present, f"{overlay_name}: the docs document {sorted(service_vars - present)} but the manifests do not set them"


# ---- the GPU model repository ----------------------------------------------------------------


STEP_MODEL = DEPLOY / "triton" / "models" / "smollm2_step"


@pytest.mark.parametrize("config", ["config.pbtxt", "configs/gpu.pbtxt"])
def test_step_model_config_matches_the_step_protocol(config: str) -> None:
    text = (STEP_MODEL / config).read_text()
    protocol = (ROOT / "services" / "triton-local" / "src" / "sluice_triton_local" / "step_protocol.py").read_text()
    kinds = {"np.int32": "TYPE_INT32", "np.int64": "TYPE_INT64", "np.bool_": "TYPE_BOOL", "bytes": "TYPE_STRING"}
    tensors = re.findall(r'\("([A-Z_]+)", (np\.int32|np\.int64|np\.bool_|bytes)\)', protocol)
    assert {"STEPS", "ROW_SEQ_ID", "ROUND_END"} <= {name for name, _ in tensors}
    for name, kind in tensors:
        assert re.search(rf'name: "{name}", data_type: {kinds[kind]}', text), name
    assert re.search(r'name: "STEPS", data_type: TYPE_INT32, dims: \[ -1 \], optional: true', text)
    assert "model_transaction_policy { decoupled: true }" in text, "one response per engine step of a round"
    assert 'backend: "python"' in text and "max_batch_size: 0" in text


def test_step_model_gpu_variant_differs_only_in_its_instance_group_slots_and_prefill_budget() -> None:
    """configs/gpu.pbtxt (tritonserver --model-config-name=gpu) must not drift from config.pbtxt;
    only where it runs, how many sequences it holds (a GPU holds the adapters' batch of 32) and the
    prompt tokens a step computes (a GPU computes a batch of prompts about as fast as one)."""

    def settings(path: Path) -> tuple[list[str], list[str], list[str], list[str]]:
        lines = [line for line in path.read_text().splitlines() if line.strip() and not line.lstrip().startswith("#")]
        own = ("instance_group", 'parameters: { key: "MAX_SLOTS"', 'parameters: { key: "PREFILL_TOKENS_PER_STEP"')
        return (
            [line for line in lines if not line.startswith(own)],
            [line for line in lines if line.startswith("instance_group")],
            [line for line in lines if line.startswith(own[1])],
            [line for line in lines if line.startswith(own[2])],
        )

    cpu, cpu_group, cpu_slots, cpu_budget = settings(STEP_MODEL / "config.pbtxt")
    gpu, gpu_group, gpu_slots, gpu_budget = settings(STEP_MODEL / "configs" / "gpu.pbtxt")
    assert cpu == gpu
    assert cpu_group == ["instance_group [ { count: 1, kind: KIND_CPU } ]"]
    assert gpu_group == ["instance_group [ { count: 1, kind: KIND_GPU, gpus: [ 0 ] } ]"], "one instance: one KV cache"
    assert len(cpu_slots) == len(gpu_slots) == 1
    assert len(cpu_budget) == len(gpu_budget) == 1


def test_image_installs_exactly_the_requirements_list() -> None:
    """One list for the image and for the real-Triton check's environment (make setup): the
    Dockerfile installs requirements.txt with --no-deps, and requirements.txt pins requirements.in."""
    triton = DEPLOY / "triton"
    dockerfile = (triton / "Dockerfile").read_text()
    assert "COPY deploy/triton/requirements.txt /tmp/requirements.txt" in dockerfile
    assert "pip install --no-deps --find-links /tmp/wheels --only-binary llama-cpp-python -r /tmp/requirements.txt" in dockerfile
    # Build stages may use tools the image does not carry (onnx exports MiniLM); the image itself
    # (the last stage) installs nothing but the list.
    image_stage = dockerfile.split("FROM ${TRITON_IMAGE}\n")[-1]
    assert not re.search(r"pip install (?!--no-deps --find-links)", image_stage), "every pip install goes through the list"
    assert "COPY --from=minilm-onnx /onnx/model.onnx /models/minilm_onnx/1/model.onnx" in image_stage
    makefile = (ROOT / "Makefile").read_text()
    assert "pip sync --quiet --python deploy/triton/.venv/bin/python deploy/triton/requirements.txt" in makefile
    pinned = dict(re.findall(r"^([a-z0-9-]+)==(\S+)", (triton / "requirements.txt").read_text(), re.M))
    wanted = re.findall(r"^([a-z0-9-]+)", (triton / "requirements.in").read_text(), re.M)
    assert wanted and not set(wanted) - set(pinned), f"requirements.txt lacks {set(wanted) - set(pinned)}: make deploy-requirements"
    assert pinned["numpy"].startswith("1.") and pinned["llama-cpp-python"] == "0.3.36"
    excluded = set(re.findall(r"^([a-z0-9-]+)$", (triton / "excludes.txt").read_text(), re.M))
    assert excluded == {"llm", "sentence-transformers"} and not excluded & set(pinned)


def test_vllm_model_is_decoupled_and_loads_local_weights() -> None:
    folder = DEPLOY / "triton" / "models" / "smollm2_vllm"
    assert 'backend: "vllm"' in (folder / "config.pbtxt").read_text()
    assert "decoupled: true" in (folder / "config.pbtxt").read_text()
    engine = yaml.safe_load((folder / "1" / "model.json").read_text())
    assert engine["model"].startswith("/"), "a local path: nothing downloads weights at run time"


def test_the_job_worker_is_live_by_its_liveness_service_and_ready_by_its_own() -> None:
    for overlay in OVERLAYS:
        (worker,) = find(render(overlay), "Deployment", "job-worker")
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        assert container["livenessProbe"]["grpc"].get("service") == "liveness", overlay
        assert container["readinessProbe"]["grpc"].get("service", "") == "", overlay


# Documented once for all on the configuration page, as <PREFIX>NAME.
EVERY_SERVICE_SETTINGS = ("LOG_LEVEL", "LOG_JSON", "SHUTDOWN_GRACE_S", "TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CLIENT_CA_FILE")


def _documented_in_row(variable: str, row: str) -> bool:
    """Whether a table row names `variable`: in full, or as a `_SUFFIX` beside a full name it
    shares a prefix with (`SLUICE_X_FLOOR_S` / `_CEILING_S` documents SLUICE_X_CEILING_S)."""
    if re.search(rf"\b{variable}\b", row):
        return True
    full_names = re.findall(r"\bSLUICE_[A-Z0-9_]+[A-Z0-9]\b", row)
    for suffix in re.findall(r"`(_[A-Z0-9_]+[A-Z0-9])`", row):
        stem = variable.removesuffix(suffix)
        if stem != variable and any(name == stem or name.startswith(stem + "_") for name in full_names):
            return True
    return False


def test_every_service_variable_is_documented_on_the_configuration_page() -> None:
    """An operator reads the configuration page, not config.py: a setting missing there is one
    nobody knows to set. The settings every service takes (<PREFIX>LOG_LEVEL, its own TLS files,
    its drain grace) the page documents once for all, below its table."""
    text = CONFIGURATION_PAGE.read_text()
    rows = [line for line in text.splitlines() if line.lstrip().startswith("|")]
    every_service = [name for name in EVERY_SERVICE_SETTINGS if f"<PREFIX>{name}" in text]
    assert every_service == list(EVERY_SERVICE_SETTINGS), "the page no longer says what every service takes"
    missing = [
        variable
        for service in config_vars.services_with_config()
        for variable in config_vars.service_variables(service)
        if variable.removeprefix(config_vars.env_prefix(service)) not in every_service and not any(_documented_in_row(variable, row) for row in rows)
    ]
    assert not missing, f"not on {CONFIGURATION_PAGE.relative_to(ROOT)}: {missing}"
