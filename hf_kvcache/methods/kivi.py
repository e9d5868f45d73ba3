"""KIVICache: keys quantized per channel, values per token, the most recent tokens kept exact (KIVI, Liu et al.,
ICML 2024, arXiv:2402.02750, Algorithm 1).

- Keys: each group is `group_size` (G) consecutive tokens of one channel, asymmetric min/max. New keys wait in
  the residual; once it holds `residual_length` (R) tokens, all R are quantized (R / G groups) and packed. At
  prefill the first T - (T mod R) tokens are packed at once. Packed keys are never touched again.
- Values: each group is G consecutive channels of one token. The last R tokens stay exact (a FIFO); each token
  that leaves the window is quantized and packed.
- Beyond the paper: `sink_tokens` first tokens kept exact (attention sinks), and left padding never enters a key
  group's range (the reference implementation lets it in, which costs batched accuracy). Padding is known where
  transformers passes position ids to the cache (5.24 and later; see `_compat.left_padding`).

Per token and kv-head, for head_dim D and b bits: keys `D*b/8` bytes of codes + `2*2*D/G` bytes of fp16 scale and
zero (amortized over the G tokens of a block); values `D*b/8` + `2*2*D/G`. At b=2, G=32: 0.1875 of a 16-bit
cache, plus the residual window and the sinks in the model dtype.
"""

from __future__ import annotations

import torch

from .. import kernels
from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import PackedFormat
from ..quant import dequantize_uniform, pack_bits, quantize_uniform, unpack_bits
from ..configs import attention_shape, check_choice, check_group_size, check_nonnegative_int
from .int import IntCodec

KIVI_BITS = (2, 3, 4, 8)
KIVI_GROUPS = (32, 64, 128)
# With `key_range_search`, each end of a key group's range may move inward by one of these fractions of it; the
# pair with the least squared error wins (25 candidates, tried once per block when the window flushes).
KEY_RANGE_GRID = (0.0, 0.05, 0.10, 0.15, 0.20)


class PerChannelKeyCodec(Codec):
    """Blocks of G tokens quantized per channel: fields `codes (B, H, n, G, D*bits/8) uint8` (each token's codes
    packed along D), `scale (B, H, n, D) fp16` and `zero (B, H, n, D) fp16`, n = blocks."""

    skips_incomplete_blocks = True  # `encode(complete=)`, see there

    def __init__(self, bits: int, group_size: int, range_search: tuple[float, ...] | None = None):
        super().__init__()
        self.bits = bits
        self.block_size = group_size
        self.range_search = range_search

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % 8:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 8 to pack {self.bits}-bit codes")

    def _kernel(self, x: torch.Tensor) -> bool:
        return (
            self.packed_format() is not None and kernels.use_kernels(x.device) and kernels.head_dim_ok(x.shape[-1])
            and (self.range_search is None or len(self.range_search) == 5)
        )

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor],
                    complete: torch.Tensor | None = None) -> None:
        if self._kernel(x):
            kernels.ops.pack_per_channel(x, out, self.bits, self.block_size, valid, self.range_search, complete)
        else:
            super().encode_into(x, valid, out)

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None,
               complete: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`complete (n,)` bool (a compiled or CUDA-graphed step, which packs the newest token's block every step):
        blocks not complete yet are never read, and the kernel writes them as zeros without quantizing; the reference
        quantizes every block."""
        b, h, t, d = x.shape
        g = self.block_size
        if self._kernel(x):
            out = {
                "codes": torch.empty((b, h, t // g, g, d * self.bits // 8), dtype=torch.uint8, device=x.device),
                "scale": torch.empty((b, h, t // g, d), dtype=torch.float16, device=x.device),
                "zero": torch.empty((b, h, t // g, d), dtype=torch.float16, device=x.device),
            }
            self.encode_into(x, valid, out, complete)
            return out
        blocks = x.float().reshape(b, h, t // g, g, d)  # (B, H, n, G, D): a group is one channel of a block
        # Traced (a pinned capacity under torch.compile), the fill runs always: a no-op where every token is valid.
        if valid is not None and (torch.compiler.is_compiling() or not bool(valid.all())):
            blocks = _fill_padding(blocks, valid.reshape(b, 1, t // g, g, 1))
        q = quantize_uniform(blocks, self.bits, axis=3, group_size=None, range_search=self.range_search)
        return {"codes": pack_bits(q.codes, self.bits), "scale": q.scale.squeeze(3), "zero": q.zero.squeeze(3)}

    def packed_format(self) -> PackedFormat | None:
        if self.bits not in (2, 4, 8):
            return None  # 3-bit codes straddle bytes: the reference path reads them
        return PackedFormat(kind="uniform", bits=self.bits, token_group=self.block_size, channel_group=1)

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(fields["codes"], self.bits)  # (B, H, n, G, D)
        x = dequantize_uniform(
            codes, fields["scale"].unsqueeze(3), fields["zero"].unsqueeze(3), self.bits, axis=3, dtype=dtype
        )
        b, h, n, g, d = x.shape
        return x.reshape(b, h, n * g, d)


def _fill_padding(blocks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Replace padding tokens of each channel group by the group's first valid value, so that they neither
    widen the range nor cost precision (their codes are never attended to). A group with no valid token takes
    its first token's value (a constant group, never read)."""
    valid = valid.expand_as(blocks)
    # The first valid value of each (block, channel): argmax over the token axis of the validity mask.
    first = valid.to(torch.uint8).argmax(dim=3, keepdim=True)
    fill = blocks.gather(3, first)
    return torch.where(valid, blocks, fill)


class KIVICache(QuantizedKVCache):
    """KIVI KV cache.

    Args:
        config: the model's config (`model.config`).
        bits: 2, 3, 4 or 8.
        group_size: G, 32, 64 or 128: tokens per key group, channels per value group (must divide head_dim).
        residual_length: R, the exact window, a positive multiple of G (default 128).
        sink_tokens: first tokens kept exact (default 0, KIVI as published).
        key_range_search: choose each key group's range by least squared error over `KEY_RANGE_GRID` instead of
            min/max (default False, KIVI as published). Same bytes; measured to help 2-bit keys on the default
            model (see the README's KIVI section).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
    """

    def __init__(
        self,
        config,
        bits: int = 2,
        group_size: int = 32,
        residual_length: int = 128,
        *,
        max_cache_len: int | None = None,
        sink_tokens: int = 0,
        key_range_search: bool = False,
    ):
        check_choice("bits", bits, KIVI_BITS)
        check_choice("group_size", group_size, KIVI_GROUPS)
        check_nonnegative_int("sink_tokens", sink_tokens)
        check_nonnegative_int("residual_length", residual_length)
        if residual_length == 0 or residual_length % group_size:
            raise ValueError(
                f"residual_length={residual_length} must be a positive multiple of group_size={group_size}: keys "
                "are quantized in whole groups of tokens when the window fills (e.g. residual_length=128)"
            )
        _, _, head_dim = attention_shape(config)
        check_group_size(group_size, head_dim)
        self.bits, self.group_size, self.residual_length, self.sink_tokens = bits, group_size, residual_length, sink_tokens
        self.key_range_search = bool(key_range_search)
        grid = KEY_RANGE_GRID if key_range_search else None

        def policy(layer_idx: int) -> LayerPolicy:
            return LayerPolicy(
                key_codec=PerChannelKeyCodec(bits, group_size, grid),
                value_codec=IntCodec(bits, group_size, symmetric=False),
                sink_tokens=sink_tokens,
                key_residual_length=residual_length,
                value_residual_length=residual_length,
                key_flush="block",
                value_flush="fifo",
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)
