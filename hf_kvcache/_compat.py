"""Every difference between the supported transformers versions (5.17 up to the latest 5.x), and nothing else.

- 5.17's `get_layer_types_and_kwargs` returns one kwargs dict for all layers; 5.24 returns one per layer and
  marks KV-sharing layers as "dummy" (served by `DummyLayer`, which 5.17 does not have: there the cache simply
  has fewer layers than the model).
- 5.24 calls `cache.update(k, v, layer_idx, kwargs=attention_kwargs)`; 5.17 calls `update(k, v, layer_idx)`. Our
  `update` accepts both.
- 5.24 renamed the cache argument `past_key_values` to `cache`, in every model's `forward` (the old name warns,
  removal announced for 5.40) and in `generate` (warns, removal announced for 6.0; generate hands it on to
  `prepare_inputs_for_generation(..., cache=...)`); 5.17 knows only `past_key_values`. The library's own calls take
  the name from `cache_kwargs` / `forward_parameters`; a user may pass either name wherever transformers accepts it.
- 5.17's assisted generation calls `cache.crop(-rejected)` with a 0-dim tensor, 5.24 with an int.
- Continuous batching: the allocators (`continuous_batching/cache_allocators`, one per attention kind, built by
  `PagedAttentionCache._create_allocator`) that packed pages (`hf_kvcache.paged`) replace came with 5.25 (5.17's paged
  cache has no such seam): `continuous_batching_parts` finds them or says which version is needed.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass

from transformers.cache_utils import get_layer_types_and_kwargs

try:  # 5.24: layers whose K/V another layer produces get a DummyLayer
    from transformers.cache_utils import DummyLayer
except ImportError:  # 5.17: such layers are simply left out of the cache's layer list
    DummyLayer = None

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
    """The attention implementation the model runs with (`config._attn_implementation`). Read twice a layer step (the
    cache's update, the routed read): the decoder's config is looked up once a config (`get_text_config` walks the
    config, 26 us a call on this CPU, 1.6 ms a step of the default model's 30 layers)."""
    found = _TEXT_CONFIGS.get(id(config))
    sub = found() if found is not None else None
    if sub is None:
        sub = text_config(config)
        try:
            found = weakref.ref(sub)
            weakref.finalize(config, _TEXT_CONFIGS.pop, id(config), None)  # (before its id can be another config's)
        except TypeError:  # (an object that takes no weak reference: not kept)
            return getattr(sub, "_attn_implementation", None)
        _TEXT_CONFIGS[id(config)] = found
    return getattr(sub, "_attn_implementation", None)


# a config's decoder config by the config's id, while that config lives (configs are unhashable)
_TEXT_CONFIGS: dict[int, weakref.ref] = {}


@functools.cache
def forward_parameters(model_class: type) -> tuple[str, bool]:
    """`(name of the cache argument, whether logits_to_keep is accepted)` for a model class's forward.

    Feature detection, not a version check: transformers 5.24 renamed the forward argument `past_key_values` to
    `cache` (the old name warns); 5.17 only knows `past_key_values`.
    """
    params = inspect.signature(model_class.forward).parameters
    return ("cache" if "cache" in params else "past_key_values"), "logits_to_keep" in params


def _llama_class() -> type:
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    return LlamaForCausalLM


CACHE_ARGUMENT = forward_parameters(_llama_class())[0]


def cache_kwargs(cache, model=None) -> dict:
    """`{"cache": cache}` where the model's forward takes that name (5.24+), else `{"past_key_values": cache}`;
    for `model(...)` and `model.generate(...)` alike: transformers renamed both in the same release, and
    tests/test_compat.py checks that they agree. Without a model, what Llama takes on this transformers."""
    name = forward_parameters(type(model))[0] if model is not None else CACHE_ARGUMENT
    return {name: cache}


def left_padding(update_kwargs: dict, tokens_before: int, n_new: int, batch: int):
    """Per-row count of left-padding tokens `(B,)` long, or None when transformers tells the cache nothing.

    transformers 5.24 passes the attention kwargs to `cache.update(..., kwargs=...)`, position ids included, and
    `generate` numbers a left-padded row's first real token 0: the row's last token then sits at absolute index
    `tokens_before + n_new - 1` but at position `position_ids[b, -1]`, and the difference is its padding.
    5.17 passes no kwargs to `update`, so there padding cannot be told apart from text.
    """
    attention_kwargs = update_kwargs.get("kwargs") or {}
    positions = attention_kwargs.get("position_ids") if isinstance(attention_kwargs, dict) else None
    if positions is None:
        return None
    if positions.ndim == 3:  # multimodal rotary sections (3, B, T): the text section comes first
        positions = positions[0]
    pads = (tokens_before + n_new - 1) - positions[:, -1].long()
    return pads.clamp(min=0).expand(batch).clone()


def crop_argument(tokens_to_remove) -> int:
    """`Cache.crop`'s argument as a Python int. transformers 5.17's assisted generation passes a 0-dim tensor
    (`-(candidate_length - n_matches)`, its `n_matches` being a tensor); 5.24 passes an int. Arithmetic such as
    `n -= taken` on that tensor would change it in place, and every layer is handed the same one."""
    return int(tokens_to_remove)


def quantized_cache(backend: str, config, **kwargs):
    """transformers' own `QuantizedCache` of `backend` for `config`. Its fp8 backend came with 5.24; on an older
    transformers the error says so instead of transformers' "Unknown quantization backend"."""
    import transformers
    from transformers import QuantizedCache

    try:
        return QuantizedCache(backend=backend, config=config, **kwargs)
    except ValueError as error:
        if "Unknown quantization backend" not in str(error):
            raise
        raise ValueError(f"transformers {transformers.__version__}'s QuantizedCache has no {backend!r} backend "
                         "(fp8 came with 5.24): upgrade transformers, or compare another backend") from error


# The first transformers whose continuous batching builds its pages through allocators (`cache_allocators`).
PAGED_MIN_VERSION = "5.25"


@dataclass(frozen=True)
class ContinuousBatchingParts:
    ContinuousBatchingConfig: type
    PagedAttentionCache: type
    FullAttentionCacheAllocator: type
    FULL_ATTENTION: str


def continuous_batching_parts() -> ContinuousBatchingParts:
    """transformers' continuous-batching classes that packed pages build on, or an ImportError that names the
    transformers they need. Feature detection: the allocator seam and the allocator API `hf_kvcache.paged` uses."""
    import transformers

    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        from transformers.generation.continuous_batching.cache import PagedAttentionCache
        from transformers.generation.continuous_batching.cache_allocators import (FULL_ATTENTION,
                                                                                  FullAttentionCacheAllocator)
        seams = ("_before_cache_tensor_init", "_after_cache_tensor_init", "register_cache_tensor", "get_write_indices")
        if not hasattr(PagedAttentionCache, "_create_allocator") or not all(
                hasattr(FullAttentionCacheAllocator, name) for name in seams):
            raise ImportError("the paged cache has no allocator seam")
    except ImportError as error:
        raise ImportError(f"packed pages for continuous batching need transformers >= {PAGED_MIN_VERSION} (its paged "
                          f"cache built by allocators); this is transformers {transformers.__version__}: "
                          f"pip install -U 'transformers>={PAGED_MIN_VERSION}'") from error
    return ContinuousBatchingParts(ContinuousBatchingConfig, PagedAttentionCache, FullAttentionCacheAllocator,
                                   FULL_ATTENTION)


def install_allocator_factory(factory) -> None:
    """Route `PagedAttentionCache._create_allocator` through `factory(cb_config, model_config, attn_type, default,
    **allocator_kwargs)`, where `default()` builds transformers' own allocator. Installed once, idempotent; the
    factory keeps transformers' allocator for every config that does not ask for packed pages."""
    cls = continuous_batching_parts().PagedAttentionCache
    if getattr(cls._create_allocator, "_hf_kvcache_factory", None) is factory:
        return
    original = getattr(cls._create_allocator, "_hf_kvcache_original", cls._create_allocator)

    def _create_allocator(self, continuous_batching_config, attn_type, index, layer_indices, num_key_value_heads):
        def default():
            return original(self, continuous_batching_config, attn_type, index, layer_indices, num_key_value_heads)

        return factory(continuous_batching_config, self.config, attn_type, default, index=index,
                       layer_indices=layer_indices, num_key_value_heads=num_key_value_heads, cache_dtype=self.dtype,
                       page_size=continuous_batching_config.page_size,
                       allow_block_sharing=continuous_batching_config.allow_block_sharing)

    _create_allocator._hf_kvcache_factory = factory
    _create_allocator._hf_kvcache_original = original
    cls._create_allocator = _create_allocator


def paged_head_dim(config) -> int:
    """The head size transformers' paged cache uses for `config`."""
    from transformers.generation.continuous_batching.utils import find_head_dim

    return find_head_dim(text_config(config))
