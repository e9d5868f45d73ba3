"""KVQuantCache: calibrated non-uniform (NUQ) codes, keys before RoPE, dense-and-sparse outliers (KVQuant, Hooper
et al., NeurIPS 2024, arXiv:2401.18079).

- Keys, per channel: each channel of each kv-head is mapped to [-1, 1] by its calibrated range (the outlier
  thresholds of `hf-kvcache calibrate`) and coded with the layer's key codebook (2^bits centroids fitted by
  sensitivity-weighted k-means). Keys are quantized *before* RoPE, where their channels have stable ranges:
  the cache receives the rotated keys the model stores, undoes the rotation exactly (the model's own rotary
  module, at each token's position; checked against the model's pre-RoPE keys by `KVQuantCache.from_model`)
  and re-applies it to the dequantized keys when they are read.
- Values, per token: each vector is mapped to [-1, 1] by its own min and max (fp16, rounded outward) and coded
  with the layer's value codebook.
- Outliers (dense-and-sparse): each token vector keeps `ceil(outlier_fraction * head_dim)` fixed slots of
  (channel index, fp16 value): for keys the channels farthest outside their calibrated range, for values the
  largest magnitudes. No host round trips and no growing sparse matrices; key outliers beyond the slots clamp.
- The first `sink_tokens` (default 1) tokens stay exact.

Positions: a token's RoPE position is its index in the cache minus its row's left padding (what `generate`
passes as position ids). Fields per token and kv-head, head_dim D, b bits, s slots: `codes D*b/8` bytes, `out_idx s`
bytes, `out_val 2s` bytes; values add fp16 `lo`/`hi` (4 bytes); keys add the token's position (4 bytes, int32,
shared by the kv-heads). At D=64, 3 bits, 1%, 3 kv-heads: 0.22 (keys) and 0.24 (values) of a 16-bit cache.
"""

from __future__ import annotations

import math

import torch

from .. import kernels
from ..cache import Codec, LayerPolicy, QuantizedKVCache
from ..kernels.layout import NUQFormat
from ..patching import LayerRope, layer_ropes, rotate
from ..quant import (
    midrange,
    normalize_per_channel,
    nuq_dequantize,
    nuq_quantize,
    pack_bits,
    round_fp16,
    unpack_bits,
)
from ..configs import attention_shape, check_choice, check_nonnegative_int

KVQUANT_BITS = (2, 3, 4)


def _outlier_slots(fraction: float, head_dim: int) -> int:
    return math.ceil(fraction * head_dim - 1e-9)


def _check_head_dim(head_dim: int) -> None:
    if head_dim % 8 or head_dim > 256:  # slot indices are uint8
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 (packed codes) and at most 256")


def _midpoints(codebook: torch.Tensor) -> torch.Tensor:
    """The decision boundaries of nearest-centroid coding (`quant.nuq_quantize`): `(2^b - 1,)` float32."""
    return (codebook[1:] + codebook[:-1]) / 2


