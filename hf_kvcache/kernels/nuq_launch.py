"""Launchers of `nuq.py`'s kernels (KVQuant): the fused attention over NUQ codes (`NUQFormat`) and the pack kernel that
writes them. The layout and the math are `hf_kvcache.methods.kvquant`'s (the reference codecs) and `nuq.py`'s
docstring. Beside its kernel module (`launch.py` says why).
"""

from __future__ import annotations

import torch

from . import backend
from .decode_launch import _combine
from .launch import (TUNING, _PACK_BLOCK_T, _bh_t_strides, _compiling, _compute_dtype, _len, _length_args, _mask_args,
                     _partials, _place, _split_k, _step_counts, on_input_device, operand_copy)
from .layout import NUQFormat, StaticLayout, StreamTensors


def supports_nuq(keys: StreamTensors, values: StreamTensors, query: torch.Tensor, static: bool) -> str | None:
    """What KVQuant's kernel cannot read of a NUQ layer (`dispatch.supports` checked the rest), else None."""
    if keys.fmt.mid is None:
        return "NUQ keys without their codebook's midpoints"
    d = query.shape[-1]
    return None if d >= 32 else f"NUQ keys are rotated in halves of >= 16 channels, not head_dim {d}"


@on_input_device
def nuq_attention(
    query: torch.Tensor,
    keys: StreamTensors,
    values: StreamTensors,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    *,
    exact_new: bool,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    static: StaticLayout | None = None,
) -> torch.Tensor:
    """`dispatch.decode_attention` over KVQuant's NUQ layout (`NUQFormat`, kernels in `nuq.py`): `query (B, Hq, Tq, D)`,
    keys `codes (B, Hkv, T, D*b/8)` + outlier slots + `pos (B, 1, T)`, values `codes` + `lo`/`hi (B, Hkv, T, 1)`
    + slots -> `(B, Tq, Hq, D)`; keys get RoPE at their stored positions after dequantization. `static`: as in
    `decode_attention` (sinks and packed tokens only: KVQuant keeps no residual window)."""
    from . import nuq

    b, hq, tq, d = query.shape
    hkv, g, n_sink, n_new, stop = _step_counts(query, keys, k_new, exact_new)
    kf, vf = keys.fmt, values.fmt
    dummy = k_new
    if static is not None:
        if static.key_ring or static.value_ring:
            raise ValueError("the static NUQ kernel reads sinks and packed tokens only (no residual window)")
        n_sink, stop = 0, keys.n_packed
    block_n = TUNING["nuq_block_n"]
    rows = tq * g
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m_tiles = nuq.triton.cdiv(rows, block_m)
    body = max(min(keys.n_packed, values.n_packed, stop - n_sink), 0)
    n_splits, tiles_per_split = _split_k(query, nuq.triton.cdiv(body, block_n), b * hkv * m_tiles)
    part_acc, part_m, part_l = _partials(query, b * hkv * m_tiles * block_m, n_splits + 1, reuse=static is None)
    dt, prec = _compute_dtype(query)
    if query.stride(3) != 1:
        query = query.contiguous()

    def exact_places(st: StreamTensors, new: torch.Tensor) -> list:
        return [*_place(st.sink, dummy), *_place(st.residual, dummy), *_place(new, dummy)]

    def packed(st: StreamTensors) -> list:
        """codes + batch, head and token strides, slot indices and values + their strides."""
        row_bytes, slots = d * st.fmt.bits // 8, max(st.fmt.slots, 1)
        if not st.fields:  # no packed place yet: dummies with its token strides (`decode_launch._packed_args`)
            return [dummy, 0, 0, row_bytes, dummy, dummy, 0, 0, slots]
        f = st.fields
        codes = f["codes"]
        if codes.stride(3) != 1:
            raise ValueError("NUQ codes must be contiguous along head_dim")
        word = {4: 4, 3: 4, 2: 2}[st.fmt.bits]  # `nuq._words` reads 4 and 3-bit codes as int32, 2-bit as int16
        if codes.data_ptr() % word or any(t % word for t in codes.stride()[:3]):
            raise ValueError(f"{st.fmt.bits}-bit NUQ codes are read {word} bytes at a time: their rows must start "
                             f"at multiples of {word} bytes (a contiguous copy of the codes does)")
        if not st.fmt.slots:
            return [codes, *codes.stride()[:3], dummy, dummy, 0, 0, slots]
        idx, val = f["out_idx"], f["out_val"]
        if idx.stride() != val.stride() or idx.stride(3) != 1:
            raise ValueError("the outlier slots' indices and values must share a layout, contiguous per token")
        return [codes, *codes.stride()[:3], idx, val, *idx.stride()[:3]]

    device = query.device
    rope = kf.inv_freq is not None
    if rope and keys.fields:
        pos = keys.fields["pos"]  # (B, 1, T)
        pos_args = [pos, pos.stride(0), pos.stride(2)]
    else:
        pos_args = [dummy, 0, 1]
    if values.fields:
        lo, hi = values.fields["lo"], values.fields["hi"]  # (B, H, T, 1)
        if lo.stride() != hi.stride():
            raise ValueError("the values' lo and hi must share a layout")
        range_args = [lo, hi, *lo.stride()[:3]]
    else:
        range_args = [dummy, dummy, 0, 0, 1]
    k_args = [*packed(keys), *pos_args, kf.mid.to(device), kf.half.to(device), kf.codebook.to(device),
              (kf.inv_freq if rope else kf.codebook).to(device)]
    v_args = [*packed(values), *range_args, vf.codebook.to(device)]
    out = torch.empty((b, tq, hq, d), device=device, dtype=query.dtype)
    lookup = _nuq_lookup(query)
    cap = {"maxnreg": TUNING["nuq_maxnreg"]} if TUNING["nuq_maxnreg"] and not backend.interpreting() else {}
    nuq._nuq_attn[(b * hkv, n_splits + 1, m_tiles)](
        query, query.stride(0), query.stride(1), query.stride(2),
        *exact_places(keys, k_new), *exact_places(values, v_new),
        *k_args, *v_args,
        *_mask_args(attention_mask, dummy),
        part_acc, part_m, part_l, *_length_args(static, dummy),
        hkv, tq, n_sink, body, keys.n_packed, _len(keys.residual), stop, n_new, tiles_per_split, n_splits,
        m_tiles, float(scaling), float(softcap or 0.0), float(kf.rope_scale),
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, DT=dt, PREC=prec, HAS_MASK=attention_mask is not None,
        HAS_SOFTCAP=softcap is not None, ROPE=rope, K_BITS=kf.bits, V_BITS=vf.bits, K_S=kf.slots, V_S=vf.slots,
        K_SP=nuq.triton.next_power_of_2(max(kf.slots, 1)), V_SP=nuq.triton.next_power_of_2(max(vf.slots, 1)),
        FAST_TRIG=TUNING["nuq_fast_trig"] and not backend.interpreting(), LOOKUP=lookup,
        K_ASM=nuq.lookup_asm(kf.bits) if lookup == nuq.LOOKUP_REGISTERS else "",
        V_ASM=nuq.lookup_asm(vf.bits) if lookup == nuq.LOOKUP_REGISTERS else "",
        STATIC=static is not None, SINK_CAP=static.sink_tokens if static is not None else 0,
        H16=lookup == nuq.LOOKUP_REGISTERS and TUNING["nuq_fp16"] and kf.fp16 and vf.fp16,
        B_COPY=operand_copy(True), num_warps=TUNING["nuq_num_warps"], num_stages=2, **cap,
    )
    _combine(part_acc, part_m, part_l, out, s_aux, hkv, tq, g, n_splits + 1, m_tiles * block_m)
    return out


