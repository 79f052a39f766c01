"""Load a llama-architecture GGUF file into fp32 numpy weights.

Everything is dequantized once at load time so the forward pass is plain BLAS
matmuls; see linear.py for the weight layouts kept and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from .gguf_fast import dequantize
from .linear import Linear


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float
    rms_eps: float
    context_length: int


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [hidden]
    # q, k and v fused: one matmul instead of three per layer.
    wqkv: Linear  # hidden -> (n_heads + 2 * n_kv_heads) * head_dim
    wo: Linear  # n_heads * head_dim -> hidden
    ffn_norm: np.ndarray  # [hidden]
    w_gate_up: Linear  # hidden -> 2 * ffn, gate outputs first, then up
    w_down: Linear  # ffn -> hidden


@dataclass
class LlamaWeights:
    config: LlamaConfig
    tok_embd: np.ndarray  # [vocab, hidden], row lookup for input ids
    output_norm: np.ndarray  # [hidden]
    lm_head: Linear  # hidden -> vocab; shares tok_embd's memory when tied
    layers: list[LayerWeights]


def field_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """Decoded value of a GGUF metadata field (str, number or list)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def read_config(reader: gguf.GGUFReader) -> LlamaConfig:
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only 'llama' is implemented")

    def req(name: str) -> Any:
        value = field_value(reader, f"llama.{name}")
        if value is None:
            raise ValueError(f"GGUF file lacks llama.{name}")
        return value

    hidden = int(req("embedding_length"))
    n_heads = int(req("attention.head_count"))
    n_kv = int(field_value(reader, "llama.attention.head_count_kv", n_heads))
    vocab = field_value(reader, "llama.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = hidden // n_heads
    rope_dims = int(field_value(reader, "llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    return LlamaConfig(
        n_layers=int(req("block_count")),
        hidden=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        ffn=int(req("feed_forward_length")),
        vocab=int(vocab),
        rope_theta=float(field_value(reader, "llama.rope.freq_base", 10000.0)),
        rms_eps=float(req("attention.layer_norm_rms_epsilon")),
        context_length=int(req("context_length")),
    )


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf.py reorders each head's output rows from HF's
    half-split rope layout (pairs (i, i + d/2)) to the interleaved layout
    (pairs (2i, 2i + 1)) that ggml's "normal" rope mode expects. Putting the
    rows back as [evens, odds] per head recovers the half-split layout, whose
    rope is two contiguous slices instead of strided ones, so it is cheaper in
    numpy. q and k get the same permutation, so q.k scores are unchanged.
    """
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    w = w.reshape(n_heads, head_dim // 2, 2, in_dim)
    return w.swapaxes(1, 2).reshape(out_dim, in_dim)


def load_weights(reader: gguf.GGUFReader, dual_layout: bool = True) -> LlamaWeights:
    """Dequantize every tensor of an opened GGUF file (gguf_fast.open_reader).

    dual_layout keeps a second, gemv-friendly copy of every matrix (see
    linear.py): faster at small batch, about twice the weight memory.
    """
    cfg = read_config(reader)
    tensors = {t.name: t for t in reader.tensors}

    def get(name: str) -> np.ndarray:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"GGUF file lacks tensor {name}")
        # dequantize returns numpy order [out, in] (GGUF lists dims reversed).
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)

    def linear(*parts: np.ndarray) -> Linear:
        w = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        return Linear.from_out_in(w, dual_layout)

    # Folding the 1/sqrt(head_dim) attention scale into Wq saves a [T, q_dim]
    # multiply per layer at run time.
    q_scale = np.float32(1.0 / np.sqrt(cfg.head_dim))
    layers: list[LayerWeights] = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        wq = _unpermute_rows(get(p + "attn_q.weight"), cfg.n_heads) * q_scale
        wk = _unpermute_rows(get(p + "attn_k.weight"), cfg.n_kv_heads)
        layers.append(
            LayerWeights(
                attn_norm=get(p + "attn_norm.weight"),
                wqkv=linear(wq, wk, get(p + "attn_v.weight")),
                wo=linear(get(p + "attn_output.weight")),
                ffn_norm=get(p + "ffn_norm.weight"),
                w_gate_up=linear(get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")),
                w_down=linear(get(p + "ffn_down.weight")),
            )
        )

    tok_embd = get("token_embd.weight")
    # Tied embeddings: the [vocab, hidden] embedding already is the gemm
    # layout of the output head, so only the optional gemv copy is extra.
    lm_head = linear(get("output.weight")) if "output.weight" in tensors else Linear.from_out_in(tok_embd, dual_layout)
    weights = LlamaWeights(
        config=cfg,
        tok_embd=tok_embd,
        output_norm=get("output_norm.weight"),
        lm_head=lm_head,
        layers=layers,
    )
    return weights
