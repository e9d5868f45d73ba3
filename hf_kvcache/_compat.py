"""Every difference between the supported transformers versions (5.17 up to the latest 5.x), and nothing else.

- 5.17's `get_layer_types_and_kwargs` returns one kwargs dict for all layers; 5.24 returns one per layer and
  marks KV-sharing layers as "dummy" (served by `DummyLayer`, which 5.17 does not have: there the cache simply
  has fewer layers than the model).
- 5.24 calls `cache.update(k, v, layer_idx, kwargs=attention_kwargs)` and renamed the forward argument
  `past_key_values` to `cache`; 5.17 calls `update(k, v, layer_idx)`. Our `update` accepts both.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from transformers.cache_utils import get_layer_types_and_kwargs

TRANSFORMERS_VERSION = tuple(int(p) for p in transformers.__version__.split(".")[:2])

_FULL = {"full_attention"}
_SLIDING = {"sliding_attention", "chunked_attention"}


@dataclass(frozen=True)
class LayerSpec:
    """One cache layer as the model's config describes it. `kind`: "full", "sliding" or "dummy"."""

    kind: str
    sliding_window: int | None = None


def text_config(config):
    """The decoder's config of a (possibly multimodal) model config."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layer_specs(config) -> list[LayerSpec]:
    """The cache layers that transformers' own DynamicCache would build for this config, as `LayerSpec`s.

    Raises a ValueError for layer types that are not softmax attention over cached K/V (linear attention,
    Mamba-style hybrids, compressed attention): hf-kvcache quantizes attention caches only.
    """
    config = text_config(config)
    types, kwargs = get_layer_types_and_kwargs(config)
    per_layer = kwargs if isinstance(kwargs, list) else [kwargs] * len(types)
    specs = []
    for idx, (kind, kw) in enumerate(zip(types, per_layer)):
        if kind in _FULL:
            specs.append(LayerSpec("full"))
        elif kind in _SLIDING:
            specs.append(LayerSpec("sliding", int(kw["sliding_window"])))
        elif kind == "dummy":
            specs.append(LayerSpec("dummy"))
        else:
            raise ValueError(
                f"layer {idx} of this {getattr(config, 'model_type', '?')} model has type {kind!r}; hf-kvcache "
                f"quantizes softmax-attention caches only (layer types {sorted(_FULL | _SLIDING)}). Use "
                "transformers' own cache for this model."
            )
    return specs


def attn_implementation(config) -> str | None:
    """The attention implementation the model runs with (`config._attn_implementation`)."""
    return getattr(text_config(config), "_attn_implementation", None)


def _takes_cache_argument() -> bool:
    # The rename shows in the models' forward signatures (generate takes it through **kwargs on both).
    import inspect

    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return "cache" in inspect.signature(LlamaForCausalLM.forward).parameters


CACHE_ARGUMENT = "cache" if _takes_cache_argument() else "past_key_values"


def cache_kwargs(cache) -> dict:
    """`{"cache": cache}` on transformers that renamed the argument (5.24), else `{"past_key_values": cache}`;
    for `model(...)` and `model.generate(...)`."""
    return {CACHE_ARGUMENT: cache}
