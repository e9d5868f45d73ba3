"""Launchers of `turbo.py`'s kernel (TurboQuant): the fused attention over codebook codes (`CodebookFormat`), the query
rotated into the keys' frame here and the output out of the values' frame by the combine. The math is stated in
`turbo.py`'s docstring. Beside its kernel module (`launch.py` says why); TurboQuant's pack kernel is `pack.py`'s
(`pack_launch.pack_turbo`).
"""

from __future__ import annotations

import functools

import torch

from . import backend
from .decode_launch import _combine
from .hadamard_launch import rotate_rows
from .launch import (TUNING, _compute_dtype, _len, _length_args, _mask_args, _partials, _place, _split_k,
                     _step_counts, _tail_split, head_dim_ok, on_input_device, operand_copy)
from .layout import StaticLayout, StreamTensors


def supports_codebook(keys: StreamTensors, values: StreamTensors, query: torch.Tensor, static: bool) -> str | None:
    """What TurboQuant's kernel cannot read of a codebook layer (`dispatch.supports` checked the rest), else None."""
    if static and _len(keys.residual) != _len(values.residual):
        return "a static TurboQuant layer with residual windows of two lengths"
    for fmt in (keys.fmt, values.fmt):
        if len(fmt.parts) > 2:
            return f"{len(fmt.parts)} codebook parts"
        for part in fmt.parts:
            if part.bits not in (2, 3, 4) or not head_dim_ok(part.width):
                return f"a codebook part of {part.width} channels at {part.bits} bits"
    return None


