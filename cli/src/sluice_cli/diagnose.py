"""`sluice diagnose`'s analysis: where a fan-out serializes, by Little's law per hop.

Input: each service's Prometheus text, scraped several times over a window (the first and last
scrapes give counters and histograms, every scrape a sample of the gauges), plus what the rate-limit
service's GetUsage said meanwhile and, when `sluice diagnose --probe` drove load itself, what its
clients saw. No gRPC here: diagnose_collect.py collects, this module computes, tests feed it
recorded metric texts.

Per hop (client -> gateway -> rate-limit -> inference-adapter -> Triton, and the job worker):

- L, requests in flight: the mean of the sampled in-flight gauge (`sluice_rpc_in_flight`, every
  service's interceptor; the job worker's `sluice_jobs_rows_in_flight`);
- lambda, completions per second, and W, mean time per request: from the RPC duration histogram's
  count and sum over the window (`sluice_rpc_duration_seconds`), so lambda x W is Little's L;
- configured: the hop's own bound, where it has one (the adapter's batch, Triton's KV slots, the
  worker's adaptive bound, the tenant's requests-in-flight budget);
- effective: the concurrency the bounded resource really runs at, by Little's law over the bounded
  stage only (the adapter: completions/s x (W - queue wait), the sequences in its batches; when no
  stream ended within the window, its sampled batch and queue gauges instead);
- where the time goes: queue wait (in front of the bound), rate-limit wait, service time, and each
  service's event-loop lag (`sluice_event_loop_lag_seconds`).

A hop serializes when its effective concurrency stands at its bound while the work in front of it
waits: the verdict names it with those numbers. A hop far below its bound is not the limit, however
slow the requests through it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

GATEWAY = "gateway"
RATELIMIT = "rate-limit"
ADAPTER = "inference-adapter"
TRITON = "triton-local"
WORKER = "job-worker"
EVALLOG = "evaluation-logging"
# The hops in request order; evaluation-logging is off the request path (its loop lag is shown).
SERVICES = (GATEWAY, RATELIMIT, ADAPTER, TRITON, WORKER, EVALLOG)

GATEWAY_GENERATE = "/sluice.gateway.v1.GatewayService/Generate"
ADAPTER_GENERATE = "/sluice.inference.v1.InferenceService/Generate"
RATELIMIT_ACQUIRE = "/sluice.ratelimit.v1.RateLimitService/Acquire"

RPC_IN_FLIGHT = "sluice_rpc_in_flight"
RPC_DURATION = "sluice_rpc_duration_seconds"
LOOP_LAG = "sluice_event_loop_lag_seconds"

# A bound is reached when the effective concurrency is at least this share of it: Little's law over
# a window of a few seconds, with streams cut at its edges, reads a full batch of 1 as 0.85-1.05.
SATURATED = 0.8
# ... and it serializes the fan-out when the work in front of it waits at least this share of its time.
WAITING = 0.3
# Denied Acquires (share of all) that make rate-limit the hop that holds the load back, when no
# probe measured how long its clients waited to retry (WAITING then).
DENIED = 0.3
# An engine busy this share of the window is compute-bound: no bound to raise, add hardware.
BUSY = 0.9
# A service whose mean event-loop lag is this long stalls every request through it.
LOOP_STALL_S = 0.05

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One scrape of one service: sample (name, labels) -> value, taken at `at` (monotonic seconds)."""

    at: float
    samples: dict[tuple[str, Labels], float]

    def value(self, name: str, **labels: str) -> float | None:
        """The sum of `name`'s samples whose labels include `labels`; None when there is none."""
        wanted = set(labels.items())
        found = [v for (n, ls), v in self.samples.items() if n == name and wanted <= set(ls)]
        return sum(found) if found else None

    def label_values(self, name: str, label: str) -> set[str]:
        return {dict(ls)[label] for (n, ls) in self.samples if n == name and label in dict(ls)}