def _scatter_outliers(x: torch.Tensor, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
    """Write the slots' values over `x (..., D)`; a NaN value marks an empty slot (the dense value stays)."""
    if idx.shape[-1] == 0:
        return x
    idx = idx.long()
    cur = x.gather(-1, idx)
    return x.scatter(-1, idx, torch.where(torch.isnan(val), cur, val.to(x.dtype)))


class KVQuantKeyCodec(Codec):
    """Keys: fields `codes (B, H, T, D*b/8) uint8`, `out_idx (B, H, T, s) uint8`, `out_val (B, H, T, s) fp16`
    and, before RoPE, `pos (B, 1, T) int32`. Needs the tokens' positions (`needs_positions`)."""

    needs_positions = True

    def __init__(self, bits: int, codebook: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, slots: int,
                 rope: LayerRope | None):
        super().__init__()
        self.bits, self.slots, self.rope = bits, slots, rope
        self.codebook = codebook.float()
        self.lo, self.hi = lo.float(), hi.float()  # (Hkv, D) calibrated thresholds
        # whether every dense key, rotated (up to sqrt(2) larger), stays inside fp16's range: the kernel's fp16
        # arithmetic (`NUQFormat.fp16`); read once here, never from a decode step
        self._fp16 = float(torch.maximum(self.lo.abs(), self.hi.abs()).max()) * 1.5 < 65504
        self._format: NUQFormat | bool | None = None  # the kernels' view, built on first use
        self._pack_args: tuple | None = None  # the pack kernel's midpoints and normalization, built on first use

    def check_head_dim(self, head_dim: int) -> None:
        _check_head_dim(head_dim)

    def _ranges(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.lo.device != device:
            # once, not a copy every step
            self.lo, self.hi, self.codebook = self.lo.to(device), self.hi.to(device), self.codebook.to(device)
            self._format = self._pack_args = None
        return self.lo[None, :, None], self.hi[None, :, None]  # (1, H, 1, D)

    def packed_format(self) -> NUQFormat | None:
        """The kernels' view (decided once per device): None when the head_dim has no kernel or the model's RoPE
        is not one the kernel can recompute (`LayerRope.frequencies`)."""
        if self._format is None:
            self._format = self._kernel_format() or False  # False: decided, no kernel
        return self._format or None

    def _kernel_format(self) -> NUQFormat | None:
        head_dim = self.lo.shape[-1]
        if not kernels.head_dim_ok(head_dim) or head_dim < 32:
            return None
        inv_freq, scale = None, 1.0
        if self.rope is not None:
            found = self.rope.frequencies(head_dim, self.lo.device)
            if found is None:
                return None
            inv_freq, scale = found
        return NUQFormat(self.bits, self.codebook, self.slots, mid=(self.hi + self.lo) / 2, half=(self.hi - self.lo) / 2,
                         inv_freq=inv_freq, rope_scale=scale, fp16=self._fp16)

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor],
                    positions: torch.Tensor | None = None) -> None:
        self._ranges(x.device)
        fmt = self.packed_format() if kernels.use_kernels(x.device) else None
        if fmt is None:
            super().encode_into(x, valid, out, positions=positions)
            return
        if self._pack_args is None:  # once per device, not every decode step
            norm = tuple(t.contiguous() for t in (self.lo, self.hi, *midrange(self.lo, self.hi)))
            self._pack_args = (_midpoints(self.codebook), norm)
        midpoints, norm = self._pack_args
        kernels.ops.pack_nuq(x, out, fmt, midpoints, key_norm=norm, positions=positions if self.rope is not None else None)

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None, positions: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
        fields = {}
        x = x.float()
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(positions, x.shape[-1])
            x = rotate(x, cos, sin, inverse=True)  # (B, H, T, D) before RoPE
            fields["pos"] = positions.to(torch.int32)[:, None]
        lo, hi = self._ranges(x.device)
        codes = nuq_quantize(normalize_per_channel(x, lo, hi)[0], self.codebook)
        fields["codes"] = pack_bits(codes, self.bits)
        distance = (x - hi).clamp_min(0) + (lo - x).clamp_min(0)
        top = distance.topk(self.slots, dim=-1)
        val = x.gather(-1, top.indices).to(torch.float16)
        fields["out_idx"] = top.indices.to(torch.uint8)
        fields["out_val"] = torch.where(top.values > 0, val, torch.full_like(val, float("nan")))
        return fields

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(fields["codes"], self.bits)
        lo, hi = self._ranges(codes.device)
        x = nuq_dequantize(codes, self.codebook) * ((hi - lo) / 2) + (hi + lo) / 2
        x = _scatter_outliers(x, fields["out_idx"], fields["out_val"])
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(fields["pos"][:, 0], x.shape[-1])
            x = rotate(x, cos, sin)
        return x.to(dtype)


class KVQuantValueCodec(Codec):
    """Values: fields `codes (B, H, T, D*b/8) uint8`, `lo`/`hi (B, H, T, 1) fp16` (the inliers' range, rounded
    outward), `out_idx (B, H, T, s) uint8`, `out_val (B, H, T, s) fp16`."""

    def __init__(self, bits: int, codebook: torch.Tensor, slots: int):
        super().__init__()
        self.bits, self.codebook, self.slots = bits, codebook.float(), slots
        self._midpoints = _midpoints(self.codebook)  # the pack kernel's decision boundaries

    def check_head_dim(self, head_dim: int) -> None:
        _check_head_dim(head_dim)

    def packed_format(self) -> NUQFormat:
        return NUQFormat(self.bits, self.codebook, self.slots)

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor]) -> None:
        if not (kernels.use_kernels(x.device) and kernels.head_dim_ok(x.shape[-1]) and x.shape[-1] >= 32):
            super().encode_into(x, valid, out)
            return
        if self.codebook.device != x.device:  # once per device, with the midpoints
            self.codebook = self.codebook.to(x.device)
            self._midpoints = _midpoints(self.codebook)
        kernels.ops.pack_nuq(x, out, self.packed_format(), self._midpoints)

    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        x = x.float()
        top = x.abs().topk(self.slots, dim=-1)
        outlier = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, top.indices, True)
        lo = round_fp16(torch.where(outlier, float("inf"), x).amin(-1, keepdim=True), "down")
        hi = round_fp16(torch.where(outlier, float("-inf"), x).amax(-1, keepdim=True), "up")
        mid, half = (hi.float() + lo.float()) / 2, ((hi.float() - lo.float()) / 2).clamp_min(1e-30)
        codes = nuq_quantize(((x - mid) / half).clamp(-1, 1), self.codebook)
        return {
            "codes": pack_bits(codes, self.bits), "lo": lo, "hi": hi,
            "out_idx": top.indices.to(torch.uint8), "out_val": x.gather(-1, top.indices).to(torch.float16),
        }

    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(fields["codes"], self.bits)
        lo, hi = fields["lo"].float(), fields["hi"].float()
        x = nuq_dequantize(codes, self.codebook) * ((hi - lo) / 2) + (hi + lo) / 2
        return _scatter_outliers(x, fields["out_idx"], fields["out_val"]).to(dtype)


