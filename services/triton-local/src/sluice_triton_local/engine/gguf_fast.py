"""Faster GGUF reading for load time: same results as the gguf package.

gguf.GGUFReader parses ~150k metadata parts (the vocabulary) through
np.memmap slicing, whose subclass bookkeeping dominates; and
gguf.quants.dequantize processes rows in small groups. Both are correct but
together cost seconds; the versions here cut model load roughly in half.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import dequantize as _gguf_dequantize


class FastGGUFReader(gguf.GGUFReader):
    """GGUFReader whose internal slicing works on a plain ndarray view of the
    memmap (same buffer, no copy) instead of the np.memmap subclass."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self.__dict__.get("_plain_data")
        if plain is None or plain.size != self.data.size:
            plain = self._plain_data = self.data.view(np.ndarray)
        count = int(count)
        itemsize = np.dtype(dtype).itemsize
        arr = plain[offset : offset + itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def open_reader(path: str) -> gguf.GGUFReader:
    try:
        return FastGGUFReader(path)
    except (AttributeError, TypeError):  # a gguf release with different internals
        return gguf.GGUFReader(path)


def dequantize(data: np.ndarray, qtype: QType) -> np.ndarray:
    """fp32 [rows, cols] for a tensor's raw data (bit-identical to gguf's)."""
    if qtype == QType.Q4_1:
        # Block of 32: f16 scale d, f16 min m, 16 bytes; low nibbles are
        # elements 0..15, high nibbles 16..31; value = q * d + m.
        rows = data.shape[0]
        blocks = data.reshape(-1, 20)
        dm = blocks[:, :4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:]
        q = np.empty((blocks.shape[0], 2, 16), dtype=np.uint8)
        np.bitwise_and(qs, 0x0F, out=q[:, 0])
        np.right_shift(qs, 4, out=q[:, 1])
        out = q.reshape(-1, 32).astype(np.float32)
        out *= dm[:, :1]
        out += dm[:, 1:]
        return out.reshape(rows, -1)
    if qtype == QType.Q8_0:
        # Block of 32: f16 scale d, 32 int8; value = q * d.
        rows = data.shape[0]
        blocks = data.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        out = blocks[:, 2:].view(np.int8).astype(np.float32)
        out *= d
        return out.reshape(rows, -1)
    return np.asarray(_gguf_dequantize(data, qtype), dtype=np.float32)
