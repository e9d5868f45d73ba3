"""Memory: bytes per cached token, measured from the tensors a cache holds, against a 16-bit cache.

The reference is what a 16-bit cache of the same model holds per token, `2 bytes * 2 (K and V) * layers *
kv_heads * head_dim`, whatever dtype the model runs in: a float32 model's DynamicCache therefore measures a
ratio of 2.0, and a method's ratio reads as "fraction of a bf16/fp16 cache".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._compat import text_config
from ..footprint import cache_nbytes, layer_nbytes  # noqa: F401  (re-exported)
from .forward import forward_with_cache

__all__ = ["bytes_per_token", "cache_nbytes", "layer_nbytes", "memory_summary", "reference_bytes_per_token"]

REFERENCE_BYTES = 2  # a 16-bit element


def reference_bytes_per_token(config) -> int:
    """Bytes per token of a 16-bit cache of this model: 2 * 2 * layers * kv_heads * head_dim."""
    config = text_config(getattr(config, "config", config))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return REFERENCE_BYTES * 2 * config.num_hidden_layers * kv_heads * head_dim


def memory_summary(model, nbytes: int, n_tokens: int) -> dict:
    """`{"n_tokens", "nbytes", "bytes_per_token", "reference_bytes_per_token", "ratio"}` for a cache of
    `model` holding `nbytes` for `n_tokens` tokens (ratio = measured / 16-bit reference)."""
    reference = reference_bytes_per_token(model)
    per_token = nbytes / n_tokens
    return {
        "n_tokens": int(n_tokens),
        "nbytes": int(nbytes),
        "bytes_per_token": per_token,
        "reference_bytes_per_token": reference,
        "ratio": per_token / reference,
    }


@torch.inference_mode()
def bytes_per_token(
    model, cache_factory: Callable[[], object], tokens: torch.Tensor, n_tokens: int = 1024, chunk: int = 64
) -> dict:
    """Fill a fresh cache with the first `n_tokens` of `tokens (N,)`, `chunk` tokens a step (as generation
    appends), and measure what it holds. Returns `memory_summary(...)`."""
    if tokens.numel() < n_tokens:
        raise ValueError(f"need {n_tokens} tokens to fill the cache, got {tokens.numel()}")
    ids = tokens[:n_tokens].to(next(model.parameters()).device)[None]  # (1, n_tokens)
    cache = cache_factory()
    for s in range(0, n_tokens, chunk):
        forward_with_cache(model, ids[:, s : s + chunk], cache, logits_to_keep=1)
    return memory_summary(model, cache_nbytes(cache), n_tokens)
