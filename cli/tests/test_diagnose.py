"""sluice diagnose's analysis on metric texts as the services write them (prometheus_client's own
exposition of the same metric names), two scrapes a window apart plus gauge samples between."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sluice_cli import diagnose as d
from sluice_cli.diagnose import BudgetSample, ProbeStats, ServiceWindow, parse_scrape
from sluice_cli.main import build_parser

WINDOW_S = 10.0
RPC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Service:
    """One process's metrics, as its registry exposes them; `scrape(at)` is one /metrics read."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.in_flight = Gauge("sluice_rpc_in_flight", "", ["method"], registry=self.registry)
        self.duration = Histogram("sluice_rpc_duration_seconds", "", ["method"], buckets=RPC_BUCKETS, registry=self.registry)
        self.lag = Histogram("sluice_event_loop_lag_seconds", "", buckets=LAG_BUCKETS, registry=self.registry)
        self.extra: dict[str, object] = {}

    def metric(self, kind: type, name: str, labels: tuple[str, ...] = (), **kwargs: object) -> object:
        if name not in self.extra:
            self.extra[name] = kind(name, "", list(labels), registry=self.registry, **kwargs)
        return self.extra[name]

    def calls(self, method: str, count: int, seconds: float) -> None:
        for _ in range(count):
            self.duration.labels(method).observe(seconds)

    def loop(self, count: int, lag_s: float) -> None:
        for _ in range(count):
            self.lag.observe(lag_s)

    def scrape(self, at: float) -> d.Scrape:
        return parse_scrape(generate_latest(self.registry).decode(), at)


def window(service: Service, before: d.Scrape, samples: list[d.Scrape] | None = None) -> ServiceWindow:
    return ServiceWindow((before, *(samples or []), service.scrape(WINDOW_S)))


def fan_out(batch: int, in_flight: int, completed: int, mean_s: float, queue_s: float, slots_in_use: float) -> dict[str, ServiceWindow]:
    """gateway -> adapter -> triton-local with `in_flight` streams, `completed` of them ending in
    the window after `mean_s` each (`queue_s` of it in the adapter's queue)."""
    gateway, adapter, triton = Service(), Service(), Service()
    gateway_before, adapter_before, triton_before = gateway.scrape(0.0), adapter.scrape(0.0), triton.scrape(0.0)
    gateway.in_flight.labels(d.GATEWAY_GENERATE).set(in_flight)
    gateway.calls(d.GATEWAY_GENERATE, completed, mean_s + 0.002)
    rl_wait = gateway.metric(Histogram, "sluice_gateway_ratelimit_wait_seconds")
    for _ in range(completed):
        rl_wait.observe(0.002)  # type: ignore[attr-defined]
    gateway.loop(200, 0.0008)
    adapter.in_flight.labels(d.ADAPTER_GENERATE).set(in_flight)
    adapter.calls(d.ADAPTER_GENERATE, completed, mean_s)
    queue = adapter.metric(Histogram, "sluice_adapter_queue_seconds", ("replica",), buckets=(0.01, 0.1, 1, 10, 30))
    for _ in range(completed):
        queue.labels("127.0.0.1:8001").observe(queue_s)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_concurrency_limit").set(batch)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_replicas", ("state",)).labels("serving").set(1)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_kv_slots_in_use", ("replica",)).labels("127.0.0.1:8001").set(slots_in_use)  # type: ignore[attr-defined]
    adapter.metric(Counter, "sluice_adapter_engine_full", ("replica",))
    adapter.loop(200, 0.001)
    triton.metric(Gauge, "sluice_triton_local_max_slots").set(32)  # type: ignore[attr-defined]
    triton.metric(Gauge, "sluice_triton_local_active_slots").set(slots_in_use)  # type: ignore[attr-defined]
    steps = triton.metric(Histogram, "sluice_triton_local_step_seconds", buckets=(0.005, 0.01, 0.025, 0.05, 0.1))
    rows = triton.metric(Histogram, "sluice_triton_local_step_rows", buckets=(1, 2, 4, 8, 16, 32, 64))
    for _ in range(500):
        steps.observe(0.012)  # type: ignore[attr-defined]
        rows.observe(slots_in_use)  # type: ignore[attr-defined]
    middle = [s.scrape(WINDOW_S / 2) for s in (gateway, adapter, triton)]
    return {
        d.GATEWAY: window(gateway, gateway_before, [middle[0]]),
        d.ADAPTER: window(adapter, adapter_before, [middle[1]]),
        d.TRITON: window(triton, triton_before, [middle[2]]),
    }


