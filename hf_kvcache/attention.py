"""The `hf_kvcache` attention and mask functions, registered in transformers on import, and the routing that lets a
model loaded with its own attention read a packed cache through them.

A `QuantizedKVCache` returns `KVHandle`s from `update()` under `attn_implementation="hf_kvcache"`, and on CUDA under
the model's own attention (sdpa, eager, flash: `cache.DEFAULT_ATTENTIONS`) too. transformers' models look their
attention function up through `AttentionInterface.get_interface` at every forward; on import that lookup is wrapped
(`install_routing`) so that the function it returns hands a call whose keys are a `KVHandle` to this attention, the
model's mask first read into this attention's form (`_routed_mask`), and calls every other argument exactly as
before: any other cache, or none, goes to the model's own function untouched.

This attention reads the packed cache itself:
- on CUDA (`hf_kvcache.kernels` backend "auto" or "triton"), the fused Triton kernels read codes, scales, sink,
  window and the exact new tokens in one pass, every length from the device (`hf_kvcache.kernels.ops`); a decode
  step replays the layer's CUDA graph of its store and attention (`QuantizedKVLayer.replay`); a step with nothing
  stored before it (the prefill) attends to its own exact tokens through PyTorch's SDPA; under torch.compile (a
  pinned capacity) the kernels are operators the compiler keeps as they are;
- on CPU, or for a layout no kernel reads (3-bit codes, head_dim not a power of two, a float mask), the
  reference: blockwise attention over the dequantized cache, a chunk of tokens at a time, with an online
  softmax in fp32.
Neither path ever builds the full-length dense K/V. Plain tensors (any other cache, or none) go to
transformers' SDPA attention, so the implementation is safe to select for any model.

The mask function (`causal_mask`) is transformers' SDPA one (boolean, True = attend), except where that mask would
be plain causal over rows without padding: there it gives None, which this attention reads as causal by position,
aligned bottom-right (a prefill chunk's query token sees every held token up to its own position). Without a mask
function registered under the same name, transformers would pass `attention_mask=None` and padding would silently
disappear.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import _compat, kernels, prefill
from .cache import ATTENTION_NAME, KVHandle

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
    for k, v in layer.reads.iter_kv_chunks(key.new, value.new, chunk_tokens):
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
        if attention_mask is None and 1 < query.shape[2] < key.shape[2]:
            # `causal_mask` left a plain causal mask out, and SDPA's is_causal would align it top-left
            attention_mask = _bottom_right_causal(query.shape[2], key.shape[2], query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    softcap, s_aux = kwargs.get("softcap"), kwargs.get("s_aux")
    layer = key.layer
    if layer.graph.pending:
        out = layer.graph.replay(query, attention_mask, scaling, softcap, s_aux)  # the decode step's CUDA graph
        if out is not None:
            return out, None
    query = layer.reads.rotate_query(query)  # rotated keys (RotatedCache) are read with a rotated query
    if torch.compiler.is_compiling():
        return _traced_attention(query, key, value, attention_mask, scaling, softcap, s_aux), None
    if kernels.use_kernels(query.device):
        out = fused_attention(query, key, value, attention_mask, scaling, softcap=softcap, s_aux=s_aux)
        if out is not None:
            return out, None
    if _attends_to_itself(layer, query, key, softcap, s_aux):
        # A prefill (nothing stored before it): attention over its own exact tokens, as the kernel path does. The
        # reference would score every new token against every other in fp32 at once: (B, Hq, T, T), 87 GB for 64
        # windows of 6144 tokens (measured, an out-of-memory on the H200 for the formats no kernel reads).
        return _prefill_attention(query, key, value, attention_mask, scaling), None
    out = reference_attention(query, key, value, attention_mask, scaling, softcap=softcap, s_aux=s_aux)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def _attends_to_itself(layer, query: torch.Tensor, key: KVHandle, softcap, s_aux) -> bool:
    """Whether this step is a prefill that attends to its own exact tokens only (nothing stored before it)."""
    return (not layer.quantize_before_attention and layer.held_tokens == key.new.shape[2] and query.shape[2] > 1
            and softcap is None and s_aux is None)


def _prefill_attention(query, key: KVHandle, value: KVHandle, attention_mask, scaling: float) -> torch.Tensor:
    """SDPA of a prefill over its own exact tokens -> `(B, Tq, Hq, D)` (the mask's first Tq columns: a pinned layer's
    mask spans its capacity)."""
    tq = query.shape[2]
    mask = None if attention_mask is None else attention_mask[..., :tq]
    out = F.scaled_dot_product_attention(query, key.new, value.new, attn_mask=mask, scale=scaling, enable_gqa=True,
                                         is_causal=mask is None)
    return out.transpose(1, 2).contiguous()


def fused_attention(
    query: torch.Tensor,
    key: KVHandle,
    value: KVHandle,
    attention_mask: torch.Tensor | None,
    scaling: float,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The kernel path, eager: `(B, Tq, Hq, D)` in the query dtype, or None when no kernel reads this layer's layout
    (or the mask is not boolean). `query (B, Hq, Tq, D)` in the stored keys' frame (`layer.reads.rotate_query`)."""
    layer = key.layer
    layer.write_pending()
    read = layer.reads.decode_read(query)
    if read is None:
        return None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return None
    if _attends_to_itself(layer, query, key, softcap, s_aux):
        return _prefill_attention(query, key, value, attention_mask, scaling)
    chunk = query.shape[2] > 1
    if (chunk and not layer.quantize_before_attention and softcap is None and s_aux is None
            and prefill.use_workspace(query, key.new.shape[1])):
        # many query tokens over a packed history: dequantized once into a workspace, read by flash attention; a
        # left-padded batch's rows each from their first unpadded token (any other mask: the decode kernel)
        pads = None if attention_mask is None else prefill.left_padding(attention_mask, query.shape[2],
                                                                        layer.held_tokens)
        if attention_mask is None or pads is not None:
            return prefill.prefill_attention(query, layer, read.keys, read.values, key.new, value.new, scaling,
                                             pads=pads)
    if chunk:  # a kernel that failed to compile for a chunk leaves the chunks to the reference (`attend_chunk`)
        return layer.reads.attend_chunk(read, query, key.new, value.new, attention_mask, scaling, softcap, s_aux)
    return read.attend(query, key.new, value.new, attention_mask, scaling, softcap, s_aux)


