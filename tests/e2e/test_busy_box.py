"""The local stack on a box where another process keeps a core busy (a build, a test run).

llama.cpp's threads meet at each of a step's barriers; spinning there (OpenMP's default) lets one
descheduled thread stall the step for seconds, which the adapter's step timeout (a few seconds at
its floor) reads as a failed replica: with spinning threads every stream of `make bench-threads`
failed beside one busy process (and with llama.cpp's own polling thread pool too). triton-local's
threads wait passively (OMP_WAIT_POLICY), so the streams are slower there but all of them finish.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from sluice.common.v1 import types_pb2
from sluice.gateway.v1 import gateway_pb2_grpc

from conftest import auth, chat

# Near bench-threads' load (32 streams) with room under the demo key's 32 in flight: their prefills fill
# one step of some 1,300 tokens.
STREAMS = 24


def finish_reason(gateway: gateway_pb2_grpc.GatewayServiceStub, question: str) -> int:
    """The stream's finish reason; a stream cut off (UNAVAILABLE, a step timeout) raises."""
    final = None
    for response in gateway.Generate(chat(question, max_tokens=8), metadata=auth(), timeout=300):
        final = response
    assert final is not None
    return final.finish_reason


def test_every_stream_finishes_beside_a_busy_process(gateway: gateway_pb2_grpc.GatewayServiceStub) -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            reasons = list(pool.map(lambda i: finish_reason(gateway, f"Tell me a fact about the number {i}."), range(STREAMS)))
    finally:
        busy.kill()
        busy.wait()
    assert all(r in (types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH) for r in reasons), reasons