def test_an_adapter_batch_of_one_is_named_with_its_numbers() -> None:
    # 8 streams, a batch of 1 running 1 s each: 1 completion/s, each 8 s in the adapter, 7 s queued.
    report = d.analyze(fan_out(batch=1, in_flight=8, completed=10, mean_s=8.0, queue_s=7.0, slots_in_use=1))
    adapter = next(h for h in report.hops if h.name == d.ADAPTER)
    assert adapter.rate == pytest.approx(1.0)
    assert adapter.little == pytest.approx(8.0)
    assert adapter.effective == pytest.approx(1.0)
    assert adapter.configured == 1
    assert report.verdict.hop == d.ADAPTER
    assert report.verdict.text == (
        "inference-adapter serializes: effective concurrency 1.0 of configured 1 (MAX_BATCH_SIZE);"
        " 8.0 requests in flight there; queue wait 88% of its time"
    )
    assert "verdict: inference-adapter serializes" in d.render(report)


def test_the_same_load_under_a_batch_of_32_serializes_nowhere() -> None:
    # 8 streams in a batch of 32: each 3 s, 50 ms of it queued.
    report = d.analyze(fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.05, slots_in_use=8))
    assert report.verdict.hop is None
    assert report.verdict.text.startswith("no hop serializes: the busiest bounded hop, ")
    assert "of configured 32 (25%)" in report.verdict.text
    assert "inference-adapter serializes" not in report.verdict.text


def test_a_full_batch_whose_requests_do_not_wait_is_not_a_serialization() -> None:
    # At its bound, yet nothing queues in front of it: the bound is not what holds the load back.
    report = d.analyze(fan_out(batch=8, in_flight=8, completed=27, mean_s=3.0, queue_s=0.05, slots_in_use=8))
    assert report.verdict.hop is None


def test_gateway_hop_shows_the_rate_limit_wait_share() -> None:
    report = d.analyze(fan_out(batch=32, in_flight=8, completed=20, mean_s=2.0, queue_s=0.05, slots_in_use=8))
    gateway = next(h for h in report.hops if h.name == d.GATEWAY)
    assert gateway.in_flight == pytest.approx(8.0)
    assert gateway.shares["rate-limit wait"] == pytest.approx(0.002 / 2.002, rel=1e-3)
    assert gateway.configured is None


def test_a_compute_bound_engine_is_said_so_without_blaming_a_bound() -> None:
    windows = fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.05, slots_in_use=8)
    triton = Service()
    before = triton.scrape(0.0)
    triton.metric(Gauge, "sluice_triton_local_max_slots").set(32)  # type: ignore[attr-defined]
    triton.metric(Gauge, "sluice_triton_local_active_slots").set(8)  # type: ignore[attr-defined]
    steps = triton.metric(Histogram, "sluice_triton_local_step_seconds", buckets=(0.01, 0.1))
    for _ in range(200):
        steps.observe(0.048)  # type: ignore[attr-defined]  # 9.6 s of steps in 10 s
    windows[d.TRITON] = window(triton, before)
    report = d.analyze(windows)
    assert report.verdict.hop is None
    assert "triton-local's engine is busy 96% of the time: compute-bound" in report.verdict.text


def ratelimit_windows(denied: int, allowed: int) -> dict[str, ServiceWindow]:
    windows = fan_out(batch=32, in_flight=1, completed=5, mean_s=2.0, queue_s=0.01, slots_in_use=1)
    service = Service()
    before = service.scrape(0.0)
    service.calls(d.RATELIMIT_ACQUIRE, denied + allowed, 0.0004)
    decisions = service.metric(Counter, "sluice_ratelimit_decisions", ("result", "budget"))
    decisions.labels("denied", "requests_in_flight").inc(denied)  # type: ignore[attr-defined]
    decisions.labels("allowed", "").inc(allowed)  # type: ignore[attr-defined]
    windows[d.RATELIMIT] = window(service, before)
    return windows


