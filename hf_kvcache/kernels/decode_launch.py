"""Launchers of `decode.py`'s kernels: the fused attention over the formats `PackedFormat` describes (fp8, uniform
integer groups, KIVI's per-channel key blocks, exact), and the split-K combine that every attention kernel ends with
(`nuq_launch`, `turbo_launch` call it too). The math is stated in `decode.py`'s docstring; the reference is
`hf_kvcache.attention.reference_attention` over the same layer. Beside its kernel module (`launch.py` says why).
"""

from __future__ import annotations

import torch

from . import backend
from .launch import (TUNING, _compute_dtype, _len, _length_args, _mask_args, _partials, _place, _split_k,
                     _step_counts, _tail_split, _tail_tiles, fp8_native, on_input_device, operand_copy)
from .layout import FP8_KINDS, SCALED_KINDS, StaticLayout, StreamTensors

# The split-K partials `decode._combine` reads at a time. A fixed block, not the split count's power of two: the count
# grows with the context, and each power of two was a kernel variant that a long `generate` compiled on its way
# (after `warm_up`, whose calls are short).
COMBINE_PARTS = 64


def supports_packed(keys: StreamTensors, values: StreamTensors, query: torch.Tensor, static: bool) -> str | None:
    """What the decode kernel cannot read of a `PackedFormat` layer (`dispatch.supports` checked the rest), else
    None."""
    d = query.shape[-1]
    if values.fmt.token_group != 1:
        return "values grouped along tokens"
    for st in (keys, values):
        if st.fmt.kind == "uniform" and st.fmt.token_group > 1 and st.fmt.token_group not in (16, 32, 64, 128):
            return f"token group {st.fmt.token_group}"
    if keys.fmt.token_group > 1 and not _planes(keys.fmt, d, keys=True):
        return f"per-channel {keys.fmt.bits}-bit keys need head_dim >= {16 * 8 // keys.fmt.bits} (bit planes of 16)"
    return None


def _fmt_code(kind: str, native_fp8: bool = True) -> int:
    """A format's `decode.FMT_*` code; fp8 by its bits where the target has no fp8 conversions (`launch.fp8_native`)."""
    from . import decode

    if not native_fp8 and kind in FP8_KINDS:
        return decode.FMT_FP8_E4M3_BITS if kind == "fp8-e4m3" else decode.FMT_FP8_E5M2_BITS
    return {"fp8-e4m3": decode.FMT_FP8_E4M3, "fp8-e5m2": decode.FMT_FP8_E5M2, "uniform": decode.FMT_UNIFORM,
            "exact": decode.FMT_EXACT}[kind]


def _planes(fmt, head_dim: int, keys: bool) -> bool:
    """Whether the body reads this stream's codes as bit planes with its scales applied outside the products
    (one group per token row, or per-channel key blocks); other uniform formats dequantize whole tiles."""
    if fmt.kind != "uniform" or head_dim * fmt.bits // 8 < 16:  # a plane is an operand of products: >= 16 wide
        return False
    return (keys and fmt.token_group > 1) or (fmt.channel_group or head_dim) == head_dim


def _fp16_exact(fmt, head_dim: int, keys: bool) -> bool:
    """Whether the body converts this stream's codes to fp16 exactly and multiplies nothing else into that operand:
    fp8, or integer codes of one group per token row read as planes (c - 2^(bits-1), `tiles.plane`). Per-channel
    key blocks (q * scale) and whole-tile dequantization (code * scale + zero) are not: their operands could leave
    fp16's range."""
    if fmt.kind in FP8_KINDS:
        return True
    return _planes(fmt, head_dim, keys) and fmt.token_group == 1


def _product_dtype(query: torch.Tensor, keys, values) -> torch.dtype:
    """The dtype of the body's tensor-core operands (`decode._attn_fwd`'s PDT): fp16 for a bf16 model whose codes
    all convert to fp16 exactly (the query then enters scaled by a power of two, and p is rounded to fp16, which
    keeps 3 more bits of it than bf16); the model dtype otherwise, and always on the interpreter."""
    d = query.shape[-1]
    if (query.dtype == torch.bfloat16 and TUNING["fp16_products"] and not backend.interpreting()
            and _fp16_exact(keys.fmt, d, keys=True) and _fp16_exact(values.fmt, d, keys=False)):
        return torch.float16
    return query.dtype


