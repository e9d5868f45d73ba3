"""Reference codecs in plain PyTorch: the statement of every number format the caches store.

Everything here is exact about what is stored and how it is read back; the Triton kernels accelerate these
functions and are tested against them.

- Uniform integer quantization, 1 to 8 bits, symmetric or asymmetric, along any axis, in groups of any size
  that divides that axis. Codes are unsigned (`uint8`, one code per element before packing): asymmetric codes
  are `0 .. 2^bits - 1` and decode as `code * scale + zero`; symmetric codes are offset by `2^(bits-1)` and
  decode as `(code - 2^(bits-1)) * scale`.
- Scales and zeros are stored in fp16. They are rounded *outward* (zero down, scale up) so that every input in
  the group stays inside the representable range: the reconstruction error is at most half a step of the
  stored scale, and a constant group gets a zero scale without ever dividing by it.
- Bit packing: 8 codes of `bits` bits become `bits` bytes, little-endian, so 4-bit byte `i` holds elements
  `2i` (low nibble) and `2i + 1` (high nibble) and 2-bit byte `i` holds elements `4i .. 4i+3` from the low bits up.
- FP8 E4M3 and E5M2 with a scale of any shape that broadcasts (per tensor, per kv-head, per token). Every cast
  clamps to the format's finite range first: what torch does past the maximum differs between versions (NaN on
  torch 2.11, saturation on 2.13 CPU), so we never rely on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
_FP16_MAX = torch.finfo(torch.float16).max

FP8_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "e4m3": (torch.float8_e4m3fn, 448.0),
    "e5m2": (torch.float8_e5m2, 57344.0),
}
UNIFORM_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


# --------------------------------------------------------------------------------------------------- packing


def packed_size(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits occupy (`n` must be a multiple of 8)."""
    return n * bits // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes along the last axis: `(..., n) uint8 -> (..., n * bits / 8) uint8`.

    Every run of 8 codes becomes `bits` bytes, little-endian (see the module docstring).
    """
    _check_bits(bits)
    n = codes.shape[-1]
    if n % 8:
        raise ValueError(f"pack_bits needs a multiple of 8 codes along the last axis, got {n}")
    if bits == 8:
        return codes.to(torch.uint8)
    words = codes.to(torch.int64).reshape(*codes.shape[:-1], n // 8, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (words << shifts).sum(-1)  # (..., n/8): 8 * bits <= 64 bits, no overflow
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    out = (word.unsqueeze(-1) >> byte_shifts) & 0xFF  # (..., n/8, bits)
    return out.reshape(*codes.shape[:-1], n * bits // 8).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: `(..., m) uint8 -> (..., m * 8 / bits) uint8`."""
    _check_bits(bits)
    m = packed.shape[-1]
    if m % bits:
        raise ValueError(f"unpack_bits needs a multiple of {bits} bytes along the last axis, got {m}")
    if bits == 8:
        return packed
    if 8 % bits == 0:  # 1, 2, 4 bits: codes never straddle a byte, shifts are enough
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=packed.device, dtype=torch.uint8) * bits
        out = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        return out.reshape(*packed.shape[:-1], m * per_byte)
    groups = packed.to(torch.int64).reshape(*packed.shape[:-1], m // bits, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (groups << byte_shifts).sum(-1)  # (..., m/bits)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    out = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., m/bits, 8)
    return out.reshape(*packed.shape[:-1], m * 8 // bits).to(torch.uint8)


# --------------------------------------------------------------------------------------- uniform integers


@dataclass
class UniformQuantized:
    """Result of `quantize_uniform`. `codes` has the input's shape (unpacked, uint8); `scale` and `zero` have
    the input's shape with `axis` replaced by the number of groups (`zero` is None when symmetric)."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None


def _check_bits(bits: int) -> None:
    if bits not in UNIFORM_BITS:
        raise ValueError(f"bits must be one of {UNIFORM_BITS}, got {bits!r}")


def _grouped(x: torch.Tensor, axis: int, group_size: int | None) -> tuple[torch.Tensor, int]:
    """Move `axis` last and split it into groups: `(..., n) -> (..., n / g, g)`."""
    x = x.movedim(axis, -1)
    n = x.shape[-1]
    g = n if group_size is None else group_size
    if g <= 0 or n % g:
        raise ValueError(f"group_size {group_size} does not divide the quantized axis of size {n}")
    return x.reshape(*x.shape[:-1], n // g, g), g


def _ungrouped(x: torch.Tensor, axis: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-2], -1).movedim(-1, axis)


def _ieee_div(x: torch.Tensor, n: int) -> torch.Tensor:
    """`x / n` correctly rounded on every device, as the kernels divide. On CUDA PyTorch turns a division by a
    Python number into a product with its reciprocal, which can land one float32 step off; an fp16 scale rounded
    up from an exact quotient then moves to the next fp16 value. A divisor on x's device is divided exactly."""
    return x / torch.tensor(float(n), device=x.device)


def round_fp16(x: torch.Tensor, direction: str) -> torch.Tensor:
    """Round float32 `x` to the nearest fp16 value that is >= x (`"up"`) or <= x (`"down"`), clamped to fp16's range."""
    x = x.float().clamp(-_FP16_MAX, _FP16_MAX)
    h = x.to(torch.float16)
    if direction == "up":
        return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, float("inf"))), h)
    if direction == "down":
        return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)
    raise ValueError(direction)