def test_a_requests_in_flight_budget_of_one_is_named_at_rate_limit() -> None:
    budgets = [[BudgetSample("demo", "smollm2-135m-instruct", "requests_in_flight", 1, 1)] for _ in range(5)]
    probe = ProbeStats(clients=8, seconds=10, completed=5, denied=40, retry_wait_s=70.0, call_s=10.0)
    report = d.analyze(ratelimit_windows(denied=40, allowed=5), budgets, probe)
    assert report.verdict.hop == d.RATELIMIT
    assert report.verdict.text == (
        "rate-limit serializes: 89% of Acquires denied (denied by requests_in_flight 40); effective concurrency 1.0"
        " of configured 1 (requests_in_flight of demo on smollm2-135m-instruct); the probe's clients waited to retry"
        " 88% of their time"
    )


def test_clients_that_waited_to_retry_most_of_their_time_name_rate_limit_however_few_acquires_were_denied() -> None:
    """4 clients on a budget of 1 with 0.1 s calls retry seldom next to the calls admitted: 29% of
    the Acquires denied, yet the clients waited to retry 75% of their time (an e2e run measured it)."""
    budgets = [[BudgetSample("demo", "smollm2-135m-instruct", "requests_in_flight", 1, 1)] for _ in range(5)]
    probe = ProbeStats(clients=4, seconds=8, completed=71, denied=30, retry_wait_s=24.0, call_s=8.0)
    report = d.analyze(ratelimit_windows(denied=30, allowed=71), budgets, probe)
    assert report.verdict.hop == d.RATELIMIT
    assert report.verdict.text.startswith("rate-limit serializes: 30% of Acquires denied (denied by requests_in_flight 30)")
    assert report.verdict.text.endswith("the probe's clients waited to retry 75% of their time")


def test_without_a_probe_the_share_of_acquires_denied_decides() -> None:
    assert d.analyze(ratelimit_windows(denied=40, allowed=5), [], None).verdict.hop == d.RATELIMIT
    assert d.analyze(ratelimit_windows(denied=20, allowed=80), [], None).verdict.hop is None


def test_a_few_denials_that_cost_the_clients_little_are_not_a_serialization() -> None:
    probe = ProbeStats(clients=8, seconds=10, completed=50, denied=20, retry_wait_s=2.0, call_s=78.0)
    report = d.analyze(ratelimit_windows(denied=20, allowed=30), [], probe)
    assert report.verdict.hop is None


def test_the_tightest_budget_is_the_pair_closest_to_its_limit() -> None:
    samples = [
        [BudgetSample("demo", "m", "requests_in_flight", 32, 8), BudgetSample("acme", "m", "requests_in_flight", 2, 2)],
        [BudgetSample("demo", "m", "requests_in_flight", 32, 8)],  # acme's lease ended: 0 in use here
    ]
    hop = d.ratelimit_hop(None, samples, None)
    assert hop is not None
    assert (hop.configured, hop.effective, hop.configured_what) == (2, 1.0, "requests_in_flight of acme on m")


def test_a_job_worker_at_a_bound_of_one_is_named() -> None:
    worker = Service()
    before = worker.scrape(0.0)
    worker.metric(Gauge, "sluice_jobs_concurrency_limit").set(1)  # type: ignore[attr-defined]
    worker.metric(Gauge, "sluice_jobs_rows_in_flight").set(1)  # type: ignore[attr-defined]
    worker.metric(Counter, "sluice_jobs_rows", ("outcome",)).labels("completed").inc(4)  # type: ignore[attr-defined]
    report = d.analyze({d.WORKER: window(worker, before, [worker.scrape(5.0)])})
    hop = report.hops[0]
    assert (hop.rate, hop.mean_time_s) == (pytest.approx(0.4), pytest.approx(2.5))
    assert report.verdict.hop == d.WORKER
    assert report.verdict.text.startswith("job-worker serializes: 1.0 rows in flight of its bound 1 (100%)")


def test_an_event_loop_that_stalls_is_named() -> None:
    windows = fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.05, slots_in_use=8)
    gateway = Service()
    before = gateway.scrape(0.0)
    gateway.loop(100, 0.3)
    windows[d.GATEWAY] = window(gateway, before)
    report = d.analyze(windows)
    assert report.verdict.hop == d.GATEWAY
    assert report.verdict.text.startswith("gateway's event loop stalls: mean lag 300 ms (p99 500.0 ms)")


