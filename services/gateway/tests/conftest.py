"""Fixtures shared by the gateway's tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from sluice.inference.v1 import inference_pb2_grpc

from sluice_gateway.jobs.store import JobStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobStore]:
    """A real job store on SQLite in the test's own folder."""
    job_store = JobStore.create("", tmp_path / "jobs.sqlite3")
    await job_store.open()
    yield job_store
    await job_store.close()


@contextlib.asynccontextmanager
async def adapter_stub(servicer: inference_pb2_grpc.InferenceServiceServicer) -> AsyncIterator[inference_pb2_grpc.InferenceServiceStub]:
    """A stand-in adapter served over real gRPC on a free port, and a stub of it."""
    server = grpc.aio.server()
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield inference_pb2_grpc.InferenceServiceStub(channel)
    finally:
        await channel.close()
        await server.stop(None)
