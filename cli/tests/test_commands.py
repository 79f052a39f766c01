"""`sluice jobs`, `sluice eval`, `sluice logs`, `sluice health` and `sluice hash-key` as a user runs
them (main(), or a process of their own to press Ctrl-C), against real gRPC servers in this process
whose servicers stand in for the gateway and evaluation-logging."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc, events_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from sluice.jobs.v1 import jobs_pb2

from sluice_cli.eval_run import SCORE_CHUNK_BYTES
from sluice_cli.main import main
from sluice_common.tenants import hash_api_key

KEY = "sk-test"
TLS_VARIABLES = ("SLUICE_TLS", "SLUICE_TLS_CA_FILE", "SLUICE_TLS_CERT_FILE", "SLUICE_TLS_KEY_FILE", "SLUICE_TLS_SERVER_NAME")


class Gateway(gateway_pb2_grpc.GatewayServiceServicer):
    """Jobs in memory: each row's output is `output_bytes` long; WatchJob settles them at once, or
    (settle=False) waits until its caller goes away; SubmitJob of an id ending in `refuse` fails."""

    def __init__(self, settle: bool = True, refuse: str = "", output_bytes: int = 8) -> None:
        self.settle, self.refuse, self.output_bytes = settle, refuse, output_bytes
        self.jobs: dict[str, jobs_pb2.Job] = {}
        self.rows: dict[str, list[str]] = {}
        self.cancelled: list[str] = []
        self.watching = threading.Event()

    def _job(self, job_id: str, context: grpc.ServicerContext) -> jobs_pb2.Job:
        if job_id not in self.jobs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
        return self.jobs[job_id]

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        """A first token, then nothing until its caller goes away."""
        yield gateway_pb2.GenerateResponse(text="Once")
        self.watching.set()
        while context.is_active():
            time.sleep(0.02)

    def SubmitJob(self, request, context):  # type: ignore[no-untyped-def]
        if self.refuse and request.job.job_id.endswith(self.refuse):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the broker is away")
        job = jobs_pb2.Job(job_id=request.job.job_id, total_rows=len(request.job.rows), state=jobs_pb2.JOB_STATE_IN_PROGRESS)
        self.jobs[job.job_id], self.rows[job.job_id] = job, [row.custom_id for row in request.job.rows]
        return gateway_pb2.SubmitJobResponse(job=job)

    def GetJob(self, request, context):  # type: ignore[no-untyped-def]
        return gateway_pb2.GetJobResponse(job=self._job(request.job_id, context))

    def WatchJob(self, request, context):  # type: ignore[no-untyped-def]
        job = self._job(request.job_id, context)
        yield gateway_pb2.WatchJobResponse(job=job)
        self.watching.set()
        if not self.settle:
            while context.is_active():
                time.sleep(0.02)
            return
        job.state, job.completed_rows = jobs_pb2.JOB_STATE_COMPLETED, job.total_rows
        yield gateway_pb2.WatchJobResponse(job=job)

    def CancelJob(self, request, context):  # type: ignore[no-untyped-def]
        job = self._job(request.job_id, context)
        self.cancelled.append(job.job_id)
        if job.state == jobs_pb2.JOB_STATE_IN_PROGRESS:
            job.state = jobs_pb2.JOB_STATE_CANCELLED
        return gateway_pb2.CancelJobResponse(job=job)

    def ListJobResults(self, request, context):  # type: ignore[no-untyped-def]
        self._job(request.job_id, context)
        results = [
            jobs_pb2.RowResult(job_id=request.job_id, custom_id=custom_id, output="y" * self.output_bytes, finish_reason=types_pb2.FINISH_REASON_STOP)
            for custom_id in self.rows[request.job_id]
        ]
        return gateway_pb2.ListJobResultsResponse(results=results)


@dataclass
class EvalLog(evallog_pb2_grpc.EvalLogServiceServicer):
    """Records in memory for QueryRecords (newest first, from start_time); ScoreCompletions passes
    every item on exact_match, keeping each call's size."""

    records: list[evallog_pb2.Record] = field(default_factory=list)
    score_calls: list[tuple[int, int]] = field(default_factory=list)  # (items, bytes)

    def QueryRecords(self, request, context):  # type: ignore[no-untyped-def]
        start = request.start_time.ToNanoseconds() if request.HasField("start_time") else 0
        found = sorted((r for r in self.records if r.event.finished_at.ToNanoseconds() >= start), key=lambda r: -r.event.finished_at.ToNanoseconds())
        return evallog_pb2.QueryRecordsResponse(records=found[: request.page_size])

    def Summarize(self, request, context):  # type: ignore[no-untyped-def]
        return evallog_pb2.SummarizeResponse()

    def ScoreCompletions(self, request, context):  # type: ignore[no-untyped-def]
        self.score_calls.append((len(request.items), request.ByteSize()))
        scored = [evallog_pb2.ScoredItem(scores=[evallog_pb2.Score(name="exact_match", value=1.0, passed=True)]) for _ in request.items]
        return evallog_pb2.ScoreCompletionsResponse(items=scored, evaluators=[evallog_pb2.EvaluatorInfo(name="exact_match", higher_is_better=True)])