def test_window_arithmetic_counter_reset_new_series_and_quantiles() -> None:
    first = parse_scrape('a_total{x="1"} 10\nh_bucket{le="0.1"} 1\nh_bucket{le="1.0"} 2\nh_bucket{le="+Inf"} 2\nh_count 2\nh_sum 0.6\n', 0.0)
    last = parse_scrape(
        'a_total{x="1"} 3\nb_total 5\nh_bucket{le="0.1"} 91\nh_bucket{le="1.0"} 100\nh_bucket{le="+Inf"} 102\nh_count 102\nh_sum 12.6\n',
        4.0,
    )
    w = ServiceWindow((first, last))
    assert w.delta("a_total") == 3  # the process restarted: its new count
    assert w.rate("b_total") == pytest.approx(1.25)  # born in the window
    assert w.mean_time("h") == pytest.approx(0.12)
    assert w.quantile("h", 0.5) == 0.1
    assert w.quantile("h", 0.95) == 1.0
    assert w.quantile("h", 0.999) == math.inf
    assert w.mean_time("missing") is None
    with pytest.raises(ValueError):
        ServiceWindow((first,))


def test_unscraped_services_leave_their_hops_out_and_are_listed() -> None:
    windows = fan_out(batch=1, in_flight=4, completed=10, mean_s=4.0, queue_s=3.0, slots_in_use=1)
    del windows[d.TRITON]
    report = d.analyze(windows, unreachable=["triton-local", "job-worker"])
    assert [h.name for h in report.hops] == [d.GATEWAY, d.ADAPTER]
    assert "not scraped (unreachable): job-worker, triton-local" in d.render(report)
    assert report.as_dict()["verdict"] == {"hop": d.ADAPTER, "text": report.verdict.text}


# Recorded by tests/e2e/test_diagnose.py (`sluice diagnose --probe 4 --duration 8 --record`) against
# the real stack, then cut to the first, middle and last scrape and to the sluice_* families.
RECORDINGS = Path(__file__).parent / "fixtures" / "diagnose"


def test_a_recorded_run_through_an_adapter_batch_of_one_names_the_adapter() -> None:
    windows, budgets, probe = d.load_recording(RECORDINGS / "adapter-batch-1")
    report = d.analyze(windows, budgets, probe)
    adapter = next(h for h in report.hops if h.name == d.ADAPTER)
    assert adapter.configured == 1
    assert adapter.effective == pytest.approx(1.0, abs=0.2)
    # Little's law holds at the gateway: the sampled in-flight gauge vs completions/s x mean time.
    gateway = next(h for h in report.hops if h.name == d.GATEWAY)
    assert gateway.little == pytest.approx(gateway.in_flight, rel=0.25)
    assert report.verdict.hop == d.ADAPTER
    assert re.fullmatch(
        r"inference-adapter serializes: effective concurrency 1\.\d of configured 1 \(MAX_BATCH_SIZE\);"
        r" [34]\.\d requests in flight there; queue wait [6-9]\d% of its time",
        report.verdict.text,
    ), report.verdict.text


def test_a_recorded_run_of_the_stack_as_configured_names_no_hop() -> None:
    windows, budgets, probe = d.load_recording(RECORDINGS / "control")
    report = d.analyze(windows, budgets, probe)
    adapter = next(h for h in report.hops if h.name == d.ADAPTER)
    assert adapter.configured == 32
    assert adapter.shares["queue"] < d.WAITING
    assert report.verdict.hop is None
    assert report.verdict.text.startswith("no hop serializes")


def test_a_recording_saved_and_loaded_gives_the_same_report(tmp_path: Path) -> None:
    windows, budgets, probe = d.load_recording(RECORDINGS / "adapter-batch-1")
    texts = {
        name: [(s.at, (RECORDINGS / "adapter-batch-1" / f"{name}-{n:03d}.prom").read_text()) for n, s in zip((0, 8, 16), w.scrapes)]
        for name, w in windows.items()
    }
    d.save_recording(tmp_path, texts, budgets, probe)
    again = d.analyze(*d.load_recording(tmp_path))
    assert again.as_dict() == d.analyze(windows, budgets, probe).as_dict()


