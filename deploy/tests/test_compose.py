"""deploy/compose.yaml as an engine reads it (compose_file.py: interpolated, then the Compose
Specification's schema and a typed parser), and what it must hold to run: every service and the job
worker, state on writable volumes, models the Triton it dials serves, one drain grace."""

from __future__ import annotations

import ast
import re

import pytest
from compose_spec import parse_duration

import compose_file
import config_vars
from compose_file import ComposeError

ROOT = config_vars.ROOT
DEPLOY = ROOT / "deploy"
SLUICE_SERVICES = ("gateway", "job-worker", "inference-adapter", "rate-limit", "evaluation-logging")
# The CPU mode of the file's header: triton-local instead of the GPU Triton, and its embedding model.
CPU_MODE = {"SLUICE_TRITON_URLS": "triton-local:8001", "SLUICE_TRITON_EMBEDDING_MODEL": "minilm_embed"}
MODES = {"gpu": {}, "cpu": CPU_MODE}
# Settings naming a file or folder (fields ending _path, _file, _dir), by what the service does with
# it: written state must be writable; the rest (tenants, limits, TLS material, templates) is read.
WRITTEN = {
    "gateway": {"events_spill_file", "jobs_spill_file", "jobs_sqlite_path"},
    "evaluation-logging": {"sqlite_path"},
    "triton-local": {"triton_log_file", "cache_dir"},
}
READ = {
    "gateway": {"tenants_file"},
    "evaluation-logging": {"tenants_file"},
    "rate-limit": {"limits_file"},
    "inference-adapter": set(),
    "triton-local": {"gguf_path"},
}
IMAGE_USER = "10001"
SHARED_GRACE = config_vars.SHARED_VARIABLES["shutdown_grace_s"]
FLUSH_S = 10
TRITONS = ("triton", "triton-local")


@pytest.fixture(scope="module", params=MODES)
def compose(request: pytest.FixtureRequest) -> dict:
    return compose_file.load(MODES[request.param])


def service_of(spec: dict) -> str | None:
    """The Sluice service (config.py) an image runs: sluice/<service>; job-worker is the gateway's."""
    image = spec.get("image", "").split(":")[0].removeprefix("sluice/")
    return image if image in config_vars.SERVICES else None


# ---- the file as the engine reads it -----------------------------------------------------------


def test_the_header_documents_the_cpu_mode() -> None:
    header = "".join(line for line in compose_file.COMPOSE_FILE.read_text().splitlines(keepends=True) if line.startswith("#"))
    for name, value in CPU_MODE.items():
        assert f"{name}={value}" in header


@pytest.mark.parametrize(
    "broken",
    [
        pytest.param(("    image: sluice/gateway:latest\n", "    image: sluice/gateway:latest\n    restart_policy: always\n"), id="unknown-key"),
        pytest.param(("  stop_grace_period: 70s\n", "  stop_grace_period: 70x\n"), id="bad-duration"),
        pytest.param(('    ports: ["50051:50051", "8080:8080"]\n', '    ports: ["50051:grpc", "8080:8080"]\n'), id="bad-port"),
        pytest.param(("  read_only: true\n", "  read_only: sure\n"), id="not-a-boolean"),
        pytest.param(("${SLUICE_TRITON_URLS:-triton:8001}", "${SLUICE_TRITON_URLS:?set it}"), id="required-variable"),
        pytest.param(("${SLUICE_TRITON_URLS:-triton:8001}", "${SLUICE_TRITON_URLS/triton/x}"), id="unknown-interpolation"),
    ],
)
def test_the_reader_rejects_a_broken_file(broken: tuple[str, str]) -> None:
    text = compose_file.COMPOSE_FILE.read_text()
    old, new = broken
    assert old in text, "the test's anchor left the file: update the test"
    compose_file.load(text=text)  # the file as it is passes
    with pytest.raises(ComposeError):
        compose_file.load(text=text.replace(old, new, 1))


def test_interpolation_follows_the_specification() -> None:
    env = {"SET": "x", "EMPTY": ""}
    cases = {
        "$SET ${SET}": "x x",
        "${UNSET:-d} ${EMPTY:-d} ${EMPTY-d} ${UNSET-d}": "d d  d",
        "${SET:+alt} ${EMPTY:+alt} ${EMPTY+alt}": "alt  alt",
        "$$SET": "$SET",
    }
    for text, expected in cases.items():
        assert compose_file.interpolate(text, env) == expected, text


