"""Bad calibration input is refused with an error that says what differs; nothing is unpickled."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_kvcache import _compat, calibration, make_cache
from tests.helpers.tiny_models import tiny_input_ids, tiny_model


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    model = tiny_model("llama")
    ids = tiny_input_ids(model, batch=1, length=64, seed=1)
    cal = calibration.calibrate(model, ids, bits=(2, 4), chunk=32, max_samples=64, weighting="none", progress=False)
    return calibration.save(cal, tmp_path_factory.mktemp("cal") / "llama.safetensors")


def test_another_model_is_named(artifact):
    with pytest.raises(ValueError, match="num_key_value_heads: artifact 2, model 1"):
        calibration.load(artifact, tiny_model("mqa").config)
    with pytest.raises(ValueError, match="head_dim.*model_type|model_type"):
        calibration.load(artifact, tiny_model("qwen3").config)


def test_rope_parameters_are_part_of_the_fingerprint(artifact):
    config = tiny_model("llama").config
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 123.0}
    with pytest.raises(ValueError, match="rope"):
        calibration.load(artifact, config)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_corrupt_or_truncated_files_are_refused(artifact, tmp_path, damage):
    data = artifact.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes({"garbage": b"\x80\x04not a safetensors file" * 10, "truncated": data[: len(data) // 2],
                     "empty": b""}[damage])
    with pytest.raises(ValueError, match="corrupt or truncated.*hf-kvcache calibrate"):
        calibration.load(bad)


def test_other_safetensors_and_other_versions_are_refused(artifact, tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(ValueError, match="no hf-kvcache metadata"):
        calibration.load(plain)
    cal = calibration.load(artifact)
    for key, value, message in [("format_version", 99, "format version 99"), ("method", "awq", "not an hf-kvcache"),
                                ("bits", [2, 4, 9], "not in 1..8")]:
        meta = {**cal.metadata, key: value}
        out = tmp_path / f"{key}.safetensors"
        save_file({k: v.contiguous() for k, v in cal.tensors.items()}, str(out),
                  metadata={"hf_kvcache": json.dumps(meta)})
        with pytest.raises(ValueError, match=message):
            calibration.load(out)


def test_a_missing_or_broken_tensor_is_named(artifact, tmp_path):
    cal = calibration.load(artifact)
    tensors = dict(cal.tensors)
    del tensors["layers.2.v.nuq4"]
    out = tmp_path / "missing.safetensors"
    save_file(tensors, str(out), metadata={"hf_kvcache": json.dumps(cal.metadata)})
    with pytest.raises(ValueError, match="misses tensor 'layers.2.v.nuq4'"):
        calibration.load(out)
    tensors = dict(cal.tensors, **{"layers.0.k_amax": torch.tensor([1.0, float("nan")])})
    save_file(tensors, str(out), metadata={"hf_kvcache": json.dumps(cal.metadata)})
    with pytest.raises(ValueError, match="NaN or inf"):
        calibration.load(out)


def test_a_bit_width_that_was_not_calibrated_names_the_command(artifact):
    with pytest.raises(ValueError, match="--bits 3"):
        calibration.load(artifact).codebook(0, "keys", 3)


def test_fp8_calibrated_finds_the_stored_artifact(artifact, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_KVCACHE_CALIBRATION", str(tmp_path / "calibration"))
    model = tiny_model("llama")
    with pytest.raises(FileNotFoundError, match="hf-kvcache calibrate"):
        make_cache("fp8-e4m3:scale=calibrated", model)
    stored = calibration.default_path(model.config)
    stored.parent.mkdir(parents=True)
    stored.write_bytes(artifact.read_bytes())
    cache = make_cache("fp8-e4m3:scale=calibrated", model)
    ids = tiny_input_ids(model, batch=2, length=16)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         **_compat.cache_kwargs(cache))
    assert out.shape == (2, 20)
    k = calibration.load(artifact).fp8_scales(0, "e4m3")[0]  # the fitted scales, by default
    torch.testing.assert_close(cache.layers[0].key_stream.codec.fixed_scale.flatten(), k)
    wide = make_cache("fp8-e4m3:scale=calibrated,headroom=3.0", model)
    torch.testing.assert_close(wide.layers[0].key_stream.codec.fixed_scale.flatten(),
                               calibration.load(artifact).tensors["layers.0.k_amax"] * 3.0 / 448)
    with pytest.raises(ValueError, match="another model"):
        make_cache("fp8-e4m3:scale=calibrated", tiny_model("mqa"), calibration=str(artifact))


def test_a_model_without_recognizable_attention_is_refused():
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.kv = layer.self_attn.k_proj
        del layer.self_attn.k_proj
    with pytest.raises(ValueError, match="does not recognize this model's attention"):
        calibration.calibrate(model, tiny_input_ids(model, batch=1, length=8), progress=False)
