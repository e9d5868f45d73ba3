"""The registered `hf_kvcache` attention: the fused read path (handles, chunked reference attention) gives what
the dense path gives, with padding, GQA/MQA, sliding windows and QK-norm, and never builds the dense cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import hf_kvcache
from hf_kvcache import _compat, make_cache
from hf_kvcache.storage import StreamStorage
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import TINY_CONFIGS, left_padded_batch, tiny_input_ids, tiny_model

SIZES = [17, 1, 1, 9, 1, 1]


def _teacher_forced(model, ids, mask, cache):
    out, pos = [], 0
    with torch.inference_mode():
        for n in SIZES:
            out.append(
                model(
                    input_ids=ids[:, pos : pos + n], attention_mask=mask[:, : pos + n], use_cache=True,
                    **_compat.cache_kwargs(cache),
                ).logits
            )
            pos += n
    return torch.cat(out, 1)


@pytest.mark.smoke
def test_attention_and_mask_are_registered():
    assert hf_kvcache.ATTENTION_NAME in ALL_ATTENTION_FUNCTIONS
    assert hf_kvcache.ATTENTION_NAME in ALL_MASK_ATTENTION_FUNCTIONS


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=[m[0] for m in METHODS])
def test_fused_equals_dense(spec, easy, hard, name, monkeypatch):
    dense_model, fused_model = tiny_model(name), tiny_model(name, attn_implementation="hf_kvcache")
    ids, mask = left_padded_batch(dense_model, lengths=(sum(SIZES), 12))
    dense = _teacher_forced(dense_model, ids, mask, make_cache(spec, dense_model, **hard))
    # On the fused path nothing may build a layer's full dense K/V.
    monkeypatch.setattr(StreamStorage, "dense", lambda *a, **k: pytest.fail("dense K/V built on the fused path"))
    fused = _teacher_forced(fused_model, ids, mask, make_cache(spec, fused_model, **hard))
    valid = mask.bool()[:, : fused.shape[1]]
    diff = (fused[valid] - dense[valid]).abs()
    # Summation order differs (chunked online softmax vs SDPA), ~1e-6; a later layer can round a new token's
    # code the other way at 2 bits, so a few logits may move by more: bound the mean tightly, the max loosely.
    assert diff.mean() < 1e-4 and diff.max() < 5e-3, f"mean {diff.mean():.2e} max {diff.max():.2e}"


@pytest.mark.smoke
@pytest.mark.parametrize("name", ["llama", "mqa", "qwen3"])
def test_reference_attention_equals_sdpa_on_the_same_cache(name):
    """One layer, identical stored K/V: the chunked reference over handles equals SDPA over the dense read."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model(name)
    attn = model.model.layers[0].self_attn
    hq, hkv, d = model.config.num_attention_heads, model.config.num_key_value_heads, attn.head_dim
    cache = make_cache("int4-g32:sink_tokens=2,residual_length=8", model)
    layer = cache.layers[0]
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, hkv, 300, d, generator=g), torch.randn(2, hkv, 300, d, generator=g)
    layer.update(k[:, :, :290], v[:, :, :290])
    mask = torch.ones(2, 1, 10, 300, dtype=torch.bool).tril(290)
    mask[1, :, :, :37] = False  # row 1 left-padded
    q = torch.randn(2, hq, 10, d, generator=g)
    layer.fused = False
    dense_k, dense_v = layer.update(k[:, :, 290:], v[:, :, 290:])
    want, _ = sdpa_attention_forward(attn, q, dense_k, dense_v, mask, scaling=d**-0.5)
    layer.crop(-10)
    layer.fused = True
    hk, hv = layer.update(k[:, :, 290:], v[:, :, 290:])
    for chunk in (1, 7, 256):
        got = hf_kvcache.attention.reference_attention(q, hk, hv, mask, d**-0.5, chunk_tokens=chunk)
        torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


@pytest.mark.smoke
def test_other_caches_pass_through_to_sdpa():
    """With `attn_implementation="hf_kvcache"` and a DynamicCache, results are exactly SDPA's."""
    sdpa, ours = tiny_model("gemma"), tiny_model("gemma", attn_implementation="hf_kvcache")
    ids, mask = left_padded_batch(sdpa, lengths=(sum(SIZES), 5))
    a = _teacher_forced(sdpa, ids, mask, DynamicCache(config=sdpa.config))
    b = _teacher_forced(ours, ids, mask, DynamicCache(config=ours.config))
    assert torch.equal(a, b)


