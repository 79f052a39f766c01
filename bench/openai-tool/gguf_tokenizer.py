"""Writes a Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json) from the
tokenizer a GGUF file carries, for aiperf's --tokenizer: no model hub is reachable here, and
aiperf's `builtin` tokenizer downloads tiktoken's encoding on first use.

transformers' own GGUF loading (`from_pretrained(gguf_file=...)`) needs PyTorch; a byte-level
BPE (SmolLM2's `gpt2` model) is the GGUF's vocabulary and merges put into `tokenizers` directly.
Only aiperf's input-side statistics use it: `make bench-openai` counts output tokens from the
gateway's usage (--use-server-token-count), as the gRPC side does.

    python gguf_tokenizer.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from gguf import GGUFReader
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

CONTROL = 3  # llama.cpp's token type of special tokens (<|im_start|> ...)


def write_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    fields = GGUFReader(gguf_path).fields
    value = lambda name: fields[name].contents()  # noqa: E731 - a short reader
    if value("tokenizer.ggml.model") != "gpt2":
        raise SystemExit(f"{gguf_path.name}: only byte-level BPE (gpt2) tokenizers are converted, not {value('tokenizer.ggml.model')}")
    tokens: list[str] = value("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("tokenizer.ggml.merges")]
    bpe = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, value("tokenizer.ggml.token_type"), strict=True) if kind == CONTROL]
    bpe.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=tokens[value("tokenizer.ggml.bos_token_id")],
        eos_token=tokens[value("tokenizer.ggml.eos_token_id")],
        unk_token=tokens[value("tokenizer.ggml.unknown_token_id")],
    )
    if "tokenizer.chat_template" in fields:
        fast.chat_template = value("tokenizer.chat_template")
    fast.save_pretrained(out_dir)


if __name__ == "__main__":
    write_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
