"""Launchers of `hadamard.py`'s kernels, the rotations of rows: the Walsh-Hadamard transform and a product by a small
matrix. Beside its kernel module (`launch.py` says why).
"""

from __future__ import annotations

import torch

from .backend import interpreting, use_kernels
from .launch import TUNING, _compiling, head_dim_ok, on_input_device


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


_FEW_ROWS = 512  # rows_times: up to this many rows, columns in blocks of 16


@on_input_device
def rows_times(x: torch.Tensor, m: torch.Tensor, _eager: bool = False) -> torch.Tensor:
    """`x (..., D)` -> `x.float() @ m` float32, `m (D, D)` float32 of any strides (its transpose, a view, is the
    inverse of an orthogonal m), D a power of two up to 256. A Triton kernel rather than cuBLAS for a few rows (a
    decode step's) and under torch.compile (`_eager`: its operator), so that a step captured in a CUDA graph
    (`hf_kvcache.graphs`, or torch.compile's) launches no cuBLAS: cuBLAS would allocate its workspace (32 MiB on Hopper)
    in the graph's pool for every capture stream, which the cache's bytes do not count. Many rows outside a capture (a
    prefill chunk's queries, keys and values) take cuBLAS's float32 product, as the model's own layers do on that
    stream: the kernel's IEEE products run on CUDA cores, 0.84 ms a call for a chunk of 2048 tokens on the H100
    (2026-12-07, 37% of TurboQuant's prefill GPU time). Its precision is the model's float32 matmuls' (TF32 only where
    the user turned it on)."""
    from . import hadamard as kernel

    if not _eager and _compiling():
        return torch.ops.hf_kvcache.rows_times(x, m)

    d = x.shape[-1]
    if d < 16 or d > 256 or d & (d - 1) or m.shape != (d, d):
        raise ValueError(f"rows_times takes a power-of-two head_dim in [16, 256] and a (D, D) matrix, got x "
                         f"{tuple(x.shape)} and m {tuple(m.shape)}")
    if (not _eager and x.is_cuda and x.numel() > _FEW_ROWS * d and TUNING["rows_cublas"]
            and not torch.cuda.is_current_stream_capturing()):
        return x.float() @ m.float()
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, device=x.device, dtype=torch.float32)
    # Each program sums all D products of its outputs in turn (IEEE float32: no tensor cores), so a few rows (a decode
    # step's query, one token's keys: 8-32 rows) take narrow column blocks, four times the programs for a quarter of
    # that chain each; many rows (a prefill chunk's) take wide ones and read each row fewer times.
    block, block_n = 16, min(d, 16 if rows.shape[0] <= _FEW_ROWS else 64)
    kernel._rows_times[(kernel.triton.cdiv(rows.shape[0], block), d // block_n)](
        rows, m, out, rows.shape[0], rows.stride(0), m.stride(0), m.stride(1), out.stride(0), D=d, BLOCK=block,
        BLOCK_N=block_n,
    )
    return out.view(x.shape)


def rotate_rows(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """`x.float() @ m`: through `rows_times` where the kernels run and take the head_dim, else PyTorch's product (on
    the CPU without Triton's interpreter whatever the backend: a rotation is no reason to refuse one)."""
    if (x.is_cuda or interpreting()) and use_kernels(x.device) and head_dim_ok(x.shape[-1]):
        return rows_times(x, m)
    return x.float() @ m
