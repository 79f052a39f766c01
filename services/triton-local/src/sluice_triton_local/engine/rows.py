"""What one engine step takes and gives (StepEngine.step): a row per sequence (prefill, decode or
release) in, a RowResult per row out, in the same order."""

from __future__ import annotations

from dataclasses import dataclass

from sluice_common.sampling import Sampling


@dataclass(frozen=True)
class PrefillRow:
    seq_id: int
    # Templated text, its control-token strings parsed (the caller wrote the template), or the
    # prompt's token ids (a chat: GGUFTokenizer.encode_chat, whose content cannot forge a turn).
    prompt: str | tuple[int, ...]
    params: Sampling = Sampling()  # max_tokens must be set: its default 0 is refused
    chunk: int = 0  # prompt tokens cached per step; 0: the whole prompt in this step
    owner: str = ""  # who drives the sequence (an adapter instance), for per-owner slot metrics
    request_id: str = ""  # the caller's request id, named in the engine's log lines about the sequence


@dataclass(frozen=True)
class DecodeRow:
    seq_id: int


@dataclass(frozen=True)
class ReleaseRow:
    seq_id: int


Row = PrefillRow | DecodeRow | ReleaseRow


@dataclass(frozen=True)
class TopLogprob:
    token: str  # the token's text (U+FFFD where it is not whole UTF-8 by itself)
    bytes: bytes  # its exact bytes (a control token's: its name, e.g. "<|im_end|>")
    logprob: float
    token_id: int = -1


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    bytes: bytes
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()
    token_id: int = -1
    rank: int = 1  # 1 + the tokens that were more likely


@dataclass(frozen=True)
class RowResult:
    seq_id: int
    token_id: int  # -1 when no token (release row, error)
    text: str  # text delta produced by this step
    # "" while running; "stop", "length", "error", or "busy" (no free slot: retry later), or "stale" (no free
    # slot, and nobody steps the sequences holding them: the replica cannot serve until the lease frees them)
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str = ""
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of prefilled
    logprobs: TokenLogprob | None = None  # the token's, when the sequence asked for logprobs
