"""The trace id an event message's headers name, whatever those headers hold."""

from __future__ import annotations

from sluice_evaluation_logging.event_tracing import trace_id_of

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_trace_id_comes_from_a_valid_traceparent_as_text_or_bytes() -> None:
    assert trace_id_of({"traceparent": TRACEPARENT}) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace_id_of({"traceparent": TRACEPARENT.encode()}) == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_a_header_that_is_not_utf8_or_not_a_trace_context_names_no_trace() -> None:
    # The AMQP client hands a header that is not UTF-8 over as bytes: decoding it strictly failed
    # the consumer's batch on every delivery of the message, and every event behind it waited.
    assert trace_id_of({"traceparent": b"\xff\xfe-not-utf8"}) == ""
    assert trace_id_of({"traceparent": "not a trace context"}) == ""
    assert trace_id_of({}) == "" and trace_id_of(None) == ""
