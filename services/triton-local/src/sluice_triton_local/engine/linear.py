"""Linear layer that picks the fastest OpenBLAS call for the row count.

Measured single-threaded on the target box (OpenBLAS 0.3.23, all model
matrices, weights not cache-resident):
  * one row: gemv on a row-major [in, out] matrix (``x @ W``) is fastest,
    ~1.45x faster than gemv on [out, in];
  * several rows: sgemm is ~1.6x faster when the weight is row-major
    [out, in] (``x @ Wt.T``) than with [in, out], because packing the big
    operand is cheaper from that layout;
  * up to ~4 rows, one gemv per row on [in, out] beats sgemm outright.
Keeping both layouts costs a second copy of the weights (about +0.5 GB for
SmolLM2-135M); ``Linear(wt, None)`` is the low-memory form (gemm layout only).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Row counts up to this use per-row gemv when the [in, out] copy exists.
GEMV_MAX_ROWS = 4


@dataclass
class Linear:
    wt: np.ndarray  # [out, in], C-contiguous: used for sgemm
    w: np.ndarray | None  # [in, out], C-contiguous: used for gemv; None = low memory

    @classmethod
    def from_out_in(cls, w_out_in: np.ndarray, dual_layout: bool) -> "Linear":
        wt = np.ascontiguousarray(w_out_in, dtype=np.float32)
        return cls(wt, np.ascontiguousarray(wt.T) if dual_layout else None)

    @property
    def out_features(self) -> int:
        return self.wt.shape[0]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        rows = x.shape[0]
        if self.w is not None and rows <= GEMV_MAX_ROWS:
            if rows == 1:
                return x @ self.w  # numpy dispatches a [1, k] @ [k, n] product to gemv
            out = np.empty((rows, self.w.shape[1]), dtype=np.float32)
            for i in range(rows):
                np.matmul(x[i], self.w, out=out[i])
            return out
        return x @ self.wt.T
