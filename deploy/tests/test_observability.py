"""deploy/prometheus, deploy/grafana and deploy/k8s/monitoring: the scrape configuration, the alert and
recording rules (checked and unit-tested by promtool), the dashboard, and the PodMonitors.

The metrics the rules and the dashboard name are checked here against the metrics the services'
code defines (a renamed metric fails here, not on an operator's empty panel); the end-to-end suite
(tests/e2e/test_observability.py) runs the same files on a real Prometheus against the real stack."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import config_vars
from manifests import BIN, DEPLOY, OVERLAYS, render, workloads

PROMETHEUS = DEPLOY / "prometheus"
CONFIG = PROMETHEUS / "prometheus.yml"
RULES = sorted((PROMETHEUS / "rules").glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
DASHBOARD = DEPLOY / "grafana" / "sluice-dashboard.json"
MONITORING = DEPLOY / "k8s" / "monitoring"
CODE = [config_vars.ROOT / "libs", config_vars.ROOT / "services"]

# The metrics port of each job, as the configuration table (docs/operators/configuration.md), compose and the manifests have it.
JOB_PORTS = {
    "gateway": 9101,
    "job-worker": 9106,
    "inference-adapter": 9102,
    "rate-limit": 9103,
    "evaluation-logging": 9104,
    "triton-local": 9105,
    "triton": 8002,
}
# What Prometheus itself gives every target.
BUILTIN_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def promtool(*args: str | Path) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: `make prometheus-tools` installs it (Debian's prometheus package)"
    result = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"promtool {' '.join(map(str, args))}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def rule_groups() -> list[dict]:
    return [group for path in RULES for group in load_yaml(path)["groups"]]


def recorded_names() -> set[str]:
    return {rule["record"] for group in rule_groups() for rule in group["rules"] if "record" in rule}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of every panel."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


def code_metric_names() -> set[str]:
    """Every series name the services export: the names given to prometheus_client's metric types
    (with their histogram and summary series), and the publishers' `<prefix>_*` families."""
    names: set[str] = set()
    publisher_suffixes: set[str] = set()
    prefixes: set[str] = set()
    for root in CODE:
        for path in root.glob("*/src/**/*.py"):
            text = path.read_text()
            if "prometheus_client" not in text and "PublisherMetrics" not in text:
                continue
            for kind, name in re.findall(r'\b(Counter|Gauge|Histogram|Summary)\(\s*"(sluice_\w+)"', text):
                names.add(name)
                if kind == "Histogram":
                    names.update(f"{name}_{suffix}" for suffix in ("bucket", "sum", "count"))
                if kind == "Summary":
                    names.update(f"{name}_{suffix}" for suffix in ("sum", "count"))
            publisher_suffixes.update(re.findall(r'(?:Counter|Gauge)\(f"\{prefix\}(_\w+)"', text))
            prefixes.update(re.findall(r'PublisherMetrics\.get\(\s*"(sluice_\w+)"', text))
    assert publisher_suffixes and prefixes, "the publisher metrics (sluice_common.amqp_publisher.PublisherMetrics) were not found"
    names.update(prefix + suffix for prefix in prefixes for suffix in publisher_suffixes)
    return names


def named_series(expr: str) -> set[str]:
    """The series names a PromQL expression reads (Sluice's, vLLM's and the builtins), quoted strings left out."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    tokens = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", unquoted))
    return {t for t in tokens if t.startswith(("sluice_", "sluice:", "vllm:")) or t in BUILTIN_SERIES}


def test_the_scrape_configuration_and_its_rules_pass_promtool() -> None:
    out = promtool("check", "config", CONFIG)
    # check config also checks the rule files it loads: make sure it found them.
    for path in RULES:
        assert path.name in out, f"prometheus.yml does not load {path.name}:\n{out}"


def test_the_rules_pass_promtool_check() -> None:
    assert RULES, "no rule files in deploy/prometheus/rules"
    promtool("check", "rules", *RULES)


def test_the_rules_pass_their_unit_tests() -> None:
    assert RULE_TESTS, "no promtool unit tests in deploy/prometheus/tests"
    out = promtool("test", "rules", *RULE_TESTS)
    assert "SUCCESS" in out


def test_every_alert_is_unit_tested_firing_and_silent() -> None:
    alerts = {rule["alert"] for group in rule_groups() for rule in group["rules"] if "alert" in rule}
    firing: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        for case in load_yaml(path)["tests"]:
            for check in case.get("alert_rule_test", []):
                (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts - firing == set(), "alerts no test shows firing"
    assert alerts - silent == set(), "alerts no test shows silent"
    operator_pages = {
        "SluiceTimeToFirstTokenP99High",
        "SluiceGatewayErrorRatioHigh",
        "SluiceAdapterQueueSaturated",
        "SluiceTritonReplicasUnhealthy",
        "SluiceEventsWaitingInOutbox",
        "SluiceRowsDeadLettered",
        "SluiceEventsDeadLettered",
        "SluiceEvaluationLoggingLagHigh",
        "SluiceTargetDown",
    }
    assert operator_pages <= alerts


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for group in rule_groups():
        for rule in group["rules"]:
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
                assert rule["annotations"]["summary"], rule["alert"]


def test_rules_and_dashboard_name_only_metrics_that_exist() -> None:
    exported = code_metric_names()
    known = exported | recorded_names() | BUILTIN_SERIES
    assert "sluice_adapter_time_to_first_token_seconds_bucket" in exported  # the parser found the code's metrics
    exprs = [(f"rule {r.get('record') or r.get('alert')}", r["expr"]) for g in rule_groups() for r in g["rules"]]
    exprs += [(f"panel {title!r}", expr) for title, expr in dashboard_queries()]
    unknown = {(where, name) for where, expr in exprs for name in named_series(expr) - known}
    assert not unknown, f"metrics no service exports: {sorted(unknown)}"


def test_vllm_named_records_cover_the_figures_vllm_dashboards_read() -> None:
    """The names vLLM's /metrics uses for time to first token, time per output token, queue and KV
    use (deploy/README.md, "Metrics"), published by recording rules; recording rule names may hold
    colons (level:metric:operations), which is why vLLM's names have them."""
    recorded = recorded_names()
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds", "request_queue_time_seconds"):
        assert {f"vllm:{histogram}_{suffix}" for suffix in ("bucket", "sum", "count")} <= recorded, histogram
    assert {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    } <= recorded


