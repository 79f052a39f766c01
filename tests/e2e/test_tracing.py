"""Traces end to end: the shared stack exports OTLP/HTTP to a receiver started by the test session
(conftest's otlp_receiver), which decodes the real protobuf. The stack samples only requests that
bring a sampled W3C `traceparent`, so each test here starts its own trace and finds it whole."""

from __future__ import annotations

import asyncio
import json
import secrets
import urllib.request
import uuid
from typing import Any

import aio_pika
import grpc
from sluice.evallog.v1 import evallog_pb2, evallog_pb2_grpc

from conftest import auth, chat
from otlp_receiver import OtlpReceiver, ReceivedSpan
from sluice_stack import Stack
from test_jobs import gen_row, wait_job

SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # opentelemetry.proto.trace.v1.Span.SpanKind


def new_traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{len(found)} spans {name!r} of {service}: {sorted((s.service, s.name) for s in spans)}"
    return found[0]


def rpc(spans: list[ReceivedSpan], service: str, kind: int, method: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.service == service and s.kind == kind and s.attributes.get("rpc.method") == method]


def test_a_streamed_chat_with_a_traceparent_is_one_trace_across_every_service(stack: Stack, gateway: Any, otlp_receiver: OtlpReceiver) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    chunks = list(gateway.Generate(chat("Name a colour.", max_tokens=6), metadata=(*auth(), ("traceparent", traceparent)), timeout=60))
    usage = chunks[-1].usage

    def complete(spans: list[ReceivedSpan]) -> bool:
        # Each service exports in batches of its own, so wait for every span asserted on below: the
        # gateway's server span ends last (after the stream's last message) and may come in a later batch.
        services = {s.service for s in spans}
        return (
            {"gateway", "rate-limit", "inference-adapter", "evaluation-logging"} <= services
            and any(s.name == "triton.step_round" for s in spans)
            and len(rpc(spans, "rate-limit", SERVER, "Commit")) == 1
            and len(rpc(spans, "gateway", SERVER, "Generate")) == 1
            and any(s.service == "gateway" and s.kind == PRODUCER for s in spans)
            and any(s.service == "evaluation-logging" and s.kind == CONSUMER for s in spans)
        )

    spans = otlp_receiver.wait_for(trace_id, complete)
    by_id = {s.span_id: s for s in spans}

    # The gateway's server span continues the client's trace; authentication and the generation are its children.
    (server,) = rpc(spans, "gateway", SERVER, "Generate")
    assert server.parent_span_id == parent_id
    assert one(spans, "gateway", "sluice.authenticate").parent_span_id == server.span_id
    generation = one(spans, "gateway", "chat smollm2-135m-instruct")
    assert generation.parent_span_id == server.span_id
    assert generation.attributes["gen_ai.operation.name"] == "chat"
    assert generation.attributes["gen_ai.request.model"] == "smollm2-135m-instruct"
    assert generation.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens > 0
    assert generation.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens == 6
    assert generation.attributes["gen_ai.response.finish_reasons"] == ["length"]

    # Rate-limit's Acquire and Commit: the gateway's CLIENT spans under the generation, rate-limit's SERVER spans under them.
    for method in ("Acquire", "Commit"):
        (call,) = rpc(spans, "gateway", CLIENT, method)
        (served,) = rpc(spans, "rate-limit", SERVER, method)
        assert call.parent_span_id == generation.span_id and served.parent_span_id == call.span_id

    # The adapter: its Generate under the gateway's call, the sequence under it, its queue wait, its steps.
    (adapter_call,) = rpc(spans, "gateway", CLIENT, "Generate")
    assert adapter_call.parent_span_id == generation.span_id
    (adapter_server,) = rpc(spans, "inference-adapter", SERVER, "Generate")
    assert adapter_server.parent_span_id == adapter_call.span_id
    sequence = one(spans, "inference-adapter", "sluice.adapter.sequence")
    assert sequence.parent_span_id == adapter_server.span_id
    assert one(spans, "inference-adapter", "sluice.adapter.queue_wait").parent_span_id == sequence.span_id
    steps = [attributes for name, attributes in sequence.events if name == "engine.step"]
    assert len(steps) >= usage.completion_tokens  # one event per engine step, not a span per token
    assert steps[-1]["sluice.step.completion_tokens"] == usage.completion_tokens
    assert sequence.attributes["gen_ai.usage.output_tokens"] == usage.completion_tokens
    rounds = [s for s in spans if s.name == "triton.step_round"]
    assert rounds and all(r.parent_span_id == sequence.span_id and r.kind == CLIENT for r in rounds)

    # The broker hop: the gateway's publish span under the generation, evaluation-logging's process span
    # its child and linked to it.
    publish = next(s for s in spans if s.service == "gateway" and s.kind == PRODUCER)
    assert publish.parent_span_id == generation.span_id
    (process,) = [s for s in spans if s.service == "evaluation-logging" and s.kind == CONSUMER]
    assert process.parent_span_id == publish.span_id
    assert (trace_id, publish.span_id) in process.links
    assert process.attributes["sluice.evallog.stored"] is True
    # Every span's parent is in the trace, but for the gateway's (the client's span, not exported).
    assert all(s.parent_span_id in by_id for s in spans if s is not server)

    # The stored record shows the trace id, and the query API returns it.
    request_id = chunks[0].request_id
    with grpc.insecure_channel(stack.evallog_address) as channel:
        evallog = evallog_pb2_grpc.EvalLogServiceStub(channel)
        page = evallog.QueryRecords(evallog_pb2.QueryRecordsRequest(page_size=1000), metadata=auth(), timeout=10)
        (record,) = [r for r in page.records if r.event.request_id == request_id]
    assert record.trace_id == trace_id


