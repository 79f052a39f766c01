"""A real Prometheus (Debian's `prometheus` binary, installed by `make prometheus-tools`) run by the
tests with deploy/prometheus's own scrape configuration and rules, only the targets swapped for
the local stack's ports, and queried over its HTTP API."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from sluice_stack import Stack
from sluice_stack.launcher import LOCALHOST, REPO_ROOT, free_port

PROMETHEUS_DIR = REPO_ROOT / "deploy" / "prometheus"
SHIPPED_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "sluice-dashboard.json"
# Scrapes and rule evaluations this often in the tests only (the shipped file: 15 s).
TEST_INTERVAL = "1s"


def stack_targets(stack: Stack) -> dict[str, list[str]]:
    """host:port of every job of the shipped file, in the local stack."""

    def address(service: str) -> str:
        return urllib.parse.urlsplit(stack.metrics_url(service)).netloc

    # The session's job workers as they are now: test_jobs kills the first and starts others.
    job_workers = [s.name for s in stack.services if s.name.startswith("job-worker") and s.process is not None and s.process.poll() is None]
    return {
        "gateway": [address("gateway")],
        "job-worker": [address(name) for name in job_workers],
        "inference-adapter": [address("inference-adapter")],
        "rate-limit": [address("rate-limit")],
        "evaluation-logging": [address("evaluation-logging")],
        # triton-local's model process, and the tritonserver it runs (nv_inference_* metrics).
        "triton-local": [address(name) for name in stack.triton_ports],
        "triton": [f"{LOCALHOST}:{ports.triton_metrics}" for ports in stack.triton_ports.values()],
    }


def render_config(shipped: dict[str, Any], targets: dict[str, list[str]]) -> dict[str, Any]:
    """The shipped configuration with each job's DNS discovery replaced by the given targets, the
    test's intervals, and the rule files found from wherever the copy is written. Nothing else changes."""
    config = copy.deepcopy(shipped)
    config["global"] = {**config["global"], "scrape_interval": TEST_INTERVAL, "evaluation_interval": TEST_INTERVAL}
    config["rule_files"] = [str(PROMETHEUS_DIR / pattern) for pattern in shipped["rule_files"]]
    for job in config["scrape_configs"]:
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
    return config


class Prometheus:
    """One prometheus process on a free loopback port, its data in `data_dir`."""

    def __init__(self, config: dict[str, Any], data_dir: Path) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: `make prometheus-tools` installs it (Debian's prometheus package)"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.config_file = data_dir / "prometheus.yml"
        self.config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_file = data_dir / "prometheus.log"
        self.port = free_port()
        self.url = f"http://{LOCALHOST}:{self.port}"
        with self.log_file.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.config_file}",
                    f"--storage.tsdb.path={data_dir / 'tsdb'}",
                    f"--web.listen-address={LOCALHOST}:{self.port}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log_file.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not ready after {timeout_s} s:\n{self.log_file.read_text()[-3000:]}")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def api(self, path: str, **params: str) -> Any:
        """The `data` of one /api/v1 call; fails on an error status."""
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's samples (a vector; a scalar comes back as one unlabelled sample)."""
        data = self.api("query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]  # type: ignore[no-any-return]

    def finite_values(self, expr: str) -> list[float]:
        return [value for sample in self.query(expr) if math.isfinite(value := float(sample["value"][1]))]


def named_series(expr: str) -> set[str]:
    """The series names a PromQL expression reads (Sluice's and the vLLM-named records), quoted
    strings left out (deploy/tests/test_observability.py reads the same names statically)."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    return {t for t in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", unquoted) if t.startswith(("sluice_", "sluice:", "vllm:"))}


def dashboard_queries(rate_interval: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every panel's queries, Grafana's $__rate_interval given a value."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"].replace("$__rate_interval", rate_interval)) for panel in panels for target in panel.get("targets", [])]
