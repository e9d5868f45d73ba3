"""ExactCache: K/V in the model dtype, nothing quantized, through the same core, places and kernels as the
quantized methods.

It is the 16-bit baseline that shows what quantization itself gains: built with `max_cache_len`, it is the compiled
static cache that reads only its filled tokens and never repeats K/V per query head, which transformers' own
`StaticCache` does (docs/design.md, "Capacity: growing or pinned"); a quantized cache compiled the same way differs
from it by its bytes alone. Per token and kv-head: `D` elements of the model dtype, the size of a DynamicCache.
"""

from __future__ import annotations

import torch

from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import PackedFormat
from ..configs import check_nonnegative_int


class ExactCodec(Codec):
    """Field `codes (B, H, T, D)` in the model dtype: the values themselves."""

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {"codes": x.clone()}

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        out["codes"].copy_(x)

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return fields["codes"].to(dtype)

    def packed_format(self) -> PackedFormat:
        return PackedFormat(kind="exact")


class ExactCache(QuantizedKVCache):
    """The unquantized cache in the model dtype (spec `exact`).

    Args:
        config: the model's config (`model.config`).
        sink_tokens: accepted for symmetry with the other methods (every token is exact anyway; default 0).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
    """

    def __init__(self, config, *, max_cache_len: int | None = None, sink_tokens: int = 0):
        check_nonnegative_int("sink_tokens", sink_tokens)

        def policy(layer_idx: int) -> LayerPolicy:
            return LayerPolicy(key_codec=ExactCodec(), value_codec=ExactCodec(), sink_tokens=sink_tokens)

        super().__init__(config, policy, max_cache_len=max_cache_len)
