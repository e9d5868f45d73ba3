"""Assertions shared by the generation, device, long-context and compatibility tests."""

from __future__ import annotations

import contextlib
import warnings

import torch

from hf_kvcache.cache import QuantizedKVLayer


def assert_cache_finite(cache) -> None:
    """No NaN or inf anywhere in the cache: every place of every layer, dequantized."""
    for idx, layer in enumerate(cache.layers):
        if isinstance(layer, QuantizedKVLayer) and layer.held_tokens:
            for name, stream in (("keys", layer.key_stream), ("values", layer.value_stream)):
                assert torch.isfinite(stream.dense(torch.float32, layer.held_tokens)).all(), f"layer {idx} {name}: NaN or inf"


@contextlib.contextmanager
def deprecations_are_errors():
    """FutureWarning and DeprecationWarning raise inside the block. transformers warns about a deprecated argument
    with a FutureWarning attributed to its caller (`stacklevel=2`, often torch's `Module.__call__`), so a filter on
    the warning's module would miss it: every such warning raises, and the block runs only transformers-facing
    code."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        yield
