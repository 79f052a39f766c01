"""`sluice eval`: A/B two models (or two configurations of one) on a dataset, as bulk jobs, and
gate a deployment on the result (registered by main.build_parser).

    sluice eval --dataset rows.jsonl --model-a M1 --model-b M2 [--threshold 0.05] [--max-tokens N]
    sluice eval --dataset rows.jsonl --model-a M --sampling-b temperature=1.0,seed=7

Each dataset line is {"id"?, "prompt" | "messages", "reference"?}. Both sides run as one bulk job
each through the gateway (SubmitJob, WatchJob, ListJobResults); evaluation-logging scores every
output with its evaluators, plus exact_match and reference_similarity where a reference is given
(ScoreCompletions); the table compares the pass rates side by side (eval_compare.py).
Exit codes: 0 no regression, 1 B regressed beyond the threshold, 2 the comparison could not be made.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc, events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.jobs.v1 import jobs_pb2

from sluice_cli.client import NoAPIKey, bearer_metadata, bounded, stub
from sluice_cli.eval_compare import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    DatasetError,
    DatasetRow,
    RowScore,
    Side,
    compare,
    parse_dataset,
    parse_sampling,
    render,
)
from sluice_cli.jobs import progress_line
from sluice_common.config import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_EVALLOG = "127.0.0.1:50081"
# Items per ScoreCompletions call: up to four texts each to embed (similarity and
# reference_similarity), so ~256 texts, about a second of the CPU embedding model.
SCORE_CHUNK = 64
# ...and at most this many bytes of items per call (an item alone larger still goes, alone): long
# prompts and outputs made 64 items over 4 MiB, the receive limit of a server on gRPC's default.
SCORE_CHUNK_BYTES = 3 * 1024 * 1024


class EvalFailed(Exception):
    """The comparison cannot be made; the message says why (exit code 2, or 130 after Ctrl-C)."""

    def __init__(self, message: str, exit_code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    try:
        return bearer_metadata(args.api_key)
    except NoAPIKey as missing:
        raise EvalFailed(str(missing)) from None


def _sampling(side: Side, default_max_tokens: int) -> types_pb2.SamplingParams:
    settings = {"max_tokens": default_max_tokens, **side.sampling}
    try:
        return json_format.ParseDict(settings, types_pb2.SamplingParams())
    except json_format.ParseError as exc:  # a value out of its field's range (seed=-1, a 64-bit max_tokens)
        raise EvalFailed(f"--sampling-{side.label.lower()}: {exc}") from None


def job_request(job_id: str, rows: Sequence[DatasetRow], side: Side, max_tokens: int) -> jobs_pb2.JobRequest:
    sampling = _sampling(side, max_tokens)
    return jobs_pb2.JobRequest(
        job_id=job_id,
        rows=[
            jobs_pb2.JobRow(
                custom_id=row.custom_id,
                generate=jobs_pb2.GenerateRow(
                    model=side.model,
                    messages=[types_pb2.ChatMessage(role=role, content=content) for role, content in row.chat()],
                    sampling=sampling,
                ),
            )
            for row in rows
        ],
    )


def scored_event(row: DatasetRow, result: jobs_pb2.RowResult, side: Side, sampling: types_pb2.SamplingParams) -> events_pb2.CompletionEvent:
    """The completion as evaluation-logging's evaluators see it; no timings (a row result has none)."""
    return events_pb2.CompletionEvent(
        event_id=f"{result.job_id}/{row.custom_id}",
        model=side.model,
        priority_class=types_pb2.PRIORITY_CLASS_BULK,
        messages=[types_pb2.ChatMessage(role=role, content=content) for role, content in row.chat()],
        output=result.output,
        text_logged=True,
        sampling=sampling,
        finish_reason=result.finish_reason,
        usage=result.usage,
        job_id=result.job_id,
        custom_id=row.custom_id,
    )