def test_the_dashboard_covers_the_suite() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    datasource_vars = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert [v["query"] for v in datasource_vars] == ["prometheus"]
    series = {name for _, expr in dashboard_queries() for name in named_series(expr)}
    for needed in (
        "sluice_rpc_requests_total",  # request rate
        "sluice_adapter_time_to_first_token_seconds_bucket",
        "sluice_adapter_inter_token_seconds_bucket",
        "sluice_adapter_generation_tokens_total",  # tokens/s
        "sluice_adapter_waiting_requests",
        "sluice_adapter_kv_slots_in_use",  # queue and batch per replica
        "sluice_triton_local_active_slots",  # slots
        "sluice_ratelimit_tenant_denials_total",  # denials per tenant
        "sluice_jobs_rows_total",  # job progress
        "sluice_evallog_score_results_total",
        "sluice_evallog_score_sum",  # evaluation scores
    ):
        assert needed in series, needed
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]


def scrape_jobs() -> dict[str, dict]:
    return {job["job_name"]: job for job in load_yaml(CONFIG)["scrape_configs"]}


def test_every_service_is_scraped_on_its_metrics_port() -> None:
    jobs = scrape_jobs()
    assert set(jobs) == set(JOB_PORTS)
    for name, job in jobs.items():
        discovery = {key for key in job if key.endswith("_sd_configs") or key == "static_configs"}
        assert discovery == {"dns_sd_configs"}, f"{name}: the e2e suite swaps the targets of dns_sd_configs only"
        (sd,) = job["dns_sd_configs"]
        assert sd["port"] == JOB_PORTS[name] and sd["type"] == "A", name
    assert load_yaml(CONFIG)["rule_files"] == ["rules/*.yml"]


def test_compose_runs_prometheus_with_the_shipped_files() -> None:
    compose = load_yaml(DEPLOY / "compose.yaml")
    service = compose["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in service["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in service["command"]
    # The DNS names the jobs resolve are compose services, with the metrics port the service binds.
    names = {name for job in scrape_jobs().values() for name in job["dns_sd_configs"][0]["names"]}
    assert names <= set(compose["services"])
    environment = compose["services"]["job-worker"]["environment"]
    assert environment["SLUICE_GATEWAY_WORKER_METRICS_PORT"] == str(JOB_PORTS["job-worker"])


def podmonitors() -> list[dict]:
    result = subprocess.run([str(BIN / "kubectl"), "kustomize", str(MONITORING)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_podmonitors_scrape_every_metrics_port_as_the_compose_job(overlay: str) -> None:
    """Every workload's metrics ports (named metrics, triton-metrics) are selected by one PodMonitor
    endpoint, which names the job as prometheus.yml does for that port and drops what it drops."""
    monitors = podmonitors()
    assert {m["kind"] for m in monitors} == {"PodMonitor"}
    jobs = scrape_jobs()
    for workload in workloads(render(overlay)):
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        for container in template["spec"]["containers"]:
            for port in container.get("ports", []):
                if port["name"] not in ("metrics", "triton-metrics"):
                    continue
                endpoints = [
                    endpoint
                    for monitor in monitors
                    if monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
                    for endpoint in monitor["spec"]["podMetricsEndpoints"]
                    if endpoint["port"] == port["name"]
                ]
                where = f"{overlay}: {workload['metadata']['name']} port {port['name']}"
                assert len(endpoints) == 1, where
                (relabel,) = endpoints[0]["relabelings"]
                job = relabel["replacement"]
                assert relabel["targetLabel"] == "job" and JOB_PORTS[job] == port["containerPort"], where
                dropped = [(r["source_labels"], r["regex"], r["action"]) for r in jobs[job].get("metric_relabel_configs", [])]
                assert dropped == [(r["sourceLabels"], r["regex"], r["action"]) for r in endpoints[0].get("metricRelabelings", [])], where
