"""Bytes per token measured from what a cache holds, against the 16-bit reference of the same model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache.eval.memory import bytes_per_token, cache_nbytes, memory_summary, reference_bytes_per_token
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


def test_reference_is_16_bit_whatever_the_model_dtype():
    llama = tiny_model("llama")  # 3 layers, 2 kv heads, head_dim 64
    assert reference_bytes_per_token(llama) == 2 * 2 * 3 * 2 * 64
    assert reference_bytes_per_token(llama.config) == 2 * 2 * 3 * 2 * 64
    assert reference_bytes_per_token(tiny_model("qwen2")) == 2 * 2 * 3 * 2 * 32  # head_dim = hidden / heads
    assert reference_bytes_per_token(tiny_model("mqa")) == 2 * 2 * 3 * 1 * 64


@pytest.mark.parametrize(("dtype", "ratio"), [(torch.float32, 2.0), (torch.bfloat16, 1.0)])
def test_dynamic_cache_ratio_follows_the_model_dtype(dtype, ratio):
    model = tiny_model("llama").to(dtype)
    tokens = tiny_input_ids(model, batch=1, length=100)[0]
    result = bytes_per_token(model, lambda: DynamicCache(config=model.config), tokens, n_tokens=100, chunk=30)
    assert result["n_tokens"] == 100
    assert result["nbytes"] == 100 * 2 * 3 * 2 * 64 * dtype.itemsize
    assert result["ratio"] == pytest.approx(ratio)


def test_cache_nbytes_prefers_the_cache_own_count():
    class Reporting(DynamicCache):
        def nbytes(self):
            return 1234

    assert cache_nbytes(Reporting()) == 1234
    assert cache_nbytes(DynamicCache()) == 0  # no layer filled yet
    with pytest.raises(TypeError, match="cannot measure"):
        cache_nbytes(object())


def test_memory_summary_divides_by_tokens():
    model = tiny_model("llama")
    summary = memory_summary(model, nbytes=768 * 10, n_tokens=10)
    assert summary["bytes_per_token"] == 768
    assert summary["ratio"] == pytest.approx(768 / (2 * 2 * 3 * 2 * 64))


def test_quantized_caches_hold_fewer_bytes_than_16_bit():
    presets = pytest.importorskip("hf_kvcache.presets")
    model = tiny_model("llama")
    tokens = tiny_input_ids(model, batch=1, length=128)[0]
    ratios = {
        spec: bytes_per_token(model, lambda spec=spec: presets.make_cache(spec, model), tokens, n_tokens=128)[
            "ratio"
        ]
        for spec in ("int8", "int4-g32", "int2-g32")
    }
    assert ratios["int2-g32"] < ratios["int4-g32"] < ratios["int8"] < 1.0, ratios