def serve(servicer: object) -> tuple[grpc.Server, str]:
    """A server with gRPC's default limits (a 4 MiB request is as much as it takes)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    if isinstance(servicer, Gateway):
        gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server)
    elif isinstance(servicer, EvalLog):
        evallog_pb2_grpc.add_EvalLogServiceServicer_to_server(servicer, server)
    else:
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(autouse=True)
def plaintext(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TLS_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def evallog() -> Iterator[tuple[EvalLog, str]]:
    servicer = EvalLog()
    server, address = serve(servicer)
    yield servicer, address
    server.stop(0)


def gateway_at(request: pytest.FixtureRequest, **settings: object) -> tuple[Gateway, str]:
    servicer = Gateway(**settings)  # type: ignore[arg-type]
    server, address = serve(servicer)
    request.addfinalizer(lambda: server.stop(0))
    return servicer, address


def sluice(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """main() as `sluice ARGV...` runs it; its exit code."""
    monkeypatch.setattr(sys, "argv", ["sluice", "--api-key", KEY, *argv])
    with pytest.raises(SystemExit) as ended:
        main()
    code = ended.value.code
    if isinstance(code, str):  # SystemExit(message): Python prints it and exits 1
        print(code, file=sys.stderr)
        return 1
    return int(code or 0)


def interrupted(gateway: Gateway, *argv: str) -> tuple[int, str]:
    """`sluice ARGV...` in a process of its own, Ctrl-C (SIGINT) once the gateway is streaming to it:
    its exit code and stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "sluice_cli", "--api-key", KEY, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        assert gateway.watching.wait(30)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    return process.returncode, err


def dataset(tmp_path: Path, rows: int = 3) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}", "reference": "y"}) + "\n" for i in range(rows)))
    return path


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    return lines[-1]


# ---- sluice eval


