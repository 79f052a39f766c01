"""The lifeline: a service stops with the launcher that started it (SLUICE_LIFELINE_FD), and one
started without it runs as before."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice_common.bootstrap import LIFELINE_FD_ENV, LIFELINE_KILL_AFTER_ENV, watch_lifeline

# A service's shape: drains on SIGTERM (or ignores it: IGNORE_SIGTERM), says when it is ready.
PROBE_MODULE = """
import asyncio, os, signal, sys

async def main(_config=None):
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    if os.environ.get("IGNORE_SIGTERM"):
        loop.add_signal_handler(signal.SIGTERM, lambda: None)
    else:
        loop.add_signal_handler(signal.SIGTERM, stopping.set)
    print("ready", __name__, sys.argv, flush=True)
    await stopping.wait()
    print("drained", flush=True)

if __name__ == "__main__":
    asyncio.run(main())
"""

# The same through run_service, started as `python -c` (no runner): the hook is run_service's own.
PROBE_SERVICE = """
from sluice_common.bootstrap import run_service
from sluice_common.config import ServiceConfig
from probe_service import main
run_service("probe", ServiceConfig, "SLUICE_PROBE_", main)
"""


@pytest.fixture()
def probe_dir(tmp_path: Path) -> Path:
    (tmp_path / "probe_service.py").write_text(textwrap.dedent(PROBE_MODULE))
    return tmp_path


@pytest.fixture()
def lifeline() -> Iterator[tuple[int, int]]:
    read_end, write_end = os.pipe()
    yield read_end, write_end
    for fd in (read_end, write_end):
        try:
            os.close(fd)
        except OSError:
            pass


def start(command: list[str], cwd: Path, read_end: int | None, **env: str) -> tuple[subprocess.Popen[str], str]:
    """The process, and its "ready" line."""
    tie = {} if read_end is None else {LIFELINE_FD_ENV: str(read_end)}
    environ = {k: v for k, v in os.environ.items() if k not in (LIFELINE_FD_ENV, LIFELINE_KILL_AFTER_ENV)}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**environ, "PYTHONPATH": str(cwd), **tie, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        pass_fds=() if read_end is None else (read_end,),
        start_new_session=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line.startswith("ready"), line + process.stdout.read()
    return process, line


def finish(process: subprocess.Popen[str], timeout_s: float = 20) -> tuple[int, str]:
    try:
        output, _ = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode, output


def test_without_the_variable_nothing_is_watched() -> None:
    environ = {"OTHER": "1"}
    assert watch_lifeline(environ) is None
    assert environ == {"OTHER": "1"}


def test_a_bad_descriptor_is_reported_not_watched(capsys: pytest.CaptureFixture[str]) -> None:
    environ = {LIFELINE_FD_ENV: "not-a-number"}
    assert watch_lifeline(environ) is None
    assert environ == {}  # taken out: a second call, and the service's children, see none
    assert LIFELINE_FD_ENV in capsys.readouterr().err


def test_the_runner_runs_the_module_as_python_m_and_drains_when_the_lifeline_closes(probe_dir: Path, lifeline: tuple[int, int]) -> None:
    read_end, write_end = lifeline
    process, ready = start([sys.executable, "-m", "sluice_common.bootstrap", "probe_service", "--flag"], probe_dir, read_end)
    os.close(read_end)
    time.sleep(0.5)
    assert process.poll() is None  # an open lifeline keeps it serving
    os.close(write_end)  # the launcher dies
    code, output = finish(process)
    assert code == 0 and "drained" in output and "lifeline_closed" in output, output
    # argv and __name__ as under `python -m probe_service --flag`
    assert ready.split(" ", 2)[1:] == ["__main__", f"[{str(probe_dir / 'probe_service.py')!r}, '--flag']\n"], ready


def test_run_service_watches_the_lifeline_itself(probe_dir: Path, lifeline: tuple[int, int]) -> None:
    read_end, write_end = lifeline
    process, _ = start([sys.executable, "-c", PROBE_SERVICE], probe_dir, read_end, SLUICE_PROBE_LOG_JSON="true")
    os.close(read_end)
    os.close(write_end)
    code, output = finish(process)
    assert code == 0 and "drained" in output and '"lifeline_closed"' in output, output


def test_a_drain_that_does_not_end_is_killed_after_the_bound(probe_dir: Path, lifeline: tuple[int, int]) -> None:
    read_end, write_end = lifeline
    command = [sys.executable, "-m", "sluice_common.bootstrap", "probe_service"]
    process, _ = start(command, probe_dir, read_end, IGNORE_SIGTERM="1", **{LIFELINE_KILL_AFTER_ENV: "1"})
    os.close(read_end)
    closed = time.monotonic()
    os.close(write_end)
    code, output = finish(process)
    assert code == -signal.SIGKILL and "lifeline_kill" in output, (code, output)
    assert 1 <= time.monotonic() - closed < 10


def test_a_service_started_by_hand_does_not_stop_on_its_own(probe_dir: Path) -> None:
    process, _ = start([sys.executable, "-m", "sluice_common.bootstrap", "probe_service"], probe_dir, None)
    time.sleep(1)
    assert process.poll() is None
    process.send_signal(signal.SIGTERM)
    code, output = finish(process)
    assert code == 0 and "drained" in output and "lifeline" not in output, output
