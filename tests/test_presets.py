"""The spec vocabulary: every preset builds, overrides apply, bad specs get errors that list what exists."""

from __future__ import annotations

import pytest
from transformers import DynamicCache

from hf_kvcache import PRESETS, describe, make_cache
from hf_kvcache.methods.exact import ExactCache
from hf_kvcache.methods.fp8 import QuantizedFP8Cache
from hf_kvcache.methods.int import QuantizedIntCache
from hf_kvcache.methods.kivi import KIVICache
from hf_kvcache.methods.kvquant import KVQuantCache
from hf_kvcache.methods.rotated import RotatedCache
from hf_kvcache.methods.turboquant import TurboQuantCache
from hf_kvcache.presets import parse_spec
from tests.helpers.tiny_models import tiny_model


@pytest.mark.parametrize("spec", sorted(PRESETS))
def test_every_preset_builds_and_describes_itself(spec):
    model = tiny_model("qwen3")  # head_dim 128: every group size divides it
    cache = make_cache(spec, model)
    methods = (ExactCache, QuantizedFP8Cache, QuantizedIntCache, KIVICache, KVQuantCache, RotatedCache,
               TurboQuantCache)
    assert isinstance(cache, DynamicCache if spec == "none" else methods)
    assert describe(spec)


def test_overrides_apply():
    model = tiny_model("llama")
    cache = make_cache("int4-g32:sink_tokens=4,residual_length=16", model)
    layer = cache.layers[0]
    assert (cache.bits, cache.group_size) == (4, 32)
    assert layer.key_stream.sink_tokens == 4 and layer.key_stream.residual_length == 16
    cache = make_cache("fp8-e4m3:scale=none", model)
    assert cache.scale_mode == "none"
    assert parse_spec("int8:symmetric=false,headroom=1.5") == ("int8", {"symmetric": False, "headroom": 1.5})


@pytest.mark.parametrize(
    "spec,match",
    [
        ("int5", "unknown cache spec 'int5'; available: none, fp8-e4m3"),
        ("int4-g32:sink_tokens", "write key=value"),
        ("int4-g32:colour=blue", "colour"),
        ("none:bits=4", "takes no overrides"),
        ("int4-g64", "does not divide this model's head_dim=32"),
    ],
)
def test_bad_specs(spec, match):
    model = tiny_model("qwen2")  # head_dim 32
    with pytest.raises(ValueError, match=match):
        make_cache(spec, model)