def test_sluice_diagnose_replay_prints_the_table_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["diagnose", "--replay", str(RECORDINGS / "adapter-batch-1")])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert re.search(r"^inference-adapter\s+[0-9.]+\s+[0-9.]+\s", out, re.M), out
    assert "probe: 4 concurrent Generate streams, 30 completed, 0 denied" in out
    assert "\nverdict: inference-adapter serializes: effective concurrency" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--probe", "65"], "--probe must be in [0, 64]"),
        (["--duration", "0.5"], "--duration must be in [1, 120] seconds"),
        (["--metrics", "gatewy=127.0.0.1:9101"], "--metrics takes NAME=HOST:PORT"),
    ],
)
def test_sluice_diagnose_refuses_unbounded_or_wrong_arguments(argv: list[str], message: str) -> None:
    args = build_parser().parse_args(["--api-key", "k", "diagnose", *argv])
    with pytest.raises(SystemExit, match=re.escape(message)):
        args.func(args)


def test_triton_out_of_kv_slots_is_named_when_prefills_were_refused_busy() -> None:
    windows = fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.5, slots_in_use=4)
    triton, adapter = Service(), Service()
    triton_before, adapter_before = triton.scrape(0.0), adapter.scrape(0.0)
    triton.metric(Gauge, "sluice_triton_local_max_slots").set(4)  # type: ignore[attr-defined]
    triton.metric(Gauge, "sluice_triton_local_active_slots").set(4)  # type: ignore[attr-defined]
    windows[d.TRITON] = window(triton, triton_before)
    # The adapter's own figures stay those of fan_out; only its busy answers are added here.
    adapter_window = windows[d.ADAPTER]
    adapter.metric(Counter, "sluice_adapter_engine_full", ("replica",)).labels("r").inc(12)  # type: ignore[attr-defined]
    busy = window(adapter, adapter_before)
    merged = [d.Scrape(a.at, {**a.samples, **b.samples}) for a, b in zip((adapter_window.scrapes[0], adapter_window.scrapes[-1]), busy.scrapes)]
    windows[d.ADAPTER] = ServiceWindow(tuple(merged))
    report = d.analyze(windows)
    assert report.verdict.hop == d.TRITON
    assert report.verdict.text == ("triton-local serializes: 4.0 of its 4 KV slots in use (100%); 12 prefills were refused busy and waited")
    assert "prefills refused busy 12" in d.render(report)


def test_bulk_held_back_for_interactive_first_tokens_is_shown_on_the_adapter_hop() -> None:
    windows = fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.5, slots_in_use=4)
    adapter = Service()
    adapter_before = adapter.scrape(0.0)
    adapter.metric(Counter, "sluice_adapter_bulk_held", ("replica",)).labels("r").inc(7)  # type: ignore[attr-defined]
    held = window(adapter, adapter_before)
    adapter_window = windows[d.ADAPTER]
    merged = [d.Scrape(a.at, {**a.samples, **b.samples}) for a, b in zip((adapter_window.scrapes[0], adapter_window.scrapes[-1]), held.scrapes)]
    windows[d.ADAPTER] = ServiceWindow(tuple(merged))
    assert "steps that held bulk back 7" in d.render(d.analyze(windows))
    assert "held bulk back" not in d.render(d.analyze(fan_out(batch=32, in_flight=8, completed=27, mean_s=3.0, queue_s=0.5, slots_in_use=4)))


def test_streams_longer_than_the_window_are_judged_by_the_sampled_queue_and_batch() -> None:
    # 8 streams of minutes each, a batch of 1: none ends within the window, so no completions.
    adapter = Service()
    adapter.in_flight.labels(d.ADAPTER_GENERATE).set(8)
    adapter.metric(Gauge, "sluice_adapter_concurrency_limit").set(1)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_kv_slots_in_use", ("replica",)).labels("r").set(1)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_waiting_requests", ("priority", "replica")).labels("interactive", "r").set(7)  # type: ignore[attr-defined]
    report = d.analyze({d.ADAPTER: window(adapter, adapter.scrape(0.0), [adapter.scrape(5.0)])})
    hop = report.hops[0]
    assert (hop.rate, hop.mean_time_s, hop.effective) == (0, None, 1.0)
    assert hop.shares["queue"] == pytest.approx(7 / 8)
    assert report.verdict.text == (
        "inference-adapter serializes: effective concurrency 1.0 of configured 1 (MAX_BATCH_SIZE);"
        " 8.0 requests in flight there; queue wait 88% of its time"
    )


