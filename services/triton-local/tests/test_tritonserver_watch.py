"""How triton-local tells that its tritonserver has ended (server.exit_when_tritonserver_exits):
from the OS, since sh's is_alive() answers True while another thread waits on the process."""

from __future__ import annotations

import os
import subprocess
import time

from sluice_triton_local.server import _exited


def test_a_running_process_has_not_exited() -> None:
    assert not _exited(os.getpid())


def test_an_ended_child_not_yet_reaped_has_exited() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while not _exited(child.pid):  # a zombie until reaped below
        assert time.monotonic() < deadline, "the child never ended"
        time.sleep(0.01)
    assert child.poll() == 0


def test_a_reaped_child_has_exited() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert _exited(child.pid)
