"""`make run`: start the suite, stream one demo completion, serve until Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time

import grpc
from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from sluice_stack.keeper import ServiceKeeper
from sluice_stack.launcher import REPO_ROOT, VARIANT_MODEL, ServiceProcess, Stack, StartupError
from sluice_stack.rabbitmq import AMQP_URL_ENV, ensure_rabbitmq

DEMO_KEY = "sk-sluice-demo"
DEMO_QUESTION = "Which city is the capital of France?"
MODEL = "smollm2-135m-instruct"


def say(message: str) -> None:
    try:
        print(f"\033[1m[sluice]\033[0m {message}" if sys.stdout.isatty() else f"[sluice] {message}", flush=True)
    except OSError:  # the terminal is gone (SIGHUP): the stop goes on without a word
        pass


def stream_demo(gateway: str) -> None:
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gateway))
    request = gateway_pb2.GenerateRequest(
        model=MODEL,
        messages=[types_pb2.ChatMessage(role="user", content=DEMO_QUESTION)],
        sampling=types_pb2.SamplingParams(max_tokens=48),
    )
    say(f"demo: {DEMO_QUESTION!r} streamed through the gateway, token by token:")
    started = time.perf_counter()
    arrivals = []
    for response in stub.Generate(request, metadata=(("authorization", f"Bearer {DEMO_KEY}"),), timeout=120):
        if response.text:
            arrivals.append(time.perf_counter() - started)
            print(response.text, end="", flush=True)
        if response.finish_reason:
            final = response
    print(flush=True)
    say(
        f"{len(arrivals)} chunks; first after {arrivals[0] * 1000:.0f} ms, last after {arrivals[-1] * 1000:.0f} ms;"
        f" finish {types_pb2.FinishReason.Name(final.finish_reason)}; usage {final.usage.prompt_tokens}+"
        f"{final.usage.completion_tokens} tokens"
    )


def usage_text(stack: Stack) -> str:
    sluice = REPO_ROOT / "bin" / "sluice"
    return f"""
Sluice is up. Logs are in {stack.run_dir}/. Call it:
  {sluice} generate "Write a haiku about rivers"        (SLUICE_API_KEY={DEMO_KEY} is the demo key)
  {sluice} health
  {sluice} eval --dataset rows.jsonl --model-b {VARIANT_MODEL}   (A/B vs the Q4_0 variant; docs/operators/ab-evaluation.md)
  grpcurl -plaintext -H 'authorization: Bearer {DEMO_KEY}' -d '{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"sampling":{{"max_tokens":32}}}}' {stack.gateway_address} sluice.gateway.v1.GatewayService/Generate
OpenAI-compatible API: {stack.openai_base_url}  (openai.OpenAI(base_url="{stack.openai_base_url}", api_key="{DEMO_KEY}"))
Metrics: {stack.metrics_url("gateway")}  {stack.metrics_url("inference-adapter")}  {stack.metrics_url("triton-local")}
Press Ctrl-C to stop everything."""


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    run_dir = REPO_ROOT / ".run"
    try:
        say(ensure_rabbitmq(os.environ.get(AMQP_URL_ENV)))  # the broker Stack hands the services
    except RuntimeError as exc:
        say(f"warning: {exc}")
    stack = Stack(run_dir=run_dir)
    # A closed terminal (SIGHUP) stops the suite as Ctrl-C and SIGTERM do. A death that runs no
    # handler (SIGKILL) is the services' lifeline's to notice (sluice_stack.launcher).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)

    def announce(service: ServiceProcess) -> None:
        say(f"{service.name} ready (log: {service.log_path})")

    try:
        say(
            "starting triton-local (loads SmolLM2 and MiniLM and warms them up; ~20-60 s), inference-adapter,"
            " evaluation-logging, rate-limit, gateway and its job worker ..."
        )
        stack.start(on_ready=announce)
        stream_demo(stack.gateway_address)
        say(usage_text(stack))
        keeper = ServiceKeeper(stack.services, say)
        while True:  # like a cluster: a service that exits is started again, the rest keep serving
            keeper.poll()
            time.sleep(1)
    except StartupError as exc:
        say(f"startup failed: {exc}")
        return 1
    except KeyboardInterrupt:
        say("stopping ...")
        return 0
    finally:
        try:
            stack.stop()  # every tier, even when a second Ctrl-C lands meanwhile (it cuts their drains)
        except KeyboardInterrupt:
            pass
        say("all services stopped")


if __name__ == "__main__":
    raise SystemExit(main())
