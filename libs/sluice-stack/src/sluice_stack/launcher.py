"""Starts each service from its own virtual environment, waits for its health, stops it cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[4]
LOCALHOST = "127.0.0.1"


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

    @classmethod
    def ephemeral(cls) -> StackPorts:
        return cls(*(free_port() for _ in range(8)))


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

    @property
    def python(self) -> Path:
        return REPO_ROOT / "services" / self.name / ".venv" / "bin" / "python"

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

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def grpc_serving(address: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with grpc.insecure_channel(address) as channel:
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
    """triton-local, inference-adapter and gateway, started in that order."""

    run_dir: Path
    ports: StackPorts = field(default_factory=StackPorts)
    tenants_file: Path = REPO_ROOT / "config" / "tenants.toml"
    extra_env: dict[str, dict[str, str]] = field(default_factory=dict)
    services: list[ServiceProcess] = field(default_factory=list)

    @property
    def gateway_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.gateway}"

    @property
    def adapter_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.adapter}"

    @property
    def triton_grpc_address(self) -> str:
        return f"{LOCALHOST}:{self.ports.triton_grpc}"

    def metrics_url(self, service: str) -> str:
        port = {
            "gateway": self.ports.gateway_metrics,
            "inference-adapter": self.ports.adapter_metrics,
            "triton-local": self.ports.triton_local_metrics,
        }[service]
        return f"http://{LOCALHOST}:{port}/metrics"

    def _plan(self) -> list[ServiceProcess]:
        p = self.ports
        common = {"PYTHONUNBUFFERED": "1"}
        specs = [
            (
                "triton-local",
                "sluice_triton_local",
                {
                    "SLUICE_TRITON_LOCAL_HTTP_PORT": str(p.triton_http),
                    "SLUICE_TRITON_LOCAL_GRPC_PORT": str(p.triton_grpc),
                    "SLUICE_TRITON_LOCAL_TRITON_METRICS_PORT": str(p.triton_metrics),
                    "SLUICE_TRITON_LOCAL_METRICS_PORT": str(p.triton_local_metrics),
                    "SLUICE_TRITON_LOCAL_TRITON_LOG_FILE": str(self.run_dir / "tritonserver.log"),
                },
                http_ok(f"http://{LOCALHOST}:{p.triton_http}/v2/models/smollm2_step/ready"),
            ),
            (
                "inference-adapter",
                "sluice_inference_adapter",
                {
                    "SLUICE_ADAPTER_PORT": str(p.adapter),
                    "SLUICE_ADAPTER_METRICS_PORT": str(p.adapter_metrics),
                    "SLUICE_ADAPTER_TRITON_URL": self.triton_grpc_address,
                },
                grpc_serving(self.adapter_address),
            ),
            (
                "gateway",
                "sluice_gateway",
                {
                    "SLUICE_GATEWAY_PORT": str(p.gateway),
                    "SLUICE_GATEWAY_METRICS_PORT": str(p.gateway_metrics),
                    "SLUICE_GATEWAY_ADAPTER_URL": self.adapter_address,
                    "SLUICE_GATEWAY_TENANTS_FILE": str(self.tenants_file),
                },
                grpc_serving(self.gateway_address),
            ),
        ]
        return [
            ServiceProcess(name, module, {**common, **env, **self.extra_env.get(name, {})}, self.run_dir / f"{name}.log", ready)
            for name, module, env, ready in specs
        ]

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
