"""Launchers of `pack.py`'s kernels: model-dtype K/V to codes and scales in one pass, written in place into a cache's
storage (per-token integer groups, KIVI's per-channel key blocks, fp8, TurboQuant's codebook codes), each the same
numbers as its reference codec. Under torch.compile each calls its operator (`library`) instead. KVQuant's pack
kernel is `nuq.py`'s (`nuq_launch.pack_nuq`). Beside its kernel module (`launch.py` says why).
"""

from __future__ import annotations

import torch

from .launch import _PACK_BLOCK_T, _bh_t_strides, _compiling, _copy_fields, fp8_native, on_input_device


@on_input_device
def pack_per_token(
    x: torch.Tensor, out: dict[str, torch.Tensor], bits: int, group_size: int | None, symmetric: bool,
    clip_ratio: float = 1.0, _eager: bool = False,
) -> None:
    """`x (B, H, T, D)` -> `out["codes"] (B, H, T, D*bits/8) uint8`, `out["scale"]` (and `out["zero"]` unless
    symmetric) `(B, H, T, D/group) fp16`, written in place (any views with a contiguous last axis).
    Same numbers as `quant.quantize_uniform(x, bits, axis=-1, group_size=group_size, symmetric=symmetric,
    clip_ratio=clip_ratio)`."""
    from . import pack

    if not _eager and _compiling():
        fields = torch.ops.hf_kvcache.pack_per_token(x, bits, group_size or 0, symmetric, float(clip_ratio))
        _copy_fields(out, fields, ("codes", "scale") if symmetric else ("codes", "scale", "zero"))
        return

    b, h, t, d = x.shape
    codes, scale = out["codes"], out["scale"]
    zero = scale if symmetric else out["zero"]
    if zero.stride() != scale.stride():
        raise ValueError("scale and zero must share a layout")
    grid = (b * h, pack.triton.cdiv(t, _PACK_BLOCK_T))
    pack._pack_per_token[grid](
        x, *_bh_t_strides(x), codes, *_bh_t_strides(codes), scale, *_bh_t_strides(scale), zero, t, h,
        float(clip_ratio), D=d, CHG=group_size or d, BITS=bits, SYM=symmetric, BLOCK_T=_PACK_BLOCK_T,
    )