async def _publish_job(stack: Stack, job: dict[str, Any], traceparent: str) -> None:
    connection = await aio_pika.connect(stack.amqp_url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(f"{stack.amqp_prefix}.jobs")
        await exchange.publish(
            aio_pika.Message(
                json.dumps(job).encode(),
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={"traceparent": traceparent},
            ),
            routing_key="job",
        )


def test_a_job_of_three_rows_is_one_trace_with_a_span_per_row(stack: Stack, gateway: Any, otlp_receiver: OtlpReceiver) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    job_id = f"trace-{uuid.uuid4().hex[:8]}"
    rows = [gen_row(f"r{i}") for i in range(3)]
    asyncio.run(_publish_job(stack, {"job_id": job_id, "api_key": "sk-sluice-demo", "rows": rows}, traceparent))
    assert wait_job(gateway, job_id).completed_rows == 3

    def complete(spans: list[ReceivedSpan]) -> bool:
        return (
            sum(1 for s in spans if s.name == "sluice.job.row") == 3
            and sum(1 for s in spans if s.name == "chat smollm2-135m-instruct") == 3
            and any(s.service == "gateway-worker" and s.kind == CONSUMER for s in spans)  # ends last, may come in a later batch
        )

    spans = otlp_receiver.wait_for(trace_id, complete)
    (job,) = [s for s in spans if s.service == "gateway-worker" and s.kind == CONSUMER and s.name.startswith("process ")]
    assert job.parent_span_id == parent_id
    row_spans = [s for s in spans if s.name == "sluice.job.row"]
    assert sorted(s.attributes["sluice.custom_id"] for s in row_spans) == ["r0", "r1", "r2"]
    assert all(s.parent_span_id == job.span_id and s.attributes["sluice.job_id"] == job_id for s in row_spans)
    for row in row_spans:
        attempts = sorted(
            (s for s in spans if s.name == "sluice.job.row_attempt" and s.parent_span_id == row.span_id),
            key=lambda s: s.attributes["sluice.attempt"],
        )
        assert attempts and [a.attributes["sluice.attempt"] for a in attempts] == list(range(1, len(attempts) + 1))
        # Every attempt but the last failed (a retry shows as an attempt in error before the next).
        assert all(a.status_code == 2 for a in attempts[:-1]) and attempts[-1].status_code != 2
        generations = [s for s in spans if s.name == "chat smollm2-135m-instruct" and s.parent_span_id == attempts[-1].span_id]
        assert len(generations) == 1 and generations[0].attributes["sluice.custom_id"] == row.attributes["sluice.custom_id"]


def test_the_http_front_honours_a_traceparent_header(stack: Stack, otlp_receiver: OtlpReceiver) -> None:
    traceparent, trace_id, parent_id = new_traceparent()
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    request = urllib.request.Request(
        f"{stack.openai_base_url}/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer sk-sluice-demo", "traceparent": traceparent},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert b"[DONE]" in reply.read()
    spans = otlp_receiver.wait_for(
        trace_id,
        lambda spans: any(s.name == "chat smollm2-135m-instruct" and "gen_ai.usage.output_tokens" in s.attributes for s in spans)
        and any(s.service == "gateway" and s.kind == SERVER for s in spans),
    )
    (http,) = [s for s in spans if s.service == "gateway" and s.kind == SERVER]
    assert http.parent_span_id == parent_id
    generation = one(spans, "gateway", "chat smollm2-135m-instruct")
    assert generation.attributes["gen_ai.usage.output_tokens"] == 3
    # The generation is in the HTTP request's span (directly, or under authentication's sibling).
    by_id = {s.span_id: s for s in spans}
    ancestor = generation
    while ancestor.parent_span_id in by_id and ancestor is not http:
        ancestor = by_id[ancestor.parent_span_id]
    assert ancestor is http
