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
from sluice_gateway.config import ENV_PREFIX, GatewayConfig
from sluice_gateway.jobs import run_row
from sluice_gateway.row_deadline import RowDeadlines, RowTiming

CEILING_S = 60.0
TENANTS = str(Path(__file__).resolve().parents[3] / "config" / "tenants.toml")


def deadlines(floor_s: float = 0.05, default_max_tokens: int = 100) -> RowDeadlines:
    return RowDeadlines(TimeoutPolicy(2.0, floor_s, CEILING_S, window=100, min_samples=5), default_max_tokens)


def generate_row(max_tokens: int = 0) -> jobs_pb2.JobRow:
    sampling = types_pb2.SamplingParams(max_tokens=max_tokens) if max_tokens else None
    return jobs_pb2.JobRow(custom_id="r", generate=jobs_pb2.GenerateRow(model="m", prompt="hi", sampling=sampling))


EMBED_ROW = jobs_pb2.JobRow(custom_id="e", embed=jobs_pb2.EmbedRow(model="e", inputs=["a"]))


def test_the_ceiling_until_warm_then_twice_the_rows_p99s_by_max_tokens() -> None:
    rows = deadlines()
    assert rows.for_row(generate_row(20)) == CEILING_S and rows.for_row(EMBED_ROW) == CEILING_S
    for _ in range(5):
        rows.observe(generate_row(11), RowTiming(first_token_s=0.1, tokens=11, total_s=0.6))  # 50 ms a token
        rows.observe(EMBED_ROW, RowTiming(None, 0, 0.2))
    assert rows.for_row(generate_row(20)) == pytest.approx(2 * (0.1 + 20 * 0.05))
    assert rows.for_row(generate_row()) == pytest.approx(2 * (0.1 + 100 * 0.05))  # no max_tokens: the default's
    assert rows.for_row(EMBED_ROW) == pytest.approx(2 * 0.2)
    assert deadlines(floor_s=30.0).for_row(generate_row(2)) == CEILING_S  # cold, still the ceiling
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
    config = load_config(GatewayConfig, ENV_PREFIX, {f"{ENV_PREFIX}TENANTS_FILE": TENANTS})
    assert config.worker_row_timeout_policy() == TimeoutPolicy(2.0, 30.0, 120.0, 1000, 50)
    env = {f"{ENV_PREFIX}TENANTS_FILE": TENANTS, f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_S": "20"}
    with pytest.raises(ConfigError, match=f"{ENV_PREFIX}WORKER_ROW_TIMEOUT_FLOOR_S must be > 0 and <= {ENV_PREFIX}WORKER_ROW_TIMEOUT_S"):
        load_config(GatewayConfig, ENV_PREFIX, env)
