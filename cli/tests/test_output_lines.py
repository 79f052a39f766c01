"""The lines `sluice jobs` and `sluice logs` print."""

from __future__ import annotations

from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, events_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_cli.jobs import progress_line
from sluice_cli.main import record_line


def test_the_cli_progress_line_explains_expired_and_pads_the_state() -> None:
    # When the CLI stops following is WatchJob's (test_jobs_api: it ends on expired only once
    # every row is stored); the line it prints is the CLI's.
    expired = jobs_pb2.Job(state=jobs_pb2.JOB_STATE_EXPIRED, total_rows=4, completed_rows=1, failed_rows=3)
    line = progress_line(expired, width=4)
    assert line.startswith("[####] 4/4 100.0%  expired") and "EXPIRED" in line
    assert "finalizing " in progress_line(jobs_pb2.Job(state=jobs_pb2.JOB_STATE_FINALIZING, total_rows=1, completed_rows=1))


def test_sluice_logs_prints_the_records_trace_id() -> None:
    event = events_pb2.CompletionEvent(model="m", request_id="r1", finish_reason=types_pb2.FINISH_REASON_STOP)
    traced = record_line(evallog_pb2.Record(event=event, trace_id="4bf92f3577b34da6a3ce929d0e0e4736"))
    assert traced.endswith("r1  trace 4bf92f3577b34da6a3ce929d0e0e4736")
    assert "trace" not in record_line(evallog_pb2.Record(event=event))


def test_sluice_logs_prints_a_finish_reason_it_has_no_name_for_as_its_number() -> None:
    """A newer gateway's FinishReason: FinishReason.Name raised ValueError and `sluice logs` ended in a traceback."""
    event = events_pb2.CompletionEvent(model="m", request_id="r1", finish_reason=99)  # type: ignore[arg-type]
    assert " 99 " in record_line(evallog_pb2.Record(event=event))
    event.error_code = "ABORTED"
    assert " 99/ABORTED " in record_line(evallog_pb2.Record(event=event))
