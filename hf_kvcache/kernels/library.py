"""The launchers as PyTorch operators (`torch.ops.hf_kvcache.*`), for torch.compile.

Dynamo cannot trace a launcher's Python (grids, strides, dataclasses) and Inductor, meeting a plain `@triton.jit`
kernel, tries to rebuild it (it failed on our pack kernel). Under torch.compile every
launcher (the `*_launch` modules; the attention's through `dispatch.static_decode_attention`) calls itself through
one of these custom operators instead: opaque to the compiler, with a fake implementation giving the output's shape,
and captured as is by CUDA graphs. Eager code calls the launchers directly, which saves the dispatcher's host time.
Operators are functional (fresh outputs, nothing mutated), so that Inductor fuses the copies into the cache around
them. The tensor arguments are flat: a stream is a list of tensors (`stream_tensors`, `nuq_tensors`,
`turbo_tensors`) and a format a list of ints (`fmt_ints`, ...), which the operator turns back into the launcher's
arguments (`_stream`, ...); a place absent is None.

No `from __future__ import annotations` here: the operators' schemas are read from the annotations.
"""

from typing import Optional

import torch
from torch import Tensor

from . import decode_launch, hadamard_launch, nuq_launch, pack_launch, turbo_launch
from .layout import CodebookFormat, CodebookPart, NUQFormat, PackedFormat, StaticLayout, StreamTensors

_KINDS = ("fp8-e4m3", "fp8-e5m2", "uniform", "exact")


def fmt_ints(st: StreamTensors) -> list[int]:
    """`[kind, bits, token_group, channel_group, symmetric, n_packed]` of a stream's packed format."""
    f = st.fmt
    return [_KINDS.index(f.kind), f.bits, f.token_group, f.channel_group, int(f.symmetric), st.n_packed]


def _stream(sink, codes, scale, zero, residual, f8, ints: list[int]) -> StreamTensors:
    kind, bits, token_group, channel_group, symmetric, n_packed = ints
    fmt = PackedFormat(kind=_KINDS[kind], bits=bits, token_group=token_group, channel_group=channel_group,
                       symmetric=bool(symmetric), scale=f8)
    fields = {"codes": codes}
    if scale is not None:
        fields["scale"] = scale
    if zero is not None:
        fields["zero"] = zero
    return StreamTensors(sink=sink, fields=fields, fmt=fmt, n_packed=n_packed, residual=residual)


def stream_tensors(st: StreamTensors) -> list[Optional[Tensor]]:
    """`[sink, codes, scale, zero, residual, fp8 scale]` of a stream (None where absent)."""
    f = st.fields
    return [st.sink, f["codes"], f.get("scale"), f.get("zero"), st.residual, st.fmt.scale]


@torch.library.custom_op("hf_kvcache::static_attention", mutates_args=())
def static_attention(
    query: Tensor,
    k_sink: Optional[Tensor], k_codes: Tensor, k_scale: Optional[Tensor], k_zero: Optional[Tensor],
    k_res: Optional[Tensor], k_f8: Optional[Tensor],
    v_sink: Optional[Tensor], v_codes: Tensor, v_scale: Optional[Tensor], v_zero: Optional[Tensor],
    v_res: Optional[Tensor], v_f8: Optional[Tensor],
    k_new: Tensor, v_new: Tensor, length: Tensor, mask: Optional[Tensor], s_aux: Optional[Tensor],
    k_fmt: list[int], v_fmt: list[int], layout: list[int], exact_new: bool, scaling: float, softcap: float,
    has_softcap: bool,
) -> Tensor:
    keys = _stream(k_sink, k_codes, k_scale, k_zero, k_res, k_f8, k_fmt)
    values = _stream(v_sink, v_codes, v_scale, v_zero, v_res, v_f8, v_fmt)
    static = StaticLayout(length, layout[5], layout[0], layout[1], layout[2], bool(layout[3]), bool(layout[4]))
    return decode_launch.packed_attention(
        query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=mask, scaling=scaling,
        softcap=softcap if has_softcap else None, s_aux=s_aux, static=static,
    )