def _magic_offset(fmt, dtype: torch.dtype) -> int:
    """OFF of `tiles.plane` for products in `dtype`: 128 for codes below 128 in bf16, 1024 in fp16, 0 (a plain
    conversion) otherwise."""
    if fmt.kind != "uniform" or backend.interpreting():
        return 0
    if dtype == torch.float16:
        return 1024
    return 128 if dtype == torch.bfloat16 and fmt.bits <= 4 else 0


def _group_fp16(fmt, dtype: torch.dtype, head_dim: int, planes: bool) -> bool:
    """Whether the body dequantizes this stream's whole tiles of channel groups in fp16, by plane
    (`tiles.group_planes`): per-token groups of 2- or 4-bit codes of a 16-bit model (`dtype`: the query's), each
    plane at least 16 wide (an operand of products) and a group whole planes wide."""
    if fmt.kind != "uniform" or planes or fmt.token_group != 1 or fmt.bits >= 8:
        return False
    per = 8 // fmt.bits
    return (dtype in (torch.float16, torch.bfloat16) and head_dim // per >= 16
            and (fmt.channel_group or head_dim) % per == 0)


def _plane_asm(fmt, dtype: torch.dtype, head_dim: int, planes: bool) -> str:
    """The PTX `tiles.planes` splits a stream's bit planes with (`tiles.plane_asm`), or "" (Triton's own integer
    operations): planes read with a magic offset (`_magic_offset`), and grouped tiles dequantized in fp16
    (`_group_fp16`, at 1024), on the GPU, with `TUNING["plane_asm"]`."""
    from . import tiles

    if fmt.kind != "uniform" or not TUNING["plane_asm"] or backend.interpreting():
        return ""
    if not planes:
        return tiles.plane_asm(fmt.bits, 1024) if _group_fp16(fmt, dtype, head_dim, planes) else ""
    off = _magic_offset(fmt, dtype)
    return tiles.plane_asm(fmt.bits, off) if off else ""


def _packed_args(st: StreamTensors, dummy: torch.Tensor, head_dim: int) -> list:
    """Pointers and strides of the packed fields: codes + token stride, scale/zero + token and channel strides,
    fp8 scale + batch and head strides."""
    f, fmt = st.fields, st.fmt
    fp8 = fmt.kind in SCALED_KINDS
    if not f:
        # No packed place yet: a dummy pointer with the token strides the storage will have. A place that holds
        # nothing yet is passed as it is (`n_packed` 0): its pointers' dtypes are the ones a filled place passes, so
        # the kernel variant a first step compiles does not depend on whether anything has been packed yet.
        codes = scale = zero = dummy
        row = head_dim if fp8 else head_dim * fmt.bits // 8
        groups = head_dim if fmt.token_group > 1 else head_dim // (fmt.channel_group or head_dim)
        c_strides, s_strides = (0, 0, row), (0, 0, 0 if fp8 else groups, 0 if fp8 else 1)
    else:
        codes = f["codes"]
        if fmt.token_group > 1:  # (B, H, n, G, D*b/8): tokens of consecutive blocks are consecutive rows
            if codes.stride(2) != fmt.token_group * codes.stride(3) or codes.stride(4) != 1:
                raise ValueError("per-channel key codes must be contiguous within and across blocks")
            c_strides = (codes.stride(0), codes.stride(1), codes.stride(3))
        else:
            if codes.stride(3) != 1:
                raise ValueError("packed codes must be contiguous along head_dim")
            c_strides = (codes.stride(0), codes.stride(1), codes.stride(2))
        if fp8:
            scale = zero = dummy
            s_strides = (0, 0, 0, 0)
        else:
            scale = f["scale"]
            zero = f.get("zero", scale)
            if zero.stride() != scale.stride():
                raise ValueError("scale and zero must share a layout")
            s_strides = tuple(scale.stride()[:4])
    if fp8:
        f8 = fmt.scale if fmt.scale is not None else torch.ones(1, 1, device=dummy.device)
        f8 = f8.to(device=dummy.device, dtype=torch.float32)
        f8_args = [f8, f8.stride(0) if f8.shape[0] > 1 else 0, f8.stride(1) if f8.shape[1] > 1 else 0]
    else:
        f8_args = [dummy, 0, 0]
    return [codes, *c_strides, scale, *s_strides, zero], f8_args


