"""Lag and score metrics of stored records (record_metrics.py)."""

from __future__ import annotations

from prometheus_client import REGISTRY

from sluice_evaluation_logging.evaluators.base import ScoreResult, skipped
from sluice_evaluation_logging.record_metrics import observe_stored
from sluice_evaluation_logging.model import RecordRow


def row(finished_at: float, *scores: ScoreResult) -> RecordRow:
    return RecordRow(
        event_id="e",
        tenant="t",
        model="m",
        priority_class=1,
        request_id="r",
        finish_reason=1,
        error_code="",
        input_tokens=1,
        output_tokens=1,
        latency_ms=1.0,
        ttft_ms=1.0,
        started_at=finished_at,
        finished_at=finished_at,
        text_logged=False,
        event=b"",
        scores=scores,
    )


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_lag_is_measured_from_the_stream_end_and_skipped_scores_are_left_out() -> None:
    before_lag = sample("sluice_evallog_event_lag_seconds_count"), sample("sluice_evallog_event_lag_seconds_sum")
    before_slow = sample("sluice_evallog_event_lag_seconds_bucket", {"le": "2.5"})
    before = {
        "passed": sample("sluice_evallog_score_results_total", {"evaluator": "unit_rm", "result": "passed"}),
        "failed": sample("sluice_evallog_score_results_total", {"evaluator": "unit_rm", "result": "failed"}),
        "sum": sample("sluice_evallog_score_sum", {"evaluator": "unit_rm"}),
        "skipped": sample("sluice_evallog_score_count", {"evaluator": "unit_rm_skipped"}),
    }
    observe_stored(
        [
            row(1000.0, ScoreResult("unit_rm", 0.75, True), skipped("unit_rm_skipped", "n/a")),
            row(997.0, ScoreResult("unit_rm", 0.25, False)),
            row(0.0),  # no finished_at: no lag to tell
        ],
        now=1001.0,
    )
    assert sample("sluice_evallog_event_lag_seconds_count") - before_lag[0] == 2
    assert sample("sluice_evallog_event_lag_seconds_sum") - before_lag[1] == 5.0
    # 1 s is within 2.5 s, 4 s is not.
    assert sample("sluice_evallog_event_lag_seconds_bucket", {"le": "2.5"}) - before_slow == 1
    assert sample("sluice_evallog_score_results_total", {"evaluator": "unit_rm", "result": "passed"}) - before["passed"] == 1
    assert sample("sluice_evallog_score_results_total", {"evaluator": "unit_rm", "result": "failed"}) - before["failed"] == 1
    assert sample("sluice_evallog_score_sum", {"evaluator": "unit_rm"}) - before["sum"] == 1.0
    assert sample("sluice_evallog_score_count", {"evaluator": "unit_rm_skipped"}) == before["skipped"] == 0
