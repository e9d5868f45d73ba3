"""QuantizedIntCache: uniform integer K/V, INT8 per-token symmetric or INT4/INT3/INT2 asymmetric groups along
head_dim.

Per stored token and kv-head, for bits b and group g (`None` = the whole head_dim):
- codes: `D * b / 8` bytes (packed, see `hf_kvcache.quant.pack_bits`);
- scale: one fp16 per group; zero: one fp16 per group when asymmetric.
INT4 g32 is 0.3125 of a 16-bit cache, INT2 g32 0.1875, INT8 per-token (head_dim 64) 0.516.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import PackedFormat
from ..quant import dequantize_uniform, pack_bits, quantize_uniform, unpack_bits
from ..configs import attention_shape, check_choice, check_group_size, check_nonnegative_int

INT_BITS = (2, 3, 4, 8)
GROUP_SIZES = (32, 64, 128, None)


class IntCodec(Codec):
    """Per-token uniform codes: fields `codes (B, H, T, D*bits/8) uint8`, `scale (B, H, T, D/g) fp16` and, when
    asymmetric, `zero (B, H, T, D/g) fp16` (the value of code 0)."""

    def __init__(self, bits: int, group_size: int | None, symmetric: bool, clip_ratio: float = 1.0):
        super().__init__()
        if symmetric and clip_ratio != 1.0:
            raise ValueError("clip_ratio applies to asymmetric codes only")
        self.bits, self.group_size, self.symmetric, self.clip_ratio = bits, group_size, symmetric, clip_ratio

    def check_head_dim(self, head_dim: int) -> None:
        check_group_size(self.group_size, head_dim)
        if head_dim % 8:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 8 to pack {self.bits}-bit codes")

    def _kernel(self, x: torch.Tensor) -> bool:
        return self.packed_format() is not None and kernels.use_kernels(x.device) and kernels.head_dim_ok(x.shape[-1])

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self._kernel(x):
            b, h, t, d = x.shape
            groups = d // (self.group_size or d)
            out = {
                "codes": torch.empty((b, h, t, d * self.bits // 8), dtype=torch.uint8, device=x.device),
                "scale": torch.empty((b, h, t, groups), dtype=torch.float16, device=x.device),
            }
            if not self.symmetric:
                out["zero"] = torch.empty_like(out["scale"])
            self.encode_into(x, valid, out)
            return out
        # Per-token groups: a padding token only affects its own codes.
        q = quantize_uniform(x, self.bits, axis=-1, group_size=self.group_size, symmetric=self.symmetric,
                             clip_ratio=self.clip_ratio)
        fields = {"codes": pack_bits(q.codes, self.bits), "scale": q.scale}
        if q.zero is not None:
            fields["zero"] = q.zero
        return fields

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        if self._kernel(x):
            kernels.ops.pack_per_token(x, out, self.bits, self.group_size, self.symmetric, self.clip_ratio)
        else:
            super().encode_into(x, valid, out)

    def packed_format(self) -> PackedFormat | None:
        if self.bits not in (2, 4, 8):
            return None  # 3-bit codes straddle bytes: the reference path reads them
        return PackedFormat(kind="uniform", bits=self.bits, channel_group=self.group_size or 0, symmetric=self.symmetric)

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(fields["codes"], self.bits)
        return dequantize_uniform(
            codes, fields["scale"], fields.get("zero"), self.bits, axis=-1, group_size=self.group_size, dtype=dtype
        )


class QuantizedIntCache(QuantizedKVCache):
    """Uniform integer KV cache.

    Args:
        config: the model's config (`model.config`).
        bits: 8 (per-token symmetric by default), 4, 3 or 2 (asymmetric groups along head_dim by default).
        group_size: 32, 64, 128 or None (= one group per head vector). Defaults: None for 8 bits, 32 otherwise.
        symmetric: default True for 8 bits, False otherwise.
        sink_tokens: first tokens kept in the model dtype (default 0).
        residual_length: most recent tokens kept in the model dtype (default 0).
        clip_ratio: asymmetric groups quantize the range [min * r, max * r] (default 1: no clipping).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
    """

    def __init__(
        self,
        config,
        bits: int = 4,
        group_size: int | None = -1,
        *,
        max_cache_len: int | None = None,
        symmetric: bool | None = None,
        sink_tokens: int = 0,
        residual_length: int = 0,
        clip_ratio: float = 1.0,
    ):
        check_choice("bits", bits, INT_BITS, "INT8 is per-token; 4/3/2 bits are group-wise.")
        if group_size == -1:
            group_size = None if bits == 8 else 32
        check_choice("group_size", group_size, GROUP_SIZES, "None means one group per head vector.")
        check_nonnegative_int("sink_tokens", sink_tokens)
        check_nonnegative_int("residual_length", residual_length)
        _, _, head_dim = attention_shape(config)
        check_group_size(group_size, head_dim)
        symmetric = bits == 8 if symmetric is None else bool(symmetric)
        if not 0 < clip_ratio <= 1:
            raise ValueError(f"clip_ratio={clip_ratio!r} must be in (0, 1]")
        self.bits, self.group_size, self.symmetric, self.clip_ratio = bits, group_size, symmetric, clip_ratio
        IntCodec(bits, group_size, symmetric, clip_ratio)  # refuses clipping of symmetric codes up front

        def policy(layer_idx: int) -> LayerPolicy:
            return LayerPolicy(
                key_codec=IntCodec(bits, group_size, symmetric, clip_ratio),
                value_codec=IntCodec(bits, group_size, symmetric, clip_ratio),
                sink_tokens=sink_tokens,
                key_residual_length=residual_length,
                value_residual_length=residual_length,
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)
