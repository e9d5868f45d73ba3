"""Assertions shared by the generation, device and long-context tests."""

from __future__ import annotations

import torch

from hf_kvcache.cache import QuantizedKVLayer


def assert_cache_finite(cache) -> None:
    """No NaN or inf anywhere in the cache: every place of every layer, dequantized."""
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, QuantizedKVLayer) and layer.held_tokens:
            for name, stream in (("keys", layer.key_stream), ("values", layer.value_stream)):
                assert torch.isfinite(stream.dense(torch.float32, layer.held_tokens)).all(), f"layer {idx} {name}: NaN or inf"
