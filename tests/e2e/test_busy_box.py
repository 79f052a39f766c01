"""The local stack on a box where another process keeps a core busy (a build, a test run).

llama.cpp's threads meet at each of a step's barriers; spinning there (libgomp's default spins a
while first, ACTIVE until released) lets one descheduled thread stall the step for seconds, which
the adapter's step timeout (a few seconds at its floor) reads as a failed replica: with either, every
stream of `make bench-threads` failed beside one busy process (and with llama.cpp's own polling
thread pool too), and this test, run with libgomp's default, was still stuck at pytest's 300 s
timeout. triton-local waits at its barriers as libgomp does by default, but its thread governor
(engine/thread_governor.py) steps with fewer threads once the stepping thread loses its core: the
streams are slower beside the busy process, all of them finish, and the engine stepped with one
thread meanwhile (before the governor, a brief spin, GOMP_SPINCOUNT=1000, kept them finishing at
every thread; passive waits before that).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2_grpc

from sluice_stack import Stack

from conftest import auth, chat, scrape

# Near bench-threads' load (32 streams of 64 tokens) with room under the demo key's 32 in flight.
STREAMS = 24


def finish_reason(gateway: gateway_pb2_grpc.GatewayServiceStub, question: str) -> int:
    """The stream's finish reason; a stream cut off (UNAVAILABLE, a step timeout) raises."""
    final = None
    for response in gateway.Generate(chat(question, max_tokens=64), metadata=auth(), timeout=300):
        final = response
    assert final is not None
    return final.finish_reason


def fewest_engine_threads(stack: Stack, stop: threading.Event, seen: list[float]) -> None:
    """Polls triton-local's threads in use until `stop`, keeping the fewest seen in `seen`."""
    url = stack.metrics_url("triton-local")
    while not stop.wait(0.2):
        seen[0] = min(seen[0], scrape(url, "sluice_triton_local_engine_threads_in_use"))


def test_every_stream_finishes_beside_a_busy_process(gateway: gateway_pb2_grpc.GatewayServiceStub, stack: Stack) -> None:
    # Enough steps (64) on the quiet box for the adapter's step timeout to leave its ceiling and
    # follow the load, as on any stack that has served a while (the suite's, a user's).
    for response in gateway.Generate(chat("Count from one to one hundred.", max_tokens=64), metadata=auth(), timeout=300):
        pass
    threads = scrape(stack.metrics_url("triton-local"), "sluice_triton_local_engine_threads")
    # Every core but one kept busy (one process on the 2-core machines this runs on): the engine's
    # threads, as many as the cores, can no longer all have one.
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(1, len(os.sched_getaffinity(0)) - 1))]
    stop, seen = threading.Event(), [threads]
    watcher = threading.Thread(target=fewest_engine_threads, args=(stack, stop, seen))
    watcher.start()
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            reasons = list(pool.map(lambda i: finish_reason(gateway, f"Tell me a fact about the number {i}."), range(STREAMS)))
    finally:
        stop.set()
        watcher.join()
        for process in busy:
            process.kill()
            process.wait()
    assert all(r in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH) for r in reasons), reasons
    assert threads >= 2 and seen[0] < threads, f"the engine stepped with {seen[0]:.0f} of its {threads:.0f} threads at fewest"
