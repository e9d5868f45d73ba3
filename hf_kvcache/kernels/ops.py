"""Launchers of the fused attention: shape checks, grid and block sizes. The math is stated in `decode.py`'s
docstring; the reference is `hf_kvcache.attention.reference_attention` over the same layer."""

from __future__ import annotations

import functools
import math
import os

import torch

from . import backend
from .layout import FP8_KINDS, SCALED_KINDS, CodebookFormat, NUQFormat, StaticLayout, StreamTensors

# Launch parameters of the fused attention (the benchmark's sweep sets them; the environment can too):
# tokens per tile (per-token formats; per-channel keys use their block), warps, software-pipelining stages, and
# split-K's target of programs per multiprocessor (each split keeps at least `min_tiles_per_split` tiles).
# Defaults from the H200 sweeps (BENCHMARKS.md): 64-token tiles with 3 stages (2026-11-29); 2 warps a program and
# about 16 programs per multiprocessor (2026-12-01: the 4 warps of a program split each tile's columns, so every
# tile's row maxima and sums and p's operand layout crossed warps through shared memory and barriers; 2 warps with
# twice the programs were 1.08-1.16x faster for every format at batch 16), each split at least 4 tiles (more
# splits at batch 1 only added partial results to combine). KVQuant's kernel keeps 4 warps (2 were 1.7x slower).
TUNING = {
    "block_n": int(os.environ.get("HF_KVCACHE_BLOCK_N", "64")),
    "num_warps": int(os.environ.get("HF_KVCACHE_NUM_WARPS", "2")),
    "num_stages": int(os.environ.get("HF_KVCACHE_NUM_STAGES", "3")),
    "programs_per_sm": int(os.environ.get("HF_KVCACHE_PROGRAMS_PER_SM", "16")),
    "nuq_block_n": int(os.environ.get("HF_KVCACHE_NUQ_BLOCK_N", "32")),  # KVQuant's tiles (its own kernel)
    "nuq_num_warps": int(os.environ.get("HF_KVCACHE_NUQ_NUM_WARPS", "4")),
    "nuq_fast_trig": True,  # KVQuant's RoPE: reduced angles and the approximate hardware cos/sin
    # KVQuant's codebook lookup (`nuq.py`): "registers" (PTX over fp16 byte tables; fp16 and bf16 models on the GPU,
    # the others take "selects"), "selects" (a chain over the centroids) or "load" (a gather, the ablation)
    "nuq_lookup": os.environ.get("HF_KVCACHE_NUQ_LOOKUP", "registers"),
    "nuq_maxnreg": int(os.environ.get("HF_KVCACHE_NUQ_MAXNREG", "0")),  # a register cap for its programs (0: none)
    # with the register lookup: dequantize, rotate and multiply in fp16 (pairs of channels an instruction, the
    # slots written by a packed compare), where the format's values fit fp16 (`NUQFormat.fp16`)
    "nuq_fp16": os.environ.get("HF_KVCACHE_NUQ_FP16", "1") == "1",
    "min_tiles_per_split": int(os.environ.get("HF_KVCACHE_MIN_TILES_PER_SPLIT", "4")),
    # a decode step's mask row loaded one tile ahead in the body loops (`decode._attn_fwd`, `turbo._turbo_attn`)
    "mask_ahead": os.environ.get("HF_KVCACHE_MASK_AHEAD", "1") == "1",
    # fp16 products for bf16 models where every code converts to fp16 exactly (`_product_dtype`)
    "fp16_products": os.environ.get("HF_KVCACHE_FP16_PRODUCTS", "1") == "1",
    # TurboQuant's kernel (`turbo.py`): its codebook lookup, "registers" (PTX, fp16 products) or "load"
    # (BENCHMARKS.md, 2026-12-01: x0.84 against x0.28 at batch 16 x 32k), its tiles, warps and stages
    "turbo_lookup": os.environ.get("HF_KVCACHE_TURBO_LOOKUP", "registers"),
    "turbo_block_n": int(os.environ.get("HF_KVCACHE_TURBO_BLOCK_N", "128")),
    "turbo_num_warps": int(os.environ.get("HF_KVCACHE_TURBO_NUM_WARPS", "4")),
    "turbo_num_stages": int(os.environ.get("HF_KVCACHE_TURBO_NUM_STAGES", "2")),
    # a register cap for its body programs (0: none): 4 warps at 128 registers keep 4 programs on a multiprocessor;
    # local compiles of small edits went to 134-168, and the cap measured 678 -> 670 us at batch 16 (BENCHMARKS.md)
    "turbo_maxnreg": int(os.environ.get("HF_KVCACHE_TURBO_MAXNREG", "128")),
}