def test_eval_reads_pages_and_scores_in_calls_a_4_mib_server_takes(request, evallog, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """70 rows of 100 kB outputs: a page of results over 4 MiB (RESOURCE_EXHAUSTED on the CLI's
    channel before), and 64 of them to score in one call over 4 MiB (the server refused it)."""
    _, gateway = gateway_at(request, output_bytes=100_000)
    scorer, evallog_address = evallog
    code = sluice(monkeypatch, "--gateway", gateway, "eval", "--evallog", evallog_address, "--dataset", str(dataset(tmp_path, 70)), "-q")
    assert code == 0, capsys.readouterr().err
    assert sum(items for items, _ in scorer.score_calls) == 140
    assert max(size for _, size in scorer.score_calls) <= SCORE_CHUNK_BYTES
    assert "VERDICT: OK" in capsys.readouterr().out


def test_eval_names_its_jobs_before_submitting_and_cancels_the_first_when_the_second_fails(request, evallog, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request, refuse="-b")
    code = sluice(monkeypatch, "--gateway", address, "eval", "--evallog", evallog[1], "--dataset", str(dataset(tmp_path)), "-q")
    err = capsys.readouterr().err
    [a_id] = gateway.jobs
    b_id = a_id.removesuffix("-a") + "-b"
    assert code == 2 and f"side B: job {b_id}" in err  # named though its SubmitJob failed
    assert gateway.cancelled == [a_id]  # B was never recorded: NOT_FOUND, nothing to cancel
    assert one_line(err) == f"sluice eval: UNAVAILABLE: the broker is away; cancelled job {a_id}"


def test_eval_cancels_both_jobs_when_the_wait_times_out(request, evallog, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request, settle=False)
    code = sluice(monkeypatch, "--gateway", address, "eval", "--evallog", evallog[1], "--dataset", str(dataset(tmp_path)), "-q", "--timeout", "0.5")
    a_id, b_id = gateway.jobs
    assert code == 2 and sorted(gateway.cancelled) == [a_id, b_id]
    assert one_line(capsys.readouterr().err) == (
        f"sluice eval: side A's job {a_id} did not finish within --timeout 0.5 s; cancelled job {a_id}, {b_id}"
    )


def test_eval_interrupted_cancels_both_jobs_and_exits_130(request, evallog, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request, settle=False)
    code, err = interrupted(gateway, "--gateway", address, "eval", "--evallog", evallog[1], "--dataset", str(dataset(tmp_path)), "-q")
    a_id, b_id = gateway.jobs
    assert code == 130 and sorted(gateway.cancelled) == [a_id, b_id]
    assert one_line(err) == f"sluice eval: interrupted; cancelled job {a_id}, {b_id}"


def test_eval_exits_2_not_1_when_it_cannot_compare_for_a_setting_or_the_output_file(request, evallog, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Exit 1 is a regression: a TLS setting that does not fit or an --output that cannot be written
    exited 1 too (the latter with a traceback)."""
    _, address = gateway_at(request)
    common = ["--gateway", address, "eval", "--evallog", evallog[1], "--dataset", str(dataset(tmp_path)), "-q"]
    code = sluice(monkeypatch, *common, "-o", str(tmp_path / "no-such-dir" / "out.jsonl"))
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"sluice eval: cannot write {tmp_path}/no-such-dir/out.jsonl: No such file or directory")
    monkeypatch.setenv("SLUICE_TLS_CERT_FILE", str(tmp_path))
    assert sluice(monkeypatch, *common) == 2
    assert one_line(capsys.readouterr().err) == "sluice eval: invalid TLS configuration: SLUICE_TLS_CERT_FILE and SLUICE_TLS_KEY_FILE go together"


# ---- sluice jobs


def test_generate_interrupted_exits_130_with_one_line(request) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request)
    code, err = interrupted(gateway, "--gateway", address, "generate", "Tell me a story")
    assert code == 130 and one_line(err) == "sluice: interrupted"


def test_jobs_submit_interrupted_names_the_job_and_how_to_get_its_results(request, tmp_path) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request, settle=False)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"custom_id": "r1", "generate": {"model": "m", "prompt": "hi"}}\n')
    code, err = interrupted(gateway, "--gateway", address, "jobs", "submit", str(rows), "--job-id", "j-7")
    assert code == 130 and err.startswith("job j-7: submitting 1 rows\n")
    assert one_line(err) == "sluice: interrupted; job j-7 runs on: `sluice jobs results j-7 -o FILE` once it is done, or `sluice jobs cancel j-7`"
    assert gateway.cancelled == []


def test_jobs_results_to_a_file_that_cannot_be_written_says_so(request, tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    gateway, address = gateway_at(request)
    gateway.jobs["j"], gateway.rows["j"] = jobs_pb2.Job(job_id="j", total_rows=1), ["r1"]
    code = sluice(monkeypatch, "--gateway", address, "jobs", "results", "j", "-o", str(tmp_path / "no-such-dir" / "out.jsonl"))
    assert code == 1
    assert one_line(capsys.readouterr().err) == f"sluice: cannot write {tmp_path}/no-such-dir/out.jsonl: No such file or directory"


# ---- sluice logs


def record(event_id: str, finished_at: float) -> evallog_pb2.Record:
    event = events_pb2.CompletionEvent(event_id=event_id, request_id=event_id, model="m", finish_reason=types_pb2.FINISH_REASON_STOP)
    event.finished_at.FromNanoseconds(int(finished_at * 1e9))
    return evallog_pb2.Record(event=event)


def test_logs_follow_prints_only_what_arrives_after_the_listing(evallog, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """-n 2 lists the newest two; the first poll printed the three older ones of its look back too."""
    servicer, address = evallog
    now = time.time()
    servicer.records += [record(f"e{i}", now - 30 + i) for i in range(1, 6)]
    threading.Timer(0.3, lambda: servicer.records.append(record("e6", time.time()))).start()
    code = sluice(monkeypatch, "logs", "--evallog", address, "-n", "2", "--follow", "--interval", "0.1", "--follow-for", "1")
    out = capsys.readouterr().out
    assert code == 0
    printed = [line.split()[-1] for line in out.splitlines() if " ms " in line]
    assert printed == ["e4", "e5", "e6"]


def test_logs_prints_a_record_of_a_finish_reason_the_cli_does_not_know(evallog, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    servicer, address = evallog
    newer = record("e-newer", time.time() - 5)
    newer.event.finish_reason = 99  # type: ignore[assignment]
    servicer.records += [record("e-known", time.time() - 10), newer]
    code = sluice(monkeypatch, "logs", "--evallog", address)
    captured = capsys.readouterr()
    assert code == 0 and "Traceback" not in captured.err
    lines = [line for line in captured.out.splitlines() if " ms " in line]
    assert [line.split()[-1] for line in lines] == ["e-known", "e-newer"]
    assert " stop " in lines[0] and " 99 " in lines[1]


class Finishing(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(self, finish_reason: int) -> None:
        self.finish_reason = finish_reason

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        yield gateway_pb2.GenerateResponse(text="Paris")
        yield gateway_pb2.GenerateResponse(
            finish_reason=self.finish_reason, request_id="req-1", usage=types_pb2.Usage(prompt_tokens=3, completion_tokens=1)
        )


@pytest.mark.parametrize(("finish_reason", "shown"), [(types_pb2.FINISH_REASON_STOP, "FINISH_REASON_STOP"), (99, "99")])
def test_generate_verbose_names_the_finish_reason_or_gives_its_number(finish_reason: int, shown: str, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GatewayServiceServicer_to_server(Finishing(finish_reason), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = sluice(monkeypatch, "--gateway", f"127.0.0.1:{port}", "generate", "-v", "Capital of France?")
    finally:
        server.stop(0)
    captured = capsys.readouterr()
    assert code == 0 and captured.out == "Paris\n" and "Traceback" not in captured.err
    assert one_line(captured.err).startswith(f"[{shown}; 3 prompt + 1 completion tokens;") and "request id req-1" in captured.err


def test_logs_refuses_a_metadata_key_given_twice(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A dict kept the last value alone, while the help says every pair must match."""
    code = sluice(monkeypatch, "logs", "--evallog", "127.0.0.1:1", "--metadata", "run=a", "--metadata", "run=b")
    assert code == 1
    assert one_line(capsys.readouterr().err) == "sluice: --metadata run is given twice ('a' and 'b'): a key has one value"


# ---- sluice health, sluice hash-key


def test_health_lists_the_job_worker_over_plaintext_whatever_the_tls_settings(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    server, address = serve(servicer)
    try:
        for variable in ("SLUICE_GATEWAY_URL", "SLUICE_ADAPTER_URL", "SLUICE_RATELIMIT_URL", "SLUICE_EVALLOG_URL", "SLUICE_TRITON_HTTP_URL"):
            monkeypatch.setenv(variable, "127.0.0.1:1")
        monkeypatch.setenv("SLUICE_GATEWAY_WORKER_URL", address)
        monkeypatch.setenv("SLUICE_TLS", "true")  # the other services' channels: the worker's health takes no TLS
        assert sluice(monkeypatch, "health") == 1  # the others are unreachable
    finally:
        server.stop(0)
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["job-worker"][1:] == [address, "SERVING"]


@pytest.mark.parametrize(("argv", "stdin"), [([], "sk-1\n"), (["-"], "sk-1\r\n"), (["sk-1"], "")])
def test_hash_key_reads_the_key_from_stdin_unless_given(argv: list[str], stdin: str, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert sluice(monkeypatch, "hash-key", *argv) == 0
    assert capsys.readouterr().out == hash_api_key("sk-1") + "\n"


def test_hash_key_with_nothing_on_stdin_says_how_to_give_it(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert sluice(monkeypatch, "hash-key") == 1
    assert one_line(capsys.readouterr().err).startswith("sluice: no API key: type it at the prompt or pipe it in")
