"""Rotations of rows on the GPU: the Walsh-Hadamard transform (RotatedCache's online key and query rotation; its
reference is `hf_kvcache.quant.fwht`) and a product by a small matrix (TurboQuant's dense rotation, RotatedCache's
random-orthogonal one). The launchers are in `hadamard_launch`."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _fwht_rows(X, Y, n_rows, sx, sy, D: tl.constexpr, LOG_D: tl.constexpr, BLOCK: tl.constexpr):
    """Rows of `X (n_rows, D)` -> `Y = X @ H / sqrt(D)`, H the Sylvester Hadamard matrix: log2(D) butterfly
    stages in registers, float32."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows[:, None] < n_rows
    d = tl.arange(0, D)
    x = tl.load(X + rows[:, None].to(tl.int64) * sx + d[None, :], mask=ok, other=0.0).to(tl.float32)
    for stage in tl.static_range(LOG_D):
        # pairs (i, i + h), h = 2^stage, inside each block of 2h channels: put the pair axis last, add, subtract
        x4 = tl.permute(tl.reshape(x, (BLOCK, D >> (stage + 1), 2, 1 << stage)), (0, 1, 3, 2))
        a, b = tl.split(x4)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (BLOCK, D))
    tl.store(Y + rows[:, None].to(tl.int64) * sy + d[None, :], (x * (1.0 / tl.sqrt(D * 1.0))).to(Y.dtype.element_ty),
             mask=ok)


@triton.jit
def _rows_times(X, M, Y, n_rows, sx, sm0, sm1, sy, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows of `X (n_rows, D)` -> `Y = X @ M` float32, `M (D, D)` (any strides), BLOCK_N of Y's columns a program:
    IEEE float32 products (no TF32), as `x.float() @ m` gives them with TF32 off."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows[:, None] < n_rows
    d = tl.arange(0, D)
    x = tl.load(X + rows[:, None].to(tl.int64) * sx + d[None, :], mask=ok, other=0.0).to(tl.float32)
    m = tl.load(M + d[:, None] * sm0 + cols[None, :] * sm1).to(tl.float32)
    y = tl.dot(x, m, input_precision="ieee")
    tl.store(Y + rows[:, None].to(tl.int64) * sy + cols[None, :], y, mask=ok)
