"""The `hf_kvcache` attention and mask functions, registered in transformers on import.

With `attn_implementation="hf_kvcache"`, a `QuantizedKVCache` returns `KVHandle`s from `update()` and this
attention reads the packed cache itself:
- on CUDA (`hf_kvcache.kernels` backend "auto" or "triton"), the fused Triton kernel reads codes, scales, sink,
  residual and the exact new tokens in one pass (`hf_kvcache.kernels.decode_attention`); a step with nothing
  stored before it (the prefill) attends to its own exact tokens through PyTorch's SDPA;
- on CPU, or for a layout no kernel reads (3-bit codes, head_dim not a power of two, a float mask), the
  reference: blockwise attention over the dequantized cache, a chunk of tokens at a time, with an online
  softmax in fp32.
Neither path ever builds the full-length dense K/V. Plain tensors (any other cache, or none) go to
transformers' SDPA attention, so the implementation is safe to select for any model.

The mask function is transformers' SDPA one (boolean, True = attend): without a mask function registered
under the same name, transformers would pass `attention_mask=None` and padding would silently disappear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import kernels
from .cache import KVHandle
from .static import static_attention

ATTENTION_NAME = "hf_kvcache"
REFERENCE_CHUNK_TOKENS = 256


def reference_attention(
    query: torch.Tensor,
    key: KVHandle,
    value: KVHandle,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    chunk_tokens: int = REFERENCE_CHUNK_TOKENS,
) -> torch.Tensor:
    """Attention of `query (B, Hq, Tq, D)` over a quantized layer, chunk by chunk -> `(B, Hq, Tq, Dv)` float32
    (float64 for a float64 query).

    `attention_mask`: boolean `(B, 1, Tq, S)` (True = attend) or additive float, or None for plain causal;
    S = tokens the layer holds. GQA/MQA by grouping query heads (`(B, Hkv, G, Tq, D)`), never `repeat_kv`.
    """
    layer = key.layer
    b, hq, tq, d = query.shape
    hkv = key.new.shape[1]
    g = hq // hkv
    work = torch.promote_types(query.dtype, torch.float32)
    qg = query.to(work).reshape(b, hkv, g, tq, d)
    m = torch.full((b, hkv, g, tq, 1), float("-inf"), device=query.device, dtype=work)
    l_sum = torch.zeros((b, hkv, g, tq, 1), device=query.device, dtype=work)
    acc = None
    total = layer.held_tokens
    pos = 0
    for k, v in layer.iter_kv_chunks(key.new, value.new, chunk_tokens):
        c = k.shape[2]
        s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(work)) * scaling
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if attention_mask is None:
            qpos = torch.arange(tq, device=query.device).view(tq, 1) + (total - tq)
            kpos = torch.arange(pos, pos + c, device=query.device).view(1, c)
            s = s.masked_fill(kpos > qpos, float("-inf"))
        else:
            mk = attention_mask[..., pos : pos + c].unsqueeze(2)  # (B, 1, 1, Tq, c)
            s = s.masked_fill(~mk, float("-inf")) if mk.dtype == torch.bool else s + mk.to(work)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - safe)
        alpha = torch.exp(m - safe)
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        pv = torch.einsum("bhgqk,bhkd->bhgqd", p, v.to(work))
        acc = pv if acc is None else acc * alpha + pv
        m = m_new
        pos += c
    if acc is None:
        acc = torch.zeros((b, hkv, g, tq, value.new.shape[-1]), device=query.device, dtype=work)
    if s_aux is not None:
        # Learned attention sinks (gpt-oss style): one extra logit per head that takes probability mass.
        sink = s_aux.to(work).reshape(1, hkv, g, 1, 1)
        m_new = torch.maximum(m, sink)
        alpha = torch.exp(m - m_new)
        l_sum = l_sum * alpha + torch.exp(sink - m_new)
        acc = acc * alpha
    out = torch.where(l_sum > 0, acc / l_sum.clamp_min(1e-30), torch.zeros_like(acc))
    return out.reshape(b, hq, tq, -1)


def hf_kvcache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key,
    value,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
):
    """transformers attention-interface entry point. Returns `(attn_output (B, Tq, Hq, Dv), None)`."""
    if not isinstance(key, KVHandle):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    query = key.layer.rotate_query(query)  # rotated keys (RotatedCache) are read with a rotated query
    softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
    if getattr(key.layer, "is_static", False):
        out = static_attention(query, key, value, attention_mask, scaling, softcap=softcap, s_aux=s_aux)
        if out is not None:
            return out, None
    elif kernels.use_kernels(query.device):
        out = fused_attention(query, key, value, attention_mask, scaling, softcap=softcap, s_aux=s_aux)
        if out is not None:
            return out, None
    layer = key.layer
    if (not layer.quantize_before_attention and layer.held_tokens == key.new.shape[2] and softcap is None
            and s_aux is None):
        # A prefill (nothing stored before it): attention over its own exact tokens, as the kernel path does. The
        # reference would score every new token against every other in fp32 at once: (B, Hq, T, T), 87 GB for 64
        # windows of 6144 tokens (measured, an out-of-memory on the H200 for the formats no kernel reads).
        mask = None if attention_mask is None else attention_mask[..., : query.shape[2]]
        out = F.scaled_dot_product_attention(query, key.new, value.new, attn_mask=mask, scale=scaling,
                                             enable_gqa=True, is_causal=mask is None and query.shape[2] > 1)
        return out.transpose(1, 2).contiguous(), None
    out = reference_attention(query, key, value, attention_mask, scaling, softcap=softcap, s_aux=s_aux)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def fused_attention(
    query: torch.Tensor,
    key: KVHandle,
    value: KVHandle,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The kernel path: `(B, Tq, Hq, D)` in the query dtype, or None when no kernel reads this layer's layout."""
    from .kernels import ops

    layer = key.layer
    keys, values = layer.key_stream.kernel_view(), layer.value_stream.kernel_view()
    if keys is None or values is None or ops.supports(keys, values, query) is not None:
        return None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return None
    exact_new = not layer.quantize_before_attention
    if exact_new and layer.held_tokens == key.new.shape[2] and softcap is None and s_aux is None:
        # Nothing was stored before this step (a prefill): attention over its own exact tokens.
        out = F.scaled_dot_product_attention(
            query, key.new, value.new, attn_mask=attention_mask, scale=scaling, enable_gqa=True,
            is_causal=attention_mask is None and query.shape[2] > 1,
        )
        return out.transpose(1, 2).contiguous()
    return ops.decode_attention(
        query, keys, values, key.new, value.new, exact_new=exact_new, attention_mask=attention_mask,
        scaling=scaling, softcap=softcap, s_aux=s_aux,
    )


def register() -> None:
    """Register the `hf_kvcache` attention and its mask function in transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, hf_kvcache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
