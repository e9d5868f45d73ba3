"""Calibration: what `collect` captures (keys before RoPE really are the keys before RoPE), the k-means, and the
artifact's round trip on tiny models."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import calibration
from hf_kvcache.calibration.calibrate import collect, weighted_kmeans_1d
from hf_kvcache.patching import layer_ropes, rotate
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


def _ids(model, n=96):
    return tiny_input_ids(model, batch=1, length=n, seed=3)


@pytest.mark.smoke
def test_keys_before_rope_rotate_into_the_keys_the_cache_stores():
    """For every token, RoPE (the model's own rotary embedding, per layer) applied to the captured pre-RoPE key gives
    the post-RoPE key the cache received: QK-norm on (B, T, H, D) (Qwen3), on (B, H, T, D) with per-layer-type
    rotary (Gemma 3), and plain k_proj (Llama)."""
    for name in ("qwen3", "gemma", "llama"):
        model = tiny_model(name)
        acts = collect(model, _ids(model, 64), chunk=64, max_samples=64, weighting="none", progress=False)
        for layer in range(model.config.num_hidden_layers):  # every token is sampled: amax is the samples' max
            for amax, name in ((acts.k_amax, "k_post"), (acts.v_amax, "v")):
                torch.testing.assert_close(amax[layer], acts.samples[name][layer].abs().amax(dim=(0, 2)))
        ropes = layer_ropes(model)
        for layer in range(model.config.num_hidden_layers):
            cos, sin = ropes[layer].cos_sin(torch.arange(64)[None], acts.samples["k_pre"][layer].shape[-1])
            pre = acts.samples["k_pre"][layer].transpose(0, 1)[None]  # (1, Hkv, T, D): the sample holds every token
            post = acts.samples["k_post"][layer].transpose(0, 1)[None]
            torch.testing.assert_close(rotate(pre, cos, sin), post, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(rotate(post, cos, sin, inverse=True), pre, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(pre, post)


def test_fisher_weights_are_squared_gradients_of_the_loss():
    model = tiny_model("llama")
    ids = _ids(model, 48)
    acts = collect(model, ids, chunk=48, max_samples=48, weighting="fisher", progress=False)
    assert all(p.grad is None and p.requires_grad for p in model.parameters()), "weights must be left as they were"
    v0 = acts.samples["v"][0].clone().requires_grad_(True)  # (T, Hkv, D)
    # The same gradient, by hand: replace layer 0's value projection output with a leaf and backpropagate.
    attn = model.model.layers[0].self_attn
    leaf = {}

    def swap(module, args, output):
        leaf["v"] = output.detach().requires_grad_(True)
        return leaf["v"]

    handle = attn.v_proj.register_forward_hook(swap)
    try:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    finally:
        handle.remove()
    want = leaf["v"].grad[0].view(48, *v0.shape[1:]).pow(2)
    torch.testing.assert_close(acts.fisher["v"][0], want, rtol=1e-4, atol=1e-12)


def test_weighted_kmeans_follows_the_weights():
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4000, generator=gen) * 0.1 - 0.5, torch.randn(4000, generator=gen) * 0.1 + 0.5])
    even = weighted_kmeans_1d(x, torch.ones_like(x), 4)
    assert (even[:2] < 0).all() and (even[2:] > 0).all(), even
    right = weighted_kmeans_1d(x, torch.where(x > 0, 100.0, 1.0), 4)
    assert (right > 0).sum() >= 3, f"centroids should crowd where the weight is: {right}"

    def err(c, w):
        mid = (c[1:] + c[:-1]) / 2
        return float((w * (x - c[torch.bucketize(x, mid)]) ** 2).sum())

    w = torch.where(x > 0, 100.0, 1.0)
    grid = torch.linspace(x.min(), x.max(), 4)
    assert err(right, w) < err(grid, w) and err(right, w) < err(even, w)


def test_calibrate_save_load_round_trip_and_fp8_scales(tmp_path):
    model = tiny_model("qwen3")
    cal = calibration.calibrate(model, _ids(model), bits=(2, 3), chunk=32, max_samples=64, progress=False)
    assert cal.metadata["tokens"] == 96 and cal.metadata["bits"] == [2, 3]
    path = calibration.save(cal, tmp_path / "cal.safetensors")
    back = calibration.load(path, model.config)
    assert back.metadata == cal.metadata
    assert back.tensors.keys() == cal.tensors.keys()
    for name, t in cal.tensors.items():
        torch.testing.assert_close(back.tensors[name], t.float(), atol=0, rtol=0)
    for layer in range(model.config.num_hidden_layers):
        cb = back.codebook(layer, "keys", 3)
        assert cb.shape == (8,) and (cb[1:] >= cb[:-1]).all() and cb.abs().max() <= 1
        lo, hi = back.key_range(layer)
        assert (lo <= hi).all() and lo.shape == (2, 128)
        k, v = back.fp8_scales(layer, "e4m3", headroom=1.0)
        torch.testing.assert_close(k * 448, back.tensors[f"layers.{layer}.k_amax"])
        fitted = back.fp8_scales(layer, "e5m2")[1]
        ratio = fitted * 57344 / back.tensors[f"layers.{layer}.v_amax"]
        assert (ratio >= 1 - 1e-6).all() and (ratio < 4).all(), ratio


def test_fitted_fp8_scale_is_the_least_weighted_error_among_the_candidates():
    from hf_kvcache.calibration.calibrate import FP8_SCALE_STEPS, fp8_scale_search
    from hf_kvcache.quant import dequantize_fp8, quantize_fp8

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 2, 16, generator=gen) * torch.tensor([0.01, 30.0])[None, :, None]
    w = torch.rand(x.shape, generator=gen)
    amax = x.abs().amax(dim=(0, 2))
    best = fp8_scale_search(x, w, amax, "e5m2")

    def err(scale):
        s = scale[None, :, None]
        return ((dequantize_fp8(quantize_fp8(x, "e5m2", s), "e5m2", s) - x).pow(2) * w).sum(dim=(0, 2))

    for j in range(FP8_SCALE_STEPS):
        assert (err(best) <= err(amax * 2 ** (j / 8) / 57344) + 1e-12).all()


def test_vllm_export_names(tmp_path):
    from safetensors.torch import load_file

    model = tiny_model("llama")
    cal = calibration.calibrate(model, _ids(model, 32), bits=(2,), chunk=32, weighting="none", progress=False)
    out = load_file(str(calibration.export_vllm(cal, tmp_path / "kv_scales.safetensors")))
    assert sorted(out) == sorted(f"model.layers.{i}.self_attn.{s}_scale" for i in range(3) for s in ("k", "v"))
    k, _ = cal.fp8_scales(1)
    assert out["model.layers.1.self_attn.k_scale"].shape == () and float(out["model.layers.1.self_attn.k_scale"]) == float(k.max())