@pytest.mark.smoke
@pytest.mark.parametrize("spec", ["int4-g32:sink_tokens=2,residual_length=8", "kivi-2", "dynamic"])
def test_unpadded_chunks_build_no_mask_and_attend_as_with_one(spec, monkeypatch):
    """A forward of 8 tokens past 16 held ones (a prefill chunk), rows without padding: the mask function builds no
    mask (sdpa_mask is never called), and the logits equal those of the same forward given the causal mask aligned
    bottom-right as a 4D boolean mask (which transformers passes through as it is). Padded rows still get
    transformers' mask."""
    from hf_kvcache import attention

    model = tiny_model("llama", attn_implementation="hf_kvcache")
    ids = tiny_input_ids(model, batch=2, length=24)
    fn = ALL_MASK_ATTENTION_FUNCTIONS[hf_kvcache.ATTENTION_NAME]
    padded = torch.ones(2, 24, dtype=torch.long)
    padded[1, :3] = 0
    want = attention.sdpa_mask(batch_size=2, q_length=8, kv_length=24, q_offset=16, attention_mask=padded)
    assert torch.equal(fn(batch_size=2, q_length=8, kv_length=24, q_offset=16, attention_mask=padded), want)
    assert fn(batch_size=2, q_length=8, kv_length=24, q_offset=16, attention_mask=torch.ones_like(padded)) is None
    logits = {}
    for explicit in (False, True):
        cache = DynamicCache(config=model.config) if spec == "dynamic" else make_cache(spec, model)
        with torch.no_grad():
            model(ids[:, :16], use_cache=True, **_compat.cache_kwargs(cache))
            if explicit:
                mask = torch.ones(8, 24, dtype=torch.bool).tril(16).expand(2, 1, 8, 24)
            else:
                mask = torch.ones(2, 24, dtype=torch.long)
                monkeypatch.setattr(attention, "sdpa_mask", lambda *a, **k: pytest.fail("a mask was built"))
            logits[explicit] = model(ids[:, 16:], attention_mask=mask, use_cache=True,
                                     **_compat.cache_kwargs(cache)).logits
            monkeypatch.undo()
    assert torch.equal(logits[False], logits[True])


@pytest.mark.smoke
def test_a_decode_mask_is_sdpa_masks_without_calling_it(monkeypatch):
    """The mask of one query that transformers has built for every step of a compileable cache (allow_is_causal_skip
    off): the same booleans as sdpa_mask's, padded rows, a position given as a device tensor and columns past the 2D
    mask included, without calling sdpa_mask."""
    from transformers.masking_utils import sdpa_mask

    from hf_kvcache import attention

    fn = ALL_MASK_ATTENTION_FUNCTIONS[hf_kvcache.ATTENTION_NAME]
    padded = torch.ones(3, 21, dtype=torch.long)
    padded[1, :4] = 0
    padded[2, 7] = 0  # a hole, not only left padding
    cases = [(padded, 20, 40), (padded.bool(), torch.tensor(20), 21), (padded, torch.tensor(17), 64)]
    wants = [sdpa_mask(batch_size=3, q_length=1, kv_length=k, q_offset=q, attention_mask=m, allow_is_causal_skip=False)
             for m, q, k in cases]
    monkeypatch.setattr(attention, "sdpa_mask", lambda *a, **k: pytest.fail("sdpa_mask was called"))
    for (m, q, k), want in zip(cases, wants):
        got = fn(batch_size=3, q_length=1, kv_length=k, q_offset=q, attention_mask=m, allow_is_causal_skip=False)
        assert got.dtype == torch.bool and got.shape == want.shape == (3, 1, 1, k)
        assert torch.equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["int8", "int4-g32"])
