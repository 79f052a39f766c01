"""A bulk row's deadline follows the worker's own rolling p99s (row_deadline.py), and an attempt
carries it to the adapter: the row's rate-limit lease, which a dead worker never settles, lives
for that deadline plus a margin instead of the fixed WORKER_ROW_TIMEOUT_S.

run_row goes through the real InferencePath to the stand-in adapter of test_default_deadline.py
(a real gRPC server in this process)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from sluice.common.v1 import types_pb2
from sluice.jobs.v1 import jobs_pb2
from test_default_deadline import stand_in  # noqa: F401 - the fixture

from sluice_common.adaptive_timeout import TimeoutPolicy
from sluice_common.config import ConfigError, load_config
from sluice_gateway.config import ENV_PREFIX, WorkerConfig
from sluice_gateway.jobs.job import TOO_LONG_CODE, run_row, too_long_for_window
from sluice_gateway.jobs.row_deadline import RowDeadlines, RowTiming, WarmUp

CEILING_S = 60.0
WARM_UP_S = 45.0
TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def deadlines(floor_s: float = 0.05, default_max_tokens: int = 100) -> RowDeadlines:
    policy = TimeoutPolicy(2.0, floor_s, CEILING_S, window=100, min_samples=5)
    return RowDeadlines(policy, default_max_tokens, WarmUp(WARM_UP_S, per_token_s=0.001))


def configured(**env: str) -> RowDeadlines:
    """As the worker builds them, from the settings (their defaults unless given)."""
    environ = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, **{f"{ENV_PREFIX}{name}": value for name, value in env.items()}}
    config = load_config(WorkerConfig, ENV_PREFIX, environ)
    return RowDeadlines.for_settings(config.shared, config.worker)


def observe_rows(rows: RowDeadlines, count: int, first_token_s: float, per_token_s: float, tokens: int = 11) -> None:
    for _ in range(count):
        rows.observe(generate_row(tokens), RowTiming(first_token_s, tokens, first_token_s + (tokens - 1) * per_token_s))


def generate_row(max_tokens: int = 0) -> jobs_pb2.JobRow:
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens) if max_tokens else None
    return jobs_pb2.JobRow(custom_id="r", generate=jobs_pb2.GenerateRow(model="m", prompt="hi", sampling=sampling))


EMBED_ROW = jobs_pb2.JobRow(custom_id="e", embed=jobs_pb2.EmbedRow(model="e", inputs=["a"]))


def test_the_warm_up_deadline_until_warm_then_twice_the_rows_p99s_by_max_tokens() -> None:
    rows = deadlines()
    assert rows.for_row(generate_row(20)) == WARM_UP_S and rows.for_row(EMBED_ROW) == WARM_UP_S
    for _ in range(5):
        rows.observe(generate_row(11), RowTiming(first_token_s=0.1, tokens=11, total_s=0.6))  # 50 ms a token
        rows.observe(EMBED_ROW, RowTiming(None, 0, 0.2))
    assert rows.for_row(generate_row(20)) == pytest.approx(2 * (0.1 + 20 * 0.05))
    assert rows.for_row(generate_row()) == pytest.approx(2 * (0.1 + 100 * 0.05))  # no max_tokens: the default's
    assert rows.for_row(EMBED_ROW) == pytest.approx(2 * 0.2)
    assert deadlines(floor_s=30.0).for_row(generate_row(2)) == WARM_UP_S  # cold, still the warm-up deadline
    warm = deadlines(floor_s=30.0)
    for _ in range(5):
        warm.observe(generate_row(2), RowTiming(0.1, 2, 0.15))
    assert warm.for_row(generate_row(2)) == 30.0  # short rows: the floor


def test_an_attempt_cut_off_lengthens_the_next_deadlines() -> None:
    rows = deadlines()
    for _ in range(5):
        rows.observe(generate_row(2), RowTiming(0.1, 2, 0.15))
    before = rows.for_row(generate_row(2))
    for _ in range(2):  # the p99 of a window of 7 is its largest sample
        rows.observe(generate_row(2), RowTiming(None, 0, before))
    assert rows.for_row(generate_row(2)) >= 2 * before


async def test_an_attempt_reports_its_timing_and_carries_its_deadline_to_the_adapter(stand_in) -> None:  # noqa: F811
    adapter, path = stand_in
    task = jobs_pb2.RowTask(job_id="j", tenant="t", row=generate_row(10))
    run = await run_row(path, task, "rid", 7.5)
    assert adapter.deadlines[-1] == pytest.approx(7.5, abs=0.5)
    assert run.timing is not None and run.timing.tokens == 10
    assert 0 < run.timing.first_token_s < run.timing.total_s <= run.latency_s + 0.01
    embed = await run_row(path, jobs_pb2.RowTask(job_id="j", tenant="t", row=EMBED_ROW), "rid", 5.0)
    assert embed.timing is not None and embed.timing.first_token_s is None and embed.timing.total_s > 0

    adapter.stalled = True
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await run_row(path, task, "rid", 0.3)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # transient: the worker retries it
    assert time.monotonic() - started < 1.5


def test_the_row_timeout_settings_are_validated_naming_both_bounds() -> None:
    config = load_config(WorkerConfig, ENV_PREFIX, {f"{ENV_PREFIX}TENANTS_FILE": TENANTS})
    assert config.worker.row_timeout_policy(config.shared.default_deadline_policy()) == TimeoutPolicy(2.0, 30.0, 1500.0, 1000, 50)
    assert (config.worker.row_timeout_s, config.worker.row_warmup_per_token_s) == (120.0, 0.25)
    env = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S": "20"}
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_FLOOR_S must be > 0 and <= {ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S"):
        load_config(WorkerConfig, ENV_PREFIX, env)
    env = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_S": "7200"}
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_S must be > 0 and <= {ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S"):
        load_config(WorkerConfig, ENV_PREFIX, env)
    # A ceiling the broker's consumer timeout cannot cover: the broker would close the channel on the
    # row's message mid-attempt, requeueing every row on it (and, after a few, the row dead-lettered).
    env = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_CEILING_S": "3600"}
    with pytest.raises(
        ConfigError, match=r"WORKER_ROW_TIMEOUT_CEILING_S \(3600\) must be <= 1530 \(85% of SLUICE_GATEWAY_WORKER_CONSUMER_TIMEOUT_S, 1800\)"
    ):
        load_config(WorkerConfig, ENV_PREFIX, env)
    env[f"{ENV_PREFIX}WORKER_CONSUMER_TIMEOUT_S"] = "7200"  # the broker's raised (rabbitmq.conf, or a policy)
    assert load_config(WorkerConfig, ENV_PREFIX, env).worker.slot_wait_s == pytest.approx(7200 * 0.95 - 3600)
    env = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, f"{ENV_PREFIX}WORKER_ROW_WARMUP_PER_TOKEN_S": "0"}
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}WORKER_ROW_WARMUP_PER_TOKEN_S must be > 0"):
        load_config(WorkerConfig, ENV_PREFIX, env)


# ---- long rows (issue 22): the deadline grows with the row's own max_tokens, up to a ceiling for long work


def test_a_row_expected_to_take_over_120s_gets_a_deadline_past_120s() -> None:
    rows = configured()  # the defaults: warm after 50 rows
    observe_rows(rows, 50, first_token_s=1.0, per_token_s=0.15)  # a CPU replica's bulk pace
    long_row = generate_row(1024)
    assert rows.expected_s(long_row) == pytest.approx(1.0 + 1024 * 0.15)  # 154.6 s
    assert rows.for_row(long_row) == pytest.approx(2 * (1.0 + 1024 * 0.15))  # 309 s, not cut at 120 s
    assert rows.for_row(generate_row(2)) == 30.0  # a short row keeps a short deadline (and lease)


def test_the_ceiling_is_for_long_work_and_is_a_setting() -> None:
    rows = configured()
    observe_rows(rows, 50, first_token_s=1.0, per_token_s=5.0)  # 1,024 tokens would take over 85 minutes
    assert rows.for_row(generate_row(1024)) == 1500.0  # within RabbitMQ's default consumer timeout (30 min)
    longer = configured(WORKER_ROW_TIMEOUT_CEILING_S="7200", WORKER_CONSUMER_TIMEOUT_S="9000")
    observe_rows(longer, 50, first_token_s=1.0, per_token_s=5.0)
    assert longer.for_row(generate_row(1024)) == 7200.0


def test_during_warm_up_a_long_row_gets_room_for_every_token() -> None:
    rows = configured()
    # Nothing seen: WORKER_ROW_TIMEOUT_S for a short row; 2 x 1,024 x 0.25 s for a long one.
    assert rows.for_row(generate_row(2)) == 120.0 and rows.for_row(EMBED_ROW) == 120.0
    assert rows.for_row(generate_row(1024)) == pytest.approx(2 * 1024 * 0.25)
    assert rows.expected_s(generate_row(1024)) is None  # nothing trusted yet: no row is refused
    # A few rows seen (fewer than 50), slower than assumed: the slowest pace seen so far counts.
    observe_rows(rows, 3, first_token_s=2.0, per_token_s=0.4)
    assert rows.for_row(generate_row(1024)) == pytest.approx(2 * (2.0 + 1024 * 0.4))
    assert rows.for_row(generate_row(2)) == 120.0


def test_a_row_cut_off_gets_twice_that_deadline_next_until_the_ceiling() -> None:
    rows = configured()
    assert rows.for_row(generate_row(2), cut_at_s=120.0) == 240.0
    assert rows.for_row(generate_row(2), cut_at_s=1000.0) == 1500.0
    assert rows.at_ceiling(1500.0) and not rows.at_ceiling(240.0)
    # It ran that long without finishing: it needs at least that, warm or not.
    assert rows.expected_s(generate_row(2), cut_at_s=500.0) == 500.0


def test_a_row_that_cannot_fit_what_is_left_of_its_window_fails_at_once() -> None:
    task = jobs_pb2.RowTask(job_id="j", tenant="t", row=generate_row(1024))
    now = 1000.0
    refused = too_long_for_window(task, expected_s=154.6, expires_at=now + 100.0, now=now, window_s=600.0)
    assert refused is not None and refused.error.code == TOO_LONG_CODE == "TOO_LONG_FOR_WINDOW"
    assert (refused.job_id, refused.custom_id, refused.output) == ("j", "r", "")
    message = refused.error.message
    assert "2m35s" in message and "1m40s was left of the job's completion window (10m)" in message, message
    assert too_long_for_window(task, expected_s=99.0, expires_at=now + 100.0, now=now) is None
    # Within the grace of the window's end it runs: rows running when a window ends finish anyway.
    assert too_long_for_window(task, expected_s=154.6, expires_at=now + 100.0, now=now, grace_s=60.0) is None
    assert too_long_for_window(task, expected_s=154.6, expires_at=now + 100.0, now=now, grace_s=30.0) is not None
    assert too_long_for_window(task, expected_s=None, expires_at=now + 1.0, now=now) is None  # nothing known: run it
    assert too_long_for_window(task, expected_s=99.0, expires_at=None, now=now) is None  # a job without a window