def quantize_uniform(
    x: torch.Tensor,
    bits: int,
    *,
    axis: int = -1,
    group_size: int | None = None,
    symmetric: bool = False,
    range_search: tuple[float, ...] | None = None,
    clip_ratio: float = 1.0,
) -> UniformQuantized:
    """Uniform integer quantization of `x` in groups of `group_size` consecutive elements along `axis`
    (`None`: the whole axis is one group). Returns unpacked codes and fp16 scales (and zeros).

    `range_search` (asymmetric only): fractions of a group's range by which each end may move inward; every
    pair is tried and each group keeps the range with the least squared error (values outside it saturate).
    None: min/max, whose error is at most half a step.
    `clip_ratio` (asymmetric only, in (0, 1]): the range is [min * r, max * r] (QuaRot's clipping: values beyond
    it saturate, the step shrinks).
    """
    if not 0 < clip_ratio <= 1:
        raise ValueError(f"clip_ratio={clip_ratio!r} must be in (0, 1]")
    _check_bits(bits)
    xg, _ = _grouped(x.float(), axis, group_size)  # (..., n/g, g)
    if symmetric:
        if bits < 2:
            raise ValueError("symmetric quantization needs at least 2 bits")
        if clip_ratio != 1:
            raise ValueError("clip_ratio applies to asymmetric quantization only")
        if range_search:
            raise ValueError("range_search applies to asymmetric quantization only")
        qmax = 2 ** (bits - 1) - 1
        absmax = xg.abs().amax(-1, keepdim=True)
        scale = round_fp16(_ieee_div(absmax, qmax), "up")
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
        q = torch.round(xg / safe).clamp(-qmax, qmax) + 2 ** (bits - 1)
        return UniformQuantized(_ungrouped(q.to(torch.uint8), axis), _ungrouped(scale, axis), None)
    lo, hi = xg.amin(-1, keepdim=True) * clip_ratio, xg.amax(-1, keepdim=True) * clip_ratio
    q, scale, zero = _asymmetric(xg, lo, hi, bits)
    if range_search:
        best = (_dequantized(q, scale, zero) - xg).pow(2).sum(-1, keepdim=True)
        width = hi - lo
        for a in range_search:
            for b in range_search:
                if a == b == 0 or a + b >= 1:
                    continue
                cq, cs, cz = _asymmetric(xg, lo + a * width, hi - b * width, bits)
                err = (_dequantized(cq, cs, cz) - xg).pow(2).sum(-1, keepdim=True)
                better = err < best
                q, scale, zero = torch.where(better, cq, q), torch.where(better, cs, scale), torch.where(better, cz, zero)
                best = torch.minimum(err, best)
    return UniformQuantized(_ungrouped(q.to(torch.uint8), axis), _ungrouped(scale, axis), _ungrouped(zero, axis))


def _asymmetric(xg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int):
    """Codes, fp16 scale and fp16 zero for the range [lo, hi] of each group (last axis), rounded outward."""
    qmax = 2**bits - 1
    zero = round_fp16(lo, "down")
    scale = round_fp16(_ieee_div(hi - zero.float(), qmax), "up")
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(hi))
    q = torch.round((xg - zero.float()) / safe).clamp(0, qmax)
    return q, scale, zero


