"""Starts each service from its own virtual environment, waits for its health, stops it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[4]
LOCALHOST = "127.0.0.1"
# triton-local's second variant of the chat model (its VARIANT_* settings: SmolLM2 re-quantized to
# Q4_0, 4 slots), served by the adapter as a second model with a batch of 4: what `sluice eval`
# compares against the main model in `make run` and the end-to-end tests.
VARIANT_MODEL = "smollm2-135m-instruct-q4_0"
VARIANT_TRITON_MODEL = "smollm2_q4_0_step"
VARIANT_BATCH = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOCALHOST, 0))
        return int(sock.getsockname()[1])


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
        return cls(*(free_port() for _ in fields(cls)))


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
    ready: Callable[[], bool]
    process: subprocess.Popen[bytes] | None = None
    # The services/ folder whose environment runs it, when it differs from the name (replicas).
    project: str = ""

    @property
    def python(self) -> Path:
        return REPO_ROOT / "services" / (self.project or self.name) / ".venv" / "bin" / "python"

    def start(self) -> None:
        if not self.python.exists():
            raise StartupError(f"{self.python} is missing: run `make setup` first")
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [str(self.python), "-m", self.module],
            env={**os.environ, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise StartupError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            if self.ready():
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

    def terminate(self) -> None:
        """SIGTERM, without waiting: the service drains (see sluice_common.server.drain) and exits."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group: a crash, as failure tests need it."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
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