class KVQuantCache(QuantizedKVCache):
    """KVQuant KV cache. Build it with `KVQuantCache.from_model(model, calibration, bits=3)` (or
    `make_cache("kvquant-3", model)`): pre-RoPE keys need the model's rotary embedding.

    Args:
        config: the model's config.
        bits: 2, 3 or 4.
        calibration: a `hf_kvcache.calibration.Calibration`, the path of an artifact, or None for the one
            `hf-kvcache calibrate` stored for this model.
        ropes: each layer's `LayerRope` (what `from_model` finds); required when `pre_rope`.
        outlier_fraction: share of each token vector kept exact in sparse slots (default 0.01; 0 turns the
            sparse part off and clamps to the calibrated ranges).
        sink_tokens: first tokens kept exact (default 1).
        max_cache_len: the capacity pinned: storage for this many tokens allocated up front, and `generate`
            compiles the decode step (`torch.compile`, CUDA graphs); None (default): a capacity that grows as tokens
            come (on CUDA its eager decode steps replay CUDA graphs).
        pre_rope: quantize keys before RoPE (default True; False is the post-RoPE ablation, with the
            calibration's post-RoPE thresholds and codebooks).
        nuq: the calibrated codebooks (default True; False is the uniform ablation: 2^bits evenly spaced levels
            over the same ranges).
    """

    def __init__(
        self,
        config,
        bits: int = 3,
        *,
        max_cache_len: int | None = None,
        calibration=None,
        ropes: list[LayerRope] | None = None,
        outlier_fraction: float = 0.01,
        sink_tokens: int = 1,
        pre_rope: bool = True,
        nuq: bool = True,
    ):
        from ..artifact import find

        check_choice("bits", bits, KVQUANT_BITS)
        check_nonnegative_int("sink_tokens", sink_tokens)
        if not 0 <= outlier_fraction < 0.5:
            raise ValueError(f"outlier_fraction={outlier_fraction!r} must be in [0, 0.5) (KVQuant uses 0.01)")
        num_layers, _, head_dim = attention_shape(config)
        if pre_rope and (ropes is None or len(ropes) != num_layers):
            raise ValueError(
                "pre-RoPE keys need the model's rotary embedding: build the cache with "
                "KVQuantCache.from_model(model, ...) or make_cache('kvquant-3', model), or pass pre_rope=False"
            )
        cal = find(config, calibration)
        self.bits, self.outlier_fraction, self.sink_tokens = bits, outlier_fraction, sink_tokens
        self.pre_rope, self.nuq, self.calibration = pre_rope, nuq, cal
        slots = _outlier_slots(outlier_fraction, head_dim)
        uniform = torch.linspace(-1, 1, 2**bits)

        def policy(layer_idx: int) -> LayerPolicy:
            k_book = cal.codebook(layer_idx, "keys", bits, pre_rope) if nuq else uniform
            v_book = cal.codebook(layer_idx, "values", bits) if nuq else uniform
            lo, hi = cal.key_range(layer_idx, pre_rope)
            return LayerPolicy(
                key_codec=KVQuantKeyCodec(bits, k_book, lo, hi, slots, ropes[layer_idx] if pre_rope else None),
                value_codec=KVQuantValueCodec(bits, v_book, slots),
                sink_tokens=sink_tokens,
            )

        super().__init__(config, policy, max_cache_len=max_cache_len)

    @classmethod
    def from_model(cls, model, calibration=None, **kwargs) -> KVQuantCache:
        """The cache for `model`: finds each layer's rotary embedding (one probe forward pass with temporary
        hooks, see `hf_kvcache.patching.layer_ropes`) unless `pre_rope=False`."""
        ropes = layer_ropes(model) if kwargs.get("pre_rope", True) else None
        return cls(model.config, calibration=calibration, ropes=ropes, **kwargs)
