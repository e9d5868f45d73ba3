"""Which kernel reads a layer: `supports` (whether one can, else why not), `decode_attention` (the launcher of the
layer's formats, each under its tensors' CUDA device) and `static_decode_attention` (a cache's storage, through
`library`'s operators under torch.compile), each asking the reader of the keys' format (`formats.READERS`).
"""

from __future__ import annotations

import torch

from .formats import reader_of
from .launch import _compiling, head_dim_ok
from .layout import StaticLayout, StreamTensors


def supports(keys: StreamTensors, values: StreamTensors, query: torch.Tensor, static: bool = False) -> str | None:
    """None if the fused kernel can serve this layer, else why not (the caller falls back to the reference);
    `static`: a cache's storage, its lengths on the device (`hf_kvcache.storage`). The checks every format shares,
    then its reader's (`formats.READERS`)."""
    d = query.shape[-1]
    if not head_dim_ok(d):
        return f"head_dim {d} is not a power of two in [16, 256]"
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {query.dtype}"
    reader = reader_of(keys.fmt)
    if type(values.fmt) is not type(keys.fmt):
        return f"{reader.method} keys are read with values of their own format, not {type(values.fmt).__name__}"
    return reader.supports(keys, values, query, static)


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
    return reader_of(keys.fmt).attention(query, keys, values, k_new, v_new, exact_new=exact_new,
                                         attention_mask=attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
                                         static=static)


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
    return reader_of(keys.fmt).traced(query, keys, values, k_new, v_new, static, exact_new=exact_new,
                                      attention_mask=attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux)