class EvalRun:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.metadata = _metadata(args)
        self.gateway = stub(gateway_pb2_grpc.GatewayServiceStub, args.gateway)
        self.evallog = stub(evallog_pb2_grpc.EvalLogServiceStub, args.evallog)

    def submit(self, request: jobs_pb2.JobRequest) -> None:
        self.gateway.SubmitJob(gateway_pb2.SubmitJobRequest(job=request), metadata=self.metadata, timeout=30)

    def wait(self, job_id: str, label: str) -> jobs_pb2.Job:
        """Until the job is settled (WatchJob ends then); the last state seen."""
        last = self.gateway.GetJob(gateway_pb2.GetJobRequest(job_id=job_id), metadata=self.metadata, timeout=10).job
        watch = self.gateway.WatchJob(gateway_pb2.WatchJobRequest(job_id=job_id), metadata=self.metadata, timeout=self.args.timeout)
        try:
            for update in watch:
                last = update.job
                if not self.args.quiet:
                    print(f"\r{label}: " + progress_line(last), end="", file=sys.stderr, flush=True)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED:  # type: ignore[attr-defined]
                raise
            raise EvalFailed(f"side {label}'s job {job_id} did not finish within --timeout {self.args.timeout:g} s") from None
        finally:
            if not self.args.quiet:
                print(file=sys.stderr)
        return last

    def cancel(self, job_ids: Sequence[str]) -> str:
        """Cancels the jobs; what became of them, for the error line (a job never recorded is NOT_FOUND,
        a settled one stays as it is)."""
        cancelled, left = [], []
        for job_id in job_ids:
            try:
                job = self.gateway.CancelJob(gateway_pb2.CancelJobRequest(job_id=job_id), metadata=self.metadata, timeout=10).job
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                    left.append(job_id)
                continue
            if job.state in (jobs_pb2.JOB_STATE_CANCELLING, jobs_pb2.JOB_STATE_CANCELLED):
                cancelled.append(job_id)
        said = [f"cancelled job {', '.join(cancelled)}"] if cancelled else []
        if left:
            said.append(f"could not cancel job {', '.join(left)}: `sluice jobs cancel JOB_ID`")
        return "; ".join(said) or "no job left running"

    def results(self, job_id: str) -> dict[str, jobs_pb2.RowResult]:
        found: dict[str, jobs_pb2.RowResult] = {}
        token = ""
        while True:
            page = self.gateway.ListJobResults(
                gateway_pb2.ListJobResultsRequest(job_id=job_id, page_size=1000, page_token=token), metadata=self.metadata, timeout=30
            )
            found.update((r.custom_id, r) for r in page.results)
            token = page.next_page_token
            if not token:
                return found

    def score(self, items: list[evallog_pb2.ScoreItem]) -> tuple[list[list[RowScore]], list[tuple[str, bool]]]:
        scored: list[list[RowScore]] = []
        evaluators: list[tuple[str, bool]] = []
        for chunk in score_chunks(items):
            reply = self.evallog.ScoreCompletions(evallog_pb2.ScoreCompletionsRequest(items=chunk), metadata=self.metadata, timeout=120)
            evaluators = [(e.name, e.higher_is_better) for e in reply.evaluators]
            scored += [[RowScore(s.name, s.value, s.passed, s.skipped) for s in item.scores] for item in reply.items]
        return scored, evaluators


