"""Fixtures shared by the gateway's tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice_gateway.jobs.store import JobStore


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[JobStore]:
    """A real job store on SQLite in the test's own folder."""
    job_store = JobStore.create("", tmp_path / "jobs.sqlite3")
    await job_store.open()
    yield job_store
    await job_store.close()