def _dequantized(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return q * scale.float() + zero.float()


def dequantize_uniform(
    codes: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    bits: int,
    *,
    axis: int = -1,
    group_size: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of `quantize_uniform` (codes unpacked). Symmetric when `zero` is None."""
    cg, g = _grouped(codes, axis, group_size)
    s = scale.movedim(axis, -1).unsqueeze(-1).float()
    if zero is None:
        out = (cg.float() - 2 ** (bits - 1)) * s
    else:
        out = cg.float() * s + zero.movedim(axis, -1).unsqueeze(-1).float()
    return _ungrouped(out, axis).to(dtype)


# --------------------------------------------------------------------------------------------------- fp8


def _fp8(fmt: str) -> tuple[torch.dtype, float]:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    return FP8_FORMATS[fmt]


def fp8_max(fmt: str) -> float:
    """Largest finite value of the format (448 for e4m3, 57344 for e5m2)."""
    return _fp8(fmt)[1]


def fp8_scale(x: torch.Tensor, fmt: str, dims: tuple[int, ...] | None = None, headroom: float = 1.0) -> torch.Tensor:
    """Scale that maps `headroom * amax(|x|)` over `dims` (None: all) to the format's maximum, float32, kept dims.
    An all-zero reduction gets scale 1 (never a division by zero)."""
    amax = x.float().abs().amax() if dims is None else x.float().abs().amax(dim=dims, keepdim=True)
    scale = amax * headroom / fp8_max(fmt)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize_fp8(x: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float = 1.0) -> torch.Tensor:
    """`x / scale`, clamped to the finite range, cast to fp8 and returned as its raw bytes (`uint8`, x's shape)."""
    dtype, fmax = _fp8(fmt)
    y = (x.float() / scale).clamp(-fmax, fmax)
    return y.to(dtype).view(torch.uint8)


def dequantize_fp8(
    codes: torch.Tensor, fmt: str = "e4m3", scale: torch.Tensor | float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8`: raw fp8 bytes times `scale`."""
    fp8_dtype, _ = _fp8(fmt)
    return (codes.view(fp8_dtype).float() * scale).to(dtype)


# ----------------------------------------------------------------------------------- non-uniform (NUQ) codebooks


def nuq_quantize(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Nearest-centroid codes of normalized values: `x (...)`, `codebook (2^bits,)` sorted ascending ->
    `uint8 (...)`. Ties go to the lower centroid; values beyond the ends take the end codes."""
    if codebook.ndim != 1 or codebook.numel() > 256:
        raise ValueError(f"a NUQ codebook is a 1-D tensor of at most 256 centroids, got shape {tuple(codebook.shape)}")
    # Checked in eager code (the first write of every cache is eager); a traced decode step cannot read a value back.
    if not torch.compiler.is_compiling() and codebook.numel() > 1 and not bool((codebook[1:] >= codebook[:-1]).all()):
        raise ValueError("a NUQ codebook must be sorted ascending")
    cb = codebook.to(device=x.device, dtype=torch.float32)
    midpoints = (cb[1:] + cb[:-1]) / 2
    return torch.bucketize(x.float(), midpoints, right=False).to(torch.uint8)


def nuq_dequantize(codes: torch.Tensor, codebook: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `nuq_quantize`: the centroid of each code, `(...)` in `dtype`."""
    return codebook.to(device=codes.device, dtype=torch.float32)[codes.long()].to(dtype)


def midrange(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mid, half)` of the range [lo, hi], the half clamped above 0 so that a constant range never divides by 0:
    the normalization `(x - mid) / half` of the NUQ quantizers (and their pack kernel)."""
    return (hi + lo) / 2, ((hi - lo) / 2).clamp_min(torch.finfo(torch.float32).tiny)


def normalize_per_channel(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys against calibrated per-channel ranges (KVQuant): `x (..., H, D)`, `lo`/`hi (H, D)` -> the values mapped
    to [-1, 1] by `(x - mid) / half` and a bool mask of the outliers (outside `[lo, hi]`)."""
    mid, half = midrange(lo, hi)
    outlier = (x < lo) | (x > hi)
    return ((x - mid) / half).clamp(-1, 1), outlier


def normalize_per_token(x: torch.Tensor, outliers: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values per vector (KVQuant's per-token dense-and-sparse split): `x (..., D)`; the `outliers` elements of
    largest magnitude in each vector are set apart, the rest are mapped to [-1, 1] by their own min and max.
    Returns `(normalized (..., D), outlier mask (..., D), lo (..., 1), hi (..., 1))`."""
    if outliers:
        idx = x.abs().topk(outliers, dim=-1).indices
        mask = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx, True)
    else:
        mask = torch.zeros_like(x, dtype=torch.bool)
    inner = x.masked_fill(mask, float("nan"))
    lo = torch.where(mask, float("inf"), x).amin(-1, keepdim=True)
    hi = torch.where(mask, float("-inf"), x).amax(-1, keepdim=True)
    mid, half = midrange(lo, hi)
    normalized = ((inner - mid) / half).clamp(-1, 1).nan_to_num(0.0)
    return normalized, mask, lo, hi


# ------------------------------------------------------------------------------------------------ rotations


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalized Walsh-Hadamard transform along the last axis (a power of two, D): `x @ H / sqrt(D)` with H the
    Sylvester Hadamard matrix, in float32 by log2(D) butterflies. Orthogonal and its own inverse."""
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"the Walsh-Hadamard transform needs a power-of-two length, got {d}")
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2).view(-1, d)
        h *= 2
    return (y * d**-0.5).view(x.shape)
