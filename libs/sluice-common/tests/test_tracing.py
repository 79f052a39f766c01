"""sluice_common.tracing: off by default, configured from OTEL_*, and what its helpers carry.

Configuring installs a global tracer provider (once per process), so the tests that need tracing
on run it in a child process with the variables set, against a real OTLP/HTTP receiver."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from sluice_common import tracing


def test_off_unless_an_exporter_is_named() -> None:
    assert tracing.exporter_names({}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert tracing.exporter_names({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}) == []
    assert tracing.exporter_names({"OTEL_TRACES_EXPORTER": " OTLP, console"}) == ["otlp", "console"]


def test_while_off_the_helpers_do_nothing() -> None:
    assert not tracing.enabled()
    assert tracing.configure_tracing("svc", {}) is False
    assert tracing.client_interceptors() == []
    assert tracing.server_span("/a.B/C", (("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01"),), "peer") is None
    assert tracing.inject_headers({"x": "1"}) == {"x": "1"}
    assert tracing.extract_context({"traceparent": "x"}) is None
    with tracing.span("s") as span:
        assert span is None
    event = {"event": "hello"}
    assert tracing.add_trace_ids(None, "info", event) == {"event": "hello"}


def test_grpc_otlp_is_refused_with_what_to_do() -> None:
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(tracing.TracingConfigError, match="http/protobuf"):
        tracing.configure_tracing("svc", env)
    with pytest.raises(tracing.TracingConfigError, match="no trace exporter named 'jaeger'"):
        tracing.configure_tracing("svc", {"OTEL_TRACES_EXPORTER": "jaeger"})
    assert not tracing.enabled()


@pytest.fixture
def receiver() -> Any:
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


CHILD = textwrap.dedent(
    """
    import json, logging, sys
    from sluice_common import tracing
    from sluice_common.log import configure_logging

    assert tracing.configure_tracing("my-service")
    configure_logging("my-service", json=True)
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    span = tracing.server_span("/pkg.Svc/Call", (("traceparent", parent),), "ipv4:127.0.0.1:1")
    logging.getLogger("x").warning("inside")
    headers = tracing.inject_headers({"x-sluice-tenant": "demo"})
    with tracing.consumer_span("process q", headers) as consumer:
        consumed = consumer.get_span_context()
    tracing.end_server_span(span, "INTERNAL")
    tracing.shutdown()
    print(json.dumps({"headers": headers, "consumer_trace": format(consumed.trace_id, "032x")}))
    """
)


def test_spans_are_exported_over_otlp_http_with_the_callers_trace(receiver: Any) -> None:
    endpoint, bodies = receiver
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint}
    env.pop("OTEL_SERVICE_NAME", None)
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The log line inside the span carries its ids.
    line = next(json.loads(x) for x in done.stderr.splitlines() if '"inside"' in x)
    assert line["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736" and len(line["span_id"]) == 16
    # AMQP headers carry the current span's context; a consumer continues the same trace.
    assert out["headers"]["traceparent"] == f"00-4bf92f3577b34da6a3ce929d0e0e4736-{line['span_id']}-01"
    assert out["headers"]["x-sluice-tenant"] == "demo"
    assert out["consumer_trace"] == "4bf92f3577b34da6a3ce929d0e0e4736"

    spans = {}
    for body in bodies:
        for resource_spans in trace_service_pb2.ExportTraceServiceRequest.FromString(body).resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans[span.name] = (service, span)
    service, server = spans["pkg.Svc/Call"]
    assert service == "my-service"
    assert server.trace_id.hex() == "4bf92f3577b34da6a3ce929d0e0e4736" and server.parent_span_id.hex() == "00f067aa0ba902b7"
    assert server.kind == server.SPAN_KIND_SERVER and server.status.code == 2  # INTERNAL is the server's error
    attributes = {a.key: a.value for a in server.attributes}
    assert attributes["rpc.grpc.status_code"].int_value == 13 and attributes["rpc.method"].string_value == "Call"
    # The semantic conventions' bare address and port, not gRPC's "ipv4:127.0.0.1:1".
    assert attributes["network.peer.address"].string_value == "127.0.0.1" and attributes["network.peer.port"].int_value == 1
    _, consumer = spans["process q"]
    assert consumer.parent_span_id == server.span_id and [link.span_id for link in consumer.links] == [server.span_id]


@pytest.mark.parametrize(
    ("peer", "attributes"),
    [
        ("ipv4:10.0.0.5:43512", {"network.peer.address": "10.0.0.5", "network.peer.port": 43512}),
        ("ipv6:[::1]:50051", {"network.peer.address": "::1", "network.peer.port": 50051}),
        ("unix:/run/sluice.sock", {"network.peer.address": "/run/sluice.sock"}),
        ("", {}),
    ],
)
def test_grpc_peers_become_the_semantic_conventions_address_and_port(peer: str, attributes: dict[str, Any]) -> None:
    assert tracing.peer_attributes(peer) == attributes


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, True),
        ({"OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=prod, service.name=x"}, True),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.namespace=sluice"}, False),
    ],
)
def test_a_service_name_from_the_environment_wins_over_the_default(env: dict[str, str], named: bool) -> None:
    """Resource.create merges our default after the environment's attributes: OTEL_RESOURCE_ATTRIBUTES'
    service.name was replaced by "gateway" whatever the operator set."""
    assert tracing._names_the_service(env) is named