def _nuq_lookup(query: torch.Tensor) -> int:
    """KVQuant's lookup (`TUNING["nuq_lookup"]`): in registers only where the products are fp16 or bf16 on the GPU
    (its fp16 centroids round by less than those products do); fp32 models and the interpreter take the selects."""
    from . import nuq

    name = TUNING["nuq_lookup"]
    lookups = {"registers": nuq.LOOKUP_REGISTERS, "selects": nuq.LOOKUP_SELECTS, "load": nuq.LOOKUP_LOAD}
    if name not in lookups:
        raise ValueError(f"TUNING['nuq_lookup'] is one of {sorted(lookups)}, got {name!r}")
    if lookups[name] == nuq.LOOKUP_REGISTERS and (query.dtype == torch.float32 or backend.interpreting()):
        return nuq.LOOKUP_SELECTS
    return lookups[name]


@on_input_device
def pack_nuq(
    x: torch.Tensor,
    out: dict[str, torch.Tensor],
    fmt: NUQFormat,
    midpoints: torch.Tensor,
    *,
    key_norm: tuple[torch.Tensor, ...] | None = None,
    positions: torch.Tensor | None = None,
    _eager: bool = False,
) -> None:
    """KVQuant's encode in place: `x (B, H, T, D)` -> `out["codes"] (B, H, T, D*b/8)`, `out["out_idx"]`/`out["out_val"]
    (B, H, T, s)`; keys (`key_norm` = calibrated `(lo, hi)` and the encode's normalization `(mid, half)`, each
    `(H, D)` float32 contiguous on x's device, half clamped above 0: `quant.midrange`) also `out["pos"] (B, 1, T)`
    from `positions (B, T)` when `fmt.inv_freq` is set (RoPE undone at those positions); values also
    `out["lo"]`/`out["hi"] (B, H, T, 1) fp16`. `midpoints (2^b - 1,)` float32: the codebook's decision boundaries.
    Same numbers as `methods.kvquant`'s codecs up to the rounding of the RoPE angles (keys) and of fp32 products."""
    from . import nuq

    if not _eager and _compiling():
        names = ["codes", "out_idx", "out_val", "lo", "hi"]
        fields = torch.ops.hf_kvcache.pack_nuq(
            x, midpoints, fmt.codebook, fmt.inv_freq, [] if key_norm is None else list(key_norm), positions,
            fmt.bits, fmt.slots, float(fmt.rope_scale))
        for name, value in zip(names, fields):
            if name in out:
                out[name].copy_(value)
        if "pos" in out and positions is not None and fmt.inv_freq is not None:
            out["pos"].copy_(positions.to(torch.int32)[:, None])
        return
    b, h, t, d = x.shape
    keys = key_norm is not None
    rope = keys and fmt.inv_freq is not None
    codes = out["codes"]
    dev = x.device
    if fmt.slots:
        idx, val = out["out_idx"], out["out_val"]
        if idx.stride() != val.stride():
            raise ValueError("the outlier slots' indices and values must share a layout")
        slot_args = [idx, val, *_bh_t_strides(idx)]
    else:
        slot_args = [codes, codes, 0, 0, 0]
    if rope:
        if positions is None:
            raise ValueError("pre-RoPE keys need the tokens' positions")
        out["pos"].copy_(positions.to(torch.int32)[:, None])
        p = positions.to(dev)
        pos_args = [p, p.stride(0), p.stride(1), fmt.inv_freq.to(dev), float(fmt.rope_scale)]
    else:
        pos_args = [x, 0, 0, midpoints, 1.0]
    if keys:
        range_args = list(key_norm)
        side_args = [codes, codes, 0, 0, 0]
    else:
        range_args = [midpoints] * 4
        if out["lo"].stride() != out["hi"].stride():
            raise ValueError("the values' lo and hi must share a layout")
        side_args = [out["lo"], out["hi"], *_bh_t_strides(out["lo"])]
    nuq._pack_nuq[(b * h, nuq.triton.cdiv(t, _PACK_BLOCK_T))](
        x, *_bh_t_strides(x), *pos_args, *range_args, midpoints.to(dev),
        codes, *_bh_t_strides(codes), *slot_args, *side_args, t, h,
        D=d, BITS=fmt.bits, S=fmt.slots, KEYS=keys, ROPE=rope, BLOCK_T=_PACK_BLOCK_T,
    )
