"""KVQuantCache: pre-RoPE keys undone and redone exactly, NUQ codes against the uniform grid, outlier slots, and
the errors for bad input. Calibration artifacts of the tiny configs come from conftest's `tiny_calibrations`."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache import KVQuantCache, _compat, calibration, make_cache
from hf_kvcache.methods.kvquant import KVQuantKeyCodec
from hf_kvcache.patching import layer_ropes
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


def _kv(model, length=80, seed=11):
    """Post-RoPE keys and values `(1, Hkv, T, D)` of layer 1 of `model` on random tokens."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(tiny_input_ids(model, batch=1, length=length, seed=seed), use_cache=True, **_compat.cache_kwargs(cache))
    return cache.layers[1].keys, cache.layers[1].values


def _sqnr_db(x, y):
    return 10 * math.log10(float(x.pow(2).sum() / (x - y).pow(2).sum()))


def _stored(cache, k, v):
    layer = cache.layers[1]
    layer.update(k, v)
    return (layer.key_stream.dense(torch.float32, layer.held_tokens),
            layer.value_stream.dense(torch.float32, layer.held_tokens))


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma"])
def test_keys_unrotated_and_rerotated_exactly(name):
    """With every element kept in an outlier slot the codes carry nothing: what comes back is the key undone to its
    pre-RoPE frame at its position, stored in fp16, and rotated again: equal to the key up to fp16 rounding."""
    model = tiny_model(name)
    k, _ = _kv(model)
    d = k.shape[-1]
    zero = torch.zeros(k.shape[1], d)
    ropes = layer_ropes(model)
    codec = KVQuantKeyCodec(3, torch.linspace(-1, 1, 8), zero, zero, slots=d, rope=ropes[1])
    positions = torch.arange(5, 5 + k.shape[2])[None]
    fields = codec.encode(k, positions=positions)
    back = codec.decode(fields, torch.float32)
    torch.testing.assert_close(back, k, atol=2e-3 * k.abs().max().item(), rtol=1e-3)
    assert fields["pos"].dtype == torch.int32 and fields["pos"].shape == (1, 1, k.shape[2])
    wrong = codec.decode({**fields, "pos": fields["pos"] + 1}, torch.float32)
    assert not torch.allclose(wrong, k, atol=1e-2), "the stored position must matter"


@pytest.fixture(scope="module")
def mse_calibration(tmp_path_factory):
    """Tiny Llama calibrated without Fisher weights: its codebooks minimize plain squared error, which SQNR
    measures (the Fisher-weighted ones of `tiny_calibrations` minimize the loss's estimate instead)."""
    model = tiny_model("llama")
    cal = calibration.calibrate(model, tiny_input_ids(model, batch=1, length=384, seed=5), chunk=96,
                                max_samples=384, weighting="none", progress=False)
    return calibration.save(cal, tmp_path_factory.mktemp("mse") / "llama.safetensors")


@pytest.mark.parametrize("bits,floor_db", [(4, 17.0), (3, 11.5), (2, 6.0)])
def test_sqnr_floors_and_nuq_against_uniform(bits, floor_db, mse_calibration):
    model = tiny_model("llama")
    k, v = _kv(model)
    got = {}
    for nuq in (True, False):
        cache = make_cache(f"kvquant-{bits}", model, nuq=nuq, sink_tokens=0, calibration=mse_calibration)
        kq, vq = _stored(cache, k, v)
        got[nuq] = (_sqnr_db(k, kq), _sqnr_db(v, vq))
    (k_db, v_db), (k_uni, v_uni) = got[True], got[False]
    assert k_db >= floor_db and v_db >= floor_db, f"{bits}-bit SQNR keys {k_db:.1f} dB, values {v_db:.1f} dB"
    assert k_db + v_db > k_uni + v_uni, f"NUQ {k_db:.1f}/{v_db:.1f} dB vs uniform {k_uni:.1f}/{v_uni:.1f} dB"


