"""A model split over two GPUs with accelerate (layers of one cache on different devices), through the fused
attention: every cache generates exactly what it generates on one GPU, each layer's storage lives on its layer's
device, and every kernel runs on the device of the tensors it reads (no K/V crosses devices). Skipped without two
CUDA GPUs; run on a 2-GPU host with `python3 -m pytest tests/test_multi_gpu.py`."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_kvcache import _compat, make_cache
from hf_kvcache.bench import _layer_devices, split_model, storage_devices
from tests.helpers.checks import assert_cache_finite
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import left_padded_batch, tiny_model

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]


def split_device_map(model, devices: list[int]) -> dict[str, int]:
    """Decoder layers spread evenly over `devices` in order; embeddings and rotary modules on the first device,
    the final norm and the head on the last (as `device_map="auto"` places them)."""
    layers = model.model.layers
    device_map = {f"model.{name}": devices[0] for name, _ in model.model.named_children() if name != "layers"}
    device_map.update({f"model.layers.{i}": devices[i * len(devices) // len(layers)] for i in range(len(layers))})
    device_map.update({"model.norm": devices[-1], "lm_head": devices[-1]})
    return device_map


class KernelSpy:
    """Records every Triton kernel launch (`JITFunction.run`): the current CUDA device and the devices of the
    tensors passed."""

    def __init__(self, monkeypatch):
        from triton.runtime.jit import JITFunction

        self.launches: list[tuple[int, set[int]]] = []
        original = JITFunction.run

        def run(kernel, *args, **kwargs):
            devices = {a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda}
            self.launches.append((torch.cuda.current_device(), devices))
            return original(kernel, *args, **kwargs)

        monkeypatch.setattr(JITFunction, "run", run)


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3"])
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=[m[0] for m in METHODS])
def test_split_over_two_gpus_generates_as_on_one(spec, easy, hard, name, monkeypatch):
    base = tiny_model(name, attn_implementation="hf_kvcache").to(torch.bfloat16)
    ids, mask = left_padded_batch(base, lengths=(40, 11))
    outputs = []
    for devices in ([0], [0, 1]):
        model = copy.deepcopy(base)
        if len(devices) == 1:
            model = model.to("cuda:0")
        else:
            from accelerate import dispatch_model

            model = dispatch_model(model, device_map=split_device_map(model, devices))
        layer_devices = _layer_devices(model)
        assert {d.index for d in layer_devices} == set(devices)
        spy = KernelSpy(monkeypatch)
        cache = make_cache(spec, model, **hard)
        out = model.generate(
            ids.to("cuda:0"), attention_mask=mask.to("cuda:0"), max_new_tokens=70, do_sample=False, num_beams=2,
            **_compat.cache_kwargs(cache),
        )
        outputs.append(out.cpu())
        for layer, device in zip(cache.layers, layer_devices):
            if getattr(layer, "held_tokens", 0):
                assert storage_devices(layer) == {device}
        assert_cache_finite(cache)
        assert spy.launches, "the fused path launched no kernel"
        wrong = [(cur, devs) for cur, devs in spy.launches if devs != {cur}]
        assert not wrong, f"{len(wrong)} of {len(spy.launches)} launches ran off their tensors' device: {wrong[:3]}"
        monkeypatch.undo()
    assert torch.equal(outputs[0], outputs[1])


def test_split_model_places_whole_layers_as_device_map_auto():
    """The benchmark's `split_model`: a meta-device model drawn on two GPUs, every decoder layer whole on one
    device, both devices used, generate runs with a quantized cache."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, vocab_size=1000)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="hf_kvcache")
    model = split_model(model, [0, 1])
    for layer in model.model.layers:
        assert len({p.device for p in layer.parameters()}) == 1
    assert {d.index for d in _layer_devices(model)} == {0, 1}
    cache = make_cache("int4-g32", model)
    ids = torch.randint(0, 1000, (2, 64), device="cuda:0")
    out = model.generate(ids, max_new_tokens=8, do_sample=False, **_compat.cache_kwargs(cache))
    assert out.shape == (2, 72)
    assert [storage_devices(layer) for layer in cache.layers] == [{d} for d in _layer_devices(model)]
