"""The tiny model configs of tests/helpers build, report the layer types we document, and generate."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import get_layer_types_and_kwargs

from tests.helpers.tiny_models import (
    SLIDING_CONFIGS,
    TINY_CONFIGS,
    cache_of,
    left_padded_batch,
    tiny_input_ids,
    tiny_model,
)

# Smoke (also run on the oldest supported transformers): layer types and caches are what a release may change.
pytestmark = pytest.mark.smoke

EXPECTED_LAYER_TYPES = {
    "llama": ["full_attention"] * 3,
    "qwen2": ["full_attention"] * 3,
    "qwen3": ["full_attention"] * 3,
    "mistral": ["sliding_attention"] * 3,
    "gemma": ["sliding_attention", "full_attention", "sliding_attention"],
    "mqa": ["full_attention"] * 3,
}


def test_every_config_has_expected_layer_types():
    assert set(EXPECTED_LAYER_TYPES) == set(TINY_CONFIGS)
    for name, make in TINY_CONFIGS.items():
        layer_types, _ = get_layer_types_and_kwargs(make())
        assert list(layer_types) == EXPECTED_LAYER_TYPES[name], name
        assert ("sliding_attention" in layer_types) == (name in SLIDING_CONFIGS), name


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_builds_and_generates_with_dynamic_cache(name):
    model = tiny_model(name)
    assert not model.training
    assert next(model.parameters()).dtype == torch.float32
    input_ids = tiny_input_ids(model, batch=2, length=40)
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=8,
            do_sample=False,
            return_dict_in_generate=True,
        )
    assert out.sequences.shape == (2, 48)
    cache = cache_of(out)
    assert isinstance(cache, DynamicCache)
    # 47 tokens were fed through the cache: sliding layers must have dropped some, full ones none.
    layer_types = EXPECTED_LAYER_TYPES[name]
    window = getattr(model.config, "sliding_window", None)
    for layer_type, layer in zip(layer_types, cache.layers):
        held = layer.keys.shape[-2]
        assert held == (window - 1 if layer_type == "sliding_attention" else 47), (name, layer_type, held)


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_deterministic_and_rng_neutral(name):
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = tiny_model(name)
    after = torch.rand(3)
    assert torch.equal(before, after), "building a tiny model must not consume the caller's RNG"
    b = tiny_model(name)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka


def test_left_padded_batch_generates():
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch(model, lengths=(24, 9))
    assert input_ids.shape == attention_mask.shape == (2, 24)
    assert attention_mask.sum(-1).tolist() == [24, 9]
    assert (input_ids[1, :15] == 0).all() and (input_ids[1, 15:] != 0).all()
    with torch.no_grad():
        padded = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False)
        alone = model.generate(input_ids[1:, 15:], max_new_tokens=8, do_sample=False)
    # Left padding is masked: the short row continues exactly as it does on its own.
    assert torch.equal(padded[1, 24:], alone[0, 9:])
