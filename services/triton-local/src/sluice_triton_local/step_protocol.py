"""The step protocol: how one Triton request drives a round of engine steps.

The model is decoupled: one request runs a round of up to STEPS engine steps and answers one
response per step, as each step is made, so the caller pays one round trip per round rather than
per token. A request that gives STREAM_INTERVAL_MS lets later steps' rows wait and share one
response until that long has passed since the round's previous response (vLLM's stream_interval,
in time): a response costs the serving processes CPU (Triton, its proxy, the adapter, the gateway,
the client), taken from the engine on a small box and from its feeding on a GPU, while a reader
cannot tell tokens 50 ms apart from tokens as they are made. A step that holds a sequence's first
token, a finish, a row without a token or the round's end is answered at once with what waited. The request's rows make the first step; each later step decodes the request's sequences
still running (a sequence that finished, by a stop, max_tokens or an error, leaves the round), and
the round ends early when none is left. A release request sent while a round runs (another request
on the model) releases its sequences at the round's next step instead: a cancelled stream stops
within one step. An end-round request ends the round in flight after its current step, so that
a request that arrived meanwhile joins at the next step rather than at the round's end; so does
any other request that waits for the engine (another adapter's, or another model's on the same
engine): it waits one step, not a round. A request marked FOLLOWS_ROUND does not: it is the
caller's next round, sent while this one runs so that the engine starts it the moment this one
ends instead of waiting a round trip for it.

One Triton request carries one row per sequence, all tensors of shape [rows]:

  inputs   ACTION  INT32   1 prefill, 2 decode, 3 release, 4 count tokens, 5 end round: the
                           round in flight (whoever sent it) ends after its current step,
                           because requests wait to join; answered at once, SEQ_ID ignored;
                           6 interrupt: as 5, and when the round in flight is INTERRUPTIBLE,
                           its current step stops midway (an interactive request waits; on
                           llama.cpp's CPU backend, between two nodes of its graph) unless it
                           prefills one prompt for several siblings: its rows answer TOKEN_ID -1
                           with FINISH "", a decoding sequence is as before the step and a
                           prefilled one admitted with none of its prompt cached (its next
                           DECODE row caches it, as for a chunked prefill); when no step is
                           computing, the next step to start within 0.2 s stops the same way
                           before it computes, if its round is INTERRUPTIBLE (an ask may reach the engine
                           before its round); a stopped step ends its round
           SEQ_ID  INT64   the adapter's id for the sequence (its KV slot key)
           REQUEST BYTES   JSON for prefill and count rows, empty otherwise:
                           {"messages": [[role, content], ...]} (content tokenized as text:
                           control tokens come from the chat template alone) or {"prompt": "..."}
                           (the caller's own template: its control-token strings are parsed)
                           or {"prompt_token_ids": [ids]} (prefilled exactly: no template, no
                           tokenization; an id outside the vocabulary is "invalid", ERROR
                           "prompt_token_ids: <reason>"),
                           plus the generation options in their JSON form
                           (sluice_common.sampling.Sampling.to_json: "max_tokens", "temperature",
                           "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "logit_bias" {"<token id>": bias}, "seed",
                           "stop", "logprobs", "structured_outputs" (vLLM's
                           StructuredOutputsParams: {"json": schema}, {"json_object": true},
                           {"regex": ...}, {"choice": [...]} or {"grammar": ...}); absent: the
                           default; max_tokens must be given),
                           "prefill_chunk": prompt tokens to cache per step (0 or
                           absent: the whole prompt in this step), "owner": who
                           drives the sequence (slot metrics per adapter), and "request_id":
                           the caller's id for the request, which the engine's log lines about
                           the sequence name (optional; not a string: ignored; cut at 64
                           characters). Any other key is ignored, so a caller may send a key
                           an older engine does not know. A DECODE row of a
                           sequence whose prompt is not yet all cached caches its next
                           chunk and answers TOKEN_ID -1 with FINISH "".
           STEPS   INT32   optional, shape [1]: engine steps in the round (1 to MAX_ROUND_STEPS;
                           absent: 1)
           STREAM_INTERVAL_MS INT32 optional, shape [1]: how long the round's steps may wait to
                           share a response (0 to MAX_STREAM_INTERVAL_MS; absent or 0: one
                           response per step)
           FOLLOWS_ROUND INT32 optional, shape [1]: 1: the request follows the round in flight
                           (the caller's next round, sent before this one ends so that the engine
                           does not wait for it): it waits for that round's end instead of ending
                           it, and a first-step DECODE row of a sequence released meanwhile is a
                           release; an end-round ask made while it waits ends it after its
                           first step, as it ends the round in flight (one made before it was
                           sent does not); absent or 0: the request ends the round in flight
           INTERRUPTIBLE INT32 optional, shape [1]: 1: the round's steps may be stopped midway
                           by an interrupt (ACTION 6): the caller's bulk work; absent or 0: never

Each response carries one row per row of each step it answers, in step order, all tensors of
shape [rows] but ROUND_END: the first step answers the request's rows in their order; a later
one the sequences it stepped (and any a release request named), in their order in the request.
A sequence has one row per step of the response, so a response that answers several steps
repeats its SEQ_ID, in the order its tokens were made.

  outputs  ROW_SEQ_ID        INT64  the row's SEQ_ID
           TOKEN_ID          INT32  sampled token, -1 when none
           TEXT              BYTES  UTF-8 text delta
           FINISH            BYTES  "" while running, else "stop", "length", "error",
                                    "invalid" when the row's input was rejected (a client error;
                                    an option out of its range, a logit_bias id outside the
                                    vocabulary or a constraint the engine cannot compile: ERROR is
                                    "sampling.<option>: <reason>"),
                                    or "busy": a prefill found every slot taken (several adapters
                                    share the engine); nothing changed, retry it later;
                                    or "stale": as "busy", but none of the sequences holding the
                                    slots was stepped in the last 16 steps (their adapter stopped
                                    or dropped them): the replica cannot serve until the slot lease
                                    frees them, a failure of the replica, not backpressure
           PROMPT_TOKENS     INT32
           COMPLETION_TOKENS INT32
           CACHED_TOKENS     INT32  prompt tokens of the row's sequence that the engine took from its
                                    prefix cache instead of prefilling (counted in PROMPT_TOKENS; 0
                                    when none, and on rows that are not a sequence's)
           ERROR             BYTES  why a row failed, for a person to read; an "error" row the
                                    engine failed itself (not the row's input, not a sequence it no
                                    longer runs) begins "forward pass failed:", "sampling failed:" or
                                    "admission failed:", which the adapter counts against the replica
           LOGPROBS          BYTES  the row's token's log-probabilities when its sequence asked
                                    ("logprobs": k in REQUEST), as JSON in OpenAI's chat shape:
                                    {"token", "logprob", "bytes": [ints], "top_logprobs": [{"token",
                                    "logprob", "bytes"}, ...]} (k of them, by logprob descending);
                                    empty otherwise. A caller that does not request this output
                                    (Triton returns only those asked) pays nothing for it.
           ROUND_END         BOOL   shape [1]: true on the round's last response

This module knows numpy and the engine, not Triton, so it is tested directly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from sluice_common.sampling import Sampling, StructuredOutputsError, field_error, problem
from sluice_common.structured_outputs import check
from sluice_triton_local.engine.rows import DecodeRow, PrefillRow, ReleaseRow, Row, RowResult, TokenLogprob
from sluice_triton_local.shared_engine import SharedEngine

PREFILL, DECODE, RELEASE, COUNT, END_ROUND, INTERRUPT = 1, 2, 3, 4, 5, 6

# A round longer than this would hold a new arrival's first token back too long (and a caller
# asking for more is likely confused about the unit).
MAX_ROUND_STEPS = 64
# Tokens held back longer than this would read as a stall.
MAX_STREAM_INTERVAL_MS = 1000
# A prefill's owner (its adapter's host/pid) is a metric label: kept to this many characters.
MAX_OWNER = 128
# A prefill's request id is put in log lines: kept to this many characters (sluice_common's bound on
# a caller's id, which this module does not import: Triton's image copies only what the engine needs).
MAX_REQUEST_ID = 64

INPUTS: tuple[tuple[str, type], ...] = (("ACTION", np.int32), ("SEQ_ID", np.int64), ("REQUEST", bytes))
OPTIONAL_INPUTS: tuple[tuple[str, type], ...] = (
    ("STEPS", np.int32),
    ("STREAM_INTERVAL_MS", np.int32),
    ("FOLLOWS_ROUND", np.int32),
    ("INTERRUPTIBLE", np.int32),
)
OUTPUTS: tuple[tuple[str, type], ...] = (
    ("ROW_SEQ_ID", np.int64),
    ("TOKEN_ID", np.int32),
    ("TEXT", bytes),
    ("FINISH", bytes),
    ("PROMPT_TOKENS", np.int32),
    ("COMPLETION_TOKENS", np.int32),
    ("CACHED_TOKENS", np.int32),
    ("ERROR", bytes),
    ("LOGPROBS", bytes),
    ("ROUND_END", np.bool_),
)
# Told each response of a round (output name -> tensor), and whether it is the last.
OnResponse = Callable[[dict[str, np.ndarray], bool], object]


def round_inputs(
    action: int,
    seq_ids: list[int],
    bodies: list[bytes],
    steps: int = 1,
    follows: bool = False,
    stream_interval_ms: int = 0,
    interruptible: bool = False,
) -> dict[str, np.ndarray]:
    """A request's input tensors, one row per sequence, all of one action, for `steps` engine steps
    (`follows`: sent to follow the round in flight; `stream_interval_ms`: STREAM_INTERVAL_MS, 0 for
    none; `interruptible`: INTERRUPTIBLE): what a caller in process (the benchmarks) passes to
    `start_round`."""
    inputs: dict[str, np.ndarray] = {
        "ACTION": np.full(len(seq_ids), action, np.int32),
        "SEQ_ID": np.array(seq_ids, np.int64),
        "REQUEST": np.array(bodies, dtype=object),
        "STEPS": np.array([steps], np.int32),
    }
    if follows:
        inputs["FOLLOWS_ROUND"] = np.array([1], np.int32)
    if stream_interval_ms:
        inputs["STREAM_INTERVAL_MS"] = np.array([stream_interval_ms], np.int32)
    if interruptible:
        inputs["INTERRUPTIBLE"] = np.array([1], np.int32)
    return inputs


def _prompt_ids(engine: SharedEngine, request: dict[str, Any]) -> list[int]:
    """A chat's content is tokenized as text: control tokens come from the template alone, so a
    message cannot forge another role's turn. A raw prompt is the caller's own template: its
    control-token strings are control tokens, as in vLLM's and OpenAI's completions. Token ids are
    the prompt itself (vLLM's prompt_token_ids): checked by _token_problem, never re-tokenized."""
    if request.get("prompt_token_ids"):
        return [int(t) for t in request["prompt_token_ids"]]
    if request.get("messages"):
        return engine.encode_chat([(str(role), str(content)) for role, content in request["messages"]])
    return engine.encode(str(request.get("prompt", "")))


def _token_problem(request: dict[str, Any], prompt: list[int], vocab_size: int) -> str | None:
    """Why a token-id prompt cannot be prefilled (an id outside the vocabulary), naming the field."""
    if not request.get("prompt_token_ids"):
        return None
    outside = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if outside is None:
        return None
    return f"prompt_token_ids: token id {outside} is outside the model's vocabulary of {vocab_size} tokens (0 to {vocab_size - 1})"


def _invalid(seq_id: int, message: str) -> RowResult:
    return RowResult(seq_id, -1, "", "invalid", 0, 0, message)


def _parse_row(engine: SharedEngine, action: int, seq_id: int, raw: bytes) -> PrefillRow | DecodeRow | ReleaseRow | RowResult:
    """An engine row, or the RowResult answering it when it needs no engine step."""
    if action == DECODE:
        return DecodeRow(seq_id)
    if action == RELEASE:
        return ReleaseRow(seq_id)
    if action in (END_ROUND, INTERRUPT):
        return RowResult(seq_id, -1, "", "", 0, 0)
    if action not in (PREFILL, COUNT):
        return _invalid(seq_id, f"unknown ACTION {action}; expected 1 prefill, 2 decode, 3 release, 4 count, 5 end round or 6 interrupt")
    try:
        request = json.loads(raw or b"{}")
        if not isinstance(request, dict):  # .get below would fail the whole request, not this row
            return _invalid(seq_id, f"malformed REQUEST JSON: an object expected, got {type(request).__name__}")
        prompt = _prompt_ids(engine, request)
        prompt_tokens = len(prompt)
        token_problem = _token_problem(request, prompt, engine.vocab_size)
        if token_problem is not None:
            return _invalid(seq_id, token_problem)
        if action == COUNT:
            return RowResult(seq_id, -1, "", "", prompt_tokens, 0)
        if not prompt:  # the engine has no position to sample a first token from
            return _invalid(seq_id, 'the prompt is empty (0 tokens): give "messages", "prompt" or "prompt_token_ids" with at least one token')
        try:
            sampling = Sampling.from_json(request)
        except StructuredOutputsError as exc:
            return _invalid(seq_id, field_error("structured_outputs", str(exc)))
        found = problem(sampling, engine.vocab_size)
        if found is not None:
            return _invalid(seq_id, field_error(*found))
        if sampling.structured_outputs is not None:
            try:
                check(sampling.structured_outputs)  # the engine compiles it again, against the vocabulary
            except StructuredOutputsError as exc:
                return _invalid(seq_id, field_error("structured_outputs", str(exc)))
        if prompt_tokens + sampling.max_tokens > engine.context_length:
            return RowResult(
                seq_id,
                -1,
                "",
                "invalid",
                prompt_tokens,
                0,
                f"the prompt is {prompt_tokens} tokens and max_tokens is {sampling.max_tokens}; together they"
                f" exceed the model's context of {engine.context_length} tokens",
            )
        chunk = int(request.get("prefill_chunk", 0))
        if chunk < 0:
            return _invalid(seq_id, f"prefill_chunk must be >= 0, got {chunk}")
        owner = str(request.get("owner", ""))[:MAX_OWNER]
        return PrefillRow(seq_id, tuple(prompt), sampling, chunk=chunk, owner=owner, request_id=_request_id(request))
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError) as exc:
        # OverflowError: a number JSON spells as 1e999 (inf) where an integer goes; RecursionError:
        # JSON nested deeper than the parser's recursion. Either fails this row, not the request's others.
        return _invalid(seq_id, f"malformed REQUEST JSON: {exc}")


