"""Byte-level BPE tokenizer rebuilt from GGUF metadata, plus ChatML templating.

The GGUF file carries the whole vocabulary, merges and token types, so no
tokenizer.json (and no network) is needed.

A chat is encoded in segments (`encode_chat`): the template's control tokens are
placed by id, and everything between them (the role line and the message content)
is tokenized as plain text, where a control token's string such as "<|im_start|>"
is ordinary text. Rendering the chat to one string and tokenizing it whole would let
a message forge a turn of another role.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import SupportsInt, cast
from functools import lru_cache

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from .gguf_weights import field_value

# GGUF token types (llama.cpp's llama_token_type).
_TYPE_CONTROL = 3
_TYPE_USER_DEFINED = 4

DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable char -> raw byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class GGUFTokenizer:
    def __init__(self, reader: gguf.GGUFReader) -> None:
        model = field_value(reader, "tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"unsupported tokenizer model {model!r}; only byte-level BPE ('gpt2') is implemented")
        tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
        merges: list[str] = field_value(reader, "tokenizer.ggml.merges")
        types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        self.chat_template: str = field_value(reader, "tokenizer.chat_template", "") or ""

        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[(left, right) for left, _, right in (m.partition(" ") for m in merges)], fuse_unk=False)
        tk = Tokenizer(bpe)
        # Matches SmolLM2's tokenizer.json: digits split one by one, then GPT-2 byte level.
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
        tk.decoder = decoders.ByteLevel()
        self._special_ids = {i for i, t in enumerate(types) if t == _TYPE_CONTROL}
        # Control and user-defined tokens must match as whole units in raw text
        # (e.g. "<|im_start|>"), not be split by BPE.
        tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in sorted(self._special_ids)])
        user = [tokens[i] for i, t in enumerate(types) if t == _TYPE_USER_DEFINED]
        if user:
            tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        self._tk = tk
        # The same tokenizer with control-token strings matched as ordinary text, for content.
        plain = Tokenizer.from_str(tk.to_str())
        plain.encode_special_tokens = True
        self._plain = plain
        self.vocab = vocab
        self.vocab_size = len(tokens)
        self._tokens = tokens

        # Raw bytes per id for streaming detokenization. Control tokens render
        # as "" (like skip_special_tokens): they are never user-visible text.
        bd = _byte_decoder()
        self._token_bytes: list[bytes] = []
        for i, tok in enumerate(tokens):
            if i in self._special_ids:
                self._token_bytes.append(b"")
            elif types[i] == _TYPE_USER_DEFINED or any(c not in bd for c in tok):
                self._token_bytes.append(tok.encode("utf-8"))
            else:
                self._token_bytes.append(bytes(bd[c] for c in tok))

        self.bos_id = _opt_int(field_value(reader, "tokenizer.ggml.bos_token_id"))
        self.eos_id = _opt_int(field_value(reader, "tokenizer.ggml.eos_token_id"))
        stop = {vocab[t] for t in ("<|im_end|>", "<|endoftext|>") if t in vocab}
        if self.eos_id is not None:
            stop.add(self.eos_id)
        self.stop_ids: frozenset[int] = frozenset(stop)

    def encode(self, text: str) -> list[int]:
        """Text whose control-token strings are control tokens: a template the caller wrote."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Text as text: a control token's string becomes the ordinary tokens that spell it."""
        return self._plain.encode(text, add_special_tokens=False).ids

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self._special_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def token_piece(self, token_id: int) -> bytes:
        """A token's bytes as logprobs show it: its text's bytes, a control token's name (which
        text never shows)."""
        raw = self._token_bytes[token_id]
        return raw if raw or token_id not in self._special_ids else self._tokens[token_id].encode()

    def detokenizer(self) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self)

    def apply_chat_template(self, messages: Sequence[tuple[str, str]]) -> str:
        """ChatML exactly as SmolLM2's tokenizer.chat_template, with generation prompt, as text."""
        return "".join(text for text, _ in _chatml(messages))

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The token ids of apply_chat_template's text, with control tokens only where the
        template puts them: each text between two of them is tokenized as plain text. For
        content without control-token strings these are exactly the ids of encoding the whole
        text (the tokenizer splits at control tokens first and encodes the pieces apart)."""
        ids: list[int] = []
        for text, control in _chatml(messages):
            ids += [self.vocab[text]] if control else self.encode_text(text)
        return ids


_IM_START, _IM_END = ("<|im_start|>", True), ("<|im_end|>", True)


def _chatml(messages: Sequence[tuple[str, str]]) -> list[tuple[str, bool]]:
    """SmolLM2's ChatML as (text, is_control_token) pieces: control tokens and the texts between them."""
    pieces: list[tuple[str, bool]] = []
    if not messages or messages[0][0] != "system":
        pieces += [_IM_START, (f"system\n{DEFAULT_SYSTEM_PROMPT}", False), _IM_END, ("\n", False)]
    for role, content in messages:
        pieces += [_IM_START, (f"{role}\n{content}", False), _IM_END, ("\n", False)]
    pieces += [_IM_START, ("assistant\n", False)]
    return pieces


class IncrementalDetokenizer:
    """Turns a token stream into text deltas without ever splitting a UTF-8 char.

    Byte-level BPE tokens are byte strings; a multi-byte character may span
    tokens. Python's incremental UTF-8 decoder holds back an incomplete
    trailing sequence until the next bytes arrive, so each delta is O(1) and
    the concatenation of deltas equals decoding all bytes at once.
    """

    def __init__(self, tokenizer: GGUFTokenizer) -> None:
        self._tok = tokenizer
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token_id))

    def flush(self) -> str:
        """Emit whatever is held back (as U+FFFD if it never became a valid char)."""
        return self._dec.decode(b"", final=True)


def _opt_int(value: object) -> int | None:
    return None if value is None else int(cast(SupportsInt, value))