@on_input_device
def pack_per_channel(
    x: torch.Tensor,
    out: dict[str, torch.Tensor],
    bits: int,
    block_size: int,
    valid: torch.Tensor | None = None,
    range_search: tuple[float, ...] | None = None,
    complete: torch.Tensor | None = None,
    _eager: bool = False,
) -> None:
    """`x (B, H, n*G, D)` -> `out["codes"] (B, H, n, G, D*bits/8)`, `out["scale"]`, `out["zero"] (B, H, n, D) fp16`:
    each channel of each block of G tokens is one asymmetric group (KIVI keys); `valid (B, n*G)` marks tokens that
    are not left padding. Same numbers as `methods.kivi.PerChannelKeyCodec.encode` (with `range_search`, the chosen
    candidate can differ where two candidates' squared errors tie to float rounding). `complete (n,)` bool, when
    given: only those blocks are packed, the others written as zeros (the incomplete block of a graphed or compiled
    step)."""
    from . import pack

    if not _eager and _compiling():
        fields = torch.ops.hf_kvcache.pack_per_channel(
            x, valid, complete, bits, block_size, None if range_search is None else [float(r) for r in range_search])
        _copy_fields(out, fields, ("codes", "scale", "zero"))
        return
    b, h, t, d = x.shape
    grid_vals = tuple(range_search or (0.0,) * 5)
    if len(grid_vals) != 5 or max(grid_vals) >= 0.5:
        raise ValueError("the range search kernel takes 5 candidate fractions, each below 0.5")
    codes, scale, zero = out["codes"], out["scale"], out["zero"]
    if codes.stride(4) != 1 or codes.stride(3) != d * bits // 8 or scale.stride() != zero.stride():
        raise ValueError("per-channel codes must be contiguous within a block; scale and zero must share a layout")
    if valid is not None:
        v = valid.view(torch.uint8)
        v_args = [v, v.stride(0), v.stride(1)]
    else:
        v_args = [x, 0, 0]
    pack._pack_per_channel[(b * h, t // block_size)](
        x, *_bh_t_strides(x), *v_args, codes, *_bh_t_strides(codes), scale, *_bh_t_strides(scale), zero,
        complete.view(torch.uint8) if complete is not None else codes, h, *grid_vals,
        D=d, G=block_size, BITS=bits, HAS_VALID=valid is not None, SEARCH=range_search is not None,
        HAS_KEEP=complete is not None,
    )


@on_input_device
def pack_fp8(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, fmt: str, fmax: float,
             _eager: bool = False) -> None:
    """`x (B, H, T, D)` -> `out (B, H, T, D) uint8`, the fp8 bytes of `clamp(x / scale, -fmax, fmax)`;
    `scale (B or 1, H)`, `fmt` "e4m3" or "e5m2" (`quant.quantize_fp8`)."""
    from . import pack

    if not _eager and _compiling():
        out.copy_(torch.ops.hf_kvcache.pack_fp8(x, scale, fmt, float(fmax)))
        return

    b, h, t, d = x.shape
    s = scale.to(device=x.device, dtype=torch.float32)
    grid = (b * h, pack.triton.cdiv(t, _PACK_BLOCK_T))
    pack._pack_fp8[grid](
        x, *_bh_t_strides(x), out, *_bh_t_strides(out),
        s, s.stride(0) if s.shape[0] > 1 else 0, s.stride(1) if s.shape[1] > 1 else 0, t, h, float(fmax),
        D=d, E5M2=fmt == "e5m2", BLOCK_T=_PACK_BLOCK_T, NATIVE=fp8_native(x.device),
    )


@on_input_device
def pack_turbo(y: torch.Tensor, codes: list[torch.Tensor], norm: torch.Tensor, bits: list[int],
               mids: list[torch.Tensor], books: list[torch.Tensor], lsq: bool, _eager: bool = False) -> None:
    """TurboQuant's fields of rotated vectors under one length, in place: `y (B, H, T, W)` float32 -> per part i (its
    channels next in order, `bits[i]` bits, W_i of them) `codes[i] (B, H, T, W_i * b_i / 8)` uint8, the index of
    each unit coordinate's cell (`mids[i]`, the ascending codebook's midpoints) in sign-magnitude order, and
    `norm (B, H, T, 1)` fp16, the norm or (`lsq`) the least-squares length of `books[i][codes]` (code order);
    `turboquant.TurboCodec.encode` after its rotation."""
    from . import pack

    if not _eager and _compiling():
        outs = torch.ops.hf_kvcache.pack_turbo(y, mids, books, bits, [c.shape[-1] for c in codes], lsq)
        for out, value in zip([*codes, norm], outs):
            out.copy_(value)
        return

    b, h, t, w = y.shape
    two = len(codes) == 2
    widths = [c.shape[-1] * 8 // n for c, n in zip(codes, bits)]
    if sum(widths) != w or len(codes) not in (1, 2):
        raise ValueError(f"codes of widths {widths} do not cover the {w} channels of the rotated vectors")
    ca, cb = codes[0], codes[-1]
    pack._pack_turbo[(b * h, pack.triton.cdiv(t, _PACK_BLOCK_T))](
        y, *_bh_t_strides(y), ca, *_bh_t_strides(ca), cb, *_bh_t_strides(cb), norm, *_bh_t_strides(norm),
        mids[0], books[0], mids[-1], books[-1], t, h,
        WA=widths[0], WB=widths[-1], BA=bits[0], BB=bits[-1], TWO=two, LSQ=lsq, BLOCK_T=_PACK_BLOCK_T,
    )


@on_input_device
def token_places(p: torch.Tensor, sinks: int, ring: int, block: int, mode: int, rows: int,
                 capacity: int) -> torch.Tensor:
    """Where one new token of a stream goes (`pack._token_places`, its layout): `p (1,)` int64, the token's held
    index, on the device; `mode` a `pack.PLACE_*`, `block` the tokens a packed block holds (1 but PLACE_BLOCK)."""
    from . import pack

    gp = pack.triton.next_power_of_2(block)
    out = torch.empty(8 + 2 * gp, dtype=torch.long, device=p.device)
    pack._token_places[(1,)](p, out, rows, capacity, S=sinks, R=ring, G=block, MODE=mode, GP=gp)
    return out
