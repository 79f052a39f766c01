"""Llama forward pass in numpy over a ragged batch with per-slot KV caches.

All new tokens of all sequences in a step (whole prompts and single decode
tokens alike) are stacked into one [T, hidden] matrix so each linear layer is
a single matmul; only attention is done per sequence, against its own slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .gguf_weights import LlamaConfig, LlamaWeights

# KV arrays grow in multiples of this many positions: small enough that short
# chats stay cheap, large enough that growth (a copy) is rare.
_KV_CHUNK = 256
# A released slot keeps its buffer for reuse unless it grew beyond this; a
# long-context sequence should not pin hundreds of MB after it is gone.
_KV_KEEP = 1024
# Query rows per attention block during prefill, bounding the score matrix to
# n_heads * _Q_BLOCK * context floats.
_Q_BLOCK = 256


@dataclass(frozen=True)
class BatchItem:
    slot: int
    token_ids: list[int]
    start_pos: int  # cache position of token_ids[0]; everything before is cached


class KVCache:
    """Per-slot K/V arrays of shape [n_layers, n_kv_heads, capacity, head_dim].

    Preallocating max_slots * max_context would be ~3 GB for this model at
    8192 positions (46 KB per position), so each slot grows lazily instead.
    """

    def __init__(self, cfg: LlamaConfig, max_slots: int, max_context: int) -> None:
        self.cfg = cfg
        self.max_context = max_context
        self.k: list[np.ndarray | None] = [None] * max_slots
        self.v: list[np.ndarray | None] = [None] * max_slots

    def capacity(self, slot: int) -> int:
        k = self.k[slot]
        return 0 if k is None else k.shape[2]

    def ensure(self, slot: int, length: int, used: int) -> None:
        """Make room for `length` positions, keeping the first `used` ones."""
        cap = self.capacity(slot)
        if length <= cap:
            return
        if length > self.max_context:
            raise ValueError(f"sequence needs {length} positions; the context holds {self.max_context}")
        want = -(-length // _KV_CHUNK) * _KV_CHUNK
        new_cap = min(self.max_context, max(want, 2 * cap))
        c = self.cfg
        shape = (c.n_layers, c.n_kv_heads, new_cap, c.head_dim)
        k = np.empty(shape, dtype=np.float32)
        v = np.empty(shape, dtype=np.float32)
        old_k, old_v = self.k[slot], self.v[slot]
        if old_k is not None and old_v is not None and used:
            k[:, :, :used] = old_k[:, :, :used]
            v[:, :, :used] = old_v[:, :, :used]
        self.k[slot], self.v[slot] = k, v

    def release(self, slot: int) -> None:
        if self.capacity(slot) > _KV_KEEP:
            self.k[slot] = None
            self.v[slot] = None

    def copy(self, source: int, target: int) -> None:
        k, v = self.k[source], self.v[source]
        self.k[target] = None if k is None else k.copy()
        self.v[target] = None if v is None else v.copy()

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v if a is not None)


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.einsum("ij,ij->i", x, x)[:, None] / np.float32(x.shape[1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps))) * w


class StepInterrupted(RuntimeError):
    """An interruptible forward pass stopped midway because the model's `interrupt()` asked it to:
    none of its tokens stay in the KV cache, and it answers no logits."""


class LlamaModel:
    tiled_attention_rows: int | None = None  # attention is one numpy path whatever the batch
    # But the matrix products round by the step's token count (Linear's gemv up to GEMV_MAX_ROWS
    # rows, OpenBLAS's sgemm above, whose blocking depends on the rows too): a prompt that reuses
    # cached cells prefills fewer rows than its cold prefill, and its logits may differ in the last
    # bits (up to 3.6e-5 on a 30-token prompt reusing 20 or 29 tokens; some hits happen to be exact).
    # The prefix cache reuses every shared token here; greedy output may then differ where two
    # tokens nearly tie.
    reuse_bit_exact = False

    def __init__(self, weights: LlamaWeights, max_slots: int, max_context: int) -> None:
        self.w = weights
        self.cfg = weights.config
        self.max_context = max_context
        self.cache = KVCache(self.cfg, max_slots, max_context)
        hd = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        angles = np.outer(np.arange(max_context, dtype=np.float64), inv_freq)
        self._cos = np.cos(angles).astype(np.float32)  # [max_context, head_dim / 2]
        self._sin = np.sin(angles).astype(np.float32)

    def release(self, slot: int) -> None:
        self.cache.release(slot)

    def copy(self, source: int, target: int) -> None:
        self.cache.copy(source, target)

    def truncate(self, slot: int, keep: int) -> None:
        """Nothing to do: positions from `keep` on are written again before they are read."""

    def interrupt(self, keep: bool = False) -> bool:
        """A numpy forward pass runs to its end: nothing to stop."""
        return False

    def forward(self, items: list[BatchItem], interruptible: bool = False) -> np.ndarray:
        """Run all new tokens through the model; returns [len(items), vocab] logits
        for the last new position of each item (the only ones sampled). Never interrupted."""
        cfg = self.cfg
        lens = [len(it.token_ids) for it in items]
        if any(n == 0 for n in lens):
            raise ValueError("every batch item needs at least one token")
        for it, n in zip(items, lens):
            self.cache.ensure(it.slot, it.start_pos + n, it.start_pos)
        ids = np.fromiter((t for it in items for t in it.token_ids), dtype=np.int64)
        positions = np.concatenate([np.arange(it.start_pos, it.start_pos + n) for it, n in zip(items, lens)])
        offsets = np.concatenate([[0], np.cumsum(lens)])
        T = int(offsets[-1])

        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = nh * hd, nkv * hd
        half = hd // 2
        cos = self._cos[positions][:, None, :]
        sin = self._sin[positions][:, None, :]

        x = self.w.tok_embd[ids]
        attn = np.empty((T, q_dim), dtype=np.float32)
        for li, lw in enumerate(self.w.layers):
            h = _rms_norm(x, lw.attn_norm, cfg.rms_eps)
            qkv = lw.wqkv(h)
            q = _rope(qkv[:, :q_dim].reshape(T, nh, hd), cos, sin, half)
            k = _rope(qkv[:, q_dim : q_dim + kv_dim].reshape(T, nkv, hd), cos, sin, half)
            v = qkv[:, q_dim + kv_dim :].reshape(T, nkv, hd)
            for it, n, o in zip(items, lens, offsets):
                kc = self.cache.k[it.slot][li]  # type: ignore[index]
                vc = self.cache.v[it.slot][li]  # type: ignore[index]
                s = it.start_pos
                kc[:, s : s + n] = k[o : o + n].transpose(1, 0, 2)
                vc[:, s : s + n] = v[o : o + n].transpose(1, 0, 2)
                attn[o : o + n] = self._attend(q[o : o + n], kc, vc, s)
            x = x + lw.wo(attn)
            h = _rms_norm(x, lw.ffn_norm, cfg.rms_eps)
            gu = lw.w_gate_up(h)
            gate, up = gu[:, : cfg.ffn], gu[:, cfg.ffn :]
            # silu(gate) * up, computed in place to avoid extra [T, ffn] temporaries.
            act = np.negative(gate)
            np.exp(act, out=act)
            act += 1.0
            np.divide(gate, act, out=act)
            act *= up
            x = x + lw.w_down(act)

        last = x[offsets[1:] - 1]
        return self.w.lm_head(_rms_norm(last, self.w.output_norm, cfg.rms_eps))

    def _attend(self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int) -> np.ndarray:
        """Causal attention of n new query rows (positions start..start+n-1)
        against the slot cache kc/vc [n_kv, cap, hd]; returns [n, n_heads*hd]."""
        cfg = self.cfg
        n = q.shape[0]
        nkv, hd = cfg.n_kv_heads, cfg.head_dim
        group = cfg.n_heads // nkv
        # GQA: query head h reads kv head h // group, so group the query heads
        # under their kv head and let one batched matmul cover a whole group.
        qg = q.reshape(n, nkv, group, hd).transpose(1, 2, 0, 3)  # [nkv, group, n, hd]
        out = np.empty((n, nkv, group, hd), dtype=np.float32)
        for b0 in range(0, n, _Q_BLOCK):
            b1 = min(n, b0 + _Q_BLOCK)
            m = b1 - b0
            L = start + b1  # later keys are masked for every row in this block
            qb = qg[:, :, b0:b1].reshape(nkv, group * m, hd)
            scores = qb @ kc[:, :L].transpose(0, 2, 1)  # [nkv, group*m, L]
            if m > 1:
                # Row i (absolute position start+b0+i) may see keys j <= start+b0+i.
                mask = np.arange(L)[None, :] > (start + b0 + np.arange(m))[:, None]
                scores.reshape(nkv, group, m, L)[:, :, mask] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            ob = scores @ vc[:, :L]  # [nkv, group*m, hd]
            out[b0:b1] = ob.reshape(nkv, group, m, hd).transpose(2, 0, 1, 3)
        return out.reshape(n, nkv * group * hd)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, half: int) -> np.ndarray:
    """Rotary embedding in half-split layout: dim i pairs with dim i + half
    (the GGUF q/k rows were un-permuted at load to get this layout)."""
    x1, x2 = x[..., :half], x[..., half:]
    out = np.empty(x.shape, dtype=np.float32)
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:] = x2 * cos + x1 * sin
    return out
