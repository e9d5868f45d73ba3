"""What the kernels need to know about a codec's packed fields: `PackedFormat`. Plain Python, no Triton.

A codec that the kernels can read returns a `PackedFormat` from `Codec.packed_format()`. The field layouts it
promises (B = batch, H = kv-heads, D = head_dim, b = bits, rows along axis 2 as `_Rows` stores them):

- `kind="fp8-e4m3" | "fp8-e5m2"`: `codes (B, H, T, D) uint8` (raw fp8 bytes); the value is `fp8(code) * scale`
  with `scale (B or 1, H) float32` held in the format itself (one per sequence and kv-head).
- `kind="exact"`: `codes (B, H, T, D)` in the model dtype, the values themselves (scale 1).
- `kind="uniform"`, `token_group=1` (per-token groups of `channel_group` channels): `codes (B, H, T, D*b/8) uint8`
  (packed little-endian, see `hf_kvcache.quant.pack_bits`), `scale (B, H, T, D/channel_group) fp16` and, when
  asymmetric, `zero` of the same shape. The value is `code * scale + zero`, or `(code - 2^(b-1)) * scale` when
  symmetric.
- `kind="uniform"`, `token_group=G > 1`, `channel_group=1` (KIVI keys, per channel over blocks of G tokens):
  `codes (B, H, n, G, D*b/8) uint8`, `scale (B, H, n, D) fp16`, `zero (B, H, n, D) fp16`.

KVQuant's non-uniform codes are described by `NUQFormat` (kernels in `nuq.py`), TurboQuant's codebook codes by
`CodebookFormat` (kernels in `turbo.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_KINDS = ("fp8-e4m3", "fp8-e5m2")
# Formats read element by element with one scale per kv-head: FP8 bytes, or the model dtype itself ("exact").
SCALED_KINDS = FP8_KINDS + ("exact",)


@dataclass(frozen=True)
class PackedFormat:
    kind: str  # "fp8-e4m3" | "fp8-e5m2" | "exact" | "uniform"
    bits: int = 8
    token_group: int = 1  # consecutive tokens that share one scale (and zero) per channel
    channel_group: int = 0  # consecutive channels that share one scale (and zero) per token; 0 = head_dim
    symmetric: bool = False
    scale: torch.Tensor | None = None  # fp8 only: (B or 1, H) float32

    def __post_init__(self):
        if self.kind not in SCALED_KINDS + ("uniform",):
            raise ValueError(f"unknown packed format kind {self.kind!r}")
        if self.kind == "uniform" and self.bits not in (2, 4, 8):
            raise ValueError(f"the kernels read 2, 4 or 8-bit codes, not {self.bits}")
        if self.token_group > 1 and self.channel_group != 1:
            raise ValueError("a format with token groups must quantize each channel separately (channel_group=1)")


@dataclass
class StreamTensors:
    """One stream (keys or values) of a layer as the fused attention reads it, places in token order.

    `sink (B, H, n_sink, D)` and `residual (B, H, n_residual, D)` in the model dtype (None when empty);
    `fields`: the packed fields (views of the storage, layouts as in `PackedFormat`), empty when nothing is packed
    yet; `n_packed` counts packed tokens.
    """

    sink: torch.Tensor | None
    fields: dict[str, torch.Tensor]
    fmt: PackedFormat
    n_packed: int
    residual: torch.Tensor | None


@dataclass(frozen=True)
class StaticLayout:
    """How a layer's places split its tokens (`hf_kvcache.storage`), which the kernels derive on the
    device from `length`, a 0-dim int64 tensor: the tokens held after this step's update (at most `capacity`), or a
    `(B,)` one, a length per batch row (packed pages read requests of different lengths in one launch). The first
    `min(length, sink_tokens)` are sinks; of the rest, a stream with `ring = 0` reads all from the packed place; with
    `window` (a FIFO window, every token also packed) the last `min(rest, ring)` from a ring of `ring` rows; without
    (block flush, KIVI's keys) the `rest % ring` newest from the ring's first rows."""

    length: torch.Tensor
    capacity: int  # max_cache_len: the kernels never read past it, whatever `length` says
    sink_tokens: int = 0
    key_ring: int = 0
    value_ring: int = 0
    key_window: bool = False
    value_window: bool = False


@dataclass(frozen=True)
class NUQFormat:
    """KVQuant's fields (`hf_kvcache.methods.kvquant`): `codes (B, H, T, D*b/8) uint8` (a little-endian bit stream of
    b-bit indices into `codebook`), `out_idx (B, H, T, s) uint8` and `out_val (B, H, T, s) fp16` (outlier slots,
    NaN = empty). Keys: per-channel ranges `mid`/`half (H, D) float32` (value = codebook[code] * half + mid) and,
    with `inv_freq (D/2,) float32`, pre-RoPE storage with `pos (B, 1, T) int32`: the read applies RoPE at `pos`
    (angles pos * inv_freq, times `rope_scale`). Values: per-token `lo`/`hi (B, H, T, 1) fp16` (mid and half
    from them). `fp16`: every dequantized value fits fp16's range (the slots and the values' ranges are fp16; the
    keys' `mid`/`half` were checked when their codec was built), so the kernel may dequantize in fp16."""

    bits: int
    codebook: torch.Tensor  # (2^b,) float32, ascending
    slots: int
    mid: torch.Tensor | None = None
    half: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None
    rope_scale: float = 1.0
    kind: str = "nuq"
    token_group: int = 1
    fp16: bool = True

    def __post_init__(self):
        if self.bits not in (2, 3, 4) or self.codebook.numel() != 2**self.bits:
            raise ValueError(f"a NUQ format has 2, 3 or 4 bits and 2^bits centroids, got {self.bits} bits and "
                             f"{self.codebook.numel()} centroids")