def test_outlier_slots_hold_the_largest_values_exactly():
    model = tiny_model("llama")
    k, v = _kv(model)
    v = v.clone()
    v[0, 0, 10, 3] = 50.0  # one huge value
    plain = make_cache("kvquant-2", model, outlier_fraction=0.0, sink_tokens=0)
    slots = make_cache("kvquant-2", model, outlier_fraction=0.02, sink_tokens=0)
    _, v0 = _stored(plain, k, v)
    _, v1 = _stored(slots, k, v)
    assert v1[0, 0, 10, 3] == 50.0
    assert _sqnr_db(v, v1) > _sqnr_db(v, v0) + 3


def test_kernel_dequantizes_in_fp16_only_where_the_calibrated_keys_fit():
    book = torch.linspace(-1, 1, 8)
    small, big = torch.full((2, 64), 3.0), torch.full((2, 64), 5e4)  # rotated, 5e4 can reach 7.1e4 > fp16's max
    assert KVQuantKeyCodec(3, book, -small, small, slots=1, rope=None)._kernel_format().fp16
    assert not KVQuantKeyCodec(3, book, -small, big, slots=1, rope=None)._kernel_format().fp16


def test_memory_per_token_is_what_the_docstring_says():
    model = tiny_model("llama")  # 2 kv-heads, head_dim 64, 3 layers
    k, v = _kv(model)
    cache = make_cache("kvquant-3", model, sink_tokens=0)  # 1% of 64 -> 1 slot
    cache.layers[1].update(k, v)
    t, h, d = k.shape[2], k.shape[1], k.shape[3]
    keys = t * h * (d * 3 // 8 + 1 + 2) + t * 4
    values = t * h * (d * 3 // 8 + 1 + 2 + 4)
    assert cache.layers[1].nbytes() == keys + values


def test_bad_input_is_refused_with_what_to_do(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="bits=5"):
        make_cache("kvquant-3:bits=5", model)
    with pytest.raises(ValueError, match="needs the model itself"):
        make_cache("kvquant-3", model.config)
    with pytest.raises(ValueError, match="KVQuantCache.from_model"):
        KVQuantCache(model.config, bits=3)
    with pytest.raises(ValueError, match="another model"):
        make_cache("kvquant-3", tiny_model("mqa"), calibration=calibration.default_path(model.config))
    two_bit = calibration.calibrate(model, tiny_input_ids(model, batch=1, length=32), bits=(2,), chunk=32,
                                    weighting="none", progress=False)
    path = calibration.save(two_bit, tmp_path / "two.safetensors")
    with pytest.raises(ValueError, match="--bits 3"):
        make_cache("kvquant-3", model, calibration=path)


def test_uncalibrated_model_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_KVCACHE_CALIBRATION", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="hf-kvcache calibrate"):
        make_cache("kvquant-3", tiny_model("llama"))


@pytest.mark.smoke
def test_from_model_leaves_no_hooks():
    model = tiny_model("gemma")
    KVQuantCache.from_model(model, bits=3)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


@pytest.mark.smoke
def test_a_rotary_convention_other_than_rotate_half_is_refused(monkeypatch):
    """Interleaved RoPE (pairs of neighbouring channels): the probe sees that the stored keys are not the pre-RoPE
    keys rotated the rotate-half way, and refuses, naming the way out."""
    from transformers.models.llama import modeling_llama

    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        def rot(x):
            pairs = x.view(*x.shape[:-1], -1, 2)
            return torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)

        c = cos.unsqueeze(unsqueeze_dim).view(*cos.unsqueeze(unsqueeze_dim).shape[:-1], 2, -1).transpose(-1, -2)
        s = sin.unsqueeze(unsqueeze_dim).view(*sin.unsqueeze(unsqueeze_dim).shape[:-1], 2, -1).transpose(-1, -2)
        c, s = c.flatten(-2), s.flatten(-2)
        return q * c + rot(q) * s, k * c + rot(k) * s

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", interleaved)
    with pytest.raises(ValueError, match="rotate-half convention.*pre_rope=False"):
        make_cache("kvquant-3", tiny_model("llama"))
    make_cache("kvquant-3:pre_rope=false", tiny_model("llama"))  # the post-RoPE ablation needs no probe
