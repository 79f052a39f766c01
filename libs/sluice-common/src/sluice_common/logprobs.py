"""Token log-probabilities between the engines' JSON and sluice.common.v1.TokenLogprob.

An engine reports a generated token's entry in OpenAI's chat shape ({"token", "logprob", "bytes":
[ints], "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, triton-local's step protocol
LOGPROBS output); the adapter carries it as that dict and turns it into the proto here; the gateway
turns the proto into OpenAI's chat or completions shape (sluice_gateway.openai_logprobs).
"""

from __future__ import annotations

from typing import Any

from sluice.common.v1 import types_pb2


def token_logprob(entry: dict[str, Any]) -> types_pb2.TokenLogprob:
    return types_pb2.TokenLogprob(
        token=str(entry["token"]),
        logprob=float(entry["logprob"]),
        bytes=bytes(entry.get("bytes") or b""),
        top_logprobs=[
            types_pb2.TopLogprob(token=str(t["token"]), logprob=float(t["logprob"]), bytes=bytes(t.get("bytes") or b""))
            for t in entry.get("top_logprobs", ())
        ],
    )
