"""Token log-probabilities between the engines' JSON and sluice.common.v1.TokenLogprob.

An engine reports a generated token's entry in OpenAI's chat shape ({"token", "logprob", "bytes":
[ints], "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, triton-local's step protocol
LOGPROBS output); the adapter carries it as that dict and turns it into the proto here; the gateway
turns the proto into OpenAI's chat or completions shape (sluice_gateway.openai_front.choices). Triton's
vLLM backend reports vLLM's own shape instead, which `from_vllm` turns into the same entries.
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


def from_vllm(positions: list[dict[str, dict[str, Any]]], text: str, top: int) -> list[dict[str, Any]]:
    """Entries in the chat shape from Triton's vLLM backend's `logprobs` output: one object per
    generated token, {"<token id>": {"logprob", "rank", "decoded_token"}}, holding the `top` most
    likely tokens and the sampled one (vllm_backend src/utils/request.py). The backend does not say
    which is the sampled token: it is the one ranked beyond `top` when there is one (vLLM adds it
    then), else the most likely whose text continues the response's `text` (the tokens' text in
    order), else the most likely."""
    entries = []
    rest = text
    for position in positions:
        candidates = sorted(position.values(), key=lambda c: int(c["rank"]))
        beyond = [c for c in candidates if int(c["rank"]) > top]
        if beyond:
            sampled = beyond[0]
        else:
            sampled = next((c for c in candidates if c["decoded_token"] and rest.startswith(c["decoded_token"])), candidates[0])
        if rest.startswith(sampled["decoded_token"]):
            rest = rest[len(sampled["decoded_token"]) :]
        entries.append({**_chat_entry(sampled), "top_logprobs": [_chat_entry(c) for c in candidates if int(c["rank"]) <= top][:top]})
    return entries


def _chat_entry(candidate: dict[str, Any]) -> dict[str, Any]:
    token = str(candidate["decoded_token"] or "")
    return {"token": token, "logprob": float(candidate["logprob"]), "bytes": list(token.encode())}
