"""QuantizedIntCache: stored K/V equal the reference codec applied per token, accuracy floors per bit width,
exact byte accounting, and clear errors for bad parameters."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.methods.int import QuantizedIntCache
from hf_kvcache.quant import dequantize_uniform, quantize_uniform
from tests.helpers.references import feed, outlier_keys, sqnr_db
from tests.helpers.tiny_models import TINY_CONFIGS

LLAMA = TINY_CONFIGS["llama"]()  # head_dim 64, 2 kv heads, 3 layers


def _reference(x, bits, group_size, symmetric):
    q = quantize_uniform(x, bits, axis=-1, group_size=group_size, symmetric=symmetric)
    return dequantize_uniform(q.codes, q.scale, q.zero, bits, axis=-1, group_size=group_size)


@pytest.mark.parametrize(
    "bits,group_size,floor_db",
    [(8, None, 38.0), (4, 32, 18.0), (4, 64, 16.0), (4, 128, None), (3, 32, 12.0), (2, 32, 6.0)],
)
def test_dense_read_is_the_per_token_reference(bits, group_size, floor_db):
    if group_size == 128:
        cfg = TINY_CONFIGS["qwen3"]()  # head_dim 128
        d, floor_db = 128, 14.0
    else:
        cfg, d = LLAMA, 64
    cache = QuantizedIntCache(cfg, bits=bits, group_size=group_size)
    k = outlier_keys(d=d)
    v = torch.randn_like(k)
    keys, values = feed(cache.layers[0], k, v, [40, 1, 1, 30, 24])
    cache.quantize_before_attention = True
    keys, values = cache.layers[0].update(k[:, :, :1], v[:, :, :1])  # one more token, returned quantized
    k_all, v_all = torch.cat([k, k[:, :, :1]], 2), torch.cat([v, v[:, :, :1]], 2)
    symmetric = bits == 8
    torch.testing.assert_close(keys, _reference(k_all, bits, group_size, symmetric))
    torch.testing.assert_close(values, _reference(v_all, bits, group_size, symmetric))
    got = sqnr_db(v_all, values)
    assert got >= floor_db, f"int{bits} g{group_size}: values SQNR {got:.1f} dB below the {floor_db} dB floor"


def test_new_tokens_are_exact_on_the_streaming_path():
    cache = QuantizedIntCache(LLAMA, bits=2, group_size=32)
    k, v = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    keys, values = feed(cache.layers[0], k, v, [12, 8])
    torch.testing.assert_close(keys[:, :, 12:], k[:, :, 12:])  # the 8 new ones, exact
    assert sqnr_db(k[:, :, :12], keys[:, :, :12]) < 20  # the stored ones are 2-bit


@pytest.mark.parametrize(
    "bits,group_size,ratio", [(8, None, (64 + 2) / 128), (4, 32, 0.3125), (4, 64, (32 + 4) / 128), (2, 32, 0.1875)]
)
def test_bytes_per_token(bits, group_size, ratio):
    cache = QuantizedIntCache(LLAMA, bits=bits, group_size=group_size)
    tokens = 100
    for layer in cache.layers:
        feed(layer, torch.randn(1, 2, tokens, 64), torch.randn(1, 2, tokens, 64), [tokens])
    sixteen_bit = 2 * 2 * len(cache.layers) * 2 * 64 * tokens  # bytes * (K, V) * layers * heads * head_dim
    assert cache.nbytes() / sixteen_bit == pytest.approx(ratio)


def test_constant_and_padding_like_inputs_stay_finite():
    cache = QuantizedIntCache(LLAMA, bits=4, group_size=32)
    k = torch.zeros(2, 2, 16, 64)
    k[1] = 7.0
    keys, _ = feed(cache.layers[0], k, k, [8, 8])
    assert torch.isfinite(keys).all()
    torch.testing.assert_close(keys, k)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=5), "bits=5"),
        (dict(bits=4, group_size=48), "group_size=48"),
        (dict(bits=4, group_size=16), "group_size=16"),
        (dict(bits=4, sink_tokens=-1), "sink_tokens"),
        (dict(bits=4, residual_length=2.5), "residual_length"),
    ],
)
def test_bad_parameters_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantizedIntCache(LLAMA, **kwargs)


def test_group_size_must_divide_head_dim():
    qwen2 = TINY_CONFIGS["qwen2"]()  # head_dim 32
    with pytest.raises(ValueError, match="does not divide this model's head_dim=32"):
        QuantizedIntCache(qwen2, bits=4, group_size=64)


def test_a_config_without_attention_is_refused():
    from transformers import PretrainedConfig

    with pytest.raises(ValueError, match="does not describe a decoder"):
        QuantizedIntCache(PretrainedConfig(), bits=8)