def test_compose_has_every_service_and_the_backing_services(compose) -> None:
    services = compose["services"]
    assert {*SLUICE_SERVICES, "triton", "triton-local", "rabbitmq", "redis", "postgres"} <= set(services)
    for name, spec in services.items():
        if "build" in spec:
            assert spec["build"]["context"] == "..", f"{name}: images build from the repository root"
            assert (ROOT / spec["build"]["dockerfile"]).is_file(), name
    devices = services["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
    assert "nvcr.io/nvidia/tritonserver" in (DEPLOY / "triton" / "Dockerfile").read_text()
    # The step model on that GPU: llama.cpp's CUDA build and the KIND_GPU config variant together.
    assert services["triton"]["build"]["args"] == {"LLAMA_BUILD": "cuda"}
    assert "--model-config-name=gpu" in services["triton"]["command"]


@pytest.mark.parametrize("name", [*SLUICE_SERVICES, "triton-local"])
def test_compose_sets_known_variables_and_binds_every_interface(compose, name: str) -> None:
    spec = compose["services"][name]
    environment = spec.get("environment", {})
    service = service_of(spec)
    known = config_vars.service_variables(service)
    shared = set(config_vars.shared_variables(service).values())
    assert not set(environment) - set(known) - shared, f"unknown variables {sorted(set(environment) - set(known) - shared)}"
    (host,) = [v for v in known if v.endswith("_HOST")]
    assert environment.get(host) == "0.0.0.0"
    for variable in known:
        if variable.endswith(("_TENANTS_FILE", "_LIMITS_FILE")):  # required by __post_init__
            assert variable in environment, variable


def test_compose_services_reach_each_other_by_name(compose) -> None:
    services = compose["services"]
    for name in ("gateway", "job-worker"):
        env = services[name]["environment"]
        assert env["SLUICE_GATEWAY_ADAPTER_URL"] == "inference-adapter:50061"
        assert env["SLUICE_GATEWAY_RATELIMIT_URL"] == "rate-limit:50071"
        assert "@rabbitmq:5672" in env["SLUICE_GATEWAY_AMQP_URL"]
    env = services["evaluation-logging"]["environment"]
    assert "@rabbitmq:5672" in env["SLUICE_EVALLOG_AMQP_URL"] and "@postgres:5432" in env["SLUICE_EVALLOG_DATABASE_URL"]


# ---- the job worker ------------------------------------------------------------------------------


def job_worker_spec_variables() -> set[str]:
    """The variables sluice-stack's launcher gives a job worker (job_worker_spec's env dict)."""
    tree = ast.parse((ROOT / "libs" / "sluice-stack" / "src" / "sluice_stack" / "launcher.py").read_text())
    (function,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "job_worker_spec"]
    (env,) = [n for n in ast.walk(function) if isinstance(n, ast.Dict)]
    return {key.value for key in env.keys if isinstance(key, ast.Constant)}


def test_the_job_worker_runs_the_gateway_image_as_its_worker_role(compose) -> None:
    worker, gateway = compose["services"]["job-worker"], compose["services"]["gateway"]
    assert worker["image"] == gateway["image"] and worker["build"] == gateway["build"]
    assert worker["entrypoint"] == ["python", "-m", "sluice_gateway.jobs.worker"]
    environment = worker["environment"]
    missing = job_worker_spec_variables() - set(environment)
    assert not missing, f"the job worker lacks what the launcher gives it: {sorted(missing)}"
    port = environment["SLUICE_GATEWAY_WORKER_PORT"]
    # Its health is on the worker's port, not the gateway's (the image's HEALTHCHECK).
    assert worker["healthcheck"]["test"][-2:] == ["SLUICE_GATEWAY_WORKER_", port]
    # One job topology and one job store: the gateway records jobs, the worker runs their rows.
    assert environment["SLUICE_GATEWAY_AMQP_PREFIX"] == gateway["environment"]["SLUICE_GATEWAY_AMQP_PREFIX"]
    assert environment["SLUICE_GATEWAY_JOBS_SQLITE_PATH"] == gateway["environment"]["SLUICE_GATEWAY_JOBS_SQLITE_PATH"]
    assert environment["SLUICE_GATEWAY_EVENTS_SPILL_FILE"] != gateway["environment"]["SLUICE_GATEWAY_EVENTS_SPILL_FILE"]


# ---- state on writable storage -------------------------------------------------------------------


def test_every_path_setting_is_known_as_written_or_read() -> None:
    for service in config_vars.services_with_config():
        prefix = next(iter(config_vars.service_variables(service))).removesuffix("HOST")
        fields = {v.removeprefix(prefix).lower() for v in config_vars.service_variables(service) if v.endswith(("_PATH", "_FILE", "_DIR"))}
        # TLS material is read only (every service has it, from sluice_common).
        fields = {f for f in fields if "tls_" not in f}
        unknown = fields - WRITTEN.get(service, set()) - READ[service]
        assert not unknown, f"{service}: is {sorted(unknown)} written (WRITTEN) or only read (READ)?"


def writable_targets(compose: dict, spec: dict) -> dict[str, str]:
    """{mount target: 'tmpfs' or the named volume} of a service: where a read-only root can write."""
    targets = {path.split(":")[0]: "tmpfs" for path in spec.get("tmpfs", [])}
    for volume in spec.get("volumes", []):
        source, target, *options = volume.split(":") if isinstance(volume, str) else (volume["source"], volume["target"])
        if source in compose.get("volumes", {}) and "ro" not in options:
            targets[target] = source
    return targets


def owned_by_the_image_user(dockerfile: str, folder: str) -> bool:
    return bool(re.search(rf"install -d -o {IMAGE_USER} -g {IMAGE_USER} (\S+ )*{re.escape(folder)}\b", dockerfile))


@pytest.mark.parametrize("name", SLUICE_SERVICES)
def test_every_state_path_is_on_writable_storage(compose, name: str) -> None:
    spec = compose["services"][name]
    service = service_of(spec)
    assert spec.get("read_only") is True, f"{name}: a read-only root (what it writes is named below)"
    prefix = next(iter(config_vars.service_variables(service))).removesuffix("HOST")
    targets = writable_targets(compose, spec)
    dockerfile = (ROOT / spec["build"]["dockerfile"]).read_text()
    for field in sorted(WRITTEN.get(service, ())):
        variable = f"{prefix}{field.upper()}"
        path = spec["environment"].get(variable, "")
        assert path.startswith("/"), f"{name}: {variable}={path!r} must be an absolute path (the working directory is read-only)"
        (target,) = [t for t in targets if path.startswith(t.rstrip("/") + "/")] or [None]
        assert target, f"{name}: {variable}={path} is on the read-only root: mount a volume or tmpfs there"
        assert targets[target] != "tmpfs", f"{name}: {variable}={path} is state: a named volume, not tmpfs"
        # An empty named volume takes the image folder's owner: the image user must own it.
        assert owned_by_the_image_user(dockerfile, target), f"{name}: the image does not give {target} to user {IMAGE_USER}"


# ---- models ----------------------------------------------------------------------------------------


def served_models(compose: dict, triton: str) -> set[str]:
    """Model names the compose service `triton` or `triton-local` serves."""
    spec = compose["services"][triton]
    if triton == "triton-local":
        defaults = config_vars.service_variables("triton-local")
        environment = spec.get("environment", {})
        return {
            environment.get(v) or ast.literal_eval(defaults[v])
            for v in ("SLUICE_TRITON_LOCAL_STEP_MODEL_NAME", "SLUICE_TRITON_LOCAL_GENERATE_MODEL_NAME", "SLUICE_TRITON_LOCAL_EMBEDDING_MODEL_NAME")
        }
    # The official image, --model-control-mode=explicit: the models named by --load-model, each a
    # folder of deploy/triton/models.
    loaded = {a.split("=", 1)[1] for a in spec["command"] if a.startswith("--load-model=")}
    for model in loaded:
        assert (DEPLOY / "triton" / "models" / model / "config.pbtxt").is_file(), model
    return loaded


def test_the_adapter_names_models_its_triton_serves(compose) -> None:
    environment = compose["services"]["inference-adapter"]["environment"]
    defaults = config_vars.service_variables("inference-adapter")

    def setting(variable: str) -> str:
        return environment.get(variable) or ast.literal_eval(defaults[variable])

    (url,) = setting("SLUICE_ADAPTER_TRITON_URLS").split(",")
    triton = url.split(":")[0]
    assert triton in ("triton", "triton-local"), url
    served = served_models(compose, triton)
    for variable in ("SLUICE_ADAPTER_TRITON_MODEL", "SLUICE_ADAPTER_TRITON_EMBEDDING_MODEL"):
        assert setting(variable) in served, f"{variable}={setting(variable)}: {triton} serves {sorted(served)}"
    evaluation = compose["services"]["evaluation-logging"]["environment"]
    assert evaluation.get("SLUICE_EVALLOG_EMBEDDING_MODEL", "all-minilm-l6-v2") == setting("SLUICE_ADAPTER_EMBEDDING_MODEL_NAME")


# ---- shutdown ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*SLUICE_SERVICES, *TRITONS])
def test_stop_grace_period_covers_the_drain(compose, name: str) -> None:
    spec = compose["services"][name]
    if name in TRITONS:
        # A Triton reads no grace: it must outlive the adapter's drain, as stopped after it.
        assert_stopped_after_the_adapter(compose, name)
        spec, grace_from = compose["services"][name], compose["services"]["inference-adapter"]
    else:
        grace_from = spec
    environment = grace_from["environment"]
    overrides = [v for v in environment if v.endswith("SHUTDOWN_GRACE_S") and v != SHARED_GRACE]
    assert not overrides, f"{name}: the grace is set once ({SHARED_GRACE}), not {overrides}"
    grace = float(environment[SHARED_GRACE])
    # No preStop in compose: SIGTERM comes at once, SIGKILL after stop_grace_period (default 10 s).
    assert parse_duration(spec.get("stop_grace_period", "10s")) >= grace + FLUSH_S, name


def assert_stopped_after_the_adapter(compose: dict, triton: str) -> None:
    """`docker compose stop/down` stopped the Tritons beside the adapter, SIGKILLed after 10 s, while
    the adapter drained its streams for the grace (and Triton answers nothing once it has SIGTERM).
    Compose stops a service's dependents first: the adapter depends on both Tritons, neither
    required (one runs, by profile), and each is in a profile, or the CPU mode would start the GPU
    Triton as the adapter's dependency."""
    services = compose["services"]
    dependency = services["inference-adapter"].get("depends_on", {}).get(triton)
    assert dependency is not None, f"the adapter does not depend on {triton}: compose stops them side by side"
    assert dependency.get("required") is False and dependency["condition"] == "service_started", dependency
    assert services[triton].get("profiles"), f"{triton} has no profile: every mode would start it"


def healthcheck_start_period_s(dockerfile: str) -> float:
    (period,) = re.findall(r"^HEALTHCHECK .*--start-period=(\w+)", (ROOT / dockerfile).read_text(), re.M)
    return float(parse_duration(period))


def test_the_adapter_is_given_as_long_to_become_healthy_as_triton(compose) -> None:
    """The adapter is healthy only once a Triton is (and has answered a token), and the gateway and
    the job worker wait for it healthy: an adapter unhealthy first (its image's 60 s start period
    and three failures) made `compose up` abort while Triton still loaded. So its start period
    covers each Triton's, and a minute more for its own start and first token."""
    adapter = compose["services"]["inference-adapter"]
    start_period = float(parse_duration(adapter["healthcheck"]["start_period"]))
    for triton in TRITONS:
        dockerfile = compose["services"][triton]["build"]["dockerfile"]
        assert start_period >= healthcheck_start_period_s(dockerfile) + 60, triton
    image_check = re.search(r"^ {4}CMD (\[.*\])$", (DEPLOY / "docker" / "inference-adapter.Dockerfile").read_text(), re.M)
    assert image_check is not None and adapter["healthcheck"]["test"] == ["CMD", *ast.literal_eval(image_check.group(1))], "the image's own check"
    for name in ("gateway", "job-worker"):
        assert compose["services"][name]["depends_on"]["inference-adapter"]["condition"] == "service_healthy"
