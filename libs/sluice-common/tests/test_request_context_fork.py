"""Request ids stay unique across a fork (a worker pool started from a service)."""

from __future__ import annotations

import os

from sluice_common.request_context import new_request_id


def test_a_forked_child_mints_other_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its next ids and leave without running pytest's teardown
        os.write(write, ",".join(new_request_id() for _ in range(3)).encode())
        os._exit(0)
    os.close(write)
    child_ids = os.read(read, 4096).decode().split(",")
    os.waitpid(pid, 0)
    parent_ids = [new_request_id() for _ in range(3)]
    assert len(child_ids) == 3 and all(len(i) == 32 for i in child_ids + parent_ids)
    assert not set(child_ids) & set(parent_ids)
    assert child_ids[0][:16] != parent_ids[0][:16]