def score_chunks(items: Sequence[evallog_pb2.ScoreItem]) -> Iterator[list[evallog_pb2.ScoreItem]]:
    """The items in order, SCORE_CHUNK at most a chunk and SCORE_CHUNK_BYTES unless one item alone is more."""
    chunk: list[evallog_pb2.ScoreItem] = []
    size = 0
    for item in items:
        item_size = item.ByteSize()
        if chunk and (len(chunk) == SCORE_CHUNK or size + item_size > SCORE_CHUNK_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(item)
        size += item_size
    if chunk:
        yield chunk


def _side_outcome(
    run: EvalRun, rows: Sequence[DatasetRow], side: Side, job_id: str, sampling: types_pb2.SamplingParams
) -> tuple[list[evallog_pb2.ScoreItem], list[tuple[str, str]], dict[str, Any]]:
    """The items to score, the failed rows (id, why), and per-row records for --output."""
    results = run.results(job_id)
    items: list[evallog_pb2.ScoreItem] = []
    failed: list[tuple[str, str]] = []
    records: dict[str, Any] = {}
    for row in rows:
        result = results.get(row.custom_id)
        if result is None:
            failed.append((row.custom_id, "NO_RESULT: the job reported no result for this row"))
            continue
        records[row.custom_id] = {"output": result.output}
        if result.HasField("error"):
            failed.append((row.custom_id, f"{result.error.code}: {result.error.message}"))
            records[row.custom_id]["error"] = f"{result.error.code}: {result.error.message}"
            continue
        items.append(evallog_pb2.ScoreItem(event=scored_event(row, result, side, sampling), reference=row.reference))
    return items, failed, records


def _report_failures(label: str, failed: list[tuple[str, str]], total: int) -> None:
    if not failed:
        return
    print(f"side {label}: {len(failed)} of {total} rows failed (counted in rows_ok, not scored):", file=sys.stderr)
    for custom_id, why in failed[:10]:
        print(f"  {custom_id}: {why}", file=sys.stderr)
    if len(failed) > 10:
        print(f"  ... and {len(failed) - 10} more", file=sys.stderr)


def _sides(args: argparse.Namespace) -> tuple[Side, Side]:
    try:
        a = Side("A", args.model_a, parse_sampling(args.sampling_a))
        b = Side("B", args.model_b or args.model_a, parse_sampling(args.sampling_b))
    except ValueError as exc:
        raise EvalFailed(f"--sampling-a/--sampling-b: {exc}") from None
    if a.model == b.model and a.sampling == b.sampling:
        print("sluice eval: A and B are the same model and settings: the comparison only measures noise", file=sys.stderr)
    return a, b


def run_eval(args: argparse.Namespace) -> int:
    try:
        rows = parse_dataset(Path(args.dataset).read_text(encoding="utf-8"), args.dataset)
    except (OSError, DatasetError) as exc:
        raise EvalFailed(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise EvalFailed(f"{args.dataset}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    a, b = _sides(args)
    samplings = [_sampling(side, args.max_tokens) for side in (a, b)]  # a bad setting stops it before any job
    run = EvalRun(args)
    stamp = f"eval-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    sides = [(a, f"{stamp}-a"), (b, f"{stamp}-b")]
    # The ids are chosen here and printed before SubmitJob: whatever happens next, the jobs are named.
    for side, job_id in sides:
        print(f"side {side.label}: job {job_id}, {len(rows)} rows", file=sys.stderr)
    try:
        # Both jobs are submitted before either is waited for: they run side by side in the bulk class.
        for side, job_id in sides:
            run.submit(job_request(job_id, rows, side, args.max_tokens))
        states = [run.wait(job_id, side.label) for side, job_id in sides]
    except (EvalFailed, grpc.RpcError, KeyboardInterrupt) as stopped:
        # No comparison will come of them: neither job is left running (a second Ctrl-C cuts this short).
        code = EXIT_INTERRUPTED if isinstance(stopped, KeyboardInterrupt) else EXIT_ERROR
        raise EvalFailed(f"{_why(stopped)}; {run.cancel([job_id for _, job_id in sides])}", code) from None
    scored: list[list[list[RowScore]]] = []
    failures: list[tuple[int, int]] = []
    evaluators: list[tuple[str, bool]] = []
    per_row: dict[str, dict[str, Any]] = {}
    for (side, job_id), sampling in zip(sides, samplings, strict=True):
        items, failed, records = _side_outcome(run, rows, side, job_id, sampling)
        _report_failures(side.label, failed, len(rows))
        side_scores, evaluators = run.score(items) if items else ([], evaluators)
        for item, scores in zip(items, side_scores, strict=True):
            records[item.event.custom_id]["scores"] = {s.name: s.value for s in scores if not s.skipped}
        for custom_id, record in records.items():
            per_row.setdefault(custom_id, {"id": custom_id})[side.label] = record
        scored.append(side_scores)
        failures.append((len(rows), len(failed)))
    report = compare(evaluators, scored[0], scored[1], failures[0], failures[1], args.threshold)
    print(render(report, a, b))
    if args.output:
        try:
            Path(args.output).write_text("".join(json.dumps(per_row[r.custom_id], sort_keys=True) + "\n" for r in rows if r.custom_id in per_row))
        except OSError as exc:
            outputs = " and ".join(f"`sluice jobs results {job_id}`" for _, job_id in sides)
            raise EvalFailed(f"cannot write {args.output}: {exc.strerror or exc} (the outputs, not the scores, stay in {outputs})") from None
    unsettled = [
        f"{side.label} ({job_id}: {jobs_pb2.JobState.Name(job.state)})"
        for (side, job_id), job in zip(sides, states, strict=True)
        if job.state != jobs_pb2.JOB_STATE_COMPLETED
    ]
    if unsettled:
        raise EvalFailed(f"job(s) did not complete: {', '.join(unsettled)}; the table counts their missing rows as failed")
    return report.exit_code


def _why(stopped: BaseException) -> str:
    if isinstance(stopped, KeyboardInterrupt):
        return "interrupted"
    if isinstance(stopped, grpc.RpcError):
        return f"{stopped.code().name}: {stopped.details()}"  # type: ignore[attr-defined]
    return str(stopped)


def cmd_eval(args: argparse.Namespace) -> int:
    """Exit codes: EXIT_OK, EXIT_REGRESSION, and EXIT_ERROR for anything that kept the comparison from
    being made or kept (a setting, an RPC, a file), never 1 (a regression); 130 after Ctrl-C."""
    try:
        return run_eval(args)
    except (EvalFailed, ConfigError, grpc.RpcError) as exc:
        print(f"sluice eval: {_why(exc)}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, EvalFailed) else EXIT_ERROR
    except KeyboardInterrupt:
        print("\nsluice eval: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


_threshold = bounded(float, lambda value: 0.0 <= value <= 1.0, "a share of the pass rate in [0, 1] (0.05 = five points)")


def add_eval_parser(commands: Any) -> None:
    command = commands.add_parser(
        "eval",
        help="A/B two models or configurations on a dataset as bulk jobs; exit 1 when B regresses",
        description="Runs each dataset row through side A and side B as two bulk jobs, scores both with"
        " evaluation-logging's evaluators (plus exact_match and reference_similarity for rows with a"
        " reference), prints a table per evaluator and a verdict. Exit 0: no regression; 1: B's pass rate"
        " is more than --threshold below A's on some evaluator (or rows_ok); 2: the comparison could not be made.",
    )
    command.add_argument("--dataset", required=True, help='JSON lines: {"id"?, "prompt" | "messages", "reference"?}')
    command.add_argument("--model-a", default=DEFAULT_MODEL, help=f"side A's model (default {DEFAULT_MODEL})")
    command.add_argument("--model-b", default="", help="side B's model (default: --model-a, to compare configurations)")
    command.add_argument(
        "--sampling-a",
        default="",
        help="side A's sampling, like temperature=0.7,top_p=0.9,seed=7,max_tokens=32,stop=X (any SamplingParams option; logit_bias=ID:BIAS)",
    )
    command.add_argument("--sampling-b", default="", help="side B's sampling (same form)")
    command.add_argument("--max-tokens", type=int, default=64, help="max_tokens of both sides unless their --sampling sets it (default 64)")
    command.add_argument(
        "--threshold", type=_threshold, default=0.05, help="largest drop of B's pass rate below A's that is not a regression (default 0.05)"
    )
    command.add_argument(
        "--evallog", default=os.environ.get("SLUICE_EVALLOG_URL", DEFAULT_EVALLOG), help="evaluation-logging's gRPC address (SLUICE_EVALLOG_URL)"
    )
    command.add_argument("--timeout", type=float, default=3600.0, help="how long to wait for each job, in seconds (default 3600)")
    command.add_argument("-o", "--output", default="", help="write each row's outputs and scores, both sides, as JSON lines")
    command.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    command.set_defaults(func=cmd_eval)
