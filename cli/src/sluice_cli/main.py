"""The `sluice` command: talk to a running Sluice from a terminal.

    sluice generate "Which city is the capital of France?"     tokens print as they stream
    sluice models                                         what the gateway serves
    sluice health                                         every service's health
    sluice logs [--follow]                                recent completions and a summary table
    sluice hash-key                                       the hash of an API key (read without echo) for a tenants file
    sluice diagnose [--probe N]                           where a fan-out serializes, per hop
    sluice eval --dataset rows.jsonl --model-a A --model-b B   A/B on a dataset; exit 1 on a regression

The gateway address and API key come from --gateway/--api-key or SLUICE_GATEWAY_URL/SLUICE_API_KEY;
`sluice logs` asks evaluation-logging (--evallog or SLUICE_EVALLOG_URL) with the same key (or
--tenant-key) and sees only that key's tenant.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import time
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import json_format, timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc
from sluice.gateway.v1 import gateway_pb2

from sluice_cli.client import NoAPIKey, bearer_metadata, bounded, channel, command_metadata, gateway_stub
from sluice_cli.diagnose_collect import add_diagnose_parser
from sluice_cli.eval_run import add_eval_parser
from sluice_cli.jobs import add_jobs_parser
from sluice_common.config import ConfigError
from sluice_common.finish_reasons import finish_reason_enum_name, finish_reason_name
from sluice_common.tenants import hash_api_key

DEFAULT_GATEWAY = "127.0.0.1:50051"
DEFAULT_EVALLOG = "127.0.0.1:50081"
# name -> (env var with its address, default address); the defaults are each service's config.py port.
GRPC_SERVICES = {
    "gateway": ("SLUICE_GATEWAY_URL", DEFAULT_GATEWAY),
    "inference-adapter": ("SLUICE_ADAPTER_URL", "127.0.0.1:50061"),
    "rate-limit": ("SLUICE_RATELIMIT_URL", "127.0.0.1:50071"),
    "evaluation-logging": ("SLUICE_EVALLOG_URL", DEFAULT_EVALLOG),
}
TRITON_HTTP = ("SLUICE_TRITON_HTTP_URL", "127.0.0.1:8000")
# The gateway's job worker (python -m sluice_gateway.jobs.worker): health on its WORKER_PORT,
# always plaintext (its health server takes no TLS settings).
JOB_WORKER = ("SLUICE_GATEWAY_WORKER_URL", "127.0.0.1:50052")


def _fail(error: grpc.RpcError) -> int:
    print(f"\nsluice: {error.code().name}: {error.details()}", file=sys.stderr)  # type: ignore[attr-defined]
    return 1


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = types_pb2.SamplingParams(max_tokens=args.max_tokens, stop=args.stop or [])
    if args.temperature is not None:
        sampling.temperature = args.temperature
    if args.seed is not None:
        sampling.seed = args.seed
    request = gateway_pb2.GenerateRequest(
        model=args.model,
        messages=[types_pb2.ChatMessage(role="user", content=args.prompt)],
        sampling=sampling,
    )
    started = time.perf_counter()
    first_token_at = None
    try:
        for response in gateway_stub(args).Generate(request, metadata=command_metadata(args), timeout=args.timeout):
            if response.text and first_token_at is None:
                first_token_at = time.perf_counter()
            print(response.text, end="", flush=True)
            if response.finish_reason:
                last = response
    except grpc.RpcError as error:
        return _fail(error)
    print()
    if args.verbose:
        reason = finish_reason_enum_name(last.finish_reason)
        ttft = (first_token_at - started) * 1000 if first_token_at else 0.0
        print(
            f"[{reason}; {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} completion tokens;"
            f" first token after {ttft:.0f} ms; request id {last.request_id}]",
            file=sys.stderr,
        )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    try:
        response = gateway_stub(args).ListModels(gateway_pb2.ListModelsRequest(), metadata=command_metadata(args), timeout=10)
    except grpc.RpcError as error:
        return _fail(error)
    for model in response.models:
        kind = types_pb2.ModelKind.Name(model.kind).removeprefix("MODEL_KIND_").lower()
        print(f"{model.name}\t{kind}\tcontext {model.context_length}\tmax output {model.max_output_tokens}")
    return 0


def _grpc_health(address: str, plaintext: bool = False) -> str:
    try:
        with grpc.insecure_channel(address) if plaintext else channel(address) as health_channel:
            reply = health_pb2_grpc.HealthStub(health_channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return f"UNREACHABLE ({error.code().name})"  # type: ignore[attr-defined]


def _triton_health(address: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/health/ready", timeout=3) as reply:
            return "SERVING" if reply.status == 200 else f"NOT_SERVING (HTTP {reply.status})"
    except OSError as error:
        return f"UNREACHABLE ({error})"


def _job_worker_health(address: str) -> str:
    return _grpc_health(address, plaintext=True)


def cmd_health(args: argparse.Namespace) -> int:
    rows: list[tuple[str, str, Callable[[str], str]]]
    rows = [(name, os.environ.get(env, default), _grpc_health) for name, (env, default) in GRPC_SERVICES.items()]
    rows.append(("job-worker", os.environ.get(*JOB_WORKER), _job_worker_health))
    rows.append(("triton", os.environ.get(*TRITON_HTTP), _triton_health))
    healthy = True
    for name, address, check in rows:
        status = check(address)
        healthy &= status == "SERVING"
        print(f"{name:<20}{address:<22}{status}")
    return 0 if healthy else 1


# ---- sluice logs: recent completions and a summary table, from evaluation-logging


# --since's longest window: back to 1970 and then some, never before year 1 (a timestamp's range).
MAX_SINCE_S = 100 * 365 * 86400.0


def _duration_s(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `7d` -> seconds; 0 means no limit."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            value = float(text[:-1]) * units[text[-1]]
        else:
            value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (like 90s, 15m, 2h, 7d; 0 for all)") from None
    if not 0 <= value <= MAX_SINCE_S:  # NaN fails both
        raise argparse.ArgumentTypeError(f"a duration is 0 (all) up to {MAX_SINCE_S / 86400 / 365:.0f} years: {text!r}")
    return value


_interval_s = bounded(float, lambda value: 0 < value < float("inf"), "a polling interval is a positive number of seconds")
_positive_int = bounded(int, lambda value: value >= 1, "must be a whole number >= 1")


def _stamp(epoch_s: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(epoch_s * 1e9))
    return stamp


def _epoch(stamp: timestamp_pb2.Timestamp) -> float:
    return stamp.seconds + stamp.nanos / 1e9


def record_line(record: evallog_pb2.Record) -> str:
    """One completion: when, model, outcome, latency, TTFT, tokens, failed scores, request id."""
    event = record.event
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_epoch(event.finished_at)))
    outcome = finish_reason_name(event.finish_reason) + (f"/{event.error_code}" if event.error_code else "")
    failed = [s.name for s in record.scores if not s.passed and not s.skipped]
    return (
        f"{when}  {event.model:<24} {outcome:<10} {event.timings.total_time_ms:>8.0f} ms"
        f"  ttft {event.timings.time_to_first_token_ms:>6.0f} ms"
        f"  {event.usage.prompt_tokens:>5}+{event.usage.completion_tokens:<5} tok"
        f"  {('failed: ' + ','.join(failed)) if failed else 'ok':<24}  {event.request_id}" + (f"  trace {record.trace_id}" if record.trace_id else "")
    )


def _pct(value: float) -> str:
    return f"{value * 100:.1f}%"


def summary_table(summaries: list[evallog_pb2.Summary]) -> str:
    """Per model and tenant: count, error rate, latency and TTFT percentiles, tokens; then score pass rates."""
    if not summaries:
        return "no completions in this window"
    head = (
        f"{'MODEL':<24} {'TENANT':<12} {'COUNT':>6} {'ERRORS':>7} {'CANCEL':>6}"
        f" {'LATENCY p50/p95/p99 ms':>24} {'TTFT p50/p95/p99 ms':>22} {'TOKENS IN':>10} {'TOKENS OUT':>10}"
    )
    lines = [head]
    for s in summaries:
        lat = f"{s.latency.p50_ms:.0f}/{s.latency.p95_ms:.0f}/{s.latency.p99_ms:.0f}"
        ttft = f"{s.time_to_first_token.p50_ms:.0f}/{s.time_to_first_token.p95_ms:.0f}/{s.time_to_first_token.p99_ms:.0f}"
        lines.append(
            f"{s.model:<24} {s.tenant:<12} {s.count:>6} {_pct(s.error_rate):>7} {s.cancelled_count:>6}"
            f" {lat:>24} {ttft:>22} {s.prompt_tokens:>10} {s.completion_tokens:>10}"
        )
    scores = [(s, score) for s in summaries for score in s.scores]
    if scores:
        lines += ["", f"{'MODEL':<24} {'TENANT':<12} {'SCORE':<16} {'COUNT':>6} {'PASS':>7} {'MEAN':>10} {'MIN':>10} {'MAX':>10} {'SKIPPED':>8}"]
        for s, score in scores:
            lines.append(
                f"{s.model:<24} {s.tenant:<12} {score.name:<16} {score.count:>6} {_pct(score.pass_rate):>7}"
                f" {score.mean:>10.3f} {score.min:>10.3f} {score.max:>10.3f} {score.skipped_count:>8}"
            )
    return "\n".join(lines)


def _record_json(record: evallog_pb2.Record) -> str:
    return json.dumps(json_format.MessageToDict(record, preserving_proto_field_name=True), sort_keys=True)


def metadata_pairs(pairs: list[tuple[str, str]]) -> dict[str, str]:
    """--metadata's pairs; a key given twice is refused (a completion's metadata has one value per key,
    so no completion could match both, and a dict would keep the last one alone)."""
    found: dict[str, str] = {}
    for key, value in pairs:
        if key in found:
            raise SystemExit(f"sluice: --metadata {key} is given twice ({found[key]!r} and {value!r}): a key has one value")
        found[key] = value
    return found


class _LogsClient:
    def __init__(self, args: argparse.Namespace) -> None:
        try:
            self.metadata = bearer_metadata(args.tenant_key or args.api_key, "pass --tenant-key/--api-key or set SLUICE_API_KEY")
        except NoAPIKey as missing:
            raise SystemExit(f"sluice: {missing}") from None
        self.channel = channel(args.evallog)
        self.stub = evallog_pb2_grpc.EvalLogServiceStub(self.channel)
        self.model = args.model or ""
        self.tenant = args.tenant or ""
        self.user = args.user
        self.pairs = metadata_pairs(args.metadata)

    def records(self, start: float | None, limit: int) -> list[evallog_pb2.Record]:
        """Up to `limit` records finished at or after `start`, newest first (pages through QueryRecords)."""
        found: list[evallog_pb2.Record] = []
        token = ""
        while len(found) < limit:
            request = evallog_pb2.QueryRecordsRequest(
                tenant=self.tenant,
                model=self.model,
                page_size=min(1000, limit - len(found)),
                page_token=token,
                user=self.user,
                metadata=self.pairs,
            )
            if start is not None:
                request.start_time.CopyFrom(_stamp(start))
            page = self.stub.QueryRecords(request, metadata=self.metadata, timeout=10)
            found.extend(page.records)
            token = page.next_page_token
            if not token:
                break
        return found

    def summaries(self, start: float | None) -> list[evallog_pb2.Summary]:
        request = evallog_pb2.SummarizeRequest(tenant=self.tenant, model=self.model, user=self.user, metadata=self.pairs)
        if start is not None:
            request.start_time.CopyFrom(_stamp(start))
        return list(self.stub.Summarize(request, metadata=self.metadata, timeout=30).summaries)


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def cmd_logs(args: argparse.Namespace) -> int:
    client = _LogsClient(args)
    started = time.time()
    window_start = started - args.since if args.since > 0 else None
    show = _record_json if args.json else record_line
    try:
        # Every record already in --follow's first look back is old: seeded as seen, silently, so that
        # the first poll does not print those -n left out. Read before the listing: a record stored
        # between the two reads is listed or printed by a poll, never skipped.
        old = client.records(started - _lookback_s(args), 10_000) if args.follow else []
        # QueryRecords answers newest first; printed oldest to newest so that --follow appends below.
        recent = client.records(window_start, args.limit)
        for record in reversed(recent):
            print(show(record), flush=True)
        if args.follow:
            _follow(client, args, {r.event.event_id: _epoch(r.event.finished_at) for r in (*old, *recent)}, show)
        summaries = client.summaries(window_start)
        if args.json:  # every line JSON (for jq): the records, then {"summary": ...} per model and tenant
            for summary in summaries:
                print(json.dumps({"summary": json_format.MessageToDict(summary, preserving_proto_field_name=True)}, sort_keys=True))
        else:
            print()
            print(summary_table(summaries))
    except grpc.RpcError as error:
        return _fail(error)
    except KeyboardInterrupt:
        return 130
    finally:
        client.channel.close()
    return 0


def _lookback_s(args: argparse.Namespace) -> float:
    return max(60.0, 4 * args.interval)


def _follow(client: _LogsClient, args: argparse.Namespace, seen: dict[str, float], show) -> None:  # type: ignore[no-untyped-def]
    """Polls for records not yet printed until Ctrl-C (or --follow-for seconds). Records can be stored
    a while after they finished (batching, a broker outage), so each poll looks back `lookback` seconds
    and skips the event ids it already printed (or saw before following)."""
    lookback = _lookback_s(args)
    until = time.monotonic() + args.follow_for if args.follow_for > 0 else None
    try:
        while until is None or time.monotonic() < until:
            time.sleep(args.interval)
            since = time.time() - lookback
            fresh = [r for r in client.records(since, 10_000) if r.event.event_id not in seen]
            for record in sorted(fresh, key=lambda r: (_epoch(r.event.finished_at), r.event.event_id)):
                seen[record.event.event_id] = _epoch(record.event.finished_at)
                print(show(record), flush=True)
            for event_id in [e for e, at in seen.items() if at < since - lookback]:
                del seen[event_id]
    except KeyboardInterrupt:
        pass  # the summary table still prints


def cmd_hash_key(args: argparse.Namespace) -> int:
    key = args.api_key_to_hash
    if key == "-":  # from stdin, so that the key is in neither the shell's history nor `ps`
        key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().removesuffix("\n").removesuffix("\r")
    if not key:
        raise SystemExit('sluice: no API key: type it at the prompt or pipe it in (printf %s "$KEY" | sluice hash-key)')
    print(hash_api_key(key))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Talk to a running Sluice.")
    parser.add_argument("--gateway", default=os.environ.get("SLUICE_GATEWAY_URL", DEFAULT_GATEWAY))
    parser.add_argument("--api-key", default=os.environ.get("SLUICE_API_KEY", ""))
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream a completion for a prompt")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="smollm2-135m-instruct")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append")
    generate.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    generate.add_argument("-v", "--verbose", action="store_true", help="print usage and timings at the end")
    generate.set_defaults(func=cmd_generate)

    commands.add_parser("models", help="list the models").set_defaults(func=cmd_models)
    commands.add_parser("health", help="show every service's health").set_defaults(func=cmd_health)
    logs = commands.add_parser("logs", help="recent completions and a summary table (from evaluation-logging)")
    logs.add_argument(
        "--evallog", default=os.environ.get("SLUICE_EVALLOG_URL", DEFAULT_EVALLOG), help="evaluation-logging's gRPC address (SLUICE_EVALLOG_URL)"
    )
    logs.add_argument("--tenant-key", default="", help="API key of the tenant to read (default: --api-key / SLUICE_API_KEY)")
    logs.add_argument("--tenant", default="", help="tenant name (default: the key's own; another tenant is refused)")
    logs.add_argument("--model", default="", help="only this model")
    logs.add_argument("--user", default="", help="only completions whose request had this OpenAI `user`")
    logs.add_argument("--metadata", type=_pair, action="append", default=[], metavar="KEY=VALUE",
                      help="only completions whose request's metadata has KEY=VALUE (repeatable: all must match)")  # fmt: skip
    logs.add_argument("-n", "--limit", type=_positive_int, default=20, help="how many recent completions to list (default 20)")
    logs.add_argument(
        "--since", type=_duration_s, default=3600.0, help="window for the list and the summary, like 90s, 15m, 2h, 7d; 0 for all (default 1h)"
    )
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new completions until Ctrl-C")
    logs.add_argument("--interval", type=_interval_s, default=1.0, help="--follow polling interval in seconds (default 1)")
    logs.add_argument("--follow-for", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: stop following after N s
    logs.add_argument("--json", action="store_true", help='one JSON object per line: each completion, then each summary as {"summary": ...}')
    logs.set_defaults(func=cmd_logs)
    add_jobs_parser(commands)
    add_diagnose_parser(commands)
    add_eval_parser(commands)
    hash_key = commands.add_parser("hash-key", help="print the SHA-256 of an API key for a tenants file")
    hash_key.add_argument(
        "api_key_to_hash", nargs="?", default="-", metavar="KEY", help="default (or -): read from stdin, without echo at a terminal; prefer it"
    )
    hash_key.set_defaults(func=cmd_hash_key)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    try:
        code = args.func(args)
    except ConfigError as invalid:  # SLUICE_TLS_* that do not fit (client.tls_from_env)
        raise SystemExit(f"sluice: {invalid}") from None
    except KeyboardInterrupt:  # Ctrl-C where the command has nothing of its own to say
        print("\nsluice: interrupted", file=sys.stderr)
        code = 130
    raise SystemExit(code)


if __name__ == "__main__":
    main()
