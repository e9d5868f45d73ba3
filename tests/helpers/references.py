"""Shared numeric references for the method tests."""

from __future__ import annotations

import torch


def sqnr_db(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum x^2 / sum (x - x_hat)^2)."""
    x, x_hat = x.double(), x_hat.double()
    noise = (x - x_hat).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * torch.log10(x.pow(2).sum() / noise).item()


def feed(layer, keys: torch.Tensor, values: torch.Tensor, sizes: list[int]):
    """Update a cache layer with `keys/values (B, H, S, D)` in chunks of `sizes`; return the last dense outputs."""
    pos, out = 0, None
    for n in sizes:
        out = layer.update(keys[:, :, pos : pos + n], values[:, :, pos : pos + n])
        pos += n
    return out


def outlier_keys(b=2, h=3, s=96, d=64, seed=0) -> torch.Tensor:
    """Keys shaped like a real model's: a few channels per head ~10x larger than the rest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, s, d, generator=g)
    x[..., [3, 17, 40]] *= 10
    return x