def _request_id(request: dict[str, Any]) -> str:
    """The prefill's "request_id", for log lines alone: one that is not a string is ignored, not
    refused (no row fails for what only names it in a log), and a long one is cut."""
    value = request.get("request_id")
    return value[:MAX_REQUEST_ID] if isinstance(value, str) else ""


class RoundRejected(ValueError):
    """The request as a whole is malformed (not one of its rows): the caller's fault."""


def _scalar(inputs: dict[str, np.ndarray], name: str, absent: int, low: int, high: int) -> int:
    tensor = inputs.get(name)
    if tensor is None or tensor.size == 0:
        return absent
    if tensor.size != 1:
        raise RoundRejected(f"{name} must hold one value, got {tensor.size}")
    value = int(tensor.reshape(-1)[0])
    if not low <= value <= high:
        raise RoundRejected(f"{name} must be between {low} and {high}, got {value}")
    return value


def round_steps(inputs: dict[str, np.ndarray]) -> int:
    return _scalar(inputs, "STEPS", 1, 1, MAX_ROUND_STEPS)


def stream_interval_s(inputs: dict[str, np.ndarray]) -> float:
    return _scalar(inputs, "STREAM_INTERVAL_MS", 0, 0, MAX_STREAM_INTERVAL_MS) / 1000


