"""`QuantizedKVCache`: the model's cache, a `transformers.Cache` of `QuantizedKVLayer`s (`layer.py`), one per decoder
layer, each from the policy a method gives it (`codec.LayerPolicy`); the cache builds the layers and dispatches.

Two read paths (docs/design.md): fused (`update()` returns a `KVHandle`, which the attention reads from the packed
storage, never building the full dense K/V: on CUDA under the model's own attention too, whose calls
`hf_kvcache.attention` routes) and dense (`update()` returns K/V dequantized to the model dtype, what the model's
own attention consumes: CPU under its default attention, or `cache.read = "dense"`).

The cache core is three modules: `codec.py` (what a method gives), `layer.py` (a layer's tokens), this one; their
names are importable from here too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from . import _compat, graphs, kernels
from .codec import Codec, LayerPolicy  # noqa: F401  (Codec re-exported)
from .layer import (_GROWTH, _MIN_GROW, _SLIDING_CROP_MARGIN, KVHandle, QuantizedKVLayer,  # noqa: F401  (re-exported)
                    check_max_cache_len)

# The name the `hf_kvcache` attention and mask functions are registered under (`hf_kvcache.attention`).
ATTENTION_NAME = "hf_kvcache"

# The model's own attention implementations whose calls `hf_kvcache.attention` routes to the fused read when they get a
# `KVHandle` (and whose masks it knows how to read): on CUDA a packed cache reads itself through the kernels under
# any of them, with no attention argument (flex attention's block masks and paged attention keep the dense path).
DEFAULT_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")

# `QuantizedKVCache.read`: "auto" (the fused read where it runs) or "dense" (dequantized K/V to the model's attention)
READS = ("auto", "dense")


class QuantizedKVCache(Cache):
    """A `transformers.Cache` of `QuantizedKVLayer`s, one per decoder layer, built from the model's config.

    `policy_factory(layer_idx) -> LayerPolicy` gives each layer its codecs and places. Full-attention layers keep
    every token; sliding-window (and chunked) layers keep their window (with a pinned capacity: every token, masked);
    layers that share another layer's K/V get transformers' `DummyLayer`. Models with layers that are not attention
    (Mamba/linear attention) are refused with a ValueError.

    `max_cache_len` (tokens) pins the capacity: every place allocated up front, and `generate` compiles the decode
    step (transformers' rule: every layer `is_compileable`). None: the capacity grows with what is held, and eager
    decode steps on CUDA replay a CUDA graph per layer.
    """

    def __init__(self, config, policy_factory: Callable[[int], LayerPolicy], max_cache_len: int | None = None):
        self.config = config
        self._max_cache_len = check_max_cache_len(max_cache_len)  # transformers 5.17 has a read-only max_cache_len
        self.graph_pools = graphs.GraphPools()
        specs = _compat.layer_specs(config)
        layers: list = []
        for idx, spec in enumerate(specs):
            if spec.kind == "dummy":
                layers.append(_compat.DummyLayer())
            else:
                layers.append(QuantizedKVLayer(policy_factory(idx), spec.sliding_window, self._max_cache_len,
                                               self.graph_pools))
        super().__init__(layers=layers)
        self.read = "auto"
        self.quantize_before_attention = False
        self.offloading = False  # `enable_offloading`
        self._pending_offload: int | None = None  # a fused layer whose offload waits for its attention to be queued

    def enable_offloading(self, only_non_sliding: bool = True) -> QuantizedKVCache:
        """Keep each layer's storage in CPU memory except while its decoder layer runs, as transformers'
        `DynamicCache(offloading=True)` does: before layer i runs, layer i+1 is copied back on a side stream,
        and layer i is copied out after its step. Only CUDA layers move (a CPU-only model is unchanged);
        `only_non_sliding` keeps sliding-window layers, which stay small, resident. Offloaded layers run their steps
        eagerly, without CUDA graphs. Returns the cache: `make_cache("int4-g32", model).enable_offloading()`."""
        if self._max_cache_len is not None:
            raise ValueError("a cache with a pinned capacity (max_cache_len) cannot be offloaded: its storage must stay "
                             "where compiled CUDA graphs replay over it; leave max_cache_len out to offload")
        self.offloading = True
        self.only_non_sliding = bool(only_non_sliding)
        self.prefetch_stream = None  # created on the device of the first CUDA update
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, QuantizedKVLayer) and self._offloadable(idx):
                layer.cuda_graphs = False
        return self

    def _offloadable(self, layer_idx: int) -> bool:
        layer = self.layers[layer_idx]
        return isinstance(layer, QuantizedKVLayer) and not (self.only_non_sliding and layer.is_sliding)

    @property
    def read(self) -> str:
        """How attention reads this cache. "auto" (default): on CUDA the fused kernels read the packed storage
        directly, whatever attention the model was loaded with (sdpa, eager, flash: `hf_kvcache.attention` routes their
        calls), and `attn_implementation="hf_kvcache"` reads it on every device (the PyTorch reference on CPU); on CPU
        under the model's own attention, `update()` returns K/V dequantized to the model dtype. "dense": always that
        dequantized K/V, to the model's own attention (the reference behaviour, a full-length dense copy at every
        step)."""
        return self._read

    @read.setter
    def read(self, value: str) -> None:
        if value not in READS:
            raise ValueError(f"read={value!r}: choose one of {READS} (\"auto\": the fused kernels where they run, "
                             "\"dense\": dequantized K/V to the model's own attention)")
        self._read = value

    def _reads_fused(self, device: torch.device) -> bool:
        """Whether `update()` returns `KVHandle`s, which the attention reads as packed (see `read`)."""
        if self._read != "auto":
            return False
        implementation = _compat.attn_implementation(self.config)
        if implementation == ATTENTION_NAME:
            return True
        return implementation in DEFAULT_ATTENTIONS and kernels.use_kernels(device)

    @property
    def quantize_before_attention(self) -> bool:
        """Paper protocol: when True, every token attends to quantized K/V, the new ones included."""
        return self._quantize_before_attention

    @quantize_before_attention.setter
    def quantize_before_attention(self, value: bool) -> None:
        self._quantize_before_attention = bool(value)
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                layer.quantize_before_attention = self._quantize_before_attention

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, QuantizedKVLayer):
            layer.fused = self._reads_fused(key_states.device)
        if not (self.offloading and key_states.device.type == "cuda"):
            return layer.update(key_states, value_states, *args, **kwargs)
        # transformers' `Cache.update` offloading (written out here: its helpers differ between versions), with one
        # difference: on the fused path the attention reads the layer's storage after `update()` returns, so that
        # layer is offloaded when the next update comes (its attention is queued on the stream by then).
        if self.prefetch_stream is None:
            self.prefetch_stream = torch.cuda.Stream(key_states.device)
        if self._pending_offload is not None:
            if self._offloadable(self._pending_offload):
                self.layers[self._pending_offload].offload()
            self._pending_offload = None
        default = torch.cuda.default_stream(key_states.device)
        default.wait_stream(self.prefetch_stream)
        # The prefetch also waits for the default stream: copies out may be in flight, and memory freed there may
        # still be read by queued kernels.
        self.prefetch_stream.wait_stream(default)
        n = len(self.layers)
        following = [(layer_idx + k) % n for k in range(1, n + 1)]  # the next offloadable layer, circling round
        nxt = next((i for i in following if self._offloadable(i)), None)
        if nxt is not None:
            with torch.cuda.stream(self.prefetch_stream):
                self.layers[nxt].prefetch()
        out = layer.update(key_states, value_states, *args, **kwargs)
        if getattr(layer, "fused", False):
            self._pending_offload = layer_idx
        elif self._offloadable(layer_idx):
            layer.offload()
        return out

    def nbytes(self) -> int:
        """Bytes the held tokens take in every layer (codes, scales, zeros, windows, sinks)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def allocated_nbytes(self) -> int:
        """Bytes allocated by every layer: what is held plus the capacity not filled yet."""
        return sum(layer.allocated_nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def __repr__(self) -> str:
        n = sum(isinstance(layer, QuantizedKVLayer) for layer in self.layers)
        return f"{type(self).__name__}(layers={n}, tokens={self.get_seq_length()}, nbytes={self.nbytes()})"
