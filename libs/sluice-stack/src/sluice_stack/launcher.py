"""Starts each service from its own virtual environment, waits for its health, stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from sluice_stack.rabbitmq import AMQP_URL_ENV

REPO_ROOT = Path(__file__).resolve().parents[4]
LOCALHOST = "127.0.0.1"
# triton-local's second variant of the chat model (its VARIANT_* settings: SmolLM2 re-quantized to
# Q4_0, 4 slots), served by the adapter as a second model with a batch of 4: what `sluice eval`
# compares against the main model in `make run` and the end-to-end tests.
VARIANT_MODEL = "smollm2-135m-instruct-q4_0"
VARIANT_TRITON_MODEL = "smollm2_q4_0_step"
VARIANT_BATCH = 4


# What `stop` adds to a service's drain grace before it SIGKILLs: the NOT_SERVING notice, the flush
# of what the service owes after the drain (sluice_common.server.drain) and a busy machine's delays.
STOP_MARGIN_S = 15.0
# sluice_common.config.ServerConfig.shutdown_grace_s, the grace of a service that sets none.
DEFAULT_SHUTDOWN_GRACE_S = 60.0
SHARED_GRACE_ENV = "SLUICE_SHUTDOWN_GRACE_S"
# Each service module's settings prefix (its config.ENV_PREFIX): where its own grace is set.
ENV_PREFIXES = {
    "sluice_gateway": "SLUICE_GATEWAY_",
    "sluice_gateway.jobs.worker": "SLUICE_GATEWAY_",
    "sluice_inference_adapter": "SLUICE_ADAPTER_",
    "sluice_evaluation_logging": "SLUICE_EVALLOG_",
    "sluice_rate_limit": "SLUICE_RATELIMIT_",
    "sluice_triton_local": "SLUICE_TRITON_LOCAL_",
}
# The log line in which a service says which ports it bound, by role (sluice_common.server's and
# the gateway HTTP front's `ports_bound`, logged at any log level).
PORTS_EVENT = "ports_bound"
# What triton-local logs once Triton serves every model it binds (its server answers ready after the
# first model's load, before the others': a request for them then fails).
TRITON_LOCAL_READY = "ready"
PORT_ROLES = ("grpc", "metrics", "http")

# The lifeline (sluice_common.bootstrap's): this process holds a pipe's write end for its whole life
# and every service it starts inherits the read end, named by LIFELINE_FD_ENV. However this process
# dies (SIGKILL, a CI timeout's kill, a closed terminal) the kernel closes the write end; each
# service then reads end-of-file, sends itself SIGTERM (a drain, as `stop` asks) and is SIGKILLed,
# with its process group, after LIFELINE_KILL_AFTER_ENV seconds if still there. A pipe, not
# PR_SET_PDEATHSIG: that fires when the forking *thread* exits, and services are started from
# `_each_at_once`'s pool threads. The names are sluice_common.bootstrap's (not a dependency here).
LIFELINE_FD_ENV = "SLUICE_LIFELINE_FD"
LIFELINE_KILL_AFTER_ENV = "SLUICE_LIFELINE_KILL_AFTER_S"
# Runs a service's module as `python -m` would, watching its lifeline first: for every service,
# those whose `__main__` does not go through sluice_common.bootstrap.run_service (triton-local) too.
SERVICE_RUNNER = "sluice_common.bootstrap"
_lifeline_lock = threading.Lock()
_lifeline: tuple[int, int] | None = None


def lifeline_fd() -> int:
    """The lifeline's read end (made on first use, both ends kept open until this process ends;
    neither inheritable: only `pass_fds` hands the read end to a service)."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None:
            _lifeline = os.pipe()
        return _lifeline[0]


def _drop_lifeline_in_fork_child() -> None:
    """A forked copy of this process (multiprocessing's workers) must not hold the write end: the
    services would outlive this process for as long as it lives. It gets its own on first use."""
    global _lifeline, _lifeline_lock
    _lifeline_lock = threading.Lock()  # another thread may have held it at the fork
    if _lifeline is not None:
        for fd in _lifeline:
            with contextlib.suppress(OSError):
                os.close(fd)
        _lifeline = None