def follows_round(inputs: dict[str, np.ndarray]) -> bool:
    return _scalar(inputs, "FOLLOWS_ROUND", 0, 0, 1) == 1


def interruptible_round(inputs: dict[str, np.ndarray]) -> bool:
    return _scalar(inputs, "INTERRUPTIBLE", 0, 0, 1) == 1


class _Responses:
    """A round's steps into responses: each step at once, or, with an interval, later steps' rows
    held until the interval has passed since the previous response (see the module's docstring)."""

    def __init__(self, interval_s: float, on_response: OnResponse) -> None:
        self._interval_s = interval_s
        self._on_response = on_response
        self._held: list[RowResult] = []
        self._sent_at = time.perf_counter()

    def add(self, results: list[RowResult], last: bool) -> None:
        self._held.extend(results)
        now = time.perf_counter()
        if last or now - self._sent_at >= self._interval_s or any(_answer_at_once(r) for r in results):
            self._on_response(encode_results(self._held, last), last)
            self._held = []
            self._sent_at = now


def _answer_at_once(result: RowResult) -> bool:
    """A first token (time to first token), a finish (the caller's slot frees) or a row without a
    token (a prefill chunk, a release, an error) is not held back."""
    return result.completion_tokens <= 1 or bool(result.finish_reason) or result.token_id < 0


