"""The `sluice` command: talk to a running Sluice from a terminal.

    sluice generate "What is the capital of France?"     tokens print as they stream
    sluice models                                         what the gateway serves
    sluice health                                         every service's health
    sluice hash-key <api key>                             the hash to put in a tenants file

The gateway address and API key come from --gateway/--api-key or SLUICE_GATEWAY_URL/SLUICE_API_KEY.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_gateway.tenants import hash_api_key

DEFAULT_GATEWAY = "127.0.0.1:50051"
# name -> (env var with its address, default address)
GRPC_SERVICES = {
    "gateway": ("SLUICE_GATEWAY_URL", DEFAULT_GATEWAY),
    "inference-adapter": ("SLUICE_ADAPTER_URL", "127.0.0.1:50061"),
}
TRITON_HTTP = ("SLUICE_TRITON_HTTP_URL", "127.0.0.1:8000")


def _gateway_stub(args: argparse.Namespace) -> gateway_pb2_grpc.GatewayServiceStub:
    return gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(args.gateway))


def _metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    if not args.api_key:
        raise SystemExit("sluice: no API key: pass --api-key or set SLUICE_API_KEY")
    return (("authorization", f"Bearer {args.api_key}"),)


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
        for response in _gateway_stub(args).Generate(request, metadata=_metadata(args), timeout=args.timeout):
            if response.text and first_token_at is None:
                first_token_at = time.perf_counter()
            print(response.text, end="", flush=True)
            if response.finish_reason:
                last = response
    except grpc.RpcError as error:
        return _fail(error)
    print()
    if args.verbose:
        reason = types_pb2.FinishReason.Name(last.finish_reason)
        ttft = (first_token_at - started) * 1000 if first_token_at else 0.0
        print(
            f"[{reason}; {last.usage.prompt_tokens} prompt + {last.usage.completion_tokens} completion tokens;"
            f" first token after {ttft:.0f} ms; request id {last.request_id}]",
            file=sys.stderr,
        )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    try:
        response = _gateway_stub(args).ListModels(gateway_pb2.ListModelsRequest(), metadata=_metadata(args), timeout=10)
    except grpc.RpcError as error:
        return _fail(error)
    for model in response.models:
        kind = types_pb2.ModelKind.Name(model.kind).removeprefix("MODEL_KIND_").lower()
        print(f"{model.name}\t{kind}\tcontext {model.context_length}\tmax output {model.max_output_tokens}")
    return 0


def _grpc_health(address: str) -> str:
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as error:
        return f"UNREACHABLE ({error.code().name})"  # type: ignore[attr-defined]


def _triton_health(address: str) -> str:
    try:
        with urllib.request.urlopen(f"http://{address}/v2/health/ready", timeout=3) as reply:
            return "SERVING" if reply.status == 200 else f"NOT_SERVING (HTTP {reply.status})"
    except OSError as error:
        return f"UNREACHABLE ({error})"


def cmd_health(args: argparse.Namespace) -> int:
    rows = [(name, os.environ.get(env, default), _grpc_health) for name, (env, default) in GRPC_SERVICES.items()]
    rows.append(("triton", os.environ.get(*TRITON_HTTP), _triton_health))
    healthy = True
    for name, address, check in rows:
        status = check(address)
        healthy &= status == "SERVING"
        print(f"{name:<20}{address:<22}{status}")
    return 0 if healthy else 1


def cmd_hash_key(args: argparse.Namespace) -> int:
    print(hash_api_key(args.api_key_to_hash))
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
    hash_key = commands.add_parser("hash-key", help="print the SHA-256 of an API key for a tenants file")
    hash_key.add_argument("api_key_to_hash")
    hash_key.set_defaults(func=cmd_hash_key)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    raise SystemExit(args.func(args))


if __name__ == "__main__":
    main()