os.register_at_fork(after_in_child=_drop_lifeline_in_fork_child)


def free_port() -> int:
    """A port free now, which another process may take before it is used: only for a server that
    cannot bind port 0 and say what it bound (tritonserver), never for one of Sluice's services."""
    (port,) = free_ports(1)
    return port


def free_ports(count: int) -> list[int]:
    """`count` different ports free now (as free_port): each held until all are picked, since one
    released may be handed out again at once (a replica once got the same HTTP and metrics port,
    which tritonserver refuses)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind((LOCALHOST, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


@dataclass(frozen=True)
class StackPorts:
    gateway: int = 50051
    gateway_metrics: int = 9101
    adapter: int = 50061
    adapter_metrics: int = 9102
    triton_http: int = 8000
    triton_grpc: int = 8001
    triton_metrics: int = 8002
    triton_local_metrics: int = 9105
    evallog: int = 50081
    evallog_metrics: int = 9104
    ratelimit: int = 50071
    ratelimit_metrics: int = 9103
    job_worker: int = 50052
    job_worker_metrics: int = 9106
    # The gateway's OpenAI-compatible HTTP API (SLUICE_GATEWAY_HTTP_PORT).
    gateway_http: int = 8080

    @classmethod
    def ephemeral(cls) -> StackPorts:
        """Every service binds a free port and reports it (tests, benchmarks); Triton's ports,
        which tritonserver cannot report, are picked when the stack is made."""
        return cls(*(0 for _ in fields(cls)))


@dataclass(frozen=True)
class TritonPorts:
    http: int
    grpc: int
    triton_metrics: int
    # The model process's own metrics (tokens generated, slots in use).
    model_metrics: int


class StartupError(RuntimeError):
    pass


@dataclass
class ServiceProcess:
    name: str
    module: str
    env: dict[str, str]
    log_path: Path
    # None: gRPC health SERVING on the port the service reports having bound (`ports["grpc"]`).
    ready: Callable[[], bool] | None = None
    process: subprocess.Popen[bytes] | None = None
    # The services/ folder whose environment runs it, when it differs from the name (replicas).
    project: str = ""
    # Health checks over TLS with these (a service started with TLS on).
    credentials: grpc.ChannelCredentials | None = None
    # The variables that set its ports, by role ("grpc", "metrics", "http"). Once it is ready the
    # ports it bound are written into them, so a restart binds the same ones, as a pod keeps its own.
    port_env: dict[str, str] = field(default_factory=dict)
    # The ports it bound, by role, read from its log (JSON lines) once it is ready.
    ports: dict[str, int] = field(default_factory=dict)
    # An event the service logs once it serves, which readiness waits for too (triton-local's
    # "ready": Triton answers ready between its models' loads, with only some of them loaded).
    ready_event: str = ""
    _log_offset: int = 0

    @property
    def python(self) -> Path:
        return REPO_ROOT / "services" / (self.project or self.name) / ".venv" / "bin" / "python"

    @property
    def address(self) -> str:
        """Its gRPC address, as it reported it (after wait_ready)."""
        return f"{LOCALHOST}:{self.ports['grpc']}"

    def command(self) -> list[str]:
        """`python -m MODULE`, through SERVICE_RUNNER so that the service watches its lifeline."""
        return [str(self.python), "-m", SERVICE_RUNNER, self.module]

    def start(self) -> None:
        if not self.python.exists():
            raise StartupError(f"{self.python} is missing: run `make setup` first")
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        lifeline = lifeline_fd()
        tie = {LIFELINE_FD_ENV: str(lifeline), LIFELINE_KILL_AFTER_ENV: str(self.shutdown_grace_s + STOP_MARGIN_S)}
        # The child gets its own copy of the descriptor; ours is closed at once, not left to the
        # garbage collector (one per start, a restart loop's worth).
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.command(),
                env={**os.environ, **self.env, **tie},
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=True,
                pass_fds=(lifeline,),
            )

    def _logged(self, event: str) -> list[dict[str, Any]]:
        """The records of `event` this run of the service logged (its JSON log lines since `start`)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                lines = log.read().splitlines()
        except OSError:
            return []
        records = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == event:
                records.append(record)
        return records

    def reported_ports(self) -> dict[str, int]:
        """The ports this run of the service says it bound."""
        ports: dict[str, int] = {}
        for record in self._logged(PORTS_EVENT):
            ports.update({role: record[role] for role in PORT_ROLES if isinstance(record.get(role), int) and record[role] > 0})
        return ports

    def is_ready(self) -> bool:
        if self.ready_event and not self._logged(self.ready_event):
            return False
        if self.ready is not None:
            return self.ready()
        port = self.reported_ports().get("grpc")
        return port is not None and grpc_serving(f"{LOCALHOST}:{port}", self.credentials)()

    def _keep_ports(self) -> None:
        self.ports.update(self.reported_ports())
        for role, variable in self.port_env.items():
            if role in self.ports:
                self.env[variable] = str(self.ports[role])

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StartupError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                self._keep_ports()
                return
            time.sleep(0.25)
        raise StartupError(f"{self.name} was not ready within {timeout_s:.0f}s:\n{self.log_tail()}")

    def start_ready(self, timeout_s: float) -> None:
        """start() and wait_ready(); a process that never gets ready is stopped, not left behind."""
        self.start()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def shutdown_grace_s(self) -> float:
        """The drain grace this service runs with: its own setting, else the shared one, else the default."""
        env = {**os.environ, **self.env}
        own = f"{ENV_PREFIXES[self.module]}SHUTDOWN_GRACE_S" if self.module in ENV_PREFIXES else ""
        raw = env.get(own) or env.get(SHARED_GRACE_ENV)
        try:
            return float(raw) if raw else DEFAULT_SHUTDOWN_GRACE_S
        except ValueError:  # the service refuses to start with it; nothing to drain
            return DEFAULT_SHUTDOWN_GRACE_S

    def terminate(self) -> None:
        """SIGTERM, without waiting: the service drains (see sluice_common.server.drain) and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, as failure tests need it."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM, then SIGKILL only after the service's drain grace and STOP_MARGIN_S (or `timeout_s`)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(self.shutdown_grace_s + STOP_MARGIN_S if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def grpc_serving(address: str, credentials: grpc.ChannelCredentials | None = None) -> Callable[[], bool]:
    """Health SERVING on `address`; over TLS with `credentials` (for services started with TLS on)."""

    def check() -> bool:
        try:
            channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
            with channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    return check


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as reply:
                return reply.status == 200
        except OSError:
            return False

    return check


# The services/ folder whose environment runs each module.
MODULE_PROJECTS = {
    "sluice_gateway": "gateway",
    "sluice_gateway.jobs.worker": "gateway",
    "sluice_inference_adapter": "inference-adapter",
    "sluice_evaluation_logging": "evaluation-logging",
    "sluice_rate_limit": "rate-limit",
    "sluice_triton_local": "triton-local",
}
# Each service's port variables, by role (ServiceProcess.port_env).
ADAPTER_PORT_ENV = {"grpc": "SLUICE_ADAPTER_PORT", "metrics": "SLUICE_ADAPTER_METRICS_PORT"}
EVALLOG_PORT_ENV = {"grpc": "SLUICE_EVALLOG_PORT", "metrics": "SLUICE_EVALLOG_METRICS_PORT"}
RATELIMIT_PORT_ENV = {"grpc": "SLUICE_RATELIMIT_PORT", "metrics": "SLUICE_RATELIMIT_METRICS_PORT"}
GATEWAY_PORT_ENV = {"grpc": "SLUICE_GATEWAY_PORT", "metrics": "SLUICE_GATEWAY_METRICS_PORT", "http": "SLUICE_GATEWAY_HTTP_PORT"}
WORKER_PORT_ENV = {"grpc": "SLUICE_GATEWAY_WORKER_PORT", "metrics": "SLUICE_GATEWAY_WORKER_METRICS_PORT"}
# SLUICE_GATEWAY_HTTP_PORT's "bind a free port and report it" (its 0 turns the HTTP front off).
ANY_HTTP_PORT = -1

# A service to start: its name, module, environment and port variables (ServiceProcess's fields).
Spec = tuple[str, str, dict[str, str], dict[str, str]]


@dataclass
class Stack:
    """triton-local, inference-adapter, evaluation-logging, rate-limit and gateway, started in that order.

    Ports that are 0 in `ports` are bound by the service itself, which reports what it bound
    (ServiceProcess.ports): no port is probed free and then handed to a process that another
    may take first. Triton's are the exception: tritonserver binds what it is told, so a stack
    with Triton ports of 0 picks free ones and starts triton-local again on other ports if one
    was taken meanwhile."""

    run_dir: Path
    ports: StackPorts = field(default_factory=StackPorts)
    tenants_file: Path = REPO_ROOT / "config" / "tenants.toml"
    limits_file: Path = REPO_ROOT / "config" / "limits.toml"
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    # Readiness checks of gRPC services go over TLS with these (when extra_env turns TLS on).
    grpc_credentials: grpc.ChannelCredentials | None = None
    # More triton-local processes behind the same adapter, named triton-local-2, -3, ...
    extra_triton_replicas: int = 0
    # Processes of each of gateway, inference-adapter and evaluation-logging (the second is named
    # gateway-2, ...): the gateways dial every adapter, clients dial every gateway (`gateway_target`),
    # as a cluster's several pods per service, for rolling restarts.
    service_replicas: int = 1
    # triton-local serves the Q4_0 variant and the adapters serve it as VARIANT_MODEL (sluice eval's
    # second model). False: the main model alone, as the manifests deploy it.
    serve_variant: bool = True
    # RabbitMQ for CompletionEvents (gateway -> evaluation-logging); exchange and queue names start
    # with amqp_prefix, so a test session with its own prefix never meets another run's messages.
    amqp_url: str = field(default_factory=lambda: os.environ.get(AMQP_URL_ENV, "amqp://guest:guest@127.0.0.1:5672/"))
    amqp_prefix: str = "sluice"
    services: list[ServiceProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.ports
        self._probed_triton = not (p.triton_http and p.triton_grpc and p.triton_metrics and p.triton_local_metrics)
        if self._probed_triton:
            http, grpc_port, triton_metrics, local_metrics = free_ports(4)
            self.ports = p = replace(p, triton_http=http, triton_grpc=grpc_port, triton_metrics=triton_metrics, triton_local_metrics=local_metrics)
        self.triton_ports: dict[str, TritonPorts] = {
            "triton-local": TritonPorts(p.triton_http, p.triton_grpc, p.triton_metrics, p.triton_local_metrics)
        }
        for index in range(self.extra_triton_replicas):
            self.triton_ports[f"triton-local-{index + 2}"] = TritonPorts(*free_ports(4))
        # The (gRPC, metrics) ports asked of each replica of the services that have several (0: any).
        self.replica_ports: dict[str, list[tuple[int, int]]] = {
            "gateway": [(p.gateway, p.gateway_metrics)],
            "inference-adapter": [(p.adapter, p.adapter_metrics)],
            "evaluation-logging": [(p.evallog, p.evallog_metrics)],
        }
        for ports in self.replica_ports.values():
            ports.extend((0, 0) for _ in range(self.service_replicas - 1))

    def replica_names(self, service: str) -> list[str]:
        return [service if index == 0 else f"{service}-{index + 1}" for index in range(len(self.replica_ports[service]))]

    def _bound(self, name: str, role: str = "grpc") -> int:
        """The port a started service reported for `role`."""
        try:
            return self.service(name).ports[role]
        except (StopIteration, KeyError):
            raise StartupError(f"{name} has not reported a {role} port: is it started?") from None

    def _target(self, service: str) -> str:
        """A gRPC target naming every replica of `service` (one address when there is one)."""
        addresses = [f"{LOCALHOST}:{self._bound(name)}" for name in self.replica_names(service)]
        return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)

    @property
    def gateway_target(self) -> str:
        return self._target("gateway")

    @property
    def gateway_address(self) -> str:
        return f"{LOCALHOST}:{self._bound('gateway')}"

    @property
    def openai_base_url(self) -> str:
        """The OpenAI-compatible API of the (first) gateway: an openai client's base_url."""
        return f"http://{LOCALHOST}:{self._bound('gateway', 'http')}/v1"

    @property
    def ratelimit_address(self) -> str:
        return f"{LOCALHOST}:{self._bound('rate-limit')}"

    @property
    def evallog_address(self) -> str:
        return f"{LOCALHOST}:{self._bound('evaluation-logging')}"

    @property
    def adapter_address(self) -> str:
        return f"{LOCALHOST}:{self._bound('inference-adapter')}"

    @property
    def job_worker_address(self) -> str:
        """A running job worker's health port (test_jobs kills the first and starts others)."""
        running = [s.name for s in self.services if s.name.startswith("job-worker") and s.process is not None and s.process.poll() is None]
        return f"{LOCALHOST}:{self._bound(running[0] if running else 'job-worker')}"

    @property
    def triton_grpc_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.triton_grpc}"

    def triton_address(self, replica: str) -> str:
        return f"{LOCALHOST}:{self.triton_ports[replica].grpc}"

    def metrics_url(self, service: str) -> str:
        if service in self.triton_ports:
            return f"http://{LOCALHOST}:{self.triton_ports[service].model_metrics}/metrics"
        return f"http://{LOCALHOST}:{self._bound(service, 'metrics')}/metrics"

    def _extra_models(self) -> str:
        return f"{VARIANT_MODEL}={VARIANT_TRITON_MODEL}:{VARIANT_BATCH}" if self.serve_variant else ""

    def _triton_service(self, name: str) -> ServiceProcess:
        ports = self.triton_ports[name]
        env = {
            "SLUICE_TRITON_LOCAL_HTTP_PORT": str(ports.http),
            "SLUICE_TRITON_LOCAL_GRPC_PORT": str(ports.grpc),
            "SLUICE_TRITON_LOCAL_TRITON_METRICS_PORT": str(ports.triton_metrics),
            "SLUICE_TRITON_LOCAL_METRICS_PORT": str(ports.model_metrics),
            "SLUICE_TRITON_LOCAL_TRITON_LOG_FILE": str(self.run_dir / f"{name}.tritonserver.log"),
            **({} if self.serve_variant else {"SLUICE_TRITON_LOCAL_VARIANT_MODEL_NAME": ""}),
            **self._triton_threads(),
        }
        ready = http_ok(f"http://{LOCALHOST}:{ports.http}/v2/health/ready")
        return self._service((name, "sluice_triton_local", env, {}), ready, ready_event=TRITON_LOCAL_READY)

    def _triton_threads(self) -> dict[str, str]:
        """Several replicas on this one machine split its cores, as an operator co-locating them
        must (TritonLocalConfig.engine_threads: two replicas of 2 threads on 2 cores stall every step)."""
        if len(self.triton_ports) == 1:
            return {}
        return {"SLUICE_TRITON_LOCAL_THREADS": str(max(1, len(os.sched_getaffinity(0)) // len(self.triton_ports)))}

    def _service(self, spec: Spec, ready: Callable[[], bool] | None = None, ready_event: str = "") -> ServiceProcess:
        name, module, env, port_env = spec
        return ServiceProcess(
            name,
            module,
            {"PYTHONUNBUFFERED": "1", **env, **self.extra_env.get(name, {})},
            self.run_dir / f"{name}.log",
            ready,
            project=MODULE_PROJECTS[module],
            # The job worker's health port speaks no TLS (jobs/worker.py's create_server).
            credentials=None if module == "sluice_gateway.jobs.worker" else self.grpc_credentials,
            port_env=port_env,
            ready_event=ready_event,
        )

    def _plan(self) -> list[list[Callable[[], ServiceProcess]]]:
        """What to start, in waves: the services of a wave start at once (triton-local's replicas
        load their models side by side), each made when its wave comes, with the addresses its
        dependencies, started in an earlier wave, reported."""
        p = self.ports
        ratelimit_env = {
            "SLUICE_RATELIMIT_PORT": str(p.ratelimit),
            "SLUICE_RATELIMIT_METRICS_PORT": str(p.ratelimit_metrics),
            "SLUICE_RATELIMIT_LIMITS_FILE": str(self.limits_file),
        }

        def replicas(service: str, spec: Callable[[str, int, int], Spec]) -> list[Callable[[], ServiceProcess]]:
            return [
                partial(lambda name, ports: self._service(spec(name, *ports)), name, ports)
                for name, ports in zip(self.replica_names(service), self.replica_ports[service], strict=True)
            ]

        return [
            [
                *(partial(self._triton_service, name) for name in self.triton_ports),
                lambda: self._service(("rate-limit", "sluice_rate_limit", ratelimit_env, RATELIMIT_PORT_ENV)),
            ],
            replicas("inference-adapter", self._adapter_spec),
            [
                *replicas("evaluation-logging", self._evallog_spec),
                *replicas("gateway", self._gateway_spec),
                lambda: self._service(self.job_worker_spec()),
            ],
        ]

    def _adapter_spec(self, name: str, port: int = 0, metrics_port: int = 0) -> Spec:
        env = {
            "SLUICE_ADAPTER_PORT": str(port),
            "SLUICE_ADAPTER_METRICS_PORT": str(metrics_port),
            "SLUICE_ADAPTER_TRITON_URLS": ",".join(self.triton_address(n) for n in self.triton_ports),
            "SLUICE_ADAPTER_EXTRA_MODELS": self._extra_models(),
            **self.extra_env.get("inference-adapter", {}),
        }
        return name, "sluice_inference_adapter", env, ADAPTER_PORT_ENV

    def _evallog_spec(self, name: str, port: int = 0, metrics_port: int = 0) -> Spec:
        env = {
            "SLUICE_EVALLOG_PORT": str(port),
            "SLUICE_EVALLOG_METRICS_PORT": str(metrics_port),
            "SLUICE_EVALLOG_TENANTS_FILE": str(self.tenants_file),
            "SLUICE_EVALLOG_AMQP_URL": self.amqp_url,
            "SLUICE_EVALLOG_AMQP_PREFIX": self.amqp_prefix,
            # Replicas share one store, as a cluster's share one PostgreSQL.
            "SLUICE_EVALLOG_SQLITE_PATH": str(self.run_dir / "evallog.sqlite3"),
            "SLUICE_EVALLOG_ADAPTER_URL": self._target("inference-adapter"),
            **self.extra_env.get("evaluation-logging", {}),
        }
        return name, "sluice_evaluation_logging", env, EVALLOG_PORT_ENV

    def _gateway_role_env(self, name: str) -> dict[str, str]:
        """What the gateway's two roles (API, job worker) both need: dependencies and state files."""
        return {
            "SLUICE_GATEWAY_ADAPTER_URL": self._target("inference-adapter"),
            "SLUICE_GATEWAY_TENANTS_FILE": str(self.tenants_file),
            "SLUICE_GATEWAY_RATELIMIT_URL": self.ratelimit_address,
            "SLUICE_GATEWAY_AMQP_URL": self.amqp_url,
            "SLUICE_GATEWAY_AMQP_PREFIX": self.amqp_prefix,
            "SLUICE_GATEWAY_EVENTS_SPILL_FILE": str(self.run_dir / f"{name}-events.spill"),
            "SLUICE_GATEWAY_JOBS_SQLITE_PATH": str(self.run_dir / "jobs.sqlite3"),
        }

    def _gateway_spec(self, name: str, port: int = 0, metrics_port: int = 0) -> Spec:
        http_port = self.ports.gateway_http if name == "gateway" else 0
        env = {
            "SLUICE_GATEWAY_PORT": str(port),
            "SLUICE_GATEWAY_METRICS_PORT": str(metrics_port),
            **self._gateway_role_env(name),
            "SLUICE_GATEWAY_HTTP_PORT": str(http_port or ANY_HTTP_PORT),
            # SubmitJob's AdmittedJobs past the outbox: one file per gateway, kept across its restarts.
            "SLUICE_GATEWAY_JOBS_SPILL_FILE": str(self.run_dir / f"{name}-jobs.spill"),
            **self.extra_env.get("gateway", {}),
        }
        return name, "sluice_gateway", env, GATEWAY_PORT_ENV

    def job_worker_spec(self, name: str = "job-worker", port: int | None = None, metrics_port: int | None = None) -> Spec:
        """The gateway's job-worker role (bulk jobs); more workers: `add_job_worker`."""
        env = {
            "SLUICE_GATEWAY_WORKER_PORT": str(self.ports.job_worker if port is None else port),
            "SLUICE_GATEWAY_WORKER_METRICS_PORT": str(self.ports.job_worker_metrics if metrics_port is None else metrics_port),
            **self._gateway_role_env(name),
        }
        return name, "sluice_gateway.jobs.worker", env, WORKER_PORT_ENV

    def add_job_worker(self, name: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> ServiceProcess:
        """Starts one more job worker (for failover tests), with `env` on top of the stack's worker
        settings; stopped with the stack."""
        worker_env = {**self.extra_env.get("job-worker", {}), **(env or {})}
        service, _, _ = self._start_extra(self.job_worker_spec(name, 0, 0), worker_env, timeout_s)
        return service

    def add_adapter(self, name: str, timeout_s: float = 300.0, env: dict[str, str] | None = None) -> tuple[ServiceProcess, str, str]:
        """Starts one more inference-adapter on the same Triton replicas (it shares their slots),
        with `env` on top of the stack's adapter settings; stopped with the stack. Returns it,
        its gRPC address and its metrics URL."""
        return self._start_extra(self._adapter_spec(name), env, timeout_s)

    def add_ratelimit(
        self, name: str, limits_file: Path, timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> tuple[ServiceProcess, str, str]:
        """Starts one more rate-limit with its own limits file (a gateway from `add_gateway` with
        SLUICE_GATEWAY_RATELIMIT_URL set to it asks it); stopped with the stack. Returns it, its
        gRPC address and its metrics URL."""
        service_env = {
            **self.extra_env.get("rate-limit", {}),
            "SLUICE_RATELIMIT_PORT": "0",
            "SLUICE_RATELIMIT_METRICS_PORT": "0",
            "SLUICE_RATELIMIT_LIMITS_FILE": str(limits_file),
        }
        return self._start_extra((name, "sluice_rate_limit", service_env, RATELIMIT_PORT_ENV), env, timeout_s)

    def add_gateway(self, name: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> tuple[ServiceProcess, str, str]:
        """Starts one more gateway beside the stack's (the same rate-limit, tenants and RabbitMQ),
        with `env` on top (e.g. SLUICE_GATEWAY_ADAPTER_URL of an adapter from `add_adapter`, so a
        test routes through a differently configured adapter); stopped with the stack. Returns
        it, its gRPC address and its metrics URL; its HTTP front's port is `ports["http"]`."""
        return self._start_extra(self._gateway_spec(name), env, timeout_s)

    def _start_extra(self, spec: Spec, env: dict[str, str] | None, timeout_s: float) -> tuple[ServiceProcess, str, str]:
        """Starts a service beside the stack's own, stopped with the stack: it, its gRPC address
        and its metrics URL."""
        name, module, spec_env, port_env = spec
        service = self._service((name, module, {**spec_env, **(env or {})}, port_env))
        self.services.append(service)
        service.start_ready(timeout_s)
        return service, service.address, f"http://{LOCALHOST}:{service.ports['metrics']}/metrics"

    def start(self, timeout_s: float = 300.0, on_ready: Callable[[ServiceProcess], None] | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for wave in self._plan():
                services = [make() for make in wave]
                self.services.extend(services)
                _each_at_once(lambda service: self._start_service(service, timeout_s), services)
                for service in services:
                    if on_ready is not None:
                        on_ready(service)
        except BaseException:
            self.stop()
            raise

    # Starts of triton-local on other probed ports when one of them was taken meanwhile.
    TRITON_PORT_RETRIES = 3

    def _start_service(self, service: ServiceProcess, timeout_s: float) -> None:
        for attempt in range(self.TRITON_PORT_RETRIES + 1):
            service.start()
            try:
                service.wait_ready(timeout_s)
                return
            except StartupError as exc:
                if not (self._probed_triton and service.name in self.triton_ports and _port_taken(service, str(exc))):
                    raise
                if attempt == self.TRITON_PORT_RETRIES:
                    raise
            self._reprobe_triton(service)

    def _reprobe_triton(self, service: ServiceProcess) -> None:
        """New probed ports for a triton-local whose ports another process took first."""
        service.stop()
        ports = TritonPorts(*free_ports(4))
        self.triton_ports[service.name] = ports
        if service.name == "triton-local":
            self.ports = replace(
                self.ports, triton_http=ports.http, triton_grpc=ports.grpc, triton_metrics=ports.triton_metrics,
                triton_local_metrics=ports.model_metrics,
            )  # fmt: skip
        fresh = self._triton_service(service.name)
        service.env, service.ready = fresh.env, fresh.ready

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    def stop(self) -> None:
        """Stops the services that call others first (gateways, job workers, evaluation-logging and
        any unknown module), then the adapters and rate-limit, then triton-local; each tier's at once.

        Every tier is stopped whatever happens on the way: a SIGINT, SIGTERM or SIGHUP meanwhile (a
        second Ctrl-C) sends the services being stopped another SIGTERM, which cuts their drain, and
        its own handler (KeyboardInterrupt) runs once all are down; a tier's error is raised then too."""
        signalled: list[ServiceProcess] = []

        def hurry() -> None:
            for service in signalled:
                service.terminate()

        first_error: BaseException | None = None
        with _signals_deferred(hurry):
            for tier in range(max(STOP_TIERS.values()) + 1):
                services = [s for s in reversed(self.services) if STOP_TIERS.get(s.module, 0) == tier]
                signalled.extend(services)
                try:
                    _each_at_once(ServiceProcess.stop, services)
                except BaseException as exc:  # noqa: BLE001 - the next tiers are stopped all the same
                    first_error = first_error or exc
            self.services.clear()
        if first_error is not None:
            raise first_error


# When `Stack.stop` stops a service, by module (0 first; a module not named here: 0).
STOP_TIERS = {"sluice_inference_adapter": 1, "sluice_rate_limit": 1, "sluice_triton_local": 2}


# What `Stack.stop` defers while it stops (when their handler is Python code, as KeyboardInterrupt's).
DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_deferred(on_signal: Callable[[], None]) -> Iterator[None]:
    """In the main thread: DEFERRED_SIGNALS whose handler is a Python callable call `on_signal`
    instead, and the first one's own handler runs on the way out (raising its KeyboardInterrupt
    there). Elsewhere (signals are the main thread's) or with default handlers: nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def note(signum: int, _frame: object) -> None:
        received.append(signum)
        on_signal()

    previous: dict[int, Callable[[int, Any], Any]] = {}
    for sig in DEFERRED_SIGNALS:
        handler = signal.getsignal(sig)
        if callable(handler):
            previous[sig] = handler
            signal.signal(sig, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        previous[received[0]](received[0], None)


def _each_at_once(action: Callable[[ServiceProcess], None], services: list[ServiceProcess]) -> None:
    """`action` on every service in threads of its own; the first error (in the services' order)
    is raised once all have finished."""
    if len(services) == 1:
        action(services[0])
        return
    with ThreadPoolExecutor(max_workers=max(1, len(services))) as pool:
        futures = [pool.submit(action, service) for service in services]
    for future in futures:
        future.result()


def _port_taken(service: ServiceProcess, startup_error: str) -> bool:
    """Whether triton-local failed because a port was taken (its own log, or tritonserver's)."""
    triton_log = Path(service.env.get("SLUICE_TRITON_LOCAL_TRITON_LOG_FILE", "/nonexistent"))
    try:
        startup_error += triton_log.read_text(errors="replace")[-20_000:]
    except OSError:
        pass
    return "already in use" in startup_error.lower()  # "Address already in use", Triton's "Socket ... already in use"
