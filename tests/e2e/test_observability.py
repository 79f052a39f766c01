"""A real Prometheus on the real stack (issue 26): deploy/prometheus's scrape configuration (targets
swapped for the stack's ports, nothing else) scrapes every service `up`, its rules load and evaluate,
and after a short load (chat streams, a two-row bulk job, a refused admission) every query of
deploy/grafana's dashboard returns data, and every metric it or the rules name exists.

Uses the session's shared stack; Prometheus is this module's own process (scrape interval 1 s here only)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from sluice.ratelimit.v1 import ratelimit_pb2_grpc

from conftest import DEMO_KEY, auth, chat, wait_for
from prometheus_support import (
    SHIPPED_CONFIG,
    Prometheus,
    dashboard_queries,
    named_series,
    render_config,
    stack_targets,
)
from ratelimit_support import acquire_request
from sluice_stack import Stack
from test_jobs import gen_row, publish_and_collect

# The dashboard's $__rate_interval here: the whole test's load fits in it.
RATE_INTERVAL = "1m"
STREAMS = 4
# More tokens than the default tenant's whole tokens_per_minute (config/limits.toml): refused as such.
TOO_MANY_TOKENS = 10**7


@pytest.fixture(scope="module")
def shipped_config() -> dict[str, Any]:
    return yaml.safe_load(SHIPPED_CONFIG.read_text())


@pytest.fixture(scope="module")
def prometheus(stack: Stack, shipped_config: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    server = Prometheus(render_config(shipped_config, stack_targets(stack)), Path(tmp_path_factory.mktemp("prometheus")))
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def test_the_e2e_config_is_the_shipped_one_with_only_its_targets_swapped(stack: Stack, shipped_config: dict[str, Any]) -> None:
    rendered = render_config(shipped_config, stack_targets(stack))
    assert [j["job_name"] for j in rendered["scrape_configs"]] == [j["job_name"] for j in shipped_config["scrape_configs"]]
    for shipped, used in zip(shipped_config["scrape_configs"], rendered["scrape_configs"], strict=True):
        # Same job: everything but how its targets are found (relabelling, metric relabelling, paths).
        assert {k: v for k, v in shipped.items() if k != "dns_sd_configs"} == {k: v for k, v in used.items() if k != "static_configs"}
        (targets,) = used["static_configs"]
        assert targets["targets"], used["job_name"]
    assert {k: v for k, v in rendered["global"].items() if not k.endswith("_interval")} == {
        k: v for k, v in shipped_config["global"].items() if not k.endswith("_interval")
    }
    assert [Path(p).name for p in rendered["rule_files"]] == [Path(p).name for p in shipped_config["rule_files"]]


def active_targets(prometheus: Prometheus) -> list[dict[str, Any]]:
    return prometheus.api("targets", state="active")["activeTargets"]  # type: ignore[no-any-return]


def test_every_service_is_scraped_up_and_the_rules_evaluate(prometheus: Prometheus, stack: Stack) -> None:
    expected = {(job, target) for job, targets in stack_targets(stack).items() for target in targets}

    def all_up() -> bool:
        targets = active_targets(prometheus)
        return {(t["labels"]["job"], t["labels"]["instance"]) for t in targets} == expected and all(t["health"] == "up" for t in targets)

    try:
        wait_for(all_up, "every target up", timeout_s=30, poll_s=0.5)
    except AssertionError:
        down = [(t["labels"]["job"], t["health"], t["lastError"]) for t in active_targets(prometheus) if t["health"] != "up"]
        raise AssertionError(f"targets not up: {down}") from None
    assert {s["metric"]["job"] for s in prometheus.query("up == 1")} == {job for job, _ in expected}
    # Every rule group of deploy/prometheus/rules loaded and evaluates without error.
    wait_for(
        lambda: all(r.get("lastEvaluation", "").startswith("20") for g in prometheus.api("rules")["groups"] for r in g["rules"]),
        "every rule evaluated once",
        timeout_s=15,
        poll_s=0.5,
    )
    groups = prometheus.api("rules")["groups"]
    assert {g["name"] for g in groups} == {"sluice-vllm-names", "sluice-slo", "sluice-alerts"}
    broken = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] != "ok"]
    assert not broken, broken


def one_round_of_load(stack: Stack, gateway: Any) -> None:
    """A few seconds of what the dashboard shows: concurrent chat streams (gateway, adapter, engine,
    completion events, evaluation), a call to the OpenAI HTTP front, a two-row bulk job (job worker)
    and one refused admission."""

    def stream(index: int) -> int:
        request = chat(f"Name a colour (observability {index}).", max_tokens=8)
        return sum(1 for _ in gateway.Generate(request, metadata=auth(), timeout=120))

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        assert all(chunks > 0 for chunks in pool.map(stream, range(STREAMS)))
    # The HTTP front's panel: its series exist only once a request came (run alone, no module before
    # this one may have sent one).
    models = urllib.request.Request(f"{stack.openai_base_url}/models", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    with urllib.request.urlopen(models, timeout=30) as reply:
        assert reply.status == 200
    job = {"job_id": f"obs-{uuid.uuid4().hex[:8]}", "api_key": DEMO_KEY, "rows": [gen_row("a"), gen_row("b")]}
    replies = asyncio.run(publish_and_collect(stack, job, expect=2, timeout_s=120))
    assert all("error" not in r for r in replies), replies
    with grpc.insecure_channel(stack.ratelimit_address) as channel:
        decision = ratelimit_pb2_grpc.RateLimitServiceStub(channel).Acquire(
            acquire_request("observability-e2e", "smollm2-135m-instruct", TOO_MANY_TOKENS), timeout=10
        )
    assert not decision.allowed


def test_every_dashboard_query_returns_data_after_a_short_load(prometheus: Prometheus, stack: Stack, gateway: Any) -> None:
    wait_for(lambda: len(prometheus.query("up == 1")) == len(active_targets(prometheus)) > 0, "targets up", timeout_s=30)
    # Two rounds a few scrapes apart: the first also creates the labelled series that appear only on
    # first use (scores per evaluator, a tenant's denials), the second makes them move while scraped.
    one_round_of_load(stack, gateway)
    wait_for(lambda: bool(prometheus.query("sluice_evallog_score_results_total")), "scores scraped", timeout_s=30, poll_s=0.5)
    one_round_of_load(stack, gateway)
    queries = dashboard_queries(RATE_INTERVAL)

    def empty() -> list[tuple[str, str]]:
        return [(title, expr) for title, expr in queries if not prometheus.finite_values(expr)]

    try:
        wait_for(lambda: not empty(), "every dashboard query to return data", timeout_s=45, poll_s=1.0)
    except AssertionError:
        raise AssertionError(f"dashboard queries without data: {empty()}") from None
    # No panel and no rule names a metric the suite does not export (or a record no rule makes).
    rules = [r for g in prometheus.api("rules")["groups"] for r in g["rules"]]
    names = {name for _, expr in queries for name in named_series(expr)} | {n for r in rules for n in named_series(r["query"])}
    # ... and every recording rule, the vLLM-named ones included, publishes a series.
    names |= {r["name"] for r in rules if r["type"] == "recording"}

    # Waited on, not read at one instant: a record is there once its rule has evaluated after the
    # scrapes it reads, which can run behind them on a busy machine (CI saw one absent at one instant).
    def missing() -> list[str]:
        return sorted(name for name in names if not prometheus.query(f'count({{__name__="{name}"}})'))

    try:
        wait_for(lambda: not missing(), "every named series to be in Prometheus", timeout_s=30, poll_s=1.0)
    except AssertionError:
        absent = missing()
        states = [
            (r["name"], r["health"], r.get("lastError"), r.get("lastEvaluation"))
            for g in prometheus.api("rules")["groups"]
            for r in g["rules"]
            if r["name"] in absent
        ]
        raise AssertionError(f"named in the dashboard or the rules but not in Prometheus: {absent}; their rules: {states}") from None
    # The vLLM-named records read the same figures: a vLLM dashboard's TTFT quantile has a value once
    # the record has evaluated the buckets after the load's scrapes (a rule's evaluation can run behind
    # the scrapes on a busy machine: waited on, not read at one instant, as the raw panels were).
    vllm_ttft_p99 = f"histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[{RATE_INTERVAL}])))"
    wait_for(lambda: bool(prometheus.finite_values(vllm_ttft_p99)), "a vLLM dashboard's TTFT quantile to have a value", timeout_s=30, poll_s=1.0)

    # The vLLM-named token counter is the adapter's own (the totals, not a window's increase: the
    # checks above can outlast a minute on a busy machine).
    # The record is the rule's evaluation of the counter a moment ago: equal once both have caught
    # up with the last scrape (waited on, not read at one instant).
    def same() -> bool:
        generated = prometheus.finite_values("sum(vllm:generation_tokens_total)")
        return bool(generated) and generated[0] > 0 and generated == prometheus.finite_values("sum(sluice_adapter_generation_tokens_total)")

    wait_for(same, "vllm:generation_tokens_total to read the adapter's own token total", timeout_s=45, poll_s=1.0)
    # Both rounds' refusals, counted for their tenant (the next scrape brings the second).
    wait_for(
        lambda: prometheus.finite_values('sluice_ratelimit_tenant_denials_total{tenant="observability-e2e"} >= 2') != [],
        "both refusals counted for the tenant",
        timeout_s=10,
        poll_s=0.5,
    )