def codebook_args(st: StreamTensors, dummy: torch.Tensor, dtype: torch.dtype | None) -> tuple[list, list]:
    """A codebook stream's parts as `turbo._turbo_attn` takes them, two (a single part repeats): per part codes +
    strides, norm + strides, the codebook in `dtype` (None: the register lookup, which reads no table; `dummy` stands
    in); and each part's `(width, bits, PTX of the register lookup)`.

    The register lookup must not make a table: under a compiled step the first decode call runs inside the CUDA
    graphs' memory pool, and a table made there and kept in `_TABLES` was the "tensor(s) in the cudagraph pool not
    tracked as outputs" that stopped TurboQuant's compiled step (one a distinct codebook)."""
    args, meta = [], []
    for part in st.fmt.parts + st.fmt.parts[-1:] * (2 - len(st.fmt.parts)):
        if dtype is None:
            table, asm = dummy, _asm(part.bits, _halves(part.levels))
        else:
            table, asm = _codebook_table(part, dummy.device, dtype)
        if st.fields:  # (the place's own buffers even while they hold nothing: one kernel variant, `_packed_args`)
            codes, norm = st.fields[part.codes], st.fields[part.norm]
            if codes.stride(3) != 1:
                raise ValueError("codebook codes must be contiguous along the channels")
            args += [codes, *codes.stride()[:3], norm, *norm.stride()[:3], table]
        else:
            args += [dummy, 0, 0, part.width * part.bits // 8, dummy, 0, 0, 1, table]
        meta.append((part.width, part.bits, asm))
    return args, meta


def _into_frame(query: torch.Tensor, frame: tuple[torch.Tensor, torch.Tensor | None], hkv: int) -> torch.Tensor:
    """`query (B, Hq, Tq, D)` -> `q F = q[..., order] R` float32, the same shape (the order is per kv-head)."""
    b, hq, tq, d = query.shape
    rot, order = frame
    q = query.float().reshape(b, hkv, hq // hkv * tq, d)  # (grouped by kv-head)
    if order is not None:
        q = torch.gather(q, 3, order.long()[:, :, None, :].expand(b, hkv, q.shape[2], d))
    return rotate_rows(q, rot).view(b, hq, tq, d)


@functools.lru_cache(maxsize=64)
def _asm(bits: int, halves: tuple[int, ...]) -> str:
    from . import turbo

    return turbo.lookup_asm(bits, list(halves))


# by (bits, the codebook's values, device, dtype): found by the static operator's calls too, whose parts are rebuilt
# each call, with no copy to the device (none may run while a CUDA graph is captured)
_TABLES: dict[tuple, tuple[torch.Tensor, str]] = {}


def _codebook_table(part, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A part's codebook on `device` in `dtype` (the load lookup) and its PTX (the register lookup), cached."""
    key = (part.bits, part.levels, device, dtype)
    found = _TABLES.get(key)
    if found is None:
        found = (part.codebook.to(device=device, dtype=dtype), _asm(part.bits, _halves(part.levels)))
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = found
    return found


@functools.lru_cache(maxsize=64)
def _halves(levels: tuple[float, ...]) -> tuple[int, ...]:
    """A codebook's numbers (`CodebookPart.levels`) as the bits of their fp16 values."""
    return tuple(int(v) & 0xFFFF for v in torch.tensor(levels, dtype=torch.float32).to(torch.float16)
                 .view(torch.int16).tolist())


@functools.lru_cache(maxsize=64)
def _planes_asm(bits: int, levels: tuple[float, ...]) -> str:
    """The register lookup by plane of a codebook, from its numbers (`CodebookPart.levels`: no tensor is read):
    `turbo.lookup_asm_halves` (4 bits), `turbo.lookup_asm_eighths` (3 bits)."""
    from . import turbo

    halves = list(_halves(levels))
    return turbo.lookup_asm_halves(halves) if bits == 4 else turbo.lookup_asm_eighths(halves)


def _planes_of(fmt, head_dim: int, keys: bool) -> int:
    """How many planes the body multiplies this stream by (`turbo._half_planes`: 4, `turbo._eighth_planes`: 8), or
    0: one part of every channel, at least 128 of them, of 4 bits (the values' four products D / 4 wide then split
    over 4 warps without copies), or of 3 bits for the keys. The values' eight products of 3-bit planes, 16 wide,
    were copied on every warp and spilled (`turboquant-3.5`: 48.9 -> 156.5 warp instructions a held token for
    sm_90, `hf-kvcache bench --parts sass`, 2026-12-05)."""
    if len(fmt.parts) != 1 or head_dim % 128 or not TUNING["turbo_planes"]:
        return 0
    return {4: 4, 3: 8 if keys else 0}.get(fmt.parts[0].bits, 0)


@on_input_device
def turbo_attention(
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
    """`dispatch.decode_attention` over TurboQuant's layout (`CodebookFormat`, kernel in `turbo.py`): `query (B, Hq, Tq, D)`,
    per part `codes (B, Hkv, T, W*b/8) uint8` and `norm (B, Hkv, T, 1) fp16` -> `(B, Tq, Hq, D)`. With the frames
    F_k, F_v (`CodebookFormat.frame`): the body reads q' = q F_k (one gather and one product here), the tail the exact
    tokens as stored with q itself, and the combine takes the result out of the values' frame (o' F_v^T). `static`:
    as in `decode_attention` (the same ring for keys and values, `dispatch.supports`)."""
    from . import turbo

    b, hq, tq, d = query.shape
    hkv, g, n_sink, n_new, stop = _step_counts(query, keys, k_new, exact_new)
    kf, vf = keys.fmt, values.fmt
    device = query.device
    if static is None:
        n_body = max(min(keys.n_packed, values.n_packed, stop - n_sink), 0)
        ring = {}
    else:
        # the counts come from the device (the residuals are rings); the host sizes the launch for the capacity
        n_sink, stop, n_body = 0, keys.n_packed, keys.n_packed
        ring = dict(STATIC=True, SINK_CAP=static.sink_tokens, RING=static.key_ring, WINDOW=static.key_window,
                    ROW_LENS=static.length.dim() == 1)
    dt, prec = _compute_dtype(query)
    pdt = torch.float32 if dt == turbo.tl.float32 else torch.float16
    lookup = turbo.LOOKUP_REGISTERS if pdt == torch.float16 and TUNING["turbo_lookup"] == "registers" else \
        turbo.LOOKUP_LOAD

    block_n, tail_n = TUNING["turbo_block_n"], 16
    block_m = 16 if tq * g <= 16 else (32 if tq * g <= 32 else 64)
    m_tiles = turbo.triton.cdiv(tq * g, block_m)
    n_splits, tiles_per_split = _split_k(query, turbo.triton.cdiv(n_body, block_n), b * hkv * m_tiles,
                                         block_n)
    # the tail's tiles of exact tokens; a static launch's bound: every sink, the ring and the new tokens
    exact = stop + n_new - n_body if static is None else static.sink_tokens + static.key_ring + n_new
    n_tail = _tail_split(query, turbo.triton.cdiv(max(exact, 0), tail_n), b * hkv * m_tiles)
    part_acc, part_m, part_l = _partials(query, b * hkv * m_tiles * block_m, n_splits + n_tail, reuse=static is None)

    table_dtype = None if lookup == turbo.LOOKUP_REGISTERS else pdt
    k_args, k_meta = codebook_args(keys, k_new, table_dtype)
    v_args, v_meta = codebook_args(values, k_new, table_dtype)
    if query.stride(3) != 1:
        query = query.contiguous()
    qf = _into_frame(query, kf.frame(device), hkv)
    new_k, new_v = (k_new, v_new) if n_new else (None, None)
    args = [
        qf, qf.stride(0), qf.stride(1), qf.stride(2), query, query.stride(0), query.stride(1), query.stride(2),
        *k_args, *v_args,
        *_place(keys.sink, k_new), *_place(keys.residual, k_new), *_place(new_k, k_new),
        *_place(values.sink, k_new), *_place(values.residual, k_new), *_place(new_v, k_new),
        *_mask_args(attention_mask, k_new), part_acc, part_m, part_l, *_length_args(static, k_new),
        hkv, tq, n_sink, n_body, stop, n_new, tiles_per_split, n_splits, n_tail, m_tiles, float(scaling),
        float(softcap or 0.0),
    ]
    k_planes, v_planes = _planes_of(kf, d, keys=True), _planes_of(vf, d, keys=False)
    registers = lookup == turbo.LOOKUP_REGISTERS
    meta = dict(
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, TAIL_N=tail_n, DT=dt,
        PDT=turbo.tl.float16 if pdt == torch.float16 else dt,
        PREC=prec, HAS_MASK=attention_mask is not None, MASK_ROW=tq == 1, MASK_AHEAD=TUNING["mask_ahead"],
        HAS_SOFTCAP=softcap is not None, CAUSAL_BODY=attention_mask is None and not exact_new and tq > 1, LOOKUP=lookup,
        K_TWO=len(kf.parts) == 2, K_WA=k_meta[0][0], K_BA=k_meta[0][1], K_BB=k_meta[1][1],
        V_TWO=len(vf.parts) == 2, V_WA=v_meta[0][0], V_BA=v_meta[0][1], V_BB=v_meta[1][1],
        K_ASM_A=k_meta[0][2], K_ASM_B=k_meta[1][2], V_ASM_A=v_meta[0][2], V_ASM_B=v_meta[1][2], **ring,
        K_PLANES=k_planes, V_PLANES=v_planes,
        K_ASM_H=_planes_asm(kf.parts[0].bits, kf.parts[0].levels) if registers and k_planes else "",
        V_ASM_H=_planes_asm(vf.parts[0].bits, vf.parts[0].levels) if registers and v_planes else "",
        B_COPY=operand_copy(True),
    )
    if n_splits:
        cap = {"maxnreg": TUNING["turbo_maxnreg"]} if TUNING["turbo_maxnreg"] and not backend.interpreting() else {}
        turbo._turbo_attn[(b * hkv, n_splits, m_tiles)](
            *args, **meta, BODY=True, num_warps=TUNING["turbo_num_warps"], num_stages=TUNING["turbo_num_stages"],
            **cap)
    turbo._turbo_attn[(b * hkv, n_tail, m_tiles)](*args, **meta, BODY=False, num_warps=4, num_stages=2)
    out = torch.empty((b, tq, hq, d), device=device, dtype=query.dtype)
    _combine(part_acc, part_m, part_l, out, s_aux, hkv, tq, g, n_splits + n_tail, m_tiles * block_m,
             frame=vf.frame(device), n_framed=n_splits)
    return out