def test_default_model_fused_follows_dense(spec, default_model, default_model_fused):
    """The dense path's greedy continuation, teacher-forced through both paths on the default model: the fused
    path picks the same token wherever the choice is not a near-tie.

    Exact token equality is too strict here: the two paths sum in different orders (~1e-5 in the logits), a
    later layer then rounds some new token's code differently, and over 30 layers that grows to ~0.1 in the
    logits; with a lossless codec the two paths agree to 3e-5 at every step (tests/test_cache.py covers that).
    """
    (dense_model, tok), (fused_model, _) = default_model, default_model_fused
    batch = tok(["The three primary colors are", "Water boils at a temperature of"], return_tensors="pt", padding=True)
    seq = dense_model.generate(**batch, max_new_tokens=24, do_sample=False, **_compat.cache_kwargs(make_cache(spec, dense_model)))
    n0 = batch.input_ids.shape[1]
    mask = torch.cat([batch.attention_mask, torch.ones(2, seq.shape[1] - n0, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    logits = []
    for model, cache_spec in ((dense_model, spec), (fused_model, spec), (dense_model, "none")):
        cache = make_cache(cache_spec, model)
        steps = [(0, n0)] + [(t, t + 1) for t in range(n0, seq.shape[1] - 1)]
        with torch.inference_mode():
            logits.append(torch.stack([
                model(
                    input_ids=seq[:, a:b], attention_mask=mask[:, :b], position_ids=positions[:, a:b],
                    **_compat.cache_kwargs(cache),
                ).logits[:, -1]
                for a, b in steps
            ], 1))
    dense, fused, exact = logits
    assert torch.equal(dense.argmax(-1), seq[:, n0:])  # the teacher-forced dense path is the greedy one
    top2 = dense.topk(2, -1).values
    margin = top2[..., 0] - top2[..., 1]
    differ = fused.argmax(-1) != dense.argmax(-1)
    assert (margin[differ] < 0.2).all(), f"fused path changed a clear choice: margins {margin[differ].tolist()}"
    # The paths differ by far less than what quantization itself changes.
    path, quantization = (fused - dense).abs().mean(), (dense - exact).abs().mean()
    assert path < 0.5 * quantization, f"fused vs dense {path:.4f}, quantized vs exact {quantization:.4f}"


# ------------------------------------------------------------------ the model's own attention over a packed cache


@pytest.mark.smoke
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_plain_calls_are_untouched_by_the_routing(implementation):
    """What the routing of the model's own attention (`attention.install_routing`) changes for anything that is not a
    packed cache: nothing, bit for bit (a DynamicCache fed in steps, a padded batch, and a call without a cache)."""
    from hf_kvcache import attention

    model = tiny_model("llama", attn_implementation=implementation)
    ids, mask = left_padded_batch(model, lengths=(sum(SIZES), 12))
    got = {}
    for routed in (True, False):
        if not routed:
            attention.remove_routing()
        try:
            with torch.no_grad():
                got[routed] = (_teacher_forced(model, ids, mask, DynamicCache(config=model.config)),
                               model(input_ids=ids, attention_mask=mask, use_cache=False).logits)
        finally:
            attention.install_routing()
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])


@pytest.mark.smoke
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_the_models_own_attention_reads_a_packed_cache(implementation, monkeypatch):
    """A model loaded with its own attention reads a packed cache as `attn_implementation="hf_kvcache"` does: the
    same handles, its mask read into the same booleans (eager's additive floats included), so the same logits, and
    no dense K/V built. On CUDA that read is the kernels'; here (no kernels on CPU) the cache is told to hand out
    handles anyway, which the routed attention reads by the reference."""
    from hf_kvcache.cache import QuantizedKVCache

    monkeypatch.setattr(QuantizedKVCache, "_reads_fused", lambda self, device: self.read == "auto")
    own, fused = tiny_model("llama", attn_implementation=implementation), tiny_model("llama", "hf_kvcache")
    ids, mask = left_padded_batch(own, lengths=(sum(SIZES), 12))
    want = _teacher_forced(fused, ids, mask, make_cache("int4-g32:sink_tokens=2,residual_length=8", fused))
    monkeypatch.setattr(StreamStorage, "dense", lambda *a, **k: pytest.fail("dense K/V built on the fused path"))
    cache = make_cache("int4-g32:sink_tokens=2,residual_length=8", own)
    got = _teacher_forced(own, ids, mask, cache)
    assert all(layer.fused for layer in cache.layers)
    valid = mask.bool()[:, : got.shape[1]]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-6, rtol=1e-6)


@pytest.mark.smoke
def test_read_dense_asks_for_the_dense_path():
    """`cache.read = "dense"` hands the model's attention dequantized K/V, under any attention; other values are
    refused with the choices."""
    model = tiny_model("llama", attn_implementation="hf_kvcache")
    cache = make_cache("int4-g32", model)
    cache.read = "dense"
    with torch.no_grad():
        model(tiny_input_ids(model, batch=1, length=5), use_cache=True, **_compat.cache_kwargs(cache))
    assert not any(layer.fused for layer in cache.layers)
    with pytest.raises(ValueError, match="dense"):
        cache.read = "kernels"


