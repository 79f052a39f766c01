"""`sluice jobs ...`: bulk jobs from a terminal (registered by main.build_parser).

sluice jobs submit rows.jsonl        one JobRow per line (JSON, as in the producer contract);
                                     shows a progress bar, then writes <file>.results.jsonl and
                                     <file>.errors.jsonl (override with --results/--errors)
sluice jobs status JOB_ID
sluice jobs results JOB_ID [-o FILE] every RowResult as JSON lines
sluice jobs cancel JOB_ID
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from sluice.gateway.v1 import gateway_pb2
from sluice.jobs.v1 import jobs_pb2

from sluice_cli.client import command_metadata, gateway_stub
from sluice_common.jsonl import jsonl_lines


def _state(job: jobs_pb2.Job) -> str:
    return jobs_pb2.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()


def progress_line(job: jobs_pb2.Job, width: int = 30) -> str:
    done = job.completed_rows + job.failed_rows
    share = done / job.total_rows if job.total_rows else 0.0
    bar = "#" * int(share * width) + "-" * (width - int(share * width))
    # The state padded to the longest (finalizing, in_progress), so that "\r" overwrites it whole.
    line = f"[{bar}] {done}/{job.total_rows} {share:6.1%}  {_state(job):<11}  ({job.failed_rows} failed)"
    if job.state == jobs_pb2.JOB_STATE_EXPIRED:
        line += "; the completion window ended: rows not run by then failed with code EXPIRED"
    return line


def read_rows(path: Path) -> list[jobs_pb2.JobRow]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SystemExit(f"sluice: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise SystemExit(f"sluice: {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    rows = []
    for number, line in enumerate(jsonl_lines(text), 1):
        if line.strip():
            try:
                rows.append(json_format.Parse(line, jobs_pb2.JobRow()))
            except json_format.ParseError as exc:
                raise SystemExit(f"sluice: {path}:{number}: not a JobRow: {exc}") from None
    return rows


def _json(message: Any) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


def write_results(results: list[jobs_pb2.RowResult], ok_path: Path, errors_path: Path) -> tuple[int, int]:
    ok = [r for r in results if not r.HasField("error")]
    bad = [r for r in results if r.HasField("error")]
    ok_path.write_text("".join(_json(r) + "\n" for r in ok))
    errors_path.write_text("".join(_json(r) + "\n" for r in bad))
    return len(ok), len(bad)


def _all_results(args: argparse.Namespace, job_id: str) -> list[jobs_pb2.RowResult]:
    results: list[jobs_pb2.RowResult] = []
    token = ""
    while True:
        reply = gateway_stub(args).ListJobResults(
            gateway_pb2.ListJobResultsRequest(job_id=job_id, page_size=1000, page_token=token), metadata=command_metadata(args), timeout=30
        )
        results += reply.results
        token = reply.next_page_token
        if not token:
            return results


def _fail(error: grpc.RpcError, hint: str = "") -> int:
    print(f"\nsluice: {error.code().name}: {error.details()}" + (f"; {hint}" if hint else ""), file=sys.stderr)  # type: ignore[attr-defined]
    return 1


def _runs_on(job_id: str, submitted: bool = True) -> str:
    how = "runs on" if submitted else "runs on if the gateway got it"
    return f"job {job_id} {how}: `sluice jobs results {job_id} -o FILE` once it is done, or `sluice jobs cancel {job_id}`"


def cmd_submit(args: argparse.Namespace) -> int:
    path = Path(args.rows)
    job = jobs_pb2.JobRequest(job_id=args.job_id or f"cli-{uuid.uuid4().hex[:12]}", rows=read_rows(path))
    metadata = command_metadata(args)
    # The id is the CLI's: named before SubmitJob, so that a submit cut short (Ctrl-C, a deadline) is
    # still known (submitting it again with --job-id is safe: a job runs once).
    print(f"job {job.job_id}: submitting {len(job.rows)} rows", file=sys.stderr)
    submitted = False
    try:
        last = gateway_stub(args).SubmitJob(gateway_pb2.SubmitJobRequest(job=job), metadata=metadata, timeout=30).job
        submitted = True
        # WatchJob ends once the job is settled (for an expired job: every row stored), so the
        # results listed next are all there.
        for update in gateway_stub(args).WatchJob(gateway_pb2.WatchJobRequest(job_id=job.job_id), metadata=metadata):
            last = update.job
            print("\r" + progress_line(last), end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        results = _all_results(args, job.job_id)
    except grpc.RpcError as error:
        return _fail(error, _runs_on(job.job_id) if submitted else "")
    except KeyboardInterrupt:
        print(f"\nsluice: interrupted; {_runs_on(job.job_id, submitted)}", file=sys.stderr)
        return 130
    ok_path = Path(args.results or f"{path}.results.jsonl")
    errors_path = Path(args.errors or f"{path}.errors.jsonl")
    try:
        ok, bad = write_results(results, ok_path, errors_path)
    except OSError as exc:
        print(f"sluice: cannot write the results ({exc}); `sluice jobs results {job.job_id}` lists them", file=sys.stderr)
        return 1
    print(f"{ok} results in {ok_path}, {bad} errors in {errors_path}; job {_state(last)}", file=sys.stderr)
    return 0 if last.state == jobs_pb2.JOB_STATE_COMPLETED else 1


def cmd_status(args: argparse.Namespace) -> int:
    try:
        job = gateway_stub(args).GetJob(gateway_pb2.GetJobRequest(job_id=args.job_id), metadata=command_metadata(args), timeout=10).job
    except grpc.RpcError as error:
        return _fail(error)
    print(progress_line(job) + (f"  error: {job.error}" if job.error else ""))
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    try:
        results = _all_results(args, args.job_id)
    except grpc.RpcError as error:
        return _fail(error)
    lines = "".join(_json(r) + "\n" for r in results)
    if args.output:
        try:
            Path(args.output).write_text(lines)
        except OSError as exc:
            print(f"sluice: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(lines)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    try:
        job = gateway_stub(args).CancelJob(gateway_pb2.CancelJobRequest(job_id=args.job_id), metadata=command_metadata(args), timeout=10).job
    except grpc.RpcError as error:
        return _fail(error)
    print(progress_line(job))
    return 0


def add_jobs_parser(commands: Any) -> None:
    jobs = commands.add_parser("jobs", help="bulk jobs: submit a JSONL file, status, results, cancel")
    sub = jobs.add_subparsers(dest="jobs_command", required=True)
    submit = sub.add_parser("submit", help="submit rows.jsonl (one JobRow per line), watch it, write the results")
    submit.add_argument("rows")
    submit.add_argument("--job-id", default="", help="default: a new random id")
    submit.add_argument("--results", default="", help="default: <rows>.results.jsonl")
    submit.add_argument("--errors", default="", help="default: <rows>.errors.jsonl")
    submit.set_defaults(func=cmd_submit)
    for name, func, text in (("status", cmd_status, "a job's state and counts"), ("cancel", cmd_cancel, "cancel a job")):
        command = sub.add_parser(name, help=text)
        command.add_argument("job_id")
        command.set_defaults(func=func)
    results = sub.add_parser("results", help="a job's results as JSON lines")
    results.add_argument("job_id")
    results.add_argument("-o", "--output", default="")
    results.set_defaults(func=cmd_results)
