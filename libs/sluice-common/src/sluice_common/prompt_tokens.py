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
not fit the model's context.
"""

from __future__ import annotations

from collections.abc import Sequence

from sluice.common.v1 import types_pb2

# Template tokens around one message beyond its role's and content's bytes.
TEMPLATE_TOKENS_PER_MESSAGE = 4
# Template tokens once per chat: the assistant's header and a default system prompt.
TEMPLATE_TOKENS_PER_CHAT = 32


def prompt_token_bound(messages: Sequence[types_pb2.ChatMessage], prompt: str) -> int:
    """At least the tokens the engine prefills for this chat (or raw prompt)."""
    if messages:
        text_bytes = sum(len(m.role.encode()) + len(m.content.encode()) for m in messages)
        return text_bytes + TEMPLATE_TOKENS_PER_MESSAGE * len(messages) + TEMPLATE_TOKENS_PER_CHAT
    return len(prompt.encode()) + 1