def test_each_model_is_judged_against_its_own_bound() -> None:
    """The main model (batch 1, full, 7 waiting) beside an extra model (batch 4, 1 slot used) on the
    same replica: the main model's slots stand against its own bound of 1, not the sum of both
    models' slots against it (5 of 1 read 500%), and the extra model gets a line of its own."""
    adapter = Service()
    adapter.in_flight.labels(d.ADAPTER_GENERATE).set(9)
    limit = adapter.metric(Gauge, "sluice_adapter_concurrency_limit", ("model",))
    limit.labels("smollm2").set(1)  # type: ignore[attr-defined]
    limit.labels("smollm2-q4").set(4)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_replicas", ("state",)).labels("serving").set(1)  # type: ignore[attr-defined]
    healthy = adapter.metric(Gauge, "sluice_adapter_replica_healthy", ("replica",))
    healthy.labels("127.0.0.1:8001").set(1)  # type: ignore[attr-defined]
    healthy.labels("127.0.0.1:8001#smollm2-q4").set(1)  # type: ignore[attr-defined]
    slots = adapter.metric(Gauge, "sluice_adapter_kv_slots_in_use", ("replica",))
    slots.labels("127.0.0.1:8001").set(1)  # type: ignore[attr-defined]
    slots.labels("127.0.0.1:8001#smollm2-q4").set(1)  # type: ignore[attr-defined]
    waiting = adapter.metric(Gauge, "sluice_adapter_waiting_requests", ("priority", "replica"))
    waiting.labels("interactive", "127.0.0.1:8001").set(7)  # type: ignore[attr-defined]
    waiting.labels("interactive", "127.0.0.1:8001#smollm2-q4").set(0)  # type: ignore[attr-defined]
    report = d.analyze({d.ADAPTER: window(adapter, adapter.scrape(0.0), [adapter.scrape(5.0)])})
    main, extra = report.hops
    assert (main.name, main.configured, main.effective) == (d.ADAPTER, 1, 1.0)
    assert main.shares["queue"] == pytest.approx(7 / 8)
    assert (extra.name, extra.configured, extra.effective) == ("inference-adapter#smollm2-q4", 4, 1.0)
    assert extra.configured_what == "smollm2-q4's MAX_BATCH_SIZE" and extra.utilization == pytest.approx(0.25)
    assert report.verdict.hop == d.ADAPTER
    assert report.verdict.text.startswith("inference-adapter serializes: effective concurrency 1.0 of configured 1 (MAX_BATCH_SIZE)")


def test_an_extra_model_that_serializes_is_named() -> None:
    """The extra model full (4 of 4) with work waiting, the main model idle: the verdict names it."""
    adapter = Service()
    limit = adapter.metric(Gauge, "sluice_adapter_concurrency_limit", ("model",))
    limit.labels("smollm2").set(8)  # type: ignore[attr-defined]
    limit.labels("smollm2-q4").set(4)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_replica_healthy", ("replica",)).labels("r#smollm2-q4").set(1)  # type: ignore[attr-defined]
    slots = adapter.metric(Gauge, "sluice_adapter_kv_slots_in_use", ("replica",))
    slots.labels("r").set(0)  # type: ignore[attr-defined]
    slots.labels("r#smollm2-q4").set(4)  # type: ignore[attr-defined]
    adapter.metric(Gauge, "sluice_adapter_waiting_requests", ("priority", "replica")).labels("bulk", "r#smollm2-q4").set(4)  # type: ignore[attr-defined]
    report = d.analyze({d.ADAPTER: window(adapter, adapter.scrape(0.0), [adapter.scrape(5.0)])})
    main = report.hops[0]
    assert (main.configured, main.effective) == (8, 0.0)
    assert report.verdict.hop == "inference-adapter#smollm2-q4"
    assert report.verdict.text == (
        "inference-adapter#smollm2-q4 serializes: effective concurrency 4.0 of configured 4 (smollm2-q4's MAX_BATCH_SIZE);"
        " 8.0 requests in flight there; queue wait 50% of its time"
    )
