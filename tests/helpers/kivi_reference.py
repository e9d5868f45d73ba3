"""A fake-quantization reference of KIVI's Algorithm 1, written from the paper, independent of the cache core.

Which tokens are quantized depends only on the total length S: after `sink` exact tokens, keys are quantized
in per-channel groups of G tokens for the first floor((S - sink) / R) * R tokens (the residual fills to R and is
then flushed), values per token (groups of G channels) for all but the last R tokens. Statistics of a key group
ignore left padding. The number format is the library's (fp16 scale and zero rounded outward).
"""

from __future__ import annotations

import torch

from hf_kvcache.quant import round_fp16


def _fake_quant(x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Asymmetric min/max fake quantization of `x` with one group along `dim`, padding excluded from the range."""
    qmax = 2**bits - 1
    x = x.float()
    if valid is None:
        lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    else:
        valid = valid.expand_as(x)
        lo = x.masked_fill(~valid, float("inf")).amin(dim, keepdim=True)
        hi = x.masked_fill(~valid, float("-inf")).amax(dim, keepdim=True)
        none = ~valid.any(dim, keepdim=True)
        lo = torch.where(none, x.amin(dim, keepdim=True), lo)
        hi = torch.where(none, x.amax(dim, keepdim=True), hi)
    lo16 = round_fp16(lo, "down").float()
    scale = round_fp16((hi - lo16) / qmax, "up").float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((x - lo16) / safe).clamp(0, qmax)
    return codes * scale + lo16


def kivi_reference(k, v, bits, group_size, residual_length, sink_tokens=0, pad_lengths=None):
    """`k, v (B, H, S, D)` -> what a KIVI cache holding these S tokens reads back (float32)."""
    b, h, s, d = k.shape
    g, r = group_size, residual_length
    k_hat, v_hat = k.float().clone(), v.float().clone()
    body = max(s - sink_tokens, 0)
    n_keys = (body // r) * r
    if n_keys:
        blocks = k.float()[:, :, sink_tokens : sink_tokens + n_keys].reshape(b, h, n_keys // g, g, d)
        valid = None
        if pad_lengths is not None:
            pos = torch.arange(sink_tokens, sink_tokens + n_keys)
            valid = (pos.unsqueeze(0) >= pad_lengths.unsqueeze(1)).reshape(b, 1, n_keys // g, g, 1)
        deq = _fake_quant(blocks, bits, dim=3, valid=valid)
        k_hat[:, :, sink_tokens : sink_tokens + n_keys] = deq.reshape(b, h, n_keys, d)
    n_values = max(body - r, 0)
    if n_values:
        tokens = v.float()[:, :, sink_tokens : sink_tokens + n_values].reshape(b, h, n_values, d // g, g)
        v_hat[:, :, sink_tokens : sink_tokens + n_values] = _fake_quant(tokens, bits, dim=4).reshape(
            b, h, n_values, d
        )
    return k_hat, v_hat
