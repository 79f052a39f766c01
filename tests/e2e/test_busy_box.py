"""The local stack on a box where another process keeps a core busy (a build, a test run).

llama.cpp's threads meet at each of a step's barriers; spinning there (libgomp's default spins a
while first, ACTIVE until released) lets one descheduled thread stall the step for seconds, which
the adapter's step timeout (a few seconds at its floor) reads as a failed replica: with either, every
stream of `make bench-threads` failed beside one busy process (and with llama.cpp's own polling
thread pool too), and this test, run with libgomp's default, was still stuck at pytest's 300 s
timeout. triton-local's threads spin briefly and then sleep (GOMP_SPINCOUNT=1000; passive waits
before it): the streams are slower beside the busy process but all of them finish.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2_grpc

from conftest import auth, chat

# Near bench-threads' load (32 streams of 64 tokens) with room under the demo key's 32 in flight.
STREAMS = 24


def finish_reason(gateway: gateway_pb2_grpc.GatewayServiceStub, question: str) -> int:
    """The stream's finish reason; a stream cut off (UNAVAILABLE, a step timeout) raises."""
    final = None
    for response in gateway.Generate(chat(question, max_tokens=64), metadata=auth(), timeout=300):
        final = response
    assert final is not None
    return final.finish_reason


def test_every_stream_finishes_beside_a_busy_process(gateway: gateway_pb2_grpc.GatewayServiceStub) -> None:
    # Enough steps (64) on the quiet box for the adapter's step timeout to leave its ceiling and
    # follow the load, as on any stack that has served a while (the suite's, a user's).
    for response in gateway.Generate(chat("Count from one to one hundred.", max_tokens=64), metadata=auth(), timeout=300):
        pass
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            reasons = list(pool.map(lambda i: finish_reason(gateway, f"Tell me a fact about the number {i}."), range(STREAMS)))
    finally:
        busy.kill()
        busy.wait()
    assert all(r in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH) for r in reasons), reasons