@dataclass
class Stack:
    """triton-local, inference-adapter, evaluation-logging, rate-limit and gateway, started in that order."""

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
    amqp_url: str = field(default_factory=lambda: os.environ.get("SLUICE_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"))
    amqp_prefix: str = "sluice"
    services: list[ServiceProcess] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = self.ports
        self.triton_ports: dict[str, TritonPorts] = {
            "triton-local": TritonPorts(p.triton_http, p.triton_grpc, p.triton_metrics, p.triton_local_metrics)
        }
        for index in range(self.extra_triton_replicas):
            self.triton_ports[f"triton-local-{index + 2}"] = TritonPorts(*(free_port() for _ in range(4)))
        # (gRPC port, metrics port) of each replica of the services that have several.
        self.replica_ports: dict[str, list[tuple[int, int]]] = {
            "gateway": [(p.gateway, p.gateway_metrics)],
            "inference-adapter": [(p.adapter, p.adapter_metrics)],
            "evaluation-logging": [(p.evallog, p.evallog_metrics)],
        }
        for ports in self.replica_ports.values():
            ports.extend((free_port(), free_port()) for _ in range(self.service_replicas - 1))

    def replica_names(self, service: str) -> list[str]:
        return [service if index == 0 else f"{service}-{index + 1}" for index in range(len(self.replica_ports[service]))]

    def _target(self, service: str) -> str:
        """A gRPC target naming every replica of `service` (one address when there is one)."""
        addresses = [f"{LOCALHOST}:{port}" for port, _ in self.replica_ports[service]]
        return addresses[0] if len(addresses) == 1 else "ipv4:" + ",".join(addresses)

    @property
    def gateway_target(self) -> str:
        return self._target("gateway")

    @property
    def gateway_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.gateway}"

    @property
    def openai_base_url(self) -> str:
        """The OpenAI-compatible API of the (first) gateway: an openai client's base_url."""
        return f"http://{LOCALHOST}:{self.ports.gateway_http}/v1"

    @property
    def ratelimit_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.ratelimit}"

    @property
    def evallog_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.evallog}"

    @property
    def adapter_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.adapter}"

    @property
    def triton_grpc_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.triton_grpc}"

    def triton_address(self, replica: str) -> str:
        return f"{LOCALHOST}:{self.triton_ports[replica].grpc}"

    def metrics_url(self, service: str) -> str:
        ports = {
            "gateway": self.ports.gateway_metrics,
            "inference-adapter": self.ports.adapter_metrics,
            "evaluation-logging": self.ports.evallog_metrics,
            "rate-limit": self.ports.ratelimit_metrics,
            "job-worker": self.ports.job_worker_metrics,
            **{name: t.model_metrics for name, t in self.triton_ports.items()},
            **{
                name: metrics
                for service, ports in self.replica_ports.items()
                for name, (_, metrics) in zip(self.replica_names(service), ports, strict=True)
            },
        }
        return f"http://{LOCALHOST}:{ports[service]}/metrics"

    def _extra_models(self) -> str:
        return f"{VARIANT_MODEL}={VARIANT_TRITON_MODEL}:{VARIANT_BATCH}" if self.serve_variant else ""

    def _triton_spec(self, name: str, ports: TritonPorts) -> tuple[str, str, dict[str, str], Callable[[], bool]]:
        env = {
            "SLUICE_TRITON_LOCAL_HTTP_PORT": str(ports.http),
            "SLUICE_TRITON_LOCAL_GRPC_PORT": str(ports.grpc),
            "SLUICE_TRITON_LOCAL_TRITON_METRICS_PORT": str(ports.triton_metrics),
            "SLUICE_TRITON_LOCAL_METRICS_PORT": str(ports.model_metrics),
            "SLUICE_TRITON_LOCAL_TRITON_LOG_FILE": str(self.run_dir / f"{name}.tritonserver.log"),
            **({} if self.serve_variant else {"SLUICE_TRITON_LOCAL_VARIANT_MODEL_NAME": ""}),
            **self._triton_threads(),
        }
        # Server readiness: every model loaded (the step model alone is ready before the others).
        return name, "sluice_triton_local", env, http_ok(f"http://{LOCALHOST}:{ports.http}/v2/health/ready")

    def _triton_threads(self) -> dict[str, str]:
        """Several replicas on this one machine split its cores, as an operator co-locating them
        must (TritonLocalConfig.engine_threads: two replicas of 2 threads on 2 cores stall every step)."""
        if len(self.triton_ports) == 1:
            return {}
        return {"SLUICE_TRITON_LOCAL_THREADS": str(max(1, len(os.sched_getaffinity(0)) // len(self.triton_ports)))}

    def _plan(self) -> list[ServiceProcess]:
        p = self.ports
        common = {"PYTHONUNBUFFERED": "1"}
        specs = [
            *(self._triton_spec(name, ports) for name, ports in self.triton_ports.items()),
            *(self._adapter_spec(name, port, metrics) for name, (port, metrics) in self._replicas("inference-adapter")),
            *(self._evallog_spec(name, port, metrics) for name, (port, metrics) in self._replicas("evaluation-logging")),
            (
                "rate-limit",
                "sluice_rate_limit",
                {
                    "SLUICE_RATELIMIT_PORT": str(p.ratelimit),
                    "SLUICE_RATELIMIT_METRICS_PORT": str(p.ratelimit_metrics),
                    "SLUICE_RATELIMIT_LIMITS_FILE": str(self.limits_file),
                },
                grpc_serving(self.ratelimit_address, self.grpc_credentials),
            ),
            *(self._gateway_spec(name, port, metrics) for name, (port, metrics) in self._replicas("gateway")),
            self.job_worker_spec(),
        ]
        return [
            ServiceProcess(
                name,
                module,
                {**common, **env, **self.extra_env.get(name, {})},
                self.run_dir / f"{name}.log",
                ready,
                project=self._project_of(name),
            )
            for name, module, env, ready in specs
        ]

    def _replicas(self, service: str) -> list[tuple[str, tuple[int, int]]]:
        return list(zip(self.replica_names(service), self.replica_ports[service], strict=True))

    def _project_of(self, name: str) -> str:
        """The services/ folder that runs `name` (a replica, or the gateway's job-worker role)."""
        if name.startswith("job-worker"):
            return "gateway"
        return next((p for p in ("triton-local", *self.replica_ports) if name.startswith(p) and name != p), "")

    def _adapter_spec(self, name: str, port: int, metrics_port: int) -> tuple[str, str, dict[str, str], Callable[[], bool]]:
        env = {
            "SLUICE_ADAPTER_PORT": str(port),
            "SLUICE_ADAPTER_METRICS_PORT": str(metrics_port),
            "SLUICE_ADAPTER_TRITON_URLS": ",".join(self.triton_address(n) for n in self.triton_ports),
            "SLUICE_ADAPTER_EXTRA_MODELS": self._extra_models(),
            **self.extra_env.get("inference-adapter", {}),
        }
        return name, "sluice_inference_adapter", env, grpc_serving(f"{LOCALHOST}:{port}", self.grpc_credentials)

    def _evallog_spec(self, name: str, port: int, metrics_port: int) -> tuple[str, str, dict[str, str], Callable[[], bool]]:
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
        return name, "sluice_evaluation_logging", env, grpc_serving(f"{LOCALHOST}:{port}", self.grpc_credentials)

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

    def _gateway_spec(self, name: str, port: int, metrics_port: int) -> tuple[str, str, dict[str, str], Callable[[], bool]]:
        env = {
            "SLUICE_GATEWAY_PORT": str(port),
            "SLUICE_GATEWAY_METRICS_PORT": str(metrics_port),
            **self._gateway_role_env(name),
            "SLUICE_GATEWAY_HTTP_PORT": str(self.ports.gateway_http if name == "gateway" else free_port()),
            **self.extra_env.get("gateway", {}),
        }
        return name, "sluice_gateway", env, grpc_serving(f"{LOCALHOST}:{port}", self.grpc_credentials)

    def job_worker_spec(
        self, name: str = "job-worker", port: int | None = None, metrics_port: int | None = None
    ) -> tuple[str, str, dict[str, str], Callable[[], bool]]:
        """The gateway's job-worker role (bulk jobs); more workers: `add_job_worker`."""
        port = self.ports.job_worker if port is None else port
        metrics_port = self.ports.job_worker_metrics if metrics_port is None else metrics_port
        env = {
            "SLUICE_GATEWAY_WORKER_PORT": str(port),
            "SLUICE_GATEWAY_WORKER_METRICS_PORT": str(metrics_port),
            **self._gateway_role_env(name),
        }
        return name, "sluice_gateway.worker", env, grpc_serving(f"{LOCALHOST}:{port}")

    def add_job_worker(self, name: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> ServiceProcess:
        """Starts one more job worker (for failover tests), with `env` on top of the stack's worker
        settings; stopped with the stack."""
        _, module, spec_env, ready = self.job_worker_spec(name, free_port(), free_port())
        service = ServiceProcess(
            name, module, {"PYTHONUNBUFFERED": "1", **spec_env, **self.extra_env.get("job-worker", {}), **(env or {})},
            self.run_dir / f"{name}.log", ready, project="gateway",
        )  # fmt: skip
        self.services.append(service)
        service.start()
        service.wait_ready(timeout_s)
        return service

    def add_adapter(
        self, name: str, timeout_s: float = 300.0, env: dict[str, str] | None = None
    ) -> tuple[ServiceProcess, str, str]:
        """Starts one more inference-adapter on the same Triton replicas (it shares their slots),
        with `env` on top of the stack's adapter settings; stopped with the stack. Returns it,
        its gRPC address and its metrics URL."""
        port, metrics_port = free_port(), free_port()
        env = {
            "PYTHONUNBUFFERED": "1",
            "SLUICE_ADAPTER_EXTRA_MODELS": self._extra_models(),
            **self.extra_env.get("inference-adapter", {}),
            "SLUICE_ADAPTER_PORT": str(port),
            "SLUICE_ADAPTER_METRICS_PORT": str(metrics_port),
            "SLUICE_ADAPTER_TRITON_URLS": ",".join(self.triton_address(n) for n in self.triton_ports),
            **(env or {}),
        }
        return self._start_extra(name, "sluice_inference_adapter", "inference-adapter", env, port, metrics_port, timeout_s)

    def add_ratelimit(
        self, name: str, limits_file: Path, timeout_s: float = 60.0, env: dict[str, str] | None = None
    ) -> tuple[ServiceProcess, str, str]:
        """Starts one more rate-limit with its own limits file (a gateway from `add_gateway` with
        SLUICE_GATEWAY_RATELIMIT_URL set to it asks it); stopped with the stack. Returns it, its
        gRPC address and its metrics URL."""
        port, metrics_port = free_port(), free_port()
        service_env = {
            "PYTHONUNBUFFERED": "1",
            **self.extra_env.get("rate-limit", {}),
            "SLUICE_RATELIMIT_PORT": str(port),
            "SLUICE_RATELIMIT_METRICS_PORT": str(metrics_port),
            "SLUICE_RATELIMIT_LIMITS_FILE": str(limits_file),
            **(env or {}),
        }
        return self._start_extra(name, "sluice_rate_limit", "rate-limit", service_env, port, metrics_port, timeout_s)

    def add_gateway(
        self, name: str, timeout_s: float = 120.0, env: dict[str, str] | None = None
    ) -> tuple[ServiceProcess, str, str]:
        """Starts one more gateway beside the stack's (the same rate-limit, tenants and RabbitMQ),
        with `env` on top (e.g. SLUICE_GATEWAY_ADAPTER_URL of an adapter from `add_adapter`, so a
        test routes through a differently configured adapter); stopped with the stack. Returns
        it, its gRPC address and its metrics URL."""
        port, metrics_port = free_port(), free_port()
        _, module, spec_env, _ = self._gateway_spec(name, port, metrics_port)
        service_env = {"PYTHONUNBUFFERED": "1", **spec_env, **(env or {})}
        return self._start_extra(name, module, "gateway", service_env, port, metrics_port, timeout_s)

    def _start_extra(
        self, name: str, module: str, project: str, env: dict[str, str], port: int, metrics_port: int, timeout_s: float
    ) -> tuple[ServiceProcess, str, str]:
        """Starts a service beside the stack's own, stopped with the stack: it, its gRPC address
        and its metrics URL."""
        address = f"{LOCALHOST}:{port}"
        service = ServiceProcess(
            name, module, env, self.run_dir / f"{name}.log", grpc_serving(address, self.grpc_credentials), project=project
        )
        self.services.append(service)
        service.start_ready(timeout_s)
        return service, address, f"http://{LOCALHOST}:{metrics_port}/metrics"

    def start(self, timeout_s: float = 300.0, on_ready: Callable[[ServiceProcess], None] | None = None) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for service in self._plan():
                self.services.append(service)
                service.start()
                service.wait_ready(timeout_s)
                if on_ready is not None:
                    on_ready(service)
        except BaseException:
            self.stop()
            raise

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.services if s.name == name)

    def stop(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.services.clear()