def on_input_device(launcher):
    """Run a launcher under the CUDA device of its first tensor argument.

    Triton launches on the *current* CUDA device and its stream. A model split over GPUs (accelerate's
    `device_map`) calls the attention and pack launchers for layers whose tensors live on another GPU than the
    current one; without the switch the kernel would run on the wrong device, reading the other GPU's memory
    over the interconnect (or faulting)."""

    @functools.wraps(launcher)
    def run(x: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():  # the launcher calls its operator (`library`), which switches itself
            return launcher(x, *args, **kwargs)
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return launcher(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return run


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fmt_code(kind: str) -> int:
    from . import decode

    return {"fp8-e4m3": decode.FMT_FP8_E4M3, "fp8-e5m2": decode.FMT_FP8_E5M2, "uniform": decode.FMT_UNIFORM,
            "exact": decode.FMT_EXACT}[kind]


def head_dim_ok(d: int) -> bool:
    """The kernels handle head_dim a power of two from 16 to 256 (arange sizes); others use the reference."""
    return 16 <= d <= 256 and not d & (d - 1)


def supports(keys: StreamTensors, values: StreamTensors, query: torch.Tensor, static: bool = False) -> str | None:
    """None if the fused kernel can serve this layer, else why not (the caller falls back to the reference);
    `static`: a cache's storage, its lengths on the device (`hf_kvcache.storage`)."""
    d = query.shape[-1]
    if not head_dim_ok(d):
        return f"head_dim {d} is not a power of two in [16, 256]"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    if isinstance(keys.fmt, CodebookFormat) or isinstance(values.fmt, CodebookFormat):
        if not (isinstance(keys.fmt, CodebookFormat) and isinstance(values.fmt, CodebookFormat)):
            return "codebook keys and values are read together (TurboQuant)"
        if static and _len(keys.residual) != _len(values.residual):
            return "a static TurboQuant layer with residual windows of two lengths"
        for fmt in (keys.fmt, values.fmt):
            if len(fmt.parts) > 2:
                return f"{len(fmt.parts)} codebook parts"
            for part in fmt.parts:
                if part.bits not in (2, 3, 4) or not head_dim_ok(part.width):
                    return f"a codebook part of {part.width} channels at {part.bits} bits"
        return None
    if isinstance(keys.fmt, NUQFormat) or isinstance(values.fmt, NUQFormat):
        if not (isinstance(keys.fmt, NUQFormat) and isinstance(values.fmt, NUQFormat) and keys.fmt.mid is not None):
            return "NUQ keys and values are read together (KVQuant)"
        return None if d >= 32 else f"NUQ keys are rotated in halves of >= 16 channels, not head_dim {d}"
    if values.fmt.token_group != 1:
        return "values grouped along tokens"
    for st in (keys, values):
        if st.fmt.kind == "uniform" and st.fmt.token_group > 1 and st.fmt.token_group not in (16, 32, 64, 128):
            return f"token group {st.fmt.token_group}"
    if keys.fmt.token_group > 1 and not _planes(keys.fmt, d, keys=True):
        return f"per-channel {keys.fmt.bits}-bit keys need head_dim >= {16 * 8 // keys.fmt.bits} (bit planes of 16)"
    return None


def _planes(fmt, head_dim: int, keys: bool) -> bool:
    """Whether the body reads this stream's codes as bit planes with its scales applied outside the products
    (one group per token row, or per-channel key blocks); other uniform formats dequantize whole tiles."""
    if fmt.kind != "uniform" or head_dim * fmt.bits // 8 < 16:  # a plane is an operand of products: >= 16 wide
        return False
    return (keys and fmt.token_group > 1) or (fmt.channel_group or head_dim) == head_dim


def _fp16_exact(fmt, head_dim: int, keys: bool) -> bool:
    """Whether the body converts this stream's codes to fp16 exactly and multiplies nothing else into that operand:
    fp8, or integer codes of one group per token row read as planes (c - 2^(bits-1), `decode._plane`). Per-channel
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
    """OFF of `decode._plane` for products in `dtype`: 128 for codes below 128 in bf16, 1024 in fp16, 0 (a plain
    conversion) otherwise."""
    if fmt.kind != "uniform" or backend.interpreting():
        return 0
    if dtype == torch.float16:
        return 1024
    return 128 if dtype == torch.bfloat16 and fmt.bits <= 4 else 0


def _len(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[2]


def _step_counts(query: torch.Tensor, keys: StreamTensors, k_new: torch.Tensor,
                 exact_new: bool) -> tuple[int, int, int, int, int]:
    """The launchers' counts of one step: (kv-heads, query heads per kv-head, sinks, new tokens read exactly, `stop`:
    the held tokens before them). Hq must be a multiple of Hkv (GQA/MQA are read by head mapping)."""
    hq, hkv = query.shape[1], k_new.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv-heads")
    n_sink = _len(keys.sink)
    n_new = k_new.shape[2] if exact_new else 0
    return hkv, hq // hkv, n_sink, n_new, n_sink + keys.n_packed + _len(keys.residual) - n_new


def _place(t: torch.Tensor | None, dummy: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """A (B, H, T, D) place and its batch, head and token strides (a dummy pointer when the place is empty, with
    the token stride of a place's own storage, D, so that the kernel's specialization does not change)."""
    if t is None or t.shape[2] == 0:
        return dummy, 0, 0, dummy.shape[-1]
    if t.stride(3) != 1:
        raise ValueError("the innermost axis of a cache place must be contiguous")
    return t, t.stride(0), t.stride(1), t.stride(2)


def _packed_args(st: StreamTensors, dummy: torch.Tensor, head_dim: int) -> list:
    """Pointers and strides of the packed fields: codes + token stride, scale/zero + token and channel strides,
    fp8 scale + batch and head strides."""
    f, fmt = st.fields, st.fmt
    fp8 = fmt.kind in SCALED_KINDS
    if st.n_packed == 0 or not f:
        # Nothing packed yet: a dummy pointer with the token strides the storage will have (same specialization).
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
def decode_attention(
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
    """`softmax(q K^T * scaling) V` over every token the layer holds -> `(B, Tq, Hq, D)` in the query dtype.

    `query (B, Hq, Tq, D)`; `keys`/`values`: the layer's places (`StreamTensors`); `k_new`/`v_new (B, Hkv, Tn, D)`:
    this step's exact tokens, the last Tn the layer holds, read instead of their stored copies when `exact_new`;
    `attention_mask`: boolean `(B or 1, 1, Tq, S)` (True = attend) over the S held tokens, or None for causal.
    Hq must be a multiple of Hkv (GQA/MQA are read by head mapping).

    `static` (every cache's storage, `hf_kvcache.storage`): the places are whole allocated buffers (`n_packed` their
    capacity in tokens) and the kernel derives every length from `static.length` on the device; the launch is
    sized for the capacity, so it never reads a value back and one CUDA graph serves every step.
    """
    from . import decode

    if isinstance(keys.fmt, CodebookFormat):
        return turbo_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                               scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)
    if isinstance(keys.fmt, NUQFormat):
        return nuq_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                             scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)
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
    n_splits, tiles_per_split = _split_k(query, n_body_tiles, b * hkv * m_tiles)
    part_acc, part_m, part_l = _partials(query, b * hkv * m_tiles * block_m, n_splits + 1, reuse=static is None)
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
        stop, n_new, n_body_tiles, tiles_per_split, n_splits, m_tiles,
        float(scaling), float(softcap or 0.0),
    ]
    meta = dict(
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, DT=dt, PDT=decode.tl.float16 if pdt != query.dtype else dt,
        PREC=prec, HAS_MASK=attention_mask is not None, MASK_ROW=tq == 1, MASK_AHEAD=TUNING["mask_ahead"],
        HAS_SOFTCAP=softcap is not None, CAUSAL_BODY=attention_mask is None and not exact_new and tq > 1,
        K_PLANES=_planes(keys.fmt, d, keys=True), V_PLANES=_planes(values.fmt, d, keys=False),
        K_OFF=_magic_offset(keys.fmt, pdt), V_OFF=_magic_offset(values.fmt, pdt),
        **_fmt_meta(keys, values, d),
    )
    if static is not None:
        meta.update(STATIC=True, SINK_CAP=static.sink_tokens, K_RING=static.key_ring, V_RING=static.value_ring,
                    K_WINDOW=static.key_window, V_WINDOW=static.value_window)
    if n_splits:
        decode._attn_fwd[(b * hkv, n_splits, m_tiles)](
            *args, **meta, BODY=True, num_warps=TUNING["num_warps"], num_stages=stages
        )
    decode._attn_fwd[(b * hkv, 1, m_tiles)](*args, **meta, BODY=False, num_warps=4, num_stages=2)
    _combine(part_acc, part_m, part_l, out, s_aux, hkv, tq, g, n_splits + 1, m_tiles * block_m)
    return out


def _stream_args(st: StreamTensors, new: torch.Tensor, dummy: torch.Tensor, head_dim: int) -> list:
    """One stream's places as `decode._attn_fwd` takes them: sink, packed fields, residual, new tokens, fp8 scale."""
    packed, f8 = _packed_args(st, dummy, head_dim)
    return [*_place(st.sink, dummy), *packed, *_place(st.residual, dummy), *_place(new, dummy), *f8]


def _fmt_meta(keys: StreamTensors, values: StreamTensors, head_dim: int) -> dict:
    """The two streams' formats as `decode._attn_fwd`'s constexprs (K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM, V_...)."""

    def fmt_args(st: StreamTensors, with_tokens: bool) -> list:
        f = st.fmt
        chg = f.channel_group or head_dim
        out = [_fmt_code(f.kind), f.bits]
        if with_tokens:
            out.append(f.token_group)
        return out + [chg if f.kind == "uniform" else head_dim, f.symmetric]

    return {**dict(zip(("K_FMT", "K_BITS", "K_TOKG", "K_CHG", "K_SYM"), fmt_args(keys, True))),
            **dict(zip(("V_FMT", "V_BITS", "V_CHG", "V_SYM"), fmt_args(values, False)))}


def static_decode_attention(
    query: torch.Tensor,
    keys: StreamTensors,
    values: StreamTensors,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    static: StaticLayout,
    *,
    exact_new: bool,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode_attention` over a static layer's whole buffers, lengths from `static.length` on the device; under
    torch.compile through the operator `hf_kvcache::static_attention` (`library`)."""
    if not _compiling():
        return decode_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                                scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)
    from . import library

    if isinstance(keys.fmt, NUQFormat):
        return torch.ops.hf_kvcache.static_nuq_attention(
            query, *library.nuq_tensors(keys), *library.nuq_tensors(values), k_new, v_new, static.length,
            attention_mask, s_aux, library.nuq_ints(keys), library.nuq_ints(values),
            [static.sink_tokens, static.capacity], float(keys.fmt.rope_scale), exact_new, float(scaling),
            float(softcap or 0.0), softcap is not None,
        )
    if isinstance(keys.fmt, CodebookFormat):
        return torch.ops.hf_kvcache.static_turbo_attention(
            query, *library.turbo_tensors(keys), *library.turbo_tensors(values), k_new, v_new, static.length,
            attention_mask, s_aux, library.turbo_ints(keys), library.turbo_ints(values), library.turbo_books(keys),
            library.turbo_books(values), [static.sink_tokens, static.key_ring, int(static.key_window),
                                          static.capacity], exact_new, float(scaling), float(softcap or 0.0),
            softcap is not None,
        )
    layout = [static.sink_tokens, static.key_ring, static.value_ring, int(static.key_window), int(static.value_window),
              static.capacity]
    return torch.ops.hf_kvcache.static_attention(
        query, *library.stream_tensors(keys), *library.stream_tensors(values), k_new, v_new, static.length,
        attention_mask, s_aux, library.fmt_ints(keys), library.fmt_ints(values), layout, exact_new, float(scaling),
        float(softcap or 0.0), softcap is not None,
    )


def _length_args(static: StaticLayout | None, dummy: torch.Tensor) -> list:
    """The kernels' `LENS, cap_len`: the storage's length tensor and capacity (a dummy and 0 otherwise)."""
    return [static.length, static.capacity] if static is not None else [dummy, 0]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _copy_fields(out: dict[str, torch.Tensor], fields: list[torch.Tensor], names: tuple[str, ...]) -> None:
    for name, value in zip(names, fields):
        out[name].copy_(value)


def _split_k(query: torch.Tensor, n_tiles: int, programs: int) -> tuple[int, int]:
    """Split-K sizing: (n_splits, tiles_per_split) for `n_tiles` tiles of packed tokens and `programs` programs per
    split; on CUDA about `programs_per_sm` programs per multiprocessor, each split at least `min_tiles_per_split`
    tiles."""
    if query.is_cuda and n_tiles:
        target = TUNING["programs_per_sm"] * _multiprocessors(query.device.index or 0)
        n_splits = max(1, min(math.ceil(target / programs), n_tiles // TUNING["min_tiles_per_split"]))
    else:
        n_splits = 1 if n_tiles else 0
    tiles_per_split = math.ceil(n_tiles / n_splits) if n_splits else 0
    n_splits = math.ceil(n_tiles / tiles_per_split) if n_splits else 0
    return n_splits, tiles_per_split


# Split-K workspaces by (CUDA stream, rows, parts, D), reused from call to call without a storage layout (the kernel
# benchmarks and tests; a cache's eager decode step replays its graph's own): each call otherwise pays three
# allocations (~5 us of host time each on the H200 host). Kernels on one stream run in order, so a workspace is
# never read by one call while the next writes it; a few shapes live at once (the split count settles once a cache
# is long), and the oldest is dropped past `_WORKSPACES_KEPT`.
_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_WORKSPACES_KEPT = 8


def _partials(query: torch.Tensor, rows: int, n_parts: int,
              reuse: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 split-K partial results of `rows` query rows: acc `(rows * n_parts, D)`, running max and sum.

    `reuse` (calls without a storage layout: the kernel benchmarks and tests): from the shared workspaces. Never for a
    cache's calls, which may be captured into a layer's CUDA graph or run inside torch.compile's CUDA-graph trees:
    there even the warm-up allocates from the graph's pool, which refuses tensors kept alive outside its outputs
    (measured on the H200: "tensors in the cudagraph pool not tracked as outputs"); nor while any CUDA graph is
    captured (a graph must own its workspace, which could otherwise be dropped from here while the graph still
    replays into it); nor on CPU (the interpreter's tests)."""
    shared = reuse and query.is_cuda and not torch.cuda.is_current_stream_capturing()
    key = (torch.cuda.current_stream(query.device).cuda_stream if shared else 0, rows, n_parts, query.shape[-1])
    found = _WORKSPACES.get(key) if shared else None
    if found is not None:
        return found
    acc = torch.empty((rows * n_parts, query.shape[-1]), device=query.device, dtype=torch.float32)
    m = torch.empty((rows * n_parts,), device=query.device, dtype=torch.float32)
    parts = acc, m, torch.empty_like(m)
    if shared:
        if len(_WORKSPACES) >= _WORKSPACES_KEPT:
            _WORKSPACES.pop(next(iter(_WORKSPACES)))
        _WORKSPACES[key] = parts
    return parts


def _mask_args(attention_mask: torch.Tensor | None, dummy: torch.Tensor) -> list:
    if attention_mask is None:
        return [dummy, 0, 0, 0]
    if attention_mask.dtype != torch.bool:
        raise ValueError("the fused attention takes a boolean mask (True = attend)")
    mask = attention_mask.view(torch.uint8)
    return [mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2), mask.stride(3)]


def _compute_dtype(query: torch.Tensor) -> tuple:
    """The products' operand dtype and precision: the model dtype on tensor cores, exact fp32 for fp32 models
    and the interpreter (whose bf16 products are not trustworthy)."""
    from . import decode

    if query.dtype == torch.float32 or backend.interpreting():
        return decode.tl.float32, "ieee"
    return (decode.tl.bfloat16 if query.dtype == torch.bfloat16 else decode.tl.float16), "tf32"


def _combine(part_acc, part_m, part_l, out, s_aux, hkv: int, tq: int, g: int, n_parts: int, rows_pad: int,
             frame: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
    """The split-K partials into `out (B, Tq, Hq, D)`; `frame` (the values' `(R, order)`, TurboQuant): every part but
    the last (the tail's) is in the values' frame and is taken back by F_v^T."""
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
        s_aux if s_aux is not None else part_m, *frame_args, hkv, tq, n_parts, rows_pad,
        G=g, D=out.shape[-1], NP=decode.triton.next_power_of_2(n_parts), HAS_SAUX=s_aux is not None,
        FRAME=frame is not None, HAS_ORDER=has_order, num_warps=4,
    )


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
    """`decode_attention` over KVQuant's NUQ layout (`NUQFormat`, kernels in `nuq.py`): `query (B, Hq, Tq, D)`,
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
        if not body:  # nothing packed is read: dummies with the storage's token strides (one specialization)
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
    if rope and body:
        pos = keys.fields["pos"]  # (B, 1, T)
        pos_args = [pos, pos.stride(0), pos.stride(2)]
    else:
        pos_args = [dummy, 0, 1]
    if body:
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
        num_warps=TUNING["nuq_num_warps"], num_stages=2, **cap,
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


def codebook_args(st: StreamTensors, n_body: int, dummy: torch.Tensor, dtype: torch.dtype) -> tuple[list, list]:
    """A codebook stream's parts as `turbo._turbo_attn` takes them, two (a single part repeats): per part codes +
    strides, norm + strides, the codebook in `dtype`; and each part's `(width, bits, PTX of the register lookup)`."""
    args, meta = [], []
    for part in st.fmt.parts + st.fmt.parts[-1:] * (2 - len(st.fmt.parts)):
        table, asm = _codebook_table(part, dummy.device, dtype)
        if n_body:
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
    return (q @ rot).view(b, hq, tq, d)


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
        halves = tuple(int(v) & 0xFFFF for v in part.codebook.to(torch.float16).view(torch.int16).tolist())
        found = (part.codebook.to(device=device, dtype=dtype), _asm(part.bits, halves))
        if len(_TABLES) > 64:
            _TABLES.clear()
        _TABLES[key] = found
    return found


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
    """`decode_attention` over TurboQuant's layout (`CodebookFormat`, kernel in `turbo.py`): `query (B, Hq, Tq, D)`,
    per part `codes (B, Hkv, T, W*b/8) uint8` and `norm (B, Hkv, T, 1) fp16` -> `(B, Tq, Hq, D)`. With the frames
    F_k, F_v (`CodebookFormat.frame`): the body reads q' = q F_k (one gather and one product here), the tail the exact
    tokens as stored with q itself, and the combine takes the result out of the values' frame (o' F_v^T). `static`:
    as in `decode_attention` (the same ring for keys and values, `supports`)."""
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
        ring = dict(STATIC=True, SINK_CAP=static.sink_tokens, RING=static.key_ring, WINDOW=static.key_window)
    dt, prec = _compute_dtype(query)
    pdt = torch.float32 if dt == turbo.tl.float32 else torch.float16
    lookup = turbo.LOOKUP_REGISTERS if pdt == torch.float16 and TUNING["turbo_lookup"] == "registers" else \
        turbo.LOOKUP_LOAD

    block_n = TUNING["turbo_block_n"]
    block_m = 16 if tq * g <= 16 else (32 if tq * g <= 32 else 64)
    m_tiles = turbo.triton.cdiv(tq * g, block_m)
    n_splits, tiles_per_split = _split_k(query, turbo.triton.cdiv(n_body, block_n), b * hkv * m_tiles)
    part_acc, part_m, part_l = _partials(query, b * hkv * m_tiles * block_m, n_splits + 1, reuse=static is None)

    k_args, k_meta = codebook_args(keys, n_body, k_new, pdt)
    v_args, v_meta = codebook_args(values, n_body, k_new, pdt)
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
        hkv, tq, n_sink, n_body, stop, n_new, tiles_per_split, n_splits, m_tiles, float(scaling), float(softcap or 0.0),
    ]
    meta = dict(
        D=d, G=g, BLOCK_M=block_m, BLOCK_N=block_n, TAIL_N=16, DT=dt,
        PDT=turbo.tl.float16 if pdt == torch.float16 else dt,
        PREC=prec, HAS_MASK=attention_mask is not None, MASK_ROW=tq == 1, MASK_AHEAD=TUNING["mask_ahead"],
        HAS_SOFTCAP=softcap is not None, CAUSAL_BODY=attention_mask is None and not exact_new and tq > 1, LOOKUP=lookup,
        K_TWO=len(kf.parts) == 2, K_WA=k_meta[0][0], K_BA=k_meta[0][1], K_BB=k_meta[1][1],
        V_TWO=len(vf.parts) == 2, V_WA=v_meta[0][0], V_BA=v_meta[0][1], V_BB=v_meta[1][1],
        K_ASM_A=k_meta[0][2], K_ASM_B=k_meta[1][2], V_ASM_A=v_meta[0][2], V_ASM_B=v_meta[1][2], **ring,
    )
    if n_splits:
        cap = {"maxnreg": TUNING["turbo_maxnreg"]} if TUNING["turbo_maxnreg"] and not backend.interpreting() else {}
        turbo._turbo_attn[(b * hkv, n_splits, m_tiles)](
            *args, **meta, BODY=True, num_warps=TUNING["turbo_num_warps"], num_stages=TUNING["turbo_num_stages"],
            **cap)
    turbo._turbo_attn[(b * hkv, 1, m_tiles)](*args, **meta, BODY=False, num_warps=4, num_stages=2)
    out = torch.empty((b, tq, hq, d), device=device, dtype=query.dtype)
    _combine(part_acc, part_m, part_l, out, s_aux, hkv, tq, g, n_splits + 1, m_tiles * block_m,
             frame=vf.frame(device))
    return out


# ------------------------------------------------------------------------------------------ quantize/pack

_PACK_BLOCK_T = 16


def _bh_t_strides(t: torch.Tensor) -> tuple[int, int, int]:
    if t.stride(-1) != 1:
        raise ValueError("the innermost axis must be contiguous")
    return t.stride(0), t.stride(1), t.stride(2)


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
        D=d, E5M2=fmt == "e5m2", BLOCK_T=_PACK_BLOCK_T,
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


@on_input_device
def hadamard(x: torch.Tensor, _eager: bool = False) -> torch.Tensor:
    """`x (..., D)` -> `x @ H / sqrt(D)` in x's dtype (computed in float32), D a power of two up to 256
    (`quant.fwht`)."""
    from . import hadamard as kernel

    if not _eager and _compiling():
        return torch.ops.hf_kvcache.hadamard(x)

    d = x.shape[-1]
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"the Hadamard kernel takes a power-of-two head_dim in [16, 256], got {d}")
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    block = 16
    kernel._fwht_rows[(kernel.triton.cdiv(rows.shape[0], block),)](
        rows, out, rows.shape[0], rows.stride(0), out.stride(0), D=d, LOG_D=d.bit_length() - 1, BLOCK=block,
    )
    return out.view(x.shape)
