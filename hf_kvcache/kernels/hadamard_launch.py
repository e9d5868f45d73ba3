"""Launcher of `hadamard.py`'s kernel, RotatedCache's online rotation of keys and queries. Beside its kernel module
(`launch.py` says why).
"""

from __future__ import annotations

import torch

from .launch import _compiling, on_input_device


@on_input_device
def hadamard(x: torch.Tensor, _eager: bool = False) -> torch.Tensor:
    """`x (..., D)` -> `x @ H / sqrt(D)` in x's dtype (computed in float32), D a power of two up to 256
    (`quant.fwht`)."""
    from . import hadamard as kernel

    if not _eager and _compiling():
        return torch.ops.hf_kvcache.hadamard(x)

    d = x.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Hadamard kernel takes a power-of-two head_dim in [16, 256], got {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    block = 16
    kernel._fwht_rows[(kernel.triton.cdiv(rows.shape[0], block),)](
        rows, out, rows.shape[0], rows.stride(0), out.stride(0), D=d, LOG_D=d.bit_length() - 1, BLOCK=block,
    )
    return out.view(x.shape)