def _traced_attention(query, key: KVHandle, value: KVHandle, attention_mask, scaling: float, softcap=None,
                      s_aux=None) -> torch.Tensor:
    """The fused read of a pinned layer while torch.compile traces it -> `(B, Tq, Hq, D)`: the kernel's operator
    (`hf_kvcache::static_attention`) on CUDA, else attention over the whole capacity, masked (`_dense_attention`)."""
    layer = key.layer
    # (the formats are built in eager code, the prefill's: building one can read values that tracing cannot)
    read = layer.reads.decode_read(query) if kernels.use_kernels(query.device) else None
    if read is not None and (attention_mask is None or attention_mask.dtype == torch.bool):
        return read.attend(query, key.new, value.new, attention_mask, scaling, softcap, s_aux)
    return _dense_attention(query, key, value, attention_mask, scaling, softcap, s_aux)


def _dense_attention(query, key: KVHandle, value: KVHandle, attention_mask, scaling, softcap, s_aux):
    """Plain attention over the whole capacity, masked to the held tokens (and by `attention_mask`), in float32
    (float64 for a float64 query, as `reference_attention`)."""
    layer = key.layer
    k, v = layer.reads.dense_kv(key.new, value.new)
    b, hq, tq, d = query.shape
    hkv = k.shape[1]
    work = torch.promote_types(query.dtype, torch.float32)
    qg = query.to(work).reshape(b, hkv, hq // hkv, tq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(work)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(layer.capacity, device=query.device)
    qpos = layer.length - tq + torch.arange(tq, device=query.device)
    allowed = (kpos[None, :] <= qpos[:, None]).view(1, 1, 1, tq, -1)  # causal over what is held
    if attention_mask is not None:
        mk = attention_mask[..., : layer.capacity].unsqueeze(2)  # (B, 1, 1, Tq, S)
        if mk.dtype == torch.bool:
            allowed = allowed & mk
        else:
            s = s + mk.to(work)
    s = s.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:
        sink = s_aux.to(work).reshape(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, tq, 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    p_kv = p[..., :-1] if s_aux is not None else p
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p_kv, v.to(work))
    out = torch.where(denom > 0, out / denom.clamp_min(1e-30), torch.zeros_like(out))
    return out.reshape(b, hq, tq, -1).to(query.dtype).transpose(1, 2).contiguous()


def _bottom_right_causal(tq: int, s: int, device: torch.device) -> torch.Tensor:
    """`(1, 1, tq, s)` boolean, True = attend: query token i sees the keys up to position s - tq + i."""
    return torch.ones((tq, s), dtype=torch.bool, device=device).tril(s - tq)[None, None]


def _decode_mask(attention_mask: torch.Tensor, kv_length: int, q_offset) -> torch.Tensor:
    """`(B, 1, 1, kv_length)` boolean: one query at position `q_offset` (an int or a 0-dim device tensor: no host read)
    sees the tokens up to its own that the 2D padding mask `(B, L <= kv_length)` keeps; the columns past L are False,
    as sdpa_mask pads them."""
    keep = F.pad(attention_mask.bool(), (0, kv_length - attention_mask.shape[-1]))
    return (keep & (torch.arange(kv_length, device=attention_mask.device) <= q_offset))[:, None, None, :]


def causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """The mask function of `hf_kvcache`: transformers' `sdpa_mask`, or None for a forward of several tokens whose
    mask would be plain causal (no padding, no window, no other mask function), which this attention reads as causal
    by position. transformers skips the mask only when Tq is 1 or equals S (SDPA's is_causal aligns top-left), so
    every prefill chunk after the first built `(B, 1, Tq, S)` booleans: 1.07 GB at batch 16 x 2048 x 32k, beside the
    chunk's 3.9 GB of activations (BENCHMARKS.md, run 8). Seeing that nothing is padded reads the padding mask: one
    host sync a forward of several tokens, none at a decode step. While compiling, always the mask.

    A decode step that must have a mask (transformers builds one for every step of a compileable cache, before the
    compiled forward, over the whole capacity) gets it from `_decode_mask`: what sdpa_mask builds for one query, in a
    few launches instead of its dozen and the Python between them (BENCHMARKS.md, 2026-12-04)."""
    plain = mask_function is causal_mask_function and local_size is None and kv_offset == 0
    if (plain and allow_is_causal_skip and q_length > 1 and not torch.compiler.is_compiling()
            and (attention_mask is None or bool(attention_mask.all()))):
        return None
    if (plain and not allow_is_causal_skip and q_length == 1 and attention_mask is not None
            and attention_mask.dim() == 2 and attention_mask.shape[0] == batch_size
            and attention_mask.shape[-1] <= kv_length):
        return _decode_mask(attention_mask, kv_length, q_offset)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def register() -> None:
    """Register the `hf_kvcache` attention and its mask function in transformers, and route the model's own
    attention's calls over a packed cache to it (`install_routing`). Idempotent."""
    AttentionInterface.register(ATTENTION_NAME, hf_kvcache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, causal_mask)
    install_routing()


# ------------------------------------------------------------------ the model's own attention over a packed cache

_get_interface = AttentionInterface.get_interface  # transformers' own lookup


def _routed_get_interface(self, attn_implementation, default):
    return _reading_handles(_get_interface(self, attn_implementation, default))


def install_routing() -> None:
    """Wrap `AttentionInterface.get_interface` so that the attention function a model looks up (the model's own eager
    function included, which transformers passes as the lookup's default) reads a `KVHandle` through
    `hf_kvcache_attention`. Idempotent; `remove_routing` undoes it."""
    AttentionInterface.get_interface = _routed_get_interface


def remove_routing() -> None:
    """transformers' own lookup back (the tests compare plain calls with and without the routing). A packed cache on
    CUDA must then be read with `cache.read = "dense"`, or under `attn_implementation="hf_kvcache"`."""
    AttentionInterface.get_interface = _get_interface


class SelfReading:
    """Keys that read themselves: what a cache's `update` returns when it computes the attention itself from its own
    storage (`hf_kvcache.paged`'s packed pages, whose requests are read by the plan of their batch, not by a mask).
    The routed attention (`install_routing`) hands the call to `attend(module, query, attention_mask, **kwargs)`,
    which returns what transformers' attention functions return: `(output (B, T, Hq, D), None)`."""

    def attend(self, module, query: torch.Tensor, attention_mask, **kwargs) -> tuple[torch.Tensor, None]:
        raise NotImplementedError


def _reading_handles(attention):
    """`attention` (a transformers attention function) with calls whose keys are a `KVHandle` sent to this attention.
    A new closure per lookup rather than a table of them: the lookup runs inside compiled forwards too, and a closure
    is what the compiler traces without a guard on a table."""
    if attention is hf_kvcache_attention:
        return attention

    def read(module, query, key, value, attention_mask, *args, **kwargs):
        if isinstance(key, KVHandle):
            mask = _routed_mask(module, query, key, attention_mask, kwargs)
            return hf_kvcache_attention(module, query, key, value, mask, *args, **kwargs)
        if isinstance(key, SelfReading):
            return key.attend(module, query, attention_mask, *args, **kwargs)
        return attention(module, query, key, value, attention_mask, *args, **kwargs)

    return read


def _routed_mask(module, query: torch.Tensor, key: KVHandle, attention_mask, kwargs: dict) -> torch.Tensor | None:
    """The mask that the model's own mask function built, in this attention's form: boolean `(B or 1, 1, Tq, S)`
    (True = attend) over the S tokens the layer holds, or None for plain causal by position (bottom-right aligned).

    - sdpa: booleans already, or None (one query token, or as many as the layer holds: plain causal either way);
    - eager: the same booleans as additive floats, 0 where attended;
    - flash: the 2D padding mask `(B, S)` or None, and the window in `kwargs["sliding_window"]` (a key more than
      `sliding_window - 1` positions behind its query is not attended).
    A chunk of several query tokens whose mask is plain causal (no padding) gets None, which reads the history without
    a mask (`fused_attention`): that costs one pass over the mask and one host read, before a chunk's attention."""
    implementation = _compat.attn_implementation(module.config) or ""
    tq = query.shape[2]
    if implementation.startswith("flash_attention"):
        window = kwargs.get("sliding_window")
        if attention_mask is None and not window:
            return None
        # the 2D mask has a column a held token (generate's, sliced to the layer's length by flash's mask function)
        s = key.shape[2] if attention_mask is None else attention_mask.shape[-1]
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        kpos = torch.arange(s, device=query.device)
        qpos = (s - tq + torch.arange(tq, device=query.device))[:, None]
        allowed = kpos <= qpos
        if window:
            allowed = allowed & (kpos > qpos - window)
        mask = allowed[None, None] if keep is None else keep & allowed
    elif attention_mask is None:
        return None
    elif attention_mask.dtype != torch.bool:
        mask = attention_mask == 0
    else:
        mask = attention_mask
    given = mask if attention_mask is None else attention_mask  # (what every layer of the forward is passed)
    if tq > 1 and not torch.compiler.is_compiling() and _plain_causal_once(given, mask, tq, key.shape[2]):
        return None
    return mask


# The verdicts of `_plain_causal` on the last masks seen: (the mask, its version, tq, held, verdict). transformers
# builds a forward's mask once and passes the same tensor to every layer; reading it back once a layer was a host sync
# in every layer of every prefill chunk under the model's own attention (8 a chunk of the bench's model), each letting
# the GPU idle while the host launched the next layer's reads. Now one a forward, as the `hf_kvcache` mask function's.
_VERDICTS: list[tuple] = []


def _plain_causal_once(given: torch.Tensor, mask: torch.Tensor, tq: int, held: int) -> bool:
    """`_plain_causal(mask, tq, held)`, read from the device once a forward: `given` (the mask transformers passed, of
    which `mask` is this attention's form) and its version key the verdict."""
    # (an inference tensor keeps no version: it is keyed by itself and the lengths, which move every forward)
    version = -1 if given.is_inference() else given._version
    for seen, seen_version, seen_tq, seen_held, verdict in _VERDICTS:
        if seen() is given and (seen_version, seen_tq, seen_held) == (version, tq, held):
            return verdict
    verdict = _plain_causal(mask, tq, held)
    _VERDICTS.insert(0, (weakref.ref(given), version, tq, held, verdict))
    del _VERDICTS[4:]  # a forward's masks: one an attention kind (full, sliding)
    return verdict


def _plain_causal(mask: torch.Tensor, tq: int, held: int) -> bool:
    """Whether boolean `mask (B, 1, Tq, S >= held)` is exactly bottom-right causal over the `held` tokens for every
    row (S is the capacity of a pinned layer, whose columns past what is held are masked): no key past a query's own
    position (the upper triangle from column held - Tq on, every column past held included), and as many attended
    pairs as causal has (so nothing padded)."""
    if held < tq or mask.shape[-1] < held:
        return False
    per_row = tq * (held - tq) + tq * (tq + 1) // 2
    future = mask[..., held - tq:].triu(1).any()
    return bool(~future & (mask.sum() == per_row * mask.shape[0] * mask.shape[1]))