def start_round(engine: SharedEngine, inputs: dict[str, np.ndarray], on_response: OnResponse) -> Future[None]:
    """Starts a request's round on the engine's thread; `on_response` is called there with each
    step's response (or here, at once, when no row needs the engine). Raises RoundRejected."""
    steps = round_steps(inputs)
    follows = follows_round(inputs)
    interruptible = interruptible_round(inputs)
    responses = _Responses(stream_interval_s(inputs), on_response)
    actions = inputs["ACTION"].reshape(-1)
    seq_ids = inputs["SEQ_ID"].reshape(-1)
    requests = inputs["REQUEST"].reshape(-1)
    if not len(actions) == len(seq_ids) == len(requests):
        raise RoundRejected(f"ACTION, SEQ_ID and REQUEST must have one value per row, got {len(actions)}, {len(seq_ids)} and {len(requests)}")
    if INTERRUPT in actions:
        engine.interrupt_soon()
    elif END_ROUND in actions:
        engine.end_round_soon()
    parsed = [_parse_row(engine, int(a), int(s), bytes(r)) for a, s, r in zip(actions, seq_ids, requests)]
    engine_rows: list[Row] = [row for row in parsed if not isinstance(row, RowResult)]
    if not engine_rows:
        on_response(encode_results(parsed, last=True), True)  # type: ignore[arg-type]
        done: Future[None] = Future()
        done.set_result(None)
        return done
    engine.release_soon([row.seq_id for row in engine_rows if isinstance(row, ReleaseRow)])
    first = [True]

    def on_step(results: list[RowResult], last: bool) -> None:
        if first[0]:  # the first step answers every row of the request, in order
            first[0] = False
            stepped = iter(results)
            results = [row if isinstance(row, RowResult) else next(stepped) for row in parsed]
        responses.add(results, last)

    # A release request needs no round of its own in the engine's line: the round in flight
    # applies it; a following round waits its turn.
    releases_only = all(isinstance(row, ReleaseRow) for row in engine_rows)
    return engine.round(engine_rows, steps, on_step, preempts=not (releases_only or follows), interruptible=interruptible)


