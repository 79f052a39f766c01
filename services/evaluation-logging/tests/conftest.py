"""Fixtures on real infrastructure: SQLite files, the running PostgreSQL, the running RabbitMQ."""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from google.protobuf import timestamp_pb2
from sluice.common.v1 import types_pb2
from sluice.evallog.v1 import events_pb2

from sluice_evaluation_logging.store import PostgresStore, SqliteStore, Store

PG_DSN = os.environ.get("SLUICE_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")
AMQP_URL = os.environ.get("SLUICE_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def make_event(tenant: str = "demo", output: str = "Paris is the capital of France.", **fields: object) -> events_pb2.CompletionEvent:
    now = time.time()
    finished = timestamp_pb2.Timestamp()
    finished.FromNanoseconds(int(fields.pop("finished_at", now) * 1e9))  # type: ignore[operator]
    event = events_pb2.CompletionEvent(
        event_id=str(fields.pop("event_id", uuid.uuid4().hex)),
        request_id=uuid.uuid4().hex,
        tenant=tenant,
        model=str(fields.pop("model", "smollm2-135m-instruct")),
        messages=[types_pb2.ChatMessage(role="user", content="What is the capital of France?")],
        output=output,
        text_logged=True,
        sampling=types_pb2.SamplingParams(max_tokens=32),
        finish_reason=types_pb2.FINISH_REASON_STOP,
        usage=types_pb2.Usage(prompt_tokens=12, completion_tokens=8, total_tokens=20),
        timings=types_pb2.Timings(time_to_first_token_ms=120.0, total_time_ms=600.0, mean_inter_token_ms=60.0),
        finished_at=finished,
        started_at=finished,
    )
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(event, name).extend(value)
        elif isinstance(value, dict):  # a map field
            getattr(event, name).update(value)
        elif hasattr(value, "CopyFrom"):
            getattr(event, name).CopyFrom(value)
        else:
            setattr(event, name, value)
    return event


@pytest.fixture(params=["sqlite", "postgresql"])
async def store(request: pytest.FixtureRequest, tmp_path) -> AsyncIterator[Store]:  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        opened: Store = SqliteStore(tmp_path / "evallog.sqlite3")
        await opened.open()
        yield opened
        await opened.close()
        return
    schema = f"evallog_test_{uuid.uuid4().hex[:10]}"
    opened = PostgresStore(PG_DSN, schema)
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()
        connection = await asyncpg.connect(PG_DSN)
        await connection.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await connection.close()


_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an which model answer data server "
    "request token batch latency capital city river population history customer order account invoice support"
).split()


def realistic_output(size: int, seed: int, contacts: bool = True) -> str:
    """A chatbot-like answer of about `size` characters: prose with sentences and numbers and, with
    `contacts`, the occasional phone number, email and card number (what pii scans for)."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        roll = rng.random()
        if roll < 0.03:
            word = str(rng.randint(1, 99_999))
        elif contacts and roll < 0.035:
            word = f"+1 415-555-{rng.randint(0, 9999):04d}"
        elif contacts and roll < 0.037:
            word = f"support{rng.randint(0, 99)}@example.com"
        elif contacts and roll < 0.038:
            word = "4111 1111 1111 1111"
        else:
            word = rng.choice(_WORDS)
        if rng.random() < 0.07:
            word += "."
        words.append(word)
        length += len(word) + 1
    return " ".join(words)