def _keeps(labels: Labels, model: str, extras: set[str]) -> bool:
    """Whether a sample belongs to `model`'s figures ("" the main model): an extra model's
    per-replica series are labelled '<address>#<model>', the main model's '<address>'; a series
    labelled by model is that model's; a series of neither (the RPC figures) belongs to every model."""
    named = dict(labels)
    if "replica" in named:
        return named["replica"].partition("#")[2] == model
    if "model" in named:
        return named["model"] == model if model else named["model"] not in extras
    return True


def parse_scrape(text: str, at: float) -> Scrape:
    samples: dict[tuple[str, Labels], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return Scrape(at, samples)


@dataclass(frozen=True)
class ServiceWindow:
    """One service's scrapes over the window, oldest first (at least two)."""

    scrapes: tuple[Scrape, ...]

    def __post_init__(self) -> None:
        if len(self.scrapes) < 2:
            raise ValueError("a window needs at least two scrapes")

    @property
    def seconds(self) -> float:
        return max(self.scrapes[-1].at - self.scrapes[0].at, 1e-9)

    def delta(self, name: str, **labels: str) -> float:
        """How much a counter (or a histogram's _count/_sum) grew over the window."""
        last = self.scrapes[-1].value(name, **labels)
        first = self.scrapes[0].value(name, **labels)
        # A series born during the window started at 0; a restarted process (counter went down)
        # reads as its new count.
        growth = (last or 0.0) - (first or 0.0)
        return growth if growth >= 0 else (last or 0.0)

    def rate(self, name: str, **labels: str) -> float:
        return self.delta(name, **labels) / self.seconds

    def mean_time(self, histogram: str, **labels: str) -> float | None:
        """The mean of the observations a histogram took in the window; None when it took none."""
        count = self.delta(f"{histogram}_count", **labels)
        return self.delta(f"{histogram}_sum", **labels) / count if count > 0 else None

    def quantile(self, histogram: str, q: float, **labels: str) -> float | None:
        """The q-quantile of the window's observations, as the upper bound of its bucket."""
        total = self.delta(f"{histogram}_count", **labels)
        if total <= 0:
            return None
        # The `le` labels exactly as the service wrote them, in order of their value.
        bounds = sorted(self.scrapes[-1].label_values(f"{histogram}_bucket", "le"), key=float)
        for le in bounds:
            if self.delta(f"{histogram}_bucket", le=le, **labels) >= q * total:
                return float(le)
        return math.inf

    def gauge_mean(self, name: str, **labels: str) -> float | None:
        """The mean over every scrape of a gauge (summed over its matching label sets)."""
        values = [v for v in (s.value(name, **labels) for s in self.scrapes) if v is not None]
        return sum(values) / len(values) if values else None

    def extra_models(self) -> list[str]:
        """The adapter's extra generation models: those whose series are labelled '<address>#<model>'."""
        replicas = {dict(labels).get("replica", "") for scrape in self.scrapes for _, labels in scrape.samples}
        return sorted({replica.partition("#")[2] for replica in replicas if "#" in replica})

    def of_model(self, model: str) -> ServiceWindow:
        """The adapter's window with one model's series only ("" the main model): each model has its
        own slots, queue and bound, and a sum over them compares with no bound at all."""
        extras = set(self.extra_models())
        return ServiceWindow(
            tuple(
                Scrape(scrape.at, {key: value for key, value in scrape.samples.items() if _keeps(key[1], model, extras)}) for scrape in self.scrapes
            )
        )


@dataclass(frozen=True)
class BudgetSample:
    """One (tenant, model) budget as rate-limit's GetUsage reported it: its limit and its use."""

    tenant: str
    model: str
    budget: str
    limit: float
    in_use: float


@dataclass
class ProbeStats:
    """What `--probe` clients saw over the window."""

    clients: int = 0
    seconds: float = 0.0
    completed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    # RESOURCE_EXHAUSTED answers, and the time the clients then waited before retrying.
    denied: int = 0
    retry_wait_s: float = 0.0
    # Time spent in Generate calls (from sending to the stream's end).
    call_s: float = 0.0

    @property
    def retry_share(self) -> float:
        busy = self.retry_wait_s + self.call_s
        return self.retry_wait_s / busy if busy > 0 else 0.0


@dataclass
class Hop:
    """One hop's figures; None where a figure cannot be known from what was scraped."""

    name: str
    in_flight: float | None = None
    rate: float | None = None
    mean_time_s: float | None = None
    configured: float | None = None
    configured_what: str = ""
    effective: float | None = None
    # Shares of the hop's mean time, by where it went ("queue", "rate-limit wait", "service"), and
    # other shares that say how the hop spent the window ("Acquires denied", "engine busy").
    shares: dict[str, float] = field(default_factory=dict)
    # Events counted in the window that show a bound was hit ("prefills refused busy").
    events: dict[str, float] = field(default_factory=dict)
    loop_lag_s: float | None = None
    loop_lag_p99_s: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def little(self) -> float | None:
        """Little's law: the requests in flight that the completions and their times imply."""
        return self.rate * self.mean_time_s if self.rate is not None and self.mean_time_s is not None else None

    @property
    def utilization(self) -> float | None:
        if self.configured is None or self.configured <= 0 or self.effective is None:
            return None
        return self.effective / self.configured


@dataclass(frozen=True)
class Verdict:
    hop: str | None
    text: str


@dataclass
class Report:
    seconds: float
    hops: list[Hop]
    verdict: Verdict
    loop_lag: dict[str, tuple[float, float | None]]
    unreachable: list[str]
    probe: ProbeStats | None = None

    def as_dict(self) -> dict[str, object]:
        return {
            "seconds": round(self.seconds, 3),
            "verdict": {"hop": self.verdict.hop, "text": self.verdict.text},
            "hops": [
                {
                    "hop": h.name,
                    "in_flight": h.in_flight,
                    "completions_per_s": h.rate,
                    "mean_time_s": h.mean_time_s,
                    "littles_law_in_flight": h.little,
                    "configured": h.configured,
                    "configured_what": h.configured_what,
                    "effective": h.effective,
                    "shares": h.shares,
                    "events": h.events,
                    "loop_lag_mean_s": h.loop_lag_s,
                    "loop_lag_p99_s": h.loop_lag_p99_s,
                    "notes": h.notes,
                }
                for h in self.hops
            ],
            "loop_lag": {name: {"mean_s": mean, "p99_s": p99} for name, (mean, p99) in self.loop_lag.items()},
            "unreachable": self.unreachable,
            "probe": None if self.probe is None else {
                "clients": self.probe.clients, "completed": self.probe.completed, "errors": self.probe.errors,
                "denied": self.probe.denied, "retry_share": round(self.probe.retry_share, 4),
            },
        }  # fmt: skip


RECORDING_INDEX = "scrapes.json"


def save_recording(
    folder: Path, texts: dict[str, list[tuple[float, str]]], budgets: list[list[BudgetSample]], probe: ProbeStats | None = None
) -> None:
    """Writes what a run scraped (each service's texts with their times, rate-limit's budgets) to
    `folder`, so that `load_recording` (`sluice diagnose --replay`) analyzes it again, elsewhere."""
    folder.mkdir(parents=True, exist_ok=True)
    index: dict[str, object] = {
        "services": {},
        "budgets": [[asdict(b) for b in sample] for sample in budgets],
        "probe": asdict(probe) if probe is not None else None,
    }
    for service, scrapes in texts.items():
        entries = []
        for number, (at, text) in enumerate(scrapes):
            name = f"{service}-{number:03d}.prom"
            (folder / name).write_text(text)
            entries.append({"file": name, "at": at})
        index["services"][service] = entries  # type: ignore[index]
    (folder / RECORDING_INDEX).write_text(json.dumps(index, indent=1))


def load_recording(folder: Path) -> tuple[dict[str, ServiceWindow], list[list[BudgetSample]], ProbeStats | None]:
    """The windows and budgets `save_recording` wrote (its index may list a subset of the files)."""
    index = json.loads((folder / RECORDING_INDEX).read_text())
    windows = {}
    for service, entries in index["services"].items():
        scrapes = tuple(parse_scrape((folder / e["file"]).read_text(), float(e["at"])) for e in entries)
        if len(scrapes) >= 2:
            windows[service] = ServiceWindow(scrapes)
    budgets = [[BudgetSample(**b) for b in sample] for sample in index.get("budgets", [])]
    probe = ProbeStats(**index["probe"]) if index.get("probe") else None
    return windows, budgets, probe


def _loop_lag(window: ServiceWindow | None) -> tuple[float | None, float | None]:
    if window is None:
        return None, None
    return window.mean_time(LOOP_LAG), window.quantile(LOOP_LAG, 0.99)


def _rpc_hop(name: str, window: ServiceWindow, method: str) -> Hop:
    lag, lag_p99 = _loop_lag(window)
    return Hop(
        name,
        in_flight=window.gauge_mean(RPC_IN_FLIGHT, method=method),
        rate=window.rate(f"{RPC_DURATION}_count", method=method),
        mean_time_s=window.mean_time(RPC_DURATION, method=method),
        loop_lag_s=lag,
        loop_lag_p99_s=lag_p99,
    )


def gateway_hop(window: ServiceWindow) -> Hop:
    """client -> gateway: its Generate streams. No bound of its own; how much of a stream's time
    went to waiting for rate-limit's decision."""
    hop = _rpc_hop(GATEWAY, window, GATEWAY_GENERATE)
    wait = window.mean_time("sluice_gateway_ratelimit_wait_seconds")
    if hop.mean_time_s and wait is not None:
        hop.shares["rate-limit wait"] = min(1.0, wait / hop.mean_time_s)
    hop.notes.append("no concurrency bound of its own")
    return hop


def ratelimit_hop(window: ServiceWindow | None, budgets: list[list[BudgetSample]], gateway: Hop | None) -> Hop | None:
    """gateway -> rate-limit: its Acquire calls, and the tightest requests-in-flight budget seen
    (the bound on the gateway's admitted streams of that tenant and model)."""
    if window is None and not budgets:
        return None
    hop = _rpc_hop(RATELIMIT, window, RATELIMIT_ACQUIRE) if window is not None else Hop(RATELIMIT)
    tightest = _tightest_budget(budgets)
    if tightest is not None:
        (tenant, model), limit, in_use = tightest
        hop.configured, hop.effective = limit, in_use
        hop.configured_what = f"requests_in_flight of {tenant} on {model}"
    if window is not None:
        decisions = window.delta("sluice_ratelimit_decisions_total")
        denied = window.delta("sluice_ratelimit_decisions_total", result="denied")
        if decisions > 0:
            hop.shares["Acquires denied"] = denied / decisions
            by_budget = _denials_by_budget(window)
            if by_budget:
                hop.notes.append("denied by " + ", ".join(f"{b} {n:.0f}" for b, n in by_budget))
    if hop.effective is None and gateway is not None and gateway.in_flight is not None:
        hop.notes.append(f"gateway streams admitted in flight: {gateway.in_flight:.1f}")
    return hop


def _denials_by_budget(window: ServiceWindow) -> list[tuple[str, float]]:
    budgets = window.scrapes[-1].label_values("sluice_ratelimit_decisions_total", "budget")
    counts = [(b, window.delta("sluice_ratelimit_decisions_total", result="denied", budget=b)) for b in sorted(budgets)]
    return [(b, n) for b, n in counts if n > 0]


def _tightest_budget(samples: list[list[BudgetSample]]) -> tuple[tuple[str, str], float, float] | None:
    """The (tenant, model) whose requests in flight stood closest to their limit, on average."""
    uses: dict[tuple[str, str], list[float]] = {}
    limits: dict[tuple[str, str], float] = {}
    for sample in samples:
        for budget in sample:
            if budget.budget != "requests_in_flight" or budget.limit <= 0:
                continue
            key = (budget.tenant, budget.model)
            uses.setdefault(key, []).append(budget.in_use)
            limits[key] = budget.limit
    if not uses:
        return None
    # Samples where the pair was absent count as 0 in use (GetUsage lists what it holds).
    means = {key: sum(values) / len(samples) for key, values in uses.items()}
    key = max(means, key=lambda k: (means[k] / limits[k], means[k]))
    return key, limits[key], means[key]


def adapter_hops(window: ServiceWindow) -> list[Hop]:
    """The main model's hop, then one per extra model ('inference-adapter#<model>'), each with its
    own slots, queue and bound."""
    extras = window.extra_models()
    main = adapter_hop(window.of_model(""))
    if extras:
        main.notes.append("completions and their times count every model's streams; slots, queue and bound the main model's")
    return [main, *(extra_model_hop(window.of_model(model), model) for model in extras)]


def extra_model_hop(window: ServiceWindow, model: str) -> Hop:
    """An extra model's pool on the same replicas: its sampled batch against its own bound. The RPC
    figures are not per model, so its queue's share of the time is by Little's law per stage (the
    same lambda passes through its queue and its batch: their times stand as their sampled counts)."""
    hop = Hop(f"{ADAPTER}#{model}")
    limit = window.gauge_mean("sluice_adapter_concurrency_limit")
    replicas = window.scrapes[-1].value("sluice_adapter_replica_healthy")
    if limit is not None:
        hop.configured = limit * max(1.0, replicas or 1.0)
        hop.configured_what = f"{model}'s MAX_BATCH_SIZE" + (" x replicas" if (replicas or 1) > 1 else "")
    running = window.gauge_mean("sluice_adapter_kv_slots_in_use")
    waiting = window.gauge_mean("sluice_adapter_waiting_requests") or 0.0
    hop.effective = running
    if running is not None:
        hop.in_flight = running + waiting
        if waiting + running > 0:
            hop.shares["queue"] = waiting / (waiting + running)
            hop.shares["service"] = 1.0 - hop.shares["queue"]
        hop.notes.append(f"sequences in KV slots (sampled) {running:.1f}")
    queue = window.mean_time("sluice_adapter_queue_seconds")
    if queue is not None:
        hop.notes.append(f"mean queue wait {_seconds(queue)}")
    return hop


def adapter_hop(window: ServiceWindow) -> Hop:
    """gateway -> inference-adapter: its Generate streams wait in a replica's queue, then run in
    its batch. Little's law over the running stage alone is the batch's effective concurrency.
    `window` holds the main model's series (ServiceWindow.of_model)."""
    hop = _rpc_hop(ADAPTER, window, ADAPTER_GENERATE)
    limit = window.gauge_mean("sluice_adapter_concurrency_limit")
    replicas = window.scrapes[-1].value("sluice_adapter_replicas", state="serving")
    if limit is not None:
        hop.configured = limit * max(1.0, replicas or 1.0)
        hop.configured_what = "MAX_BATCH_SIZE x replicas" if (replicas or 1) > 1 else "MAX_BATCH_SIZE"
    queue = window.mean_time("sluice_adapter_queue_seconds")
    running = window.gauge_mean("sluice_adapter_kv_slots_in_use")
    if hop.mean_time_s and hop.rate:
        waited = min(queue or 0.0, hop.mean_time_s)
        hop.shares["queue"] = waited / hop.mean_time_s
        hop.shares["service"] = 1.0 - hop.shares["queue"]
        # Little's law over the running stage; the sampled batch, when scraped, measures the same
        # directly and wins: a window of a few completions puts λ x W off by a stream cut at its edges
        # (a batch of 1 full all along read 0.8 in CI and missed the saturation bound).
        hop.effective = hop.rate * (hop.mean_time_s - waited)
        if running is not None:
            hop.notes.append(f"λ x service time {hop.effective:.1f}")
            hop.effective = running
    elif running is not None:
        # No stream ended within the window (streams longer than the window): the sampled batch,
        # and the queue's share of the time by Little's law per stage (the same lambda passes
        # through the queue and the batch, so their times stand as their sampled counts).
        hop.effective = running
        waiting = window.gauge_mean("sluice_adapter_waiting_requests") or 0.0
        if waiting + running > 0:
            hop.shares["queue"] = waiting / (waiting + running)
            hop.shares["service"] = 1.0 - hop.shares["queue"]
    if running is not None:
        hop.notes.append(f"sequences in KV slots (sampled) {running:.1f}")
    held = window.delta("sluice_adapter_bulk_held_total")
    if held > 0:  # a job slowed for interactive first tokens (BULK_STEP_TARGET_S), not a fault
        hop.events["steps that held bulk back"] = held
    return hop


def triton_hop(window: ServiceWindow, adapter: ServiceWindow | None) -> Hop:
    """inference-adapter -> Triton (triton-local's step model): its KV slots in use against the
    slots it has, and how busy its engine was (one engine: a step at a time)."""
    hop = Hop(TRITON)
    hop.configured = window.gauge_mean("sluice_triton_local_max_slots")
    hop.configured_what = "MAX_SLOTS" if hop.configured is not None else ""
    hop.effective = window.gauge_mean("sluice_triton_local_active_slots")
    hop.in_flight = hop.effective
    steps = window.delta("sluice_triton_local_step_seconds_count")
    if steps > 0:
        hop.rate = steps / window.seconds
        hop.mean_time_s = window.mean_time("sluice_triton_local_step_seconds")
        hop.shares["engine busy"] = min(1.0, window.delta("sluice_triton_local_step_seconds_sum") / window.seconds)
        rows = window.mean_time("sluice_triton_local_step_rows")
        if rows is not None:
            hop.notes.append(f"rows per step {rows:.1f}")
        hop.notes.append("rate and time are per step, not per request")
    if adapter is not None:
        busy = adapter.delta("sluice_adapter_engine_full_total")
        if busy > 0:
            hop.events["prefills refused busy"] = busy
    return hop


def worker_hop(window: ServiceWindow) -> Hop:
    """The job worker: rows in flight against its adaptive bound; W from Little's law (L / lambda)."""
    lag, lag_p99 = _loop_lag(window)
    hop = Hop(WORKER, loop_lag_s=lag, loop_lag_p99_s=lag_p99)
    hop.in_flight = window.gauge_mean("sluice_jobs_rows_in_flight")
    hop.configured = window.gauge_mean("sluice_jobs_concurrency_limit")
    hop.configured_what = "adaptive bound (WORKER_CONCURRENCY_*)" if hop.configured is not None else ""
    hop.effective = hop.in_flight
    hop.rate = window.rate("sluice_jobs_rows_total")
    if hop.rate and hop.in_flight is not None:
        hop.mean_time_s = hop.in_flight / hop.rate
    wait = window.mean_time("sluice_gateway_ratelimit_wait_seconds")
    if hop.mean_time_s and wait is not None:
        hop.shares["rate-limit wait"] = min(1.0, wait / hop.mean_time_s)
    retries = window.delta("sluice_jobs_row_retries_total", code="RESOURCE_EXHAUSTED")
    if retries > 0:
        hop.notes.append(f"rows retried after RESOURCE_EXHAUSTED: {retries:.0f}")
    return hop


def analyze(
    windows: dict[str, ServiceWindow],
    budgets: list[list[BudgetSample]] | None = None,
    probe: ProbeStats | None = None,
    unreachable: Iterable[str] = (),
) -> Report:
    """Every hop's figures and the verdict, from the scraped windows (services not scraped are absent)."""
    budgets = budgets or []
    hops: list[Hop] = []
    gateway = gateway_hop(windows[GATEWAY]) if GATEWAY in windows else None
    if gateway is not None:
        hops.append(gateway)
    rate_limit = ratelimit_hop(windows.get(RATELIMIT), budgets, gateway)
    if rate_limit is not None:
        hops.append(rate_limit)
    if ADAPTER in windows:
        hops += adapter_hops(windows[ADAPTER])
    if TRITON in windows:
        hops.append(triton_hop(windows[TRITON], windows.get(ADAPTER)))
    if WORKER in windows:
        hops.append(worker_hop(windows[WORKER]))
    loop_lag = {}
    for name in SERVICES:
        mean, p99 = _loop_lag(windows.get(name))
        if mean is not None:
            loop_lag[name] = (mean, p99)
    seconds = max((w.seconds for w in windows.values()), default=0.0)
    return Report(seconds, hops, verdict(hops, loop_lag, probe), loop_lag, sorted(unreachable), probe)


def _at_bound(hop: Hop) -> bool:
    utilization = hop.utilization
    return utilization is not None and utilization >= SATURATED


def verdict(hops: list[Hop], loop_lag: dict[str, tuple[float, float | None]], probe: ProbeStats | None) -> Verdict:
    """The hop that serializes, with the measurement that shows it; the strongest case wins."""
    cases: list[tuple[float, Verdict]] = []
    by_name = {hop.name: hop for hop in hops}
    # The main model's hop, and each extra model's, named by its model ('inference-adapter#<model>').
    for adapter in (hop for hop in hops if hop.name == ADAPTER or hop.name.startswith(f"{ADAPTER}#")):
        if _at_bound(adapter) and adapter.shares.get("queue", 0.0) >= WAITING:
            text = _serializes(adapter, "queue wait", adapter.shares["queue"])
            cases.append((adapter.shares["queue"], Verdict(adapter.name, text)))
    rate_limit = by_name.get(RATELIMIT)
    if rate_limit is not None:
        case = _ratelimit_case(rate_limit, probe)
        if case is not None:
            cases.append(case)
    triton = by_name.get(TRITON)
    if triton is not None and _at_bound(triton) and triton.events.get("prefills refused busy", 0.0) > 0:
        refused = triton.events["prefills refused busy"]
        text = (
            f"{TRITON} serializes: {triton.effective:.1f} of its {triton.configured:g} KV slots in use"
            f" ({triton.utilization:.0%}); {refused:.0f} prefills were refused busy and waited"
        )
        cases.append((0.5 + min(0.5, triton.utilization or 0.0) / 2, Verdict(TRITON, text)))
    worker = by_name.get(WORKER)
    if worker is not None and _at_bound(worker) and (worker.in_flight or 0.0) >= 0.5:
        # Rows wait in the broker's prefetch, unseen here: weighed below a measured queue.
        text = (
            f"{WORKER} serializes: {worker.effective:.1f} rows in flight of its bound {worker.configured:g}"
            f" ({worker.utilization:.0%}); {worker.rate or 0.0:.2f} rows/s"
        )
        cases.append((0.45, Verdict(WORKER, text)))
    for name, (mean, p99) in loop_lag.items():
        if mean >= LOOP_STALL_S:
            text = f"{name}'s event loop stalls: mean lag {mean * 1000:.0f} ms (p99 {_ms(p99)}): every request through it waits"
            cases.append((min(1.0, mean / (4 * LOOP_STALL_S)), Verdict(name, text)))
    if cases:
        return max(cases, key=lambda case: case[0])[1]
    return Verdict(None, _no_serialization(hops))


def _serializes(hop: Hop, wait_name: str, wait_share: float) -> str:
    in_flight = f"; {hop.in_flight:.1f} requests in flight there" if hop.in_flight is not None else ""
    return (
        f"{hop.name} serializes: effective concurrency {hop.effective:.1f} of configured {hop.configured:g}"
        f" ({hop.configured_what}){in_flight}; {wait_name} {wait_share:.0%} of its time"
    )


def _ratelimit_case(hop: Hop, probe: ProbeStats | None) -> tuple[float, Verdict] | None:
    denied = hop.shares.get("Acquires denied", 0.0)
    retry = probe.retry_share if probe is not None else None
    # The probe's clients measure the holding back itself: the share of their time spent waiting
    # to retry. The share of Acquires denied only stands in for it without a probe: it follows the
    # clients' retry pace against the calls' length (4 clients, a budget of 1 and 0.1 s calls
    # waited 75% of their time with 29% of their Acquires denied).
    held_back = retry >= WAITING if retry is not None else denied >= DENIED
    if not held_back:
        return None
    bound = ""
    if hop.configured is not None and hop.effective is not None:
        bound = f"; effective concurrency {hop.effective:.1f} of configured {hop.configured:g} ({hop.configured_what})"
    waited = f"; the probe's clients waited to retry {retry:.0%} of their time" if retry is not None else ""
    detail = f" ({hop.notes[0]})" if hop.notes and hop.notes[0].startswith("denied by") else ""
    text = f"{RATELIMIT} serializes: {denied:.0%} of Acquires denied{detail}{bound}{waited}"
    return (retry if retry is not None else denied), Verdict(RATELIMIT, text)


def _no_serialization(hops: list[Hop]) -> str:
    bounded = [h for h in hops if h.utilization]
    if not bounded:
        return "no hop serializes: no bounded hop carried load in the window (run with --probe N)"
    busiest = max(bounded, key=lambda h: h.utilization or 0.0)
    text = (
        f"no hop serializes: the busiest bounded hop, {busiest.name}, runs at effective concurrency"
        f" {busiest.effective:.1f} of configured {busiest.configured:g} ({busiest.utilization:.0%})"
    )
    engine = next((h for h in hops if h.name == TRITON and h.shares.get("engine busy", 0.0) >= BUSY), None)
    if engine is not None:
        text += (
            f"; {TRITON}'s engine is busy {engine.shares['engine busy']:.0%} of the time: compute-bound,"
            " more replicas or a GPU raise throughput, a larger bound does not"
        )
    return text


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return "inf" if math.isinf(seconds) else f"{seconds * 1000:.1f} ms"


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


COLUMNS = ("hop", "in flight", "done/s", "mean time", "λ·W", "configured", "effective", "where the time goes", "loop lag mean/p99")


def render(report: Report) -> str:
    """The table, the event-loop lag of every service, and the verdict."""
    rows = [COLUMNS]
    for hop in report.hops:
        shares = ", ".join([f"{name} {value:.0%}" for name, value in hop.shares.items()] + [f"{name} {n:.0f}" for name, n in hop.events.items()])
        rows.append(
            (
                hop.name,
                _num(hop.in_flight),
                _num(hop.rate, "{:.2f}"),
                _seconds(hop.mean_time_s),
                _num(hop.little),
                "-" if hop.configured is None else f"{hop.configured:g}",
                _num(hop.effective),
                shares or "-",
                "-" if hop.loop_lag_s is None else f"{_ms(hop.loop_lag_s)} / {_ms(hop.loop_lag_p99_s)}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [f"sluice diagnose: {report.seconds:.1f} s window"]
    if report.probe is not None:
        p = report.probe
        errors = ", ".join(f"{code} {n}" for code, n in sorted(p.errors.items())) or "none"
        lines.append(
            f"probe: {p.clients} concurrent Generate streams, {p.completed} completed, {p.denied} denied"
            f" (waited to retry {p.retry_share:.0%} of their time), errors: {errors}"
        )
    lines.append("")
    lines += ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    notes = [f"  {hop.name}: {'; '.join(hop.notes)}" for hop in report.hops if hop.notes]
    if notes:
        lines += ["", "notes:", *notes]
    if report.loop_lag:
        lines += ["", "event-loop lag (mean / p99): " + ", ".join(f"{n} {_ms(m)} / {_ms(p)}" for n, (m, p) in report.loop_lag.items())]
    if report.unreachable:
        lines.append("not scraped (unreachable): " + ", ".join(report.unreachable))
    lines += ["", f"verdict: {report.verdict.text}"]
    return "\n".join(lines)