@pytest.mark.smoke
@pytest.mark.parametrize("tq,window", [(1, None), (5, None), (5, 6), (1, 6)])
def test_a_flash_models_padding_mask_reads_as_sdpas(tq, window):
    """Flash attention's mask is the 2D padding mask (or None) and its window a keyword: read into the booleans
    sdpa's mask function builds for the same positions."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    from hf_kvcache import attention
    from hf_kvcache.cache import KVHandle

    s = 12
    padded = torch.ones(2, s, dtype=torch.long)
    padded[1, :3] = 0
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="flash_attention_2"))

    class Layer:
        held_tokens = s

    key = KVHandle(Layer(), "keys", torch.zeros(2, 1, tq, 4))
    query = torch.zeros(2, 2, tq, 4)
    kwargs = {"sliding_window": window} if window else {}
    function = sliding_window_causal_mask_function(window) if window else causal_mask_function
    for mask in (padded, None):
        got = attention._routed_mask(module, query, key, mask, kwargs)
        want = sdpa_mask(batch_size=2, q_length=tq, kv_length=s, q_offset=s - tq, mask_function=function,
                         attention_mask=mask, allow_is_causal_skip=False)
        if got is None:  # plain causal: only where nothing is padded and there is no window
            assert mask is None and window is None
            continue
        assert torch.equal(got.expand_as(want), want)


@pytest.mark.smoke
def test_a_plain_causal_chunk_mask_reads_as_none():
    """sdpa's and eager's masks of a chunk over held tokens: plain causal (also over a pinned layer's capacity, whose
    columns past what is held are masked) reads as None, the workspace path's form; padding, or a key past a query's
    position, keeps the mask."""
    from types import SimpleNamespace

    from hf_kvcache import attention
    from hf_kvcache.cache import KVHandle

    held, tq = 20, 6

    class Layer:
        held_tokens = held

    key = KVHandle(Layer(), "keys", torch.zeros(2, 1, tq, 4))
    query = torch.zeros(2, 2, tq, 4)
    causal = torch.ones(tq, held, dtype=torch.bool).tril(held - tq).expand(2, 1, tq, held)
    pinned = torch.cat([causal, torch.zeros(2, 1, tq, 44, dtype=torch.bool)], -1)
    padded = causal.clone()
    padded[1, ..., :3] = False
    future = causal.clone()
    future[0, 0, 0, held - tq + 1] = True
    future[0, 0, 1, 0] = False  # as many pairs as causal, one of them past its query
    for implementation, as_given in (("sdpa", lambda m: m), ("eager", lambda m: torch.where(m, 0.0, -3e38))):
        module = SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation))
        assert attention._routed_mask(module, query, key, as_given(causal), {}) is None
        assert attention._routed_mask(module, query, key, as_given(pinned), {}) is None
        for kept in (padded, future):
            assert torch.equal(attention._routed_mask(module, query, key, as_given(kept), {}), kept)


def test_a_forwards_chunk_mask_is_read_back_once_for_every_layer(monkeypatch):
    """transformers passes every layer of a forward the same mask: whether it is plain causal is read from the device
    once (a host sync), not once a layer; an edited mask (a new version), another length held or another mask is read
    again, and its verdict is its own."""
    from types import SimpleNamespace

    from hf_kvcache import attention
    from hf_kvcache.cache import KVHandle

    reads = []
    plain = attention._plain_causal
    monkeypatch.setattr(attention, "_plain_causal", lambda *args: reads.append(args[1:]) or plain(*args))
    monkeypatch.setattr(attention, "_VERDICTS", [])
    held, tq = 20, 6

    class Layer:
        held_tokens = held

    key = KVHandle(Layer(), "keys", torch.zeros(2, 1, tq, 4))
    query = torch.zeros(2, 2, tq, 4)
    causal = torch.ones(tq, held, dtype=torch.bool).tril(held - tq).expand(2, 1, tq, held).clone()
    additive = torch.where(causal, 0.0, -3e38)
    for implementation, given in (("sdpa", causal), ("eager", additive)):
        module = SimpleNamespace(config=SimpleNamespace(_attn_implementation=implementation))
        for _ in range(8):  # the layers of one forward
            assert attention._routed_mask(module, query, key, given, {}) is None
    assert len(reads) == 2
    causal[1, ..., :3] = False  # padding written into the same tensor: its version moves
    module = SimpleNamespace(config=SimpleNamespace(_attn_implementation="sdpa"))
    assert torch.equal(attention._routed_mask(module, query, key, causal, {}), causal)
    assert len(reads) == 3
