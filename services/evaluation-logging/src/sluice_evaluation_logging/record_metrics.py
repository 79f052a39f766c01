"""What a stored batch tells an operator: how far behind the streams the store is, and the scores.

Observed once a batch is durably stored (a redelivered event that was already stored counts again:
rare, and only after a crash or a broker failure)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Histogram, Summary

from sluice_evaluation_logging.model import RecordRow

# From the end of the stream (the event's finished_at, the gateway's clock) to the record stored:
# the queue in RabbitMQ plus evaluation and storage. Alerted on in deploy/prometheus/rules.
EVENT_LAG = Histogram(
    "sluice_evallog_event_lag_seconds",
    "Time from a completion's end (its event's finished_at) to its record being stored.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
)
# The values of the scores computed at consumption (the deferred similarity score is counted by
# similarity_worker.py). Value ranges differ per evaluator: a mean (sum / count) per evaluator,
# and pass/fail counts for a pass ratio.
SCORE = Summary("sluice_evallog_score", "Scores stored with their records, by evaluator (mean = sum / count).", ["evaluator"])
SCORE_RESULTS = Counter(
    "sluice_evallog_score_results_total",
    "Scores stored with their records, by evaluator and result (passed, failed).",
    ["evaluator", "result"],
)


def observe_stored(rows: Sequence[RecordRow], now: float | None = None) -> None:
    """Lag and scores of rows just stored; skipped scores (the evaluator did not apply) are left out.
    Each evaluator's metric children are looked up once per call: a `labels()` per score was most of
    the ~17 ms a batch of 256 rows held the event loop here."""
    now = time.time() if now is None else now
    children: dict[str, tuple[Any, Any, Any]] = {}  # evaluator -> (score, passed, failed)
    for row in rows:
        if row.finished_at > 0:
            EVENT_LAG.observe(max(0.0, now - row.finished_at))
        for score in row.scores:
            if score.skipped:
                continue
            of = children.get(score.name)
            if of is None:
                of = children[score.name] = (
                    SCORE.labels(score.name),
                    SCORE_RESULTS.labels(score.name, "passed"),
                    SCORE_RESULTS.labels(score.name, "failed"),
                )
            of[0].observe(score.value)
            (of[1] if score.passed else of[2]).inc()
