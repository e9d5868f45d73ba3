"""The core's bookkeeping, tested with a lossless codec: every difference from DynamicCache is a bug in
places, flushes, windows, batch operations or crop, never quantization noise."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache import _compat
from hf_kvcache.cache import _GROWTH, _MIN_GROW, _SLIDING_CROP_MARGIN, QuantizedKVLayer
from hf_kvcache.methods.int import QuantizedIntCache
from tests.helpers.lossless import LAYOUTS, LosslessCache
from tests.helpers.tiny_models import TINY_CONFIGS, left_padded_batch, tiny_input_ids, tiny_model

# Smoke (also run on the oldest supported transformers): update() and handles under each release's calls.
pytestmark = pytest.mark.smoke
CONFIGS = sorted(TINY_CONFIGS)


def _chunked_logits(model, ids, cache, sizes, attention_mask=None):
    """Feed `ids (B, T)` in chunks of the given sizes through `cache`; return all logits `(B, T, V)`."""
    out, pos = [], 0
    for n in sizes:
        chunk = ids[:, pos : pos + n]
        mask = None if attention_mask is None else attention_mask[:, : pos + n]
        with torch.inference_mode():
            out.append(model(input_ids=chunk, attention_mask=mask, use_cache=True, **_compat.cache_kwargs(cache)).logits)
        pos += n
    return torch.cat(out, 1)


CHUNKS = [13, 1, 1, 7, 1, 20, 1, 1, 1, 9, 1]  # 56 tokens: prefill, decode steps, chunked prefills


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_lossless_chunked_logits_match_dynamic_cache(name, layout, attn):
    model = tiny_model(name, attn_implementation=attn)
    ids = tiny_input_ids(model, batch=2, length=sum(CHUNKS))
    ref = _chunked_logits(model, ids, DynamicCache(config=model.config), CHUNKS)
    cache = LosslessCache(model.config, **LAYOUTS[layout])
    got = _chunked_logits(model, ids, cache, CHUNKS)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == sum(CHUNKS)


@pytest.mark.parametrize("layout", ["kivi-like"])
@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("mode", ["greedy", "beam", "sample", "return_sequences"])
def test_lossless_generate_matches_dynamic_cache(name, layout, mode):
    model = tiny_model(name)
    ids, mask = left_padded_batch(model, lengths=(21, 6))
    kwargs = dict(max_new_tokens=40, do_sample=False)
    if mode == "beam":
        kwargs.update(num_beams=3, num_return_sequences=2)
    elif mode == "sample":
        kwargs.update(do_sample=True, top_k=20)
    elif mode == "return_sequences":
        kwargs.update(do_sample=True, num_return_sequences=3)
    torch.manual_seed(0)
    ref = model.generate(ids, attention_mask=mask, **kwargs, **_compat.cache_kwargs(DynamicCache(config=model.config)))
    torch.manual_seed(0)
    cache = LosslessCache(model.config, **LAYOUTS[layout])
    got = model.generate(ids, attention_mask=mask, **kwargs, **_compat.cache_kwargs(cache))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("layout", ["sink+fifo", "kivi-like"])
@pytest.mark.parametrize("name", ["llama", "gemma"])
@pytest.mark.parametrize("cut", [1, 6, 30])
def test_crop_then_continue_matches_dynamic_cache(name, layout, cut):
    """Crop (assisted generation) cuts into the residual, a packed block or the sinks; the continuation must be
    what a DynamicCache that never saw the cropped tokens computes."""
    model = tiny_model(name)
    ids = tiny_input_ids(model, batch=2, length=60)
    reference = DynamicCache(config=model.config)
    _chunked_logits(model, ids[:, : 45 - cut], reference, [45 - cut])
    want = _chunked_logits(model, ids[:, 45 - cut :], reference, [cut, 1, 1, 13])
    cache = LosslessCache(model.config, **LAYOUTS[layout])
    _chunked_logits(model, ids[:, :45], cache, [20, 1, 1, 23])
    cache.crop(-cut)
    assert cache.get_seq_length() == 45 - cut
    got = _chunked_logits(model, ids[:, 45 - cut :], cache, [cut, 1, 1, 13])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_reset_and_reuse():
    model = tiny_model("llama")
    ids = tiny_input_ids(model, batch=2, length=30)
    cache = LosslessCache(model.config, **LAYOUTS["kivi-like"])
    first = _chunked_logits(model, ids, cache, [10, 1, 19])
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    again = _chunked_logits(model, ids, cache, [10, 1, 19])
    torch.testing.assert_close(again, first)


def test_second_generate_continues_the_first():
    model = tiny_model("llama")
    ids = tiny_input_ids(model, batch=1, length=12)
    ref = model.generate(ids, max_new_tokens=30, do_sample=False)
    cache = LosslessCache(model.config, **LAYOUTS["sink+fifo"])
    part = model.generate(ids, max_new_tokens=10, do_sample=False, **_compat.cache_kwargs(cache))
    full = model.generate(part, max_new_tokens=20, do_sample=False, **_compat.cache_kwargs(cache))
    assert torch.equal(full, ref)


def test_a_deleted_cache_is_freed_at_once_not_by_the_collector():
    """A layer's parts (`reads`, `graph`) see it through a weak reference: no reference cycle keeps a deleted cache's
    storage (GPU memory, on a GPU) alive until Python's cycle collector happens to run; a deep copy's parts see the
    copy (`warm_up` warms one)."""
    import gc
    import weakref

    model = tiny_model("llama")
    cache = LosslessCache(model.config, **LAYOUTS["kivi-like"])
    _chunked_logits(model, tiny_input_ids(model, batch=1, length=20), cache, [19, 1])
    layer, storage = weakref.ref(cache.layers[0]), weakref.ref(cache.layers[0].streams["keys"])
    assert cache.layers[0].reads.layer is cache.layers[0] is cache.layers[0].graph.layer
    copied = copy.deepcopy(cache)
    assert copied.layers[0].reads.layer is copied.layers[0] is copied.layers[0].graph.layer
    assert copied.layers[0].graph.pools is copied.layers[1].graph.pools is not cache.layers[0].graph.pools
    del copied
    enabled = gc.isenabled()
    gc.disable()
    try:
        del cache
        assert layer() is None and storage() is None
    finally:
        if enabled:
            gc.enable()


def _layer(cache, idx=0) -> QuantizedKVLayer:
    return cache.layers[idx]


def test_places_and_mask_sizes():
    model = tiny_model("llama")
    cache = LosslessCache(model.config, **LAYOUTS["kivi-like"])  # sink 2, key blocks of 4 flushed by 8, fifo values 8
    ids = tiny_input_ids(model, batch=1, length=40)
    _chunked_logits(model, ids, cache, [19])
    layer = _layer(cache)
    k, v = layer.key_stream, layer.value_stream
    # 17 tokens after the sinks: keys pack 16 (a multiple of 8), values keep the last 8.
    assert k.split(layer.held_tokens)[:3] == (2, 16, 1)
    assert v.split(layer.held_tokens)[:3] == (2, 9, 8)
    assert layer.get_mask_sizes(1) == (20, 0)
    for step in range(7):
        _chunked_logits(model, ids[:, 19 + step :], cache, [1])
        assert k.split(layer.held_tokens)[2] == (1 + step + 1) % 8 and v.split(layer.held_tokens)[2] == 8
    assert cache.get_seq_length() == 26


def test_sliding_layers_keep_only_their_window():
    model = tiny_model("gemma")  # layers: sliding(16), full, sliding(16)
    cache = LosslessCache(model.config)
    ids = tiny_input_ids(model, batch=1, length=400)
    _chunked_logits(model, ids, cache, [50] + [1] * 350)
    sliding, full = _layer(cache, 0), _layer(cache, 1)
    assert full.held_tokens == 400
    assert sliding.is_sliding and 15 <= sliding.held_tokens <= 15 + 2 * _SLIDING_CROP_MARGIN
    kv_len, offset = sliding.get_mask_sizes(1)
    # The mask covers the tokens the next update attends to (after any pending trim), ending at position 400.
    assert offset + kv_len - 1 == 400 and 15 <= kv_len - 1 <= sliding.held_tokens
    assert sliding.key_stream.sink_tokens == 0  # sinks are dead weight on a sliding layer


def test_storage_grows_geometrically_and_never_reencodes():
    model = tiny_model("llama")
    cache = QuantizedIntCache(model.config, bits=4, group_size=32)
    encoded = []
    for layer in cache.layers:
        codec = layer.key_stream.codec
        original = codec.encode

        def counting(x, valid=None, original=original):
            encoded.append(x.shape[2])
            return original(x, valid)

        codec.encode = counting
    ids = tiny_input_ids(model, batch=2, length=300)
    _chunked_logits(model, ids, cache, [100])
    layer = _layer(cache)
    snapshot = {k: t[:, :, :100].clone() for k, t in layer.key_stream.packed.items()}
    _chunked_logits(model, ids[:, 100:], cache, [1] * 200)
    # Every token was encoded exactly once, and the first 100 tokens' bytes never changed.
    assert sum(encoded) == 300 * len(cache.layers)
    for k, t in layer.key_stream.packed.items():
        assert torch.equal(t[:, :, :100], snapshot[k])
    live = layer.key_stream.nbytes(300)
    # the capacity's growth and the spare row the storage keeps for writes that belong elsewhere
    assert layer.key_stream.allocated_nbytes() <= live * _GROWTH + _MIN_GROW * live / 300 + 2 * live / 300


def test_a_long_write_grows_to_what_it_needs_and_a_decode_step_by_a_step():
    """A prompt (or a chunk of one) takes what it needs and 64 tokens, so that a chunked prefill ends with little
    capacity unfilled where its activations peak; decode steps grow by 6.25% (at least 64 tokens) at a time; every
    capacity a multiple of 64 (the kernels specialize on its divisibility by 16)."""
    model = tiny_model("llama")
    layer = _layer(QuantizedIntCache(model.config, bits=8))
    g = torch.Generator().manual_seed(0)

    def write(t):
        k = torch.randn(2, 2, t, 64, generator=g)
        layer.update(k, k)
        layer.write_pending()

    write(2048)  # 6.25% of it would be 128 tokens
    assert layer.capacity == 2048 + _MIN_GROW
    for _ in range(_MIN_GROW):
        write(1)
    assert layer.capacity == 2048 + _MIN_GROW  # the 64 decode tokens fit
    write(1)
    held = 2048 + _MIN_GROW + 1
    assert layer.capacity == math.ceil(held * _GROWTH / 64) * 64 and layer.held_tokens == held
    write(400)
    assert layer.capacity == math.ceil((held + 400 + _MIN_GROW) / 64) * 64 and layer.held_tokens == held + 400


def test_nbytes_counts_exactly_what_is_held():
    model = tiny_model("llama")  # 3 layers, 2 kv heads, head_dim 64
    cache = LosslessCache(model.config, **LAYOUTS["sink+fifo"])
    ids = tiny_input_ids(model, batch=2, length=50)
    _chunked_logits(model, ids, cache, [50])
    assert cache.nbytes() == 3 * 2 * (2 * 2 * 50 * 64) * 4  # layers * (K, V) * B*H*S*D * fp32


def test_beam_reorder_touches_every_place():
    model = tiny_model("llama")
    cache = LosslessCache(model.config, **LAYOUTS["kivi-like"])
    ids = tiny_input_ids(model, batch=3, length=30)
    _chunked_logits(model, ids, cache, [30])
    layer = _layer(cache)

    def held():
        return layer.key_stream.dense(torch.float32, layer.held_tokens)

    before = held()
    idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(idx)
    torch.testing.assert_close(held(), before[idx])
    cache.batch_select_indices(torch.tensor([0, 1]))
    torch.testing.assert_close(held(), before[idx][:2])
    cache.batch_repeat_interleave(2)
    torch.testing.assert_close(held(), before[idx][:2].repeat_interleave(2, 0))


def test_unsupported_layer_types_are_refused():
    config = TINY_CONFIGS["llama"]()
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        QuantizedIntCache(config, bits=8)


@pytest.mark.parametrize("stream", ["key_stream", "value_stream"])
def test_a_failed_encode_loses_nothing(stream):
    """An update whose encode raises stores nothing that is read: the counts stay, and what the failed write put past
    them is never attended to."""
    config = TINY_CONFIGS["llama"]()
    cache = QuantizedIntCache(config, bits=4)
    layer = cache.layers[0]
    k = torch.randn(1, config.num_key_value_heads, 40, config.head_dim)
    layer.update(k, k.clone())
    before = {s: getattr(layer, s).dense(torch.float32, 40).clone() for s in ("key_stream", "value_stream")}
    codec = getattr(layer, stream).codec

    def broken(x, valid, out):
        raise RuntimeError("encode failed")

    codec.encode_into = broken
    with pytest.raises(RuntimeError, match="encode failed"):
        layer.update(k[:, :, :1], k[:, :, :1].clone())
    del codec.encode_into
    assert layer.get_seq_length() == layer.held_tokens == 40
    for s, dense in before.items():
        assert torch.equal(getattr(layer, s).dense(torch.float32, 40), dense), s
    layer.update(k[:, :, :1], k[:, :, :1].clone())  # and the layer still works
    assert layer.held_tokens == 41
