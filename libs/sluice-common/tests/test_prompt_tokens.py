"""The prompt-token bound and guess that the gateway and the adapter share before a model counts."""

from __future__ import annotations

from sluice_common.prompt_tokens import (
    TEMPLATE_TOKENS_PER_CHAT,
    TEMPLATE_TOKENS_PER_MESSAGE,
    estimate_prompt_tokens,
    prompt_token_bound,
)

CHAT = [("system", "You are terse."), ("user", "The quick brown fox jumps over the lazy dog. " * 20)]


def test_the_guess_is_about_three_bytes_a_token_plus_the_template() -> None:
    text_bytes = sum(len(role) + len(content) for role, content in CHAT)
    expected = -(-text_bytes // 3) + TEMPLATE_TOKENS_PER_MESSAGE * 2 + TEMPLATE_TOKENS_PER_CHAT
    assert estimate_prompt_tokens(CHAT, "") == expected
    assert estimate_prompt_tokens([], "abcdef") == 3  # a raw prompt: no template, one token for BOS room
    assert estimate_prompt_tokens([("user", "é")], "") == 2 + 4 + 32  # UTF-8 bytes: "user" and "é" are 6, 2 tokens


def test_the_bound_is_never_below_the_guess() -> None:
    for messages, prompt in [(CHAT, ""), ([], "abcdef"), ([("user", "1234567890" * 50)], ""), ([("user", "日本語🙂")], "")]:
        assert prompt_token_bound(messages, prompt) >= estimate_prompt_tokens(messages, prompt)


def test_the_bound_counts_a_byte_a_token() -> None:
    assert prompt_token_bound([("user", "abc")], "") == 7 + TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS_PER_CHAT
    assert prompt_token_bound([], "abc") == 4
