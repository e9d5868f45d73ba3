"""transformers' own `QuantizedCache`, measured by name beside the presets: what it holds is counted (its quantized
tensors, down to a quanto tensor's packed codes), the evaluation takes its names, and what is missing says what to
install."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat
from hf_kvcache.eval import compared
from hf_kvcache.eval.memory import cache_nbytes, reference_bytes_per_token
from tests.helpers.tiny_models import tiny_model

LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64  # the tiny llama


def _filled(spec: str, tokens: int, model):
    cache = compared.build(spec, model)
    gen = torch.Generator().manual_seed(0)
    for i in range(LAYERS):
        k, v = (torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=gen, dtype=torch.bfloat16) for _ in range(2))
        cache.update(k, v, i)
    return cache


@pytest.mark.skipif(not compared._installed("optimum.quanto"), reason="needs optimum-quanto (make env installs it)")
@pytest.mark.parametrize(("spec", "bits"), [("hf-quanto-int4", 4), ("hf-quanto-int2", 2)])
def test_a_quanto_cache_is_counted_by_its_packed_codes_scales_and_shifts(spec, bits):
    model = tiny_model("llama").to(torch.bfloat16)
    tokens = 512
    held = cache_nbytes(_filled(spec, tokens, model))
    # A prompt of 512 tokens is quantized whole at its first update (no residual kept): codes at `bits` a value,
    # a bf16 scale and shift for each group of 64
    codes = LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM * bits // 8
    groups = LAYERS * 2 * KV_HEADS * tokens * HEAD_DIM // 64
    assert held == codes + groups * 2 * 2
    assert held / (tokens * reference_bytes_per_token(model)) == pytest.approx((bits + 0.5) / 16)  # vs bf16


def test_the_fp8_backend_holds_a_byte_a_value_where_transformers_has_it():
    model = tiny_model("llama").to(torch.bfloat16)
    try:
        cache = _filled("hf-fp8", 100, model)
    except ValueError as error:  # transformers before 5.24
        assert "fp8 came with 5.24" in str(error)
        return
    assert cache_nbytes(cache) == LAYERS * 2 * (KV_HEADS * 100 * HEAD_DIM + 4)  # fp8 codes and one fp32 scale


def test_a_backend_transformers_lacks_is_named_with_its_version():
    with pytest.raises(ValueError, match="has no 'nope' backend"):
        _compat.quantized_cache("nope", tiny_model("llama").config)


def test_a_missing_backend_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(compared, "_installed", lambda module: False)
    with pytest.raises(ImportError, match="pip install optimum-quanto"):
        compared.build("hf-quanto-int4", tiny_model("llama"))


def test_the_evaluation_takes_their_names():
    from hf_kvcache.eval.runner import _describe, _factory

    assert "QuantizedCache" in _describe("hf-fp8")
    if compared._installed("optimum.quanto"):
        assert type(_factory("hf-quanto-int2", tiny_model("llama"))()).__name__ == "QuantizedCache"
