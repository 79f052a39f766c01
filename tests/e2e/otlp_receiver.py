"""An OTLP/HTTP trace receiver for the end-to-end tests: what the services export, decoded.

It takes `POST /v1/traces` as a real collector does (an `ExportTraceServiceRequest` in protobuf,
gzip or not, answered with an `ExportTraceServiceResponse`), and keeps every span with the
`service.name` of the resource that exported it. Nothing is mocked on the services' side: they
run their own OpenTelemetry SDK and OTLP exporter, pointed here by OTEL_EXPORTER_OTLP_ENDPOINT.
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]
    links: list[tuple[str, str]]  # (trace id, span id)
    status_code: int
    start_ns: int
    end_ns: int

    @classmethod
    def of(cls, service: str, span: trace_pb2.Span) -> ReceivedSpan:
        return cls(
            service=service,
            trace_id=span.trace_id.hex(),
            span_id=span.span_id.hex(),
            parent_span_id=span.parent_span_id.hex(),
            name=span.name,
            kind=span.kind,
            attributes={a.key: _value(a.value) for a in span.attributes},
            events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in span.events],
            links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
            status_code=span.status.code,
            start_ns=span.start_time_unix_nano,
            end_ns=span.end_time_unix_nano,
        )


@dataclass
class OtlpReceiver:
    server: ThreadingHTTPServer
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, body: bytes) -> None:
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                received += [ReceivedSpan.of(service, span) for span in scope_spans.spans]
        with self.lock:
            self.spans += received
            self.requests += 1

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done: Any, timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The trace's spans once `done(spans)` holds; fails with what came after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id} incomplete after {timeout_s}s: {sorted((s.service, s.name) for s in spans)}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_receiver() -> OtlpReceiver:
    receiver: OtlpReceiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(body)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    receiver = OtlpReceiver(server)
    threading.Thread(target=server.serve_forever, daemon=True, name="otlp-receiver").start()
    return receiver


def tracing_env(endpoint: str) -> dict[str, str]:
    """What the shared stack's services run with: OTLP/HTTP to the receiver, and only the requests
    that come with a sampled `traceparent` recorded (parentbased_always_off), so the other tests'
    traffic makes no spans to export."""
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_SAMPLER": "parentbased_always_off",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
