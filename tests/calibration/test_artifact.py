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


# ------------------------------------------------------------------------------------ hostile files (fuzzed)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _refused(path) -> str:
    """Load `path`: it must raise a ValueError (never another exception, never load)."""
    try:
        calibration.load(path)
    except ValueError as error:
        return str(error)
    raise AssertionError("a damaged artifact was loaded")


@_FUZZ
@given(cut=st.floats(0.0, 0.999))
def test_fuzz_truncated_files(artifact, tmp_path, cut):
    data = artifact.read_bytes()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[: int(cut * len(data))])
    assert "hf-kvcache calibrate" in _refused(bad)


@_FUZZ
@given(where=st.floats(0.0, 0.999), byte=st.integers(1, 255))
def test_fuzz_a_changed_byte_anywhere(artifact, tmp_path, where, byte):
    """A byte XORed anywhere, header or data: a parse error, a metadata error or a checksum mismatch (the checksum
    covers the metadata's text and every tensor). A change that leaves the content identical (JSON whitespace in
    the header's padding) may load, and then loads exactly the original."""
    data = bytearray(artifact.read_bytes())
    data[int(where * len(data))] ^= byte
    bad = tmp_path / "flip.safetensors"
    bad.write_bytes(bytes(data))
    try:
        got = calibration.load(bad)
    except ValueError:
        return
    want = calibration.load(artifact)
    assert got.metadata == want.metadata and all(torch.equal(got.tensors[k], v) for k, v in want.tensors.items())


def _raw_file(header: bytes, body: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + body


@_FUZZ
@given(meta=st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                         lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                     max_size=4), max_leaves=12))
def test_fuzz_wrong_metadata(artifact, tmp_path, meta):
    """Any JSON value as the metadata, and any value under each of the real metadata's keys."""
    real = calibration.load(artifact)
    tensors = {k: v.contiguous() for k, v in real.tensors.items()}
    for metadata in (meta, {**real.metadata, "fingerprint": meta}, {**real.metadata, "bits": meta}):
        bad = tmp_path / "meta.safetensors"
        save_file(tensors, str(bad), metadata={"hf_kvcache": json.dumps(metadata)})
        _refused(bad)


@pytest.mark.parametrize("header", [
    b"\xff\xfe{not utf-8}",  # non-UTF-8 header
    json.dumps({"__metadata__": {"hf_kvcache": "{}"}, "x": {"dtype": "F32", "shape": [1 << 40, 1 << 20],
                                                             "data_offsets": [0, 1 << 62]}}).encode(),  # huge sizes
    json.dumps({"x": {"dtype": "Q9", "shape": [2], "data_offsets": [0, 8]}}).encode(),  # unknown dtype
])
def test_hostile_headers_are_refused_without_allocating(tmp_path, header):
    bad = tmp_path / "hostile.safetensors"
    bad.write_bytes(_raw_file(header, b"\0" * 8))
    _refused(bad)


def test_huge_declared_layer_counts_are_refused_before_looping(artifact, tmp_path):
    real = calibration.load(artifact)
    fp = {**real.metadata["fingerprint"], "num_hidden_layers": 10**12}
    bad = tmp_path / "huge.safetensors"
    save_file({k: v.contiguous() for k, v in real.tensors.items()}, str(bad),
              metadata={"hf_kvcache": json.dumps({**real.metadata, "fingerprint": fp})})
    assert "num_hidden_layers" in _refused(bad)


def test_wrong_dtype_and_shape_are_refused(artifact, tmp_path):
    real = calibration.load(artifact)
    name = next(k for k in real.tensors if k.endswith(".k_pre.lo"))
    for bad_tensor in (real.tensors[name][:1], real.tensors[name].to(torch.float64) * float("inf")):
        bad = tmp_path / "t.safetensors"
        tensors = {**{k: v.contiguous() for k, v in real.tensors.items()}, name: bad_tensor.contiguous()}
        save_file(tensors, str(bad), metadata={"hf_kvcache": json.dumps(real.metadata)})
        _refused(bad)
