"""The most tokens a generation prompt can take in the model, known before the model counts it.

A byte-level BPE tokenizer (SmolLM2's, as Llama 3's, Qwen's and Mistral's tekken) spells every
byte of a text with at most one token, and Sluice tokenizes a chat's content as text (a control
token's string in a message costs its bytes, not one token: see triton-local's encode_chat). A
chat template adds its own tokens around each message (ChatML: <|im_start|>, the newline after
the role, <|im_end|> and a newline) and once per chat (the assistant's header, and a default
system prompt when the chat has none: 25 tokens in all in SmolLM2's). So the bound holds for the model
Sluice ships; a SentencePiece tokenizer may add a token per text for its leading space, which
the per-message margin covers for short role lines.

The gateway counts a prompt exactly (the adapter's CountTokens) only when this bound says it may
not fit the model's context. Until a prompt is counted, the gateway's reservation and the adapter's
scheduler take `estimate_prompt_tokens`, a guess (about 3 bytes a token) rather than a bound.

Messages are (role, content) pairs: the gateway's ChatMessages and the adapter's prompts alike.
A prompt given as token ids (vLLM's and OpenAI's token prompts) is prefilled as is: its count is
exact, its length, both as bound and as estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Template tokens around one message beyond its role's and content's bytes.
TEMPLATE_TOKENS_PER_MESSAGE = 4
# Template tokens once per chat: the assistant's header and a default system prompt.
TEMPLATE_TOKENS_PER_CHAT = 32


# English text in a byte-level BPE: about 4 bytes a token; 3 leans towards reserving too much.
BYTES_PER_TOKEN_GUESS = 3

# Why this guess and not the adapter scheduler's former one (ceil((prompt bytes + content bytes + 8
# a message) / 3) + 32, roles uncounted, the chat allowance on raw prompts too): measured with
# SmolLM2's tokenizer and template (the engine's encode_chat), this guess stays above the count
# where that one fell below it (at the price of reserving more where both are above), and a
# reservation or a step's KV budget that falls short over-admits.
#   12 messages "ok":         prefilled 97, this guess 104, the former 72
#   a 6-message conversation: prefilled 65, this guess 104, the former 84
#   raw prompt of 4 tokens:   this guess 7, the former 38 (no template around a raw prompt)

Messages = Sequence[tuple[str, str]]


def prompt_token_bound(messages: Messages, prompt: str, token_ids: Sequence[int] = ()) -> int:
    """At least the tokens the engine prefills for this chat (or raw prompt, or token-id prompt)."""
    if token_ids:
        return len(token_ids)
    if messages:
        return _text_bytes(messages) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_PER_CHAT
    return len(prompt.encode()) + 1


def estimate_prompt_tokens(messages: Messages, prompt: str, token_ids: Sequence[int] = ()) -> int:
    """A guess of the tokens the engine prefills for this chat (or raw prompt), for what is decided
    before the model counts it (a rate-limit reservation that the commit settles, a step's budget).
    Not a bound: digits take a token each, so a chat of digits counts three times its guess.
    A token-id prompt's is exact."""
    if token_ids:
        return len(token_ids)
    if messages:
        return _guess(_text_bytes(messages)) + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_PER_CHAT
    return _guess(len(prompt.encode())) + 1


def guess_text_tokens(text: str) -> int:
    """The same guess for a text alone, no template (an embedding input before its tokenizer's own)."""
    return _guess(len(text.encode()))


def _text_bytes(messages: Messages) -> int:
    return sum(len(role.encode()) + len(content.encode()) for role, content in messages)


def _guess(text_bytes: int) -> int:
    return math.ceil(text_bytes / BYTES_PER_TOKEN_GUESS)