@dataclass(frozen=True)
class CodebookPart:
    """`width` channels of the frame from `start`, coded against one fixed `codebook (2^bits,) float32` (indexed by
    code) with one length per token: `codes (B, H, T, width*bits/8) uint8` and `norm (B, H, T, 1) fp16` (field
    names). The value of channel c is `norm * codebook[code_c]`. Codes are `quant.pack_bits` little-endian for 1, 2
    and 4 bits; 3-bit codes are two planes, the low two bits (`width / 4` bytes, 2-bit layout) then the top bit
    (`width / 8` bytes, 1-bit layout). A 4-bit codebook the kernel looks up in registers is in sign-magnitude order
    (`codebook[8 + j] = -codebook[j] >= 0`, ascending in j)."""

    codes: str
    norm: str
    bits: int
    start: int
    width: int
    codebook: torch.Tensor
    levels: tuple[float, ...] = ()  # the codebook as numbers, filled in: what a traced graph holds as constants

    def __post_init__(self):
        if self.codebook.numel() != 1 << self.bits:
            raise ValueError(f"a {self.bits}-bit codebook part needs {1 << self.bits} centroids, got "
                             f"{self.codebook.numel()}")
        object.__setattr__(self, "levels", tuple(self.codebook.tolist()))


@dataclass(frozen=True)
class CodebookFormat:
    """TurboQuant's fields (`hf_kvcache.methods.turboquant`): every stored vector is `x F`, its channels coded part by
    part (`parts`, covering 0..D in order). F is orthogonal, `F = P R` (`frame(device) -> (R, order)`):
    `order (B, H, D)` uint8 a channel order per sequence and kv-head (`(x P)_j = x[order_j]`; None: the identity) and
    `R (D, D)` float32 a rotation shared by every sequence and head. The order costs D bytes a sequence and head where
    a whole F would cost 4 D^2."""

    parts: tuple[CodebookPart, ...]
    frame: Callable[[torch.device], tuple[torch.Tensor, torch.Tensor | None]]
    kind: str = "codebook"
    token_group: int = 1
