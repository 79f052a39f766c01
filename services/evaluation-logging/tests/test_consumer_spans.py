"""The consumer's per-message CONSUMER spans end however the batch ends: stored and acked
(`sluice.evallog.stored` true), or not (false, in error) when evaluation, the store or the ack
fails, or the session ends under it. Only a successful commit used to end them: a failed batch's
spans stayed open for good (never exported, held in memory)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from conftest import make_event
from sluice_common import tracing
from sluice_common.amqp import EventTopology
from sluice_evaluation_logging import consumer as consumer_module
from sluice_evaluation_logging.consumer import CompletionConsumer, ConsumerSettings
from sluice_evaluation_logging.evaluators.base import EvalContext, EvalSettings
from sluice_evaluation_logging.model import RecordRow


class _Message:
    """What the consumer reads of an aio_pika delivery."""

    def __init__(self, ack_error: BaseException | None = None) -> None:
        event = make_event()
        self.body = event.SerializeToString()
        self.content_type = "application/x-protobuf"
        self.message_id = event.event_id
        self.headers: dict[str, Any] = {}
        self.redelivered = False
        self.acked = False
        self._ack_error = ack_error

    async def ack(self, multiple: bool = False) -> None:
        if self._ack_error is not None:
            raise self._ack_error
        self.acked = True


class _Store:
    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error

    async def insert_batch(self, rows: list[RecordRow]) -> int:
        if self.error is not None:
            raise self.error
        return len(rows)


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_enabled", True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("sluice"))
    return exporter


def _consumer(store: _Store) -> CompletionConsumer:
    settings = ConsumerSettings("amqp://unused/", EventTopology("sluice-unit-spans"))
    return CompletionConsumer(settings, store, EvalContext(EvalSettings(similarity_sample_rate=0.0)))  # type: ignore[arg-type]


def _ended(exporter: InMemorySpanExporter) -> list[tuple[bool, str | None]]:
    return [(span.attributes["sluice.evallog.stored"], span.attributes.get("error.type")) for span in exporter.get_finished_spans()]


async def _handle_and_commit(consumer: CompletionConsumer, batch: list[_Message]) -> None:
    await consumer._handle(batch, dead=None)  # type: ignore[arg-type]
    await consumer._settle_commit()


async def test_a_stored_and_acked_batch_ends_its_spans_stored(exported: InMemorySpanExporter) -> None:
    batch = [_Message(), _Message()]
    await _handle_and_commit(_consumer(_Store()), batch)  # type: ignore[arg-type]
    assert _ended(exported) == [(True, None), (True, None)] and batch[-1].acked
    assert all(span.status.is_unset for span in exported.get_finished_spans())


async def test_a_batch_whose_evaluation_fails_ends_its_spans_not_stored(exported: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(consumer_module, "evaluate_batch", broken)
    with pytest.raises(RuntimeError):
        await _handle_and_commit(_consumer(_Store()), [_Message(), _Message()])  # type: ignore[arg-type]
    assert _ended(exported) == [(False, "RuntimeError"), (False, "RuntimeError")]
    assert all(not span.status.is_ok and not span.status.is_unset for span in exported.get_finished_spans())


async def test_a_batch_the_store_or_the_ack_fails_ends_its_spans_not_stored(exported: InMemorySpanExporter) -> None:
    # The store down while the service stops (it gives up then, the batch unacked).
    consumer = _consumer(_Store(ConnectionError("database down")))
    consumer._stopping.set()
    with pytest.raises(ConnectionError):
        await _handle_and_commit(consumer, [_Message()])  # type: ignore[arg-type]
    assert _ended(exported) == [(False, "ConnectionError")]
    exported.clear()
    # The ack on a channel that closed meanwhile (the session is then rebuilt).
    with pytest.raises(ConnectionResetError):
        await _handle_and_commit(_consumer(_Store()), [_Message(), _Message(ConnectionResetError("channel closed"))])  # type: ignore[arg-type]
    assert _ended(exported) == [(False, "ConnectionResetError"), (False, "ConnectionResetError")]


async def test_a_batch_behind_a_failed_commit_and_a_cancelled_commit_end_their_spans(exported: InMemorySpanExporter) -> None:
    """The session ends when the previous batch's commit failed: the next batch, evaluated meanwhile,
    is not stored in it. A commit cancelled before it ran (the service stopping) ends its spans too."""
    store = _Store()
    consumer = _consumer(store)
    await consumer._handle([_Message(ConnectionResetError("channel closed"))], dead=None)  # type: ignore[arg-type]
    with pytest.raises(ConnectionResetError):
        await consumer._handle([_Message(), _Message()], dead=None)  # type: ignore[arg-type]
    assert sorted(_ended(exported)) == [(False, "ConnectionResetError")] * 3
    exported.clear()
    await consumer._handle([_Message()], dead=None)  # type: ignore[arg-type]
    assert consumer._committing is not None
    committing = consumer._committing
    committing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await committing
    await asyncio.sleep(0)  # its done callbacks
    assert _ended(exported) == [(False, "CancelledError")]


def test_every_event_outcome_is_exported_at_0_from_the_start() -> None:
    """increase() over a series born at 1 is 0: the first dead-lettering after a restart did not
    fire SluiceEventsDeadLettered. Read in a fresh process: here other tests have counted already."""
    script = (
        "from prometheus_client import REGISTRY\n"
        "import sluice_evaluation_logging.consumer\n"
        "for outcome in ('stored', 'duplicate', 'dead_lettered'):\n"
        "    print(outcome, REGISTRY.get_sample_value('sluice_evallog_events_total', {'outcome': outcome}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60).stdout
    assert out.split("\n")[:3] == ["stored 0.0", "duplicate 0.0", "dead_lettered 0.0"]