def encode_results(results: list[RowResult], last: bool = True) -> dict[str, np.ndarray]:
    return {
        "ROW_SEQ_ID": np.array([r.seq_id for r in results], dtype=np.int64),
        "TOKEN_ID": np.array([r.token_id for r in results], dtype=np.int32),
        "TEXT": np.array([r.text.encode() for r in results], dtype=np.object_),
        "FINISH": np.array([r.finish_reason.encode() for r in results], dtype=np.object_),
        "PROMPT_TOKENS": np.array([r.prompt_tokens for r in results], dtype=np.int32),
        "COMPLETION_TOKENS": np.array([r.completion_tokens for r in results], dtype=np.int32),
        "CACHED_TOKENS": np.array([r.cached_tokens for r in results], dtype=np.int32),
        "ERROR": np.array([r.error.encode() for r in results], dtype=np.object_),
        "LOGPROBS": np.array([encode_logprob(r.logprobs) for r in results], dtype=np.object_),
        "ROUND_END": np.array([last], dtype=np.bool_),
    }


def encode_logprob(found: TokenLogprob | None) -> bytes:
    """LOGPROBS of one row: OpenAI's chat logprobs entry as JSON, b"" when none."""
    if found is None:
        return b""
    top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in found.top_logprobs]
    return json.dumps({"token": found.token, "logprob": found.logprob, "bytes": list(found.bytes), "top_logprobs": top}).encode()
