"""RotatedCache: exact rotations of every head_dim, weight fusion that leaves the model's outputs unchanged and
comes off exactly, online key rotation, and the errors for models and uses the fusion cannot serve."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from hf_kvcache import RotatedCache, _compat, make_cache, unfuse
from hf_kvcache.methods.int import IntCodec
from hf_kvcache.methods.rotated import Rotation, rotation_matrix
from hf_kvcache.patching import CONFIG_KEY, current_fusion, fuse_value_rotation
from tests.helpers.tiny_models import TINY_CONFIGS, tiny_input_ids, tiny_model


@pytest.mark.parametrize("d,kind", [(64, "hadamard"), (128, "hadamard"), (80, "hadamard-paley20"),
                                    (96, "hadamard-paley12"), (192, "hadamard-paley12"), (112, "random-orthogonal"),
                                    (48, "hadamard-paley12"), (72, "random-orthogonal")])
def test_every_head_dim_gets_an_exact_orthogonal_matrix(d, kind):
    r, got = rotation_matrix(d)
    assert got == kind
    assert r.shape == (d, d)
    torch.testing.assert_close(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    if kind.startswith("hadamard"):  # +-1/sqrt(d) everywhere: the energy of one channel spreads over all
        torch.testing.assert_close(r.abs(), torch.full_like(r, d**-0.5), atol=1e-12, rtol=0)


def test_random_orthogonal_depends_on_the_seed_only():
    assert torch.equal(rotation_matrix(112, seed=3)[0], rotation_matrix(112, seed=3)[0])
    assert not torch.equal(rotation_matrix(112, seed=3)[0], rotation_matrix(112, seed=4)[0])


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=True, **_compat.cache_kwargs(DynamicCache(config=model.config))).logits


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_fusion_keeps_logits_and_unfuse_restores_the_weights(name):
    model = tiny_model(name)
    ids = tiny_input_ids(model, batch=2, length=24)
    before = _logits(model, ids)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    cache = RotatedCache.from_model(model, bits=4)
    assert getattr(model.config, CONFIG_KEY) == cache.fusion.rotation.spec
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, weights[k])]
    assert changed and all(k.endswith(("v_proj.weight", "v_proj.bias", "o_proj.weight")) for k in changed)
    after = _logits(model, ids)
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert rel < 1e-4, f"fused logits differ by {rel:.2e} (relative)"
    assert unfuse(model) and not hasattr(model.config, CONFIG_KEY)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_fusion_keeps_the_default_models_logits(default_model):
    model, _ = default_model
    ids = torch.randint(100, 4000, (1, 64), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    try:
        RotatedCache.from_model(model, bits=4)
        after = _logits(model, ids)
    finally:
        unfuse(model)
    rel = ((after - before).abs().max() / before.abs().max()).item()
    assert rel < 1e-4, f"fused logits differ by {rel:.2e} (relative)"


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_rotated_cache_on_a_bf16_model_stays_within_bf16_noise(default_model, device):
    """A bf16 model takes the fusion (its check runs in float32) and its logits after it stay as close to the float32
    model's as the unfused bf16 model's are (measured on CPU: 1.49% against 1.38% RMS on text); then it generates."""
    from hf_kvcache import load_model
    from hf_kvcache.eval.corpus import dev_text, tokenize_corpus

    ref_model, tokenizer = default_model
    ids = tokenize_corpus(tokenizer, dev_text())[5000:5128][None]
    with torch.no_grad():
        ref = ref_model(ids).logits
        model, _ = load_model(dtype=torch.bfloat16, device=device)
        unfused = model(ids.to(device)).logits.cpu()
        cache = make_cache("rotated-4", model)
        try:
            fused = model(ids.to(device)).logits.cpu()
            out = model.generate(ids[:, :64].to(device), max_new_tokens=8, do_sample=False,
                                 **_compat.cache_kwargs(cache))
        finally:
            unfuse(model)
    noise, err = _rel(unfused, ref), _rel(fused, ref)
    assert err <= 1.25 * noise + 1e-3, f"fused bf16 logits {err:.2%} from float32's, unfused bf16 {noise:.2%}"
    assert out.shape == (1, 72)


def test_same_rotation_is_reused_and_a_different_one_refused():
    model = tiny_model("llama")
    a = RotatedCache.from_model(model, bits=4)
    b = RotatedCache.from_model(model, bits=2, group_size=32)
    assert a.fusion is b.fusion
    other = Rotation(64)
    other.kind, other.seed = "random-orthogonal", 1
    other.matrix = rotation_matrix(112, seed=1)[0][:64, :64]  # any other spec
    with pytest.raises(ValueError, match="already fused with another value rotation"):
        fuse_value_rotation(model, other)


def test_a_cache_refuses_a_model_unfused_after_it_was_built():
    model = tiny_model("llama")
    cache = make_cache("rotated-4", model)
    ids = tiny_input_ids(model, batch=1, length=12)
    unfuse(model)
    with pytest.raises(RuntimeError, match="unfused after this RotatedCache was built"):
        model(ids, use_cache=True, **_compat.cache_kwargs(cache))
    assert current_fusion(model) is None
    fresh = make_cache("rotated-4", model)  # fuses again
    assert current_fusion(model) is fresh.fusion
    model(ids, use_cache=True, **_compat.cache_kwargs(fresh))


def test_a_value_normalization_is_refused():
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.v_norm = nn.LayerNorm(64)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="v_norm"):
        make_cache("rotated-4", model)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_a_value_path_that_is_not_linear_is_caught_by_the_probe_and_restored():
    """A nonlinearity hidden inside the output projection: the float32 probe of the attention sees its output change,
    and no weight is touched."""
    model = tiny_model("llama")
    for layer in model.model.layers:
        proj = layer.self_attn.o_proj
        proj.register_forward_pre_hook(lambda module, args: (torch.tanh(args[0]),))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not linear per head"):
        make_cache("rotated-4", model)
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())
    assert current_fusion(model) is None


def test_a_direct_constructor_without_fusion_says_what_to_do():
    with pytest.raises(ValueError, match="from_model"):
        RotatedCache(tiny_model("llama").config, bits=4)
    with pytest.raises(ValueError, match="bits"):
        make_cache("rotated-4:bits=5", tiny_model("llama"))


@pytest.mark.smoke
def test_keys_are_stored_rotated_and_read_back_unrotated():
    model = tiny_model("llama")
    cache = make_cache("rotated-4", model)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 41, 64, generator=g), torch.randn(1, 2, 41, 64, generator=g)
    layer.update(k[:, :, :40], v[:, :, :40])
    dense_k, _ = layer.update(k[:, :, 40:], v[:, :, 40:])
    stored = layer.key_stream.dense(torch.float32, layer.held_tokens)  # what the places hold: rotated keys, quantized
    rotation = cache.fusion.rotation
    torch.testing.assert_close(dense_k[:, :, :40], rotation.apply(stored[:, :, :40], inverse=True), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(dense_k[:, :, 40:], k[:, :, 40:], atol=1e-5, rtol=1e-5)  # this step's, exact
    assert _sqnr_db(k[:, :, :40], dense_k[:, :, :40]) > _sqnr_db(rotation.apply(k[:, :, :40]), dense_k[:, :, :40]) + 10


def _sqnr_db(x, y):
    return 10 * math.log10(float(x.pow(2).sum() / (x - y).pow(2).sum()))


@pytest.mark.parametrize("bits", [4, 2])
def test_rotation_is_what_wins_on_keys_with_outlier_channels(bits):
    """Keys with two channels 20x the others: the same uniform codes lose far less behind the rotation."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 256, 64, generator=g)
    k[..., 3] *= 20
    k[..., 40] *= 20
    codec = IntCodec(bits, None, False)
    rotation = Rotation(64)
    plain = codec.decode(codec.encode(k), torch.float32)
    rotated = rotation.apply(codec.decode(codec.encode(rotation.apply(k)), torch.float32), inverse=True)
    gain = _sqnr_db(k, rotated) - _sqnr_db(k, plain)
    assert gain > 6, f"rotation gains only {gain:.1f} dB at {bits} bits"
