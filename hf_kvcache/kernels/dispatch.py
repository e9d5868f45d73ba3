"""Which kernel reads a layer: `supports` (whether one can, else why not), `decode_attention` (the launcher of the
layer's formats: `decode_launch`, `nuq_launch` or `turbo_launch`, each under its tensors' CUDA device) and
`static_decode_attention` (a cache's storage, through `library`'s operators under torch.compile).
"""

from __future__ import annotations

import torch

from . import library
from .decode_launch import _planes, packed_attention
from .launch import _compiling, _len, head_dim_ok
from .layout import CodebookFormat, NUQFormat, StaticLayout, StreamTensors
from .nuq_launch import nuq_attention
from .turbo_launch import turbo_attention


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
    if isinstance(keys.fmt, CodebookFormat):
        return turbo_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                               scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)
    if isinstance(keys.fmt, NUQFormat):
        return nuq_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                             scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)
    return packed_attention(query, keys, values, k_new, v_new, exact_new=exact_new, attention_mask=attention_mask,
                            scaling=scaling, softcap=softcap, s_aux=s_aux, static=static)


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
