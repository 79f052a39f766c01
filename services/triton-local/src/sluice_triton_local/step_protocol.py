"""The step protocol: how one Triton request drives one engine step.

One Triton request carries one row per sequence, all tensors of shape [rows]:

  inputs   ACTION  INT32   1 prefill, 2 decode, 3 release, 4 count tokens
           SEQ_ID  INT64   the adapter's id for the sequence (its KV slot key)
           REQUEST BYTES   JSON for prefill and count rows, empty otherwise:
                           {"messages": [[role, content], ...]} (content tokenized as text:
                           control tokens come from the chat template alone) or {"prompt": "..."}
                           (the caller's own template: its control-token strings are parsed),
                           plus "max_tokens", "temperature", "top_p", "seed", "stop",
                           "prefill_chunk": prompt tokens to cache per step (0 or
                           absent: the whole prompt in this step), and "owner": who
                           drives the sequence (slot metrics per adapter). A DECODE row of a
                           sequence whose prompt is not yet all cached caches its next
                           chunk and answers TOKEN_ID -1 with FINISH "".
  outputs  TOKEN_ID          INT32  sampled token, -1 when none
           TEXT              BYTES  UTF-8 text delta
           FINISH            BYTES  "" while running, else "stop", "length", "error",
                                    "invalid" when the row's input was rejected (a client error),
                                    or "busy": a prefill found every slot taken (several adapters
                                    share the engine); nothing changed, retry it later;
                                    or "stale": as "busy", but none of the sequences holding the
                                    slots was stepped in the last 16 steps (their adapter stopped
                                    or dropped them): the replica cannot serve until the slot lease
                                    frees them, a failure of the replica, not backpressure
           PROMPT_TOKENS     INT32
           COMPLETION_TOKENS INT32
           ERROR             BYTES  why a row failed, for a person to read

This module knows numpy and the engine, not Triton, so it is tested directly.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from sluice_triton_local.engine.step_engine import (
    DecodeRow,
    PrefillRow,
    ReleaseRow,
    RowResult,
    SamplingParams,
)
from sluice_triton_local.shared_engine import SharedEngine

PREFILL, DECODE, RELEASE, COUNT = 1, 2, 3, 4

INPUTS: tuple[tuple[str, type], ...] = (("ACTION", np.int32), ("SEQ_ID", np.int64), ("REQUEST", bytes))
OUTPUTS: tuple[tuple[str, type], ...] = (
    ("TOKEN_ID", np.int32),
    ("TEXT", bytes),
    ("FINISH", bytes),
    ("PROMPT_TOKENS", np.int32),
    ("COMPLETION_TOKENS", np.int32),
    ("ERROR", bytes),
)


def _prompt_ids(engine: SharedEngine, request: dict[str, Any]) -> list[int]:
    """A chat's content is tokenized as text: control tokens come from the template alone, so a
    message cannot forge another role's turn. A raw prompt is the caller's own template: its
    control-token strings are control tokens, as in vLLM's and OpenAI's completions."""
    if request.get("messages"):
        return engine.encode_chat([(str(role), str(content)) for role, content in request["messages"]])
    return engine.encode(str(request.get("prompt", "")))


def _sampling(request: dict[str, Any]) -> SamplingParams:
    seed = request.get("seed")
    return SamplingParams(
        max_tokens=int(request.get("max_tokens", 256)),
        temperature=float(request.get("temperature", 0.0)),
        top_p=float(request.get("top_p", 1.0)),
        seed=None if seed is None else int(seed),
        stop=tuple(str(s) for s in request.get("stop", ())),
    )


def _invalid(seq_id: int, message: str) -> RowResult:
    return RowResult(seq_id, -1, "", "invalid", 0, 0, message)


def _parse_row(engine: SharedEngine, action: int, seq_id: int, raw: bytes) -> PrefillRow | DecodeRow | ReleaseRow | RowResult:
    """An engine row, or the RowResult answering it when it needs no engine step."""
    if action == DECODE:
        return DecodeRow(seq_id)
    if action == RELEASE:
        return ReleaseRow(seq_id)
    if action not in (PREFILL, COUNT):
        return _invalid(seq_id, f"unknown ACTION {action}; expected 1 prefill, 2 decode, 3 release or 4 count")
    try:
        request = json.loads(raw or b"{}")
        prompt = _prompt_ids(engine, request)
        prompt_tokens = len(prompt)
        if action == COUNT:
            return RowResult(seq_id, -1, "", "", prompt_tokens, 0)
        sampling = _sampling(request)
        if prompt_tokens + sampling.max_tokens > engine.context_length:
            return RowResult(
                seq_id, -1, "", "invalid", prompt_tokens, 0,
                f"the prompt is {prompt_tokens} tokens and max_tokens is {sampling.max_tokens}; together they"
                f" exceed the model's context of {engine.context_length} tokens",
            )
        chunk = int(request.get("prefill_chunk", 0))
        if chunk < 0:
            return _invalid(seq_id, f"prefill_chunk must be >= 0, got {chunk}")
        return PrefillRow(seq_id, tuple(prompt), sampling, chunk=chunk, owner=str(request.get("owner", "")))
    except (ValueError, TypeError, KeyError) as exc:
        return _invalid(seq_id, f"malformed REQUEST JSON: {exc}")


def run_step(engine: SharedEngine, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Runs one engine step for a whole Triton request; one output row per input row."""
    actions = inputs["ACTION"].reshape(-1)
    seq_ids = inputs["SEQ_ID"].reshape(-1)
    requests = inputs["REQUEST"].reshape(-1)
    parsed = [_parse_row(engine, int(a), int(s), bytes(r)) for a, s, r in zip(actions, seq_ids, requests)]
    engine_rows = [row for row in parsed if not isinstance(row, RowResult)]
    stepped = iter(engine.step(engine_rows)) if engine_rows else iter(())
    results = [row if isinstance(row, RowResult) else next(stepped) for row in parsed]
    return encode_results(results)


def encode_results(results: list[RowResult]) -> dict[str, np.ndarray]:
    return {
        "TOKEN_ID": np.array([r.token_id for r in results], dtype=np.int32),
        "TEXT": np.array([r.text.encode() for r in results], dtype=np.object_),
        "FINISH": np.array([r.finish_reason.encode() for r in results], dtype=np.object_),
        "PROMPT_TOKENS": np.array([r.prompt_tokens for r in results], dtype=np.int32),
        "COMPLETION_TOKENS": np.array([r.completion_tokens for r in results], dtype=np.int32),
        "ERROR": np.array([r.error.encode() for r in results], dtype=np.object_),
    }
