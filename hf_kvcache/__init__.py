"""hf-kvcache: real KV-cache quantization for HuggingFace transformers.

Importing the package registers the `hf_kvcache` attention (and its mask function) in transformers, so
`attn_implementation="hf_kvcache"` reads the packed cache directly.
"""

from ._compat import cache_kwargs
from .attention import ATTENTION_NAME, register as _register_attention
from .cache import Codec, KVHandle, LayerPolicy, QuantizedKVCache, QuantizedKVLayer
from .methods.exact import ExactCache
from .methods.fp8 import QuantizedFP8Cache
from .methods.int import QuantizedIntCache
from .methods.kivi import KIVICache
from .methods.kvquant import KVQuantCache
from .methods.rotated import RotatedCache
from .methods.turboquant import TurboQuantCache
from .models import DEFAULT_MODEL, load_model
from .patching import unfuse
from .presets import PRESETS, describe, make_cache
from .warmup import warm_up

__version__ = "0.1.0"

__all__ = [
    "ATTENTION_NAME",
    "Codec",
    "DEFAULT_MODEL",
    "ExactCache",
    "KIVICache",
    "KVHandle",
    "KVQuantCache",
    "LayerPolicy",
    "PRESETS",
    "QuantizedFP8Cache",
    "QuantizedIntCache",
    "QuantizedKVCache",
    "QuantizedKVLayer",
    "RotatedCache",
    "TurboQuantCache",
    "cache_kwargs",
    "describe",
    "load_model",
    "make_cache",
    "plan",
    "unfuse",
    "warm_up",
]

_register_attention()


def __getattr__(name: str):
    # The planner (and the evaluation's byte counts below it) is tooling: loaded at its first use, not by the import
    # that every `generate` user makes.
    if name == "plan":
        from .planner import plan

        return plan
    # Continuous batching over packed pages: needs transformers 5.25 (`_compat`), so loaded on use and left out of
    # `__all__` (a star import on an older transformers would fail on it).
    if name == "PackedBatchingConfig":
        from .paged import PackedBatchingConfig

        return PackedBatchingConfig
    raise AttributeError(f"module 'hf_kvcache' has no attribute {name!r}")