@static_attention.register_fake
def _(query, *args, **kwargs):
    b, hq, tq, d = query.shape
    return query.new_empty((b, tq, hq, d))


@torch.library.custom_op("hf_kvcache::pack_per_token", mutates_args=())
def pack_per_token(x: Tensor, bits: int, group_size: int, symmetric: bool, clip_ratio: float) -> list[Tensor]:
    """-> `[codes, scale, zero]` (zero empty when symmetric); `group_size` 0 = head_dim."""
    out = _per_token_out(x, bits, group_size, symmetric)
    pack_launch.pack_per_token(x, out, bits, group_size or None, symmetric, clip_ratio, _eager=True)
    return [out["codes"], out["scale"], out.get("zero", x.new_empty((0,), dtype=torch.float16))]


def _per_token_out(x: Tensor, bits: int, group_size: int, symmetric: bool) -> dict:
    b, h, t, d = x.shape
    out = {"codes": x.new_empty((b, h, t, d * bits // 8), dtype=torch.uint8),
           "scale": x.new_empty((b, h, t, d // (group_size or d)), dtype=torch.float16)}
    if not symmetric:
        out["zero"] = torch.empty_like(out["scale"])
    return out


@pack_per_token.register_fake
def _(x, bits, group_size, symmetric, clip_ratio):
    out = _per_token_out(x, bits, group_size, symmetric)
    return [out["codes"], out["scale"], out.get("zero", x.new_empty((0,), dtype=torch.float16))]


@torch.library.custom_op("hf_kvcache::pack_per_channel", mutates_args=())
def pack_per_channel(x: Tensor, valid: Optional[Tensor], complete: Optional[Tensor], bits: int, block_size: int,
                     range_search: Optional[list[float]]) -> list[Tensor]:
    """-> `[codes (B, H, n, G, D*b/8), scale (B, H, n, D), zero (B, H, n, D)]`."""
    out = _per_channel_out(x, bits, block_size)
    pack_launch.pack_per_channel(x, out, bits, block_size, valid, tuple(range_search) if range_search else None,
                                 complete=complete, _eager=True)
    return [out["codes"], out["scale"], out["zero"]]


def _per_channel_out(x: Tensor, bits: int, block_size: int) -> dict:
    b, h, t, d = x.shape
    n = t // block_size
    return {"codes": x.new_empty((b, h, n, block_size, d * bits // 8), dtype=torch.uint8),
            "scale": x.new_empty((b, h, n, d), dtype=torch.float16),
            "zero": x.new_empty((b, h, n, d), dtype=torch.float16)}


@pack_per_channel.register_fake
def _(x, valid, complete, bits, block_size, range_search):
    out = _per_channel_out(x, bits, block_size)
    return [out["codes"], out["scale"], out["zero"]]


@torch.library.custom_op("hf_kvcache::pack_fp8", mutates_args=())
def pack_fp8(x: Tensor, scale: Tensor, fmt: str, fmax: float) -> Tensor:
    out = x.new_empty(x.shape, dtype=torch.uint8)
    pack_launch.pack_fp8(x, out, scale, fmt, fmax, _eager=True)
    return out


@pack_fp8.register_fake
def _(x, scale, fmt, fmax):
    return x.new_empty(x.shape, dtype=torch.uint8)


@torch.library.custom_op("hf_kvcache::hadamard", mutates_args=())
def hadamard(x: Tensor) -> Tensor:
    return hadamard_launch.hadamard(x, _eager=True)


@hadamard.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("hf_kvcache::rows_times", mutates_args=())
def rows_times(x: Tensor, m: Tensor) -> Tensor:
    return hadamard_launch.rows_times(x, m, _eager=True)


@rows_times.register_fake
def _(x, m):
    return torch.empty(x.shape, device=x.device, dtype=torch.float32)


@torch.library.custom_op("hf_kvcache::pack_turbo", mutates_args=())
def pack_turbo(y: Tensor, mids: list[Tensor], books: list[Tensor], bits: list[int], code_bytes: list[int],
               lsq: bool) -> list[Tensor]:
    """-> `[codes of each part, norm]` (`pack_launch.pack_turbo`; `code_bytes`: each part's bytes a vector)."""
    out = _turbo_out(y, code_bytes)
    pack_launch.pack_turbo(y, out[:-1], out[-1], bits, mids, books, lsq, _eager=True)
    return out


def _turbo_out(y: Tensor, code_bytes: list[int]) -> list[Tensor]:
    b, h, t, _ = y.shape
    return [y.new_empty((b, h, t, n), dtype=torch.uint8) for n in code_bytes] + [
        y.new_empty((b, h, t, 1), dtype=torch.float16)]


@pack_turbo.register_fake
def _(y, mids, books, bits, code_bytes, lsq):
    return _turbo_out(y, code_bytes)


_NUQ_FIELDS = ("codes", "out_idx", "out_val", "pos", "lo", "hi")


def nuq_tensors(st: StreamTensors) -> list[Optional[Tensor]]:
    """`[sink, codes, out_idx, out_val, pos, lo, hi, codebook, mid, half, inv_freq]` of a NUQ stream."""
    f, fmt = st.fields, st.fmt
    return [st.sink, *(f.get(k) for k in _NUQ_FIELDS), fmt.codebook, fmt.mid, fmt.half, fmt.inv_freq]


def nuq_ints(st: StreamTensors) -> list[int]:
    return [st.fmt.bits, st.fmt.slots, st.n_packed]


def _nuq_stream(tensors: list, ints: list[int], rope_scale: float) -> StreamTensors:
    sink, *fields, codebook, mid, half, inv_freq = tensors
    bits, slots, n_packed = ints
    fmt = NUQFormat(bits, codebook, slots, mid=mid, half=half, inv_freq=inv_freq, rope_scale=rope_scale)
    named = {k: v for k, v in zip(_NUQ_FIELDS, fields) if v is not None}
    return StreamTensors(sink=sink, fields=named, fmt=fmt, n_packed=n_packed, residual=None)


@torch.library.custom_op("hf_kvcache::static_nuq_attention", mutates_args=())
def static_nuq_attention(
    query: Tensor,
    k_sink: Optional[Tensor], k_codes: Tensor, k_out_idx: Optional[Tensor], k_out_val: Optional[Tensor],
    k_pos: Optional[Tensor], k_lo: Optional[Tensor], k_hi: Optional[Tensor], k_codebook: Tensor,
    k_mid: Optional[Tensor], k_half: Optional[Tensor], k_inv_freq: Optional[Tensor],
    v_sink: Optional[Tensor], v_codes: Tensor, v_out_idx: Optional[Tensor], v_out_val: Optional[Tensor],
    v_pos: Optional[Tensor], v_lo: Optional[Tensor], v_hi: Optional[Tensor], v_codebook: Tensor,
    v_mid: Optional[Tensor], v_half: Optional[Tensor], v_inv_freq: Optional[Tensor],
    k_new: Tensor, v_new: Tensor, length: Tensor, mask: Optional[Tensor], s_aux: Optional[Tensor],
    k_ints: list[int], v_ints: list[int], layout: list[int], rope_scale: float, exact_new: bool, scaling: float,
    softcap: float, has_softcap: bool,
) -> Tensor:
    keys = _nuq_stream([k_sink, k_codes, k_out_idx, k_out_val, k_pos, k_lo, k_hi, k_codebook, k_mid, k_half,
                        k_inv_freq], k_ints, rope_scale)
    values = _nuq_stream([v_sink, v_codes, v_out_idx, v_out_val, v_pos, v_lo, v_hi, v_codebook, v_mid, v_half,
                          v_inv_freq], v_ints, 1.0)
    return nuq_launch.nuq_attention(
        query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=mask, scaling=scaling,
        softcap=softcap if has_softcap else None, s_aux=s_aux, static=StaticLayout(length, layout[1], layout[0]),
    )


@static_nuq_attention.register_fake
def _(query, *args, **kwargs):
    b, hq, tq, d = query.shape
    return query.new_empty((b, tq, hq, d))


@torch.library.custom_op("hf_kvcache::pack_nuq", mutates_args=())
def pack_nuq(x: Tensor, midpoints: Tensor, codebook: Tensor, inv_freq: Optional[Tensor],
             key_norm: list[Tensor], positions: Optional[Tensor], bits: int, slots: int,
             rope_scale: float) -> list[Tensor]:
    """-> `[codes, out_idx, out_val, lo, hi]` (each empty where the stream has no such field); `key_norm` empty
    for values."""
    out = _nuq_out(x, bits, slots, keys=bool(key_norm))
    if positions is not None and inv_freq is not None:
        out["pos"] = x.new_empty((x.shape[0], 1, x.shape[2]), dtype=torch.int32)
    fmt = NUQFormat(bits, codebook, slots, inv_freq=inv_freq, rope_scale=rope_scale)
    nuq_launch.pack_nuq(x, out, fmt, midpoints, key_norm=tuple(key_norm) if key_norm else None,
                        positions=positions, _eager=True)
    return _nuq_list(x, out)


def _nuq_list(x: Tensor, out: dict) -> list[Tensor]:
    # a fresh empty tensor for each absent field: an operator's outputs may not alias each other
    return [out[k] if k in out else x.new_empty((0,), dtype=torch.float16)
            for k in ("codes", "out_idx", "out_val", "lo", "hi")]


def _nuq_out(x: Tensor, bits: int, slots: int, keys: bool) -> dict:
    b, h, t, d = x.shape
    out = {"codes": x.new_empty((b, h, t, d * bits // 8), dtype=torch.uint8)}
    if slots:
        out["out_idx"] = x.new_empty((b, h, t, slots), dtype=torch.uint8)
        out["out_val"] = x.new_empty((b, h, t, slots), dtype=torch.float16)
    if not keys:
        out["lo"] = x.new_empty((b, h, t, 1), dtype=torch.float16)
        out["hi"] = x.new_empty((b, h, t, 1), dtype=torch.float16)
    return out


@pack_nuq.register_fake
def _(x, midpoints, codebook, inv_freq, key_norm, positions, bits, slots, rope_scale):
    out = _nuq_out(x, bits, slots, keys=bool(key_norm))
    return _nuq_list(x, out)


def turbo_tensors(st: StreamTensors) -> list[Optional[Tensor]]:
    """`[sink, residual, R, order, codes and norm of part 0, of part 1]` of a TurboQuant stream (None where absent;
    one part: part 1's None)."""
    rot, order = st.fmt.frame(st.fields[st.fmt.parts[0].codes].device)
    out = [st.sink, st.residual, rot, order]
    for i in range(2):
        part = st.fmt.parts[i] if i < len(st.fmt.parts) else None
        out += [st.fields[part.codes], st.fields[part.norm]] if part else [None, None]
    return out


def turbo_ints(st: StreamTensors) -> list[int]:
    """`[n_packed, then (start, width, bits) per part]`."""
    return [st.n_packed] + [v for p in st.fmt.parts for v in (p.start, p.width, p.bits)]


def turbo_books(st: StreamTensors) -> list[float]:
    """The parts' codebooks, one after the other (a fixed few numbers: constants of the traced graph)."""
    return [v for p in st.fmt.parts for v in p.levels]


def _turbo_stream(tensors: list, ints: list[int], books: list[float]) -> StreamTensors:
    sink, residual, rot, order, *fields = tensors
    n_packed, *spec = ints
    parts, named, at = [], {}, 0
    for i in range(len(spec) // 3):
        start, width, bits = spec[3 * i: 3 * i + 3]
        named[f"codes{i}"], named[f"norm{i}"] = fields[2 * i], fields[2 * i + 1]
        parts.append(CodebookPart(f"codes{i}", f"norm{i}", bits, start, width,
                                  torch.tensor(books[at: at + (1 << bits)], dtype=torch.float32)))
        at += 1 << bits
    fmt = CodebookFormat(tuple(parts), frame=lambda device: (rot, order))
    return StreamTensors(sink=sink, fields=named, fmt=fmt, n_packed=n_packed, residual=residual)


@torch.library.custom_op("hf_kvcache::static_turbo_attention", mutates_args=())
def static_turbo_attention(
    query: Tensor,
    k_sink: Optional[Tensor], k_res: Optional[Tensor], k_rot: Tensor, k_order: Optional[Tensor],
    k_codes0: Tensor, k_norm0: Tensor, k_codes1: Optional[Tensor], k_norm1: Optional[Tensor],
    v_sink: Optional[Tensor], v_res: Optional[Tensor], v_rot: Tensor, v_order: Optional[Tensor],
    v_codes0: Tensor, v_norm0: Tensor, v_codes1: Optional[Tensor], v_norm1: Optional[Tensor],
    k_new: Tensor, v_new: Tensor, length: Tensor, mask: Optional[Tensor], s_aux: Optional[Tensor],
    k_ints: list[int], v_ints: list[int], k_books: list[float], v_books: list[float], layout: list[int],
    exact_new: bool, scaling: float, softcap: float, has_softcap: bool,
) -> Tensor:
    keys = _turbo_stream([k_sink, k_res, k_rot, k_order, k_codes0, k_norm0, k_codes1, k_norm1], k_ints, k_books)
    values = _turbo_stream([v_sink, v_res, v_rot, v_order, v_codes0, v_norm0, v_codes1, v_norm1], v_ints, v_books)
    static = StaticLayout(length, layout[3], layout[0], layout[1], layout[1], bool(layout[2]), bool(layout[2]))
    return turbo_launch.turbo_attention(
        query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=mask, scaling=scaling,
        softcap=softcap if has_softcap else None, s_aux=s_aux, static=static,
    )


@static_turbo_attention.register_fake
def _(query, *args, **kwargs):
    b, hq, tq, d = query.shape
    return query.new_empty((b, tq, hq, d))


# ------------------------------------------------------------------ the operators' calls, one a format class


def traced_packed(query, keys, values, k_new, v_new, static: StaticLayout, *, exact_new, attention_mask, scaling,
                  softcap=None, s_aux=None):
    """`static_attention` over a `PackedFormat` layer (`dispatch.static_decode_attention` under torch.compile)."""
    layout = [static.sink_tokens, static.key_ring, static.value_ring, int(static.key_window), int(static.value_window),
              static.capacity]
    return torch.ops.hf_kvcache.static_attention(
        query, *stream_tensors(keys), *stream_tensors(values), k_new, v_new, static.length, attention_mask, s_aux,
        fmt_ints(keys), fmt_ints(values), layout, exact_new, float(scaling), float(softcap or 0.0), softcap is not None,
    )


def traced_nuq(query, keys, values, k_new, v_new, static: StaticLayout, *, exact_new, attention_mask, scaling,
               softcap=None, s_aux=None):
    """`static_nuq_attention` over an `NUQFormat` layer (KVQuant)."""
    return torch.ops.hf_kvcache.static_nuq_attention(
        query, *nuq_tensors(keys), *nuq_tensors(values), k_new, v_new, static.length, attention_mask, s_aux,
        nuq_ints(keys), nuq_ints(values), [static.sink_tokens, static.capacity], float(keys.fmt.rope_scale),
        exact_new, float(scaling), float(softcap or 0.0), softcap is not None,
    )


def traced_codebook(query, keys, values, k_new, v_new, static: StaticLayout, *, exact_new, attention_mask, scaling,
                    softcap=None, s_aux=None):
    """`static_turbo_attention` over a `CodebookFormat` layer (TurboQuant)."""
    return torch.ops.hf_kvcache.static_turbo_attention(
        query, *turbo_tensors(keys), *turbo_tensors(values), k_new, v_new, static.length, attention_mask, s_aux,
        turbo_ints(keys), turbo_ints(values), turbo_books(keys), turbo_books(values),
        [static.sink_tokens, static.key_ring, int(static.key_window), static.capacity], exact_new, float(scaling),
        float(softcap or 0.0), softcap is not None,
    )