@on_input_device
def packed_attention(
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
    """`softmax(q K^T * scaling) V` over the formats `PackedFormat` describes (fp8, uniform integer groups, KIVI's
    per-channel key blocks, exact) -> `(B, Tq, Hq, D)` in the query dtype: `query (B, Hq, Tq, D)`, per stream
    `codes (B, Hkv, T, D*b/8)` (per-channel keys `(B, Hkv, n, G, D*b/8)`) and scales as `PackedFormat` lays them out.
    Kernels `decode._attn_fwd` (split-K body programs, then tail programs), then `decode._combine`; the arguments as
    in `dispatch.decode_attention`, which picks this launcher by format."""
    from . import decode

    b, hq, tq, d = query.shape
    hkv, g, n_sink, n_new, stop = _step_counts(query, keys, k_new, exact_new)
    dummy = k_new
    if static is not None:
        # Lengths come from the device; the host sizes the launch for the capacity (the body's tiles) alone.
        n_sink, stop = 0, keys.n_packed

    # Tiles of at most 16 KB of dequantized K (the body's shared-memory staging grows with it and the stages).
    itemsize = query.element_size()
    block_n = keys.fmt.token_group if keys.fmt.token_group > 1 else min(TUNING["block_n"], 16384 // (d * itemsize))
    stages = TUNING["num_stages"] if block_n * d * itemsize <= 16384 else 2
    rows = tq * g
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    m_tiles = decode.triton.cdiv(rows, block_m)
    body = max(min(keys.n_packed, values.n_packed, stop - n_sink), 0)
    n_body_tiles = body // block_n
    n_splits, tiles_per_split = _split_k(query, n_body_tiles, b * hkv * m_tiles, block_n)
    n_tail = _tail_split(query, _tail_tiles(block_n, n_sink, n_body_tiles, stop, n_new, static), b * hkv * m_tiles)
    n_parts = n_splits + n_tail
    part_acc, part_m, part_l = _partials(query, b * hkv * m_tiles * block_m, n_parts, reuse=static is None)
    m_args = _mask_args(attention_mask, dummy)
    dt, prec = _compute_dtype(query)
    pdt = _product_dtype(query, keys, values)

    out = torch.empty((b, tq, hq, d), device=query.device, dtype=query.dtype)
    if query.stride(3) != 1:
        query = query.contiguous()
    args = [
        query, query.stride(0), query.stride(1), query.stride(2),
        *_stream_args(keys, k_new, dummy, d),
        *_stream_args(values, v_new, dummy, d),
        *m_args,
        part_acc, part_m, part_l, *_length_args(static, dummy),
        hkv, tq, n_sink, keys.n_packed, _len(keys.residual), values.n_packed, _len(values.residual),
        stop, n_new, n_body_tiles, tiles_per_split, n_splits, n_tail, m_tiles,
        float(scaling), float(softcap or 0.0),
    ]
    k_gp = _group_fp16(keys.fmt, query.dtype, d, _planes(keys.fmt, d, keys=True))
    v_gp = _group_fp16(values.fmt, query.dtype, d, _planes(values.fmt, d, keys=False))
    # The products' operands behind `tiles.opaque` where both streams are grouped fp16 planes: measured on the
    # H100 at batch 16 x 32k (2026-12-05, on against off in one run), int4-g32 472.4 -> 414.0 us; fp8-e4m3 (401.9 ->
    # 416.3), int8 (418.6 -> 473.5) and KIVI-2 (669.8 -> 755.4), whose counts fell as well, lost, so they keep the
    # operand layout Triton picks (HF_KVCACHE_OPERAND_COPY=all gives it to every format, to measure the others).
    meta = dict(
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, DT=dt, PDT=decode.tl.float16 if pdt != query.dtype else dt,
        PREC=prec, HAS_MASK=attention_mask is not None, MASK_ROW=tq == 1, MASK_AHEAD=TUNING["mask_ahead"],
        HAS_SOFTCAP=softcap is not None, CAUSAL_BODY=attention_mask is None and not exact_new and tq > 1,
        K_PLANES=_planes(keys.fmt, d, keys=True), V_PLANES=_planes(values.fmt, d, keys=False),
        K_OFF=_magic_offset(keys.fmt, pdt), V_OFF=_magic_offset(values.fmt, pdt),
        K_ASM=_plane_asm(keys.fmt, pdt, d, _planes(keys.fmt, d, keys=True)),
        V_ASM=_plane_asm(values.fmt, pdt, d, _planes(values.fmt, d, keys=False)),
        K_GP=k_gp, V_GP=v_gp, B_COPY=operand_copy(k_gp and v_gp),
        **_fmt_meta(keys, values, d, query.device),
    )
    if static is not None:
        meta.update(STATIC=True, SINK_CAP=static.sink_tokens, K_RING=static.key_ring, V_RING=static.value_ring,
                    K_WINDOW=static.key_window, V_WINDOW=static.value_window, ROW_LENS=static.length.dim() == 1)
    if n_splits:
        decode._attn_fwd[(b * hkv, n_splits, m_tiles)](
            *args, **meta, BODY=True, num_warps=TUNING["num_warps"], num_stages=stages
        )
    decode._attn_fwd[(b * hkv, n_tail, m_tiles)](*args, **meta, BODY=False, num_warps=4, num_stages=2)
    _combine(part_acc, part_m, part_l, out, s_aux, hkv, tq, g, n_parts, m_tiles * block_m)
    return out


def _stream_args(st: StreamTensors, new: torch.Tensor, dummy: torch.Tensor, head_dim: int) -> list:
    """One stream's places as `decode._attn_fwd` takes them: sink, packed fields, residual, new tokens, fp8 scale."""
    packed, f8 = _packed_args(st, dummy, head_dim)
    return [*_place(st.sink, dummy), *packed, *_place(st.residual, dummy), *_place(new, dummy), *f8]


def _fmt_meta(keys: StreamTensors, values: StreamTensors, head_dim: int, device: torch.device) -> dict:
    """The two streams' formats as `decode._attn_fwd`'s constexprs (K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM, V_...) for
    kernels on `device`."""
    native = fp8_native(device)

    def fmt_args(st: StreamTensors, with_tokens: bool) -> list:
        f = st.fmt
        chg = f.channel_group or head_dim
        out = [_fmt_code(f.kind, native), f.bits]
        if with_tokens:
            out.append(f.token_group)
        return out + [chg if f.kind == "uniform" else head_dim, f.symmetric]

    return {**dict(zip(("K_FMT", "K_BITS", "K_TOKG", "K_CHG", "K_SYM"), fmt_args(keys, True))),
            **dict(zip(("V_FMT", "V_BITS", "V_CHG", "V_SYM"), fmt_args(values, False)))}


def _combine(part_acc, part_m, part_l, out, s_aux, hkv: int, tq: int, g: int, n_parts: int, rows_pad: int,
             frame: tuple[torch.Tensor, torch.Tensor | None] | None = None, n_framed: int | None = None) -> None:
    """The split-K partials into `out (B, Tq, Hq, D)`; `frame` (the values' `(R, order)`, TurboQuant): the first
    `n_framed` parts (the body's; all but the last if None) are in the values' frame and are taken back by F_v^T, the
    others (the tail programs') are in the model's."""
    from . import decode

    if frame is None:
        frame_args, has_order = [part_m, 0, part_m, 0, 0], False
    else:
        rot, order = frame
        if rot.stride(1) != 1:
            raise ValueError("a codebook format's rotation must be contiguous along its rows")
        has_order = order is not None
        order_args = [order, order.stride(0), order.stride(1)] if has_order else [part_m, 0, 0]
        frame_args = [rot, rot.stride(0), *order_args]
    decode._combine[(out.shape[0] * hkv * tq * g,)](
        part_acc, part_m, part_l, out, out.stride(0), out.stride(1), out.stride(2),
        s_aux if s_aux is not None else part_m, *frame_args, hkv, tq, n_parts,
        n_parts - 1 if n_framed is None else n_framed, rows_pad,
        G=g, D=out.shape[-1], NP=COMBINE_PARTS, HAS_SAUX=s_aux is not None,
        FRAME=frame is not None, HAS_ORDER=has_order, num_warps=4,
    )
