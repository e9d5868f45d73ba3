"""`model.generate` with every cache on every tiny model config (greedy, sampling, beam search, several
return sequences, left padding); generation features for every cache on both read paths (prompt lookup and its
`crop`, `reset` and reuse, a second `generate` continuing the first, rows of 1 and 200 tokens generating past
every window and block boundary); and the teacher-forced INT8/FP8 checks on the default model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_kvcache.layer as layer_module
from hf_kvcache import _compat, make_cache
from tests.helpers import teacher_forced
from tests.helpers.checks import assert_cache_finite
from tests.helpers.lossless import LAYOUTS, LosslessCache
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import (
    SLIDING_CONFIGS,
    TINY_CONFIGS,
    cache_of,
    left_padded_batch,
    tiny_input_ids,
    tiny_model,
)

IDS = [m[0] for m in METHODS]
ATTN = ["sdpa", "hf_kvcache"]  # dense read path, and the handle path (the fused attention's reference on CPU)
# Sliding(16) / full / sliding layers: windows, trims and crops on both kinds of layer in one model.
FEATURE_MODEL = "gemma"


# Every method on every config; the smoke suite (also run on the oldest supported transformers) takes the hard
# overrides, which put tokens in every place, on the configs with sliding-window layers.
GENERATE_CASES = [
    pytest.param(
        spec, easy, hard, name, variant, id=f"{spec}-{name}-{variant}",
        marks=pytest.mark.smoke if variant == "hard" and name in SLIDING_CONFIGS else (),
    )
    for spec, easy, hard in METHODS
    for name in sorted(TINY_CONFIGS)
    for variant in ("easy", "hard")
]


@pytest.mark.parametrize("spec,easy,hard,name,variant", GENERATE_CASES)
def test_generate_modes(spec, easy, hard, name, variant):
    model = tiny_model(name)
    ids, mask = left_padded_batch(model, lengths=(23, 7))
    kwargs = easy if variant == "easy" else hard
    runs = {
        "greedy": dict(do_sample=False),
        "sample": dict(do_sample=True, top_k=20),
        "beam": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    }
    for mode, extra in runs.items():
        torch.manual_seed(0)
        cache = make_cache(spec, model, **kwargs)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=20, return_dict_in_generate=True, **extra,
            **_compat.cache_kwargs(cache),
        )
        rows = 2 * extra.get("num_return_sequences", 1)
        assert out.sequences.shape == (rows, 23 + 20), mode
        held = cache_of(out)
        assert held is cache
        assert cache.get_seq_length() == 23 + 20 - 1, mode  # the last token is never fed back
        assert_cache_finite(cache)


def _greedy(model, ids, cache, max_new_tokens, attention_mask=None, **kwargs):
    return model.generate(
        ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False, **kwargs,
        **_compat.cache_kwargs(cache),
    )


def _record_crops(cache) -> list[int]:
    """Wrap `cache.crop` to record how many tokens each call removed (after each verified draft transformers
    passes `-rejected`: an int on 5.24, a 0-dim tensor on 5.17)."""
    calls, crop = [], cache.crop

    def recording(tokens_to_remove):
        before = cache.get_seq_length()
        crop(tokens_to_remove)
        calls.append(before - cache.get_seq_length())

    cache.crop = recording
    return calls


def _repeating_prompt(model) -> torch.Tensor:
    """`(1, 40)`: 8 random tokens 5 times, so prompt lookup finds n-gram matches and drafts from them."""
    return tiny_input_ids(model, batch=1, length=8, seed=1).repeat(1, 5)


@pytest.mark.smoke
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_prompt_lookup_crops_rejected_drafts(spec, easy, hard, attn):
    """Assisted generation (prompt lookup) verifies drafts in one forward and crops the rejected ones: the cache
    ends holding exactly the sequence, finite. Greedy equality with plain decoding is the lossless test's job
    (`test_prompt_lookup_lossless_equals_plain_greedy`): a quantized cache attends differently to drafts verified
    in a chunk than to tokens decoded one by one."""
    model = tiny_model(FEATURE_MODEL, attn_implementation=attn)
    prompt = _repeating_prompt(model)
    cache = make_cache(spec, model, **easy)
    crops = _record_crops(cache)
    out = _greedy(model, prompt, cache, 16, prompt_lookup_num_tokens=4)
    assert out.shape == (1, 40 + 16)
    assert any(n > 0 for n in crops), f"no draft was rejected, crop never removed anything: {crops}"
    assert cache.get_seq_length() == 40 + 16 - 1
    for layer in cache.layers:  # every token is held, or let go by a sliding window
        assert layer.first_position + layer.held_tokens == 55
        assert layer.is_sliding or layer.held_tokens == 55
    assert_cache_finite(cache)


@pytest.mark.smoke  # how `generate` calls `crop` after a draft differs between transformers versions
@pytest.mark.parametrize("attn", ATTN)
def test_prompt_lookup_lossless_equals_plain_greedy(attn):
    """Through the same core with a lossless codec, assisted generation (drafts verified, rejected ones cropped out
    of sinks, blocks and residuals, and `crop(0)` after fully accepted drafts) is exactly plain greedy decoding."""
    model = tiny_model(FEATURE_MODEL, attn_implementation=attn)
    prompt = _repeating_prompt(model)
    want = _greedy(model, prompt, DynamicCache(config=model.config), 24)
    cache = LosslessCache(model.config, **LAYOUTS["kivi-like"])
    crops = _record_crops(cache)
    got = _greedy(model, prompt, cache, 24, prompt_lookup_num_tokens=4)
    assert any(n > 0 for n in crops) and 0 in crops, crops
    assert torch.equal(got, want)


@pytest.mark.smoke
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_reset_reuse_and_continuation_equal_one_fresh_generate(spec, easy, hard, attn):
    """A cache used once, `reset()`, then filled by a `generate` of 8 tokens that a second `generate` continues
    for 8 more (the whole sequence so far as input, the same cache, a left-padded batch) gives exactly the
    tokens of one greedy `generate` of 16 through a fresh cache: reset forgets everything (codec state, padding,
    places), and a continuing generate feeds only the one token the cache has not seen."""
    model = tiny_model(FEATURE_MODEL, attn_implementation=attn)
    ids, mask = left_padded_batch(model, lengths=(30, 9), seed=3)
    other, other_mask = left_padded_batch(model, lengths=(12, 20), seed=4)
    want = _greedy(model, ids, make_cache(spec, model, **easy), 16, attention_mask=mask)

    cache = make_cache(spec, model, **easy)
    _greedy(model, other, cache, 5, attention_mask=other_mask)
    assert_cache_finite(cache)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0
    part = _greedy(model, ids, cache, 8, attention_mask=mask)
    assert torch.equal(part, want[:, : 30 + 8]), "a reset cache differs from a fresh one"
    assert_cache_finite(cache)
    mask = torch.cat([mask, torch.ones_like(mask[:, :8])], 1)
    full = _greedy(model, part, cache, 8, attention_mask=mask)
    assert torch.equal(full, want), "the continued generate differs from one generate of the combined length"
    assert cache.get_seq_length() == 30 + 16 - 1
    assert_cache_finite(cache)


@pytest.mark.smoke  # `prefill_chunk_size` is transformers' own loop, which moved between versions
@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_prefill_chunking_feeds_the_cache_as_a_manual_chunked_prefill(spec, easy, hard, attn):
    """`generate(..., prefill_chunk_size=8)` over a left-padded prompt of 25 tokens (a first chunk of nothing but
    padding for the short row) gives the tokens of the same chunks fed by hand (8, 8, 8; mask and positions as
    `generate` builds them), then a `generate` that continues from the last prompt token: the cache sees the same
    updates, and what a chunk attends to (its own tokens exact, the earlier chunks as stored) is the same."""
    model = tiny_model(FEATURE_MODEL, attn_implementation=attn)
    ids, mask = left_padded_batch(model, lengths=(25, 9), seed=5)
    want = _greedy(model, ids, make_cache(spec, model, **hard), 8, attention_mask=mask, prefill_chunk_size=8)
    cache = make_cache(spec, model, **hard)
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    with torch.no_grad():
        for lo in range(0, 24, 8):
            model(ids[:, lo : lo + 8], attention_mask=mask[:, : lo + 8], position_ids=positions[:, lo : lo + 8],
                  use_cache=True, **_compat.cache_kwargs(cache))
    assert cache.get_seq_length() == 24
    got = _greedy(model, ids, cache, 8, attention_mask=mask)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 25 + 8 - 1
    assert_cache_finite(cache)


@pytest.mark.parametrize("attn", ATTN)
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=IDS)
def test_rows_of_1_and_200_tokens_generate_past_every_boundary(spec, easy, hard, attn, monkeypatch):
    """Left padding of 199 tokens next to a full row, 64 new tokens with each preset: KIVI's 128-token window
    flushes in the prefill and again at 256 during decoding, FIFO residuals flush every step, and the sliding
    layers (window 16, the rollback margin cut to 8 so that they trim every 8 tokens) trim many times; every
    place stays finite and holds what it should."""
    monkeypatch.setattr(layer_module, "_SLIDING_CROP_MARGIN", 8)
    model = tiny_model(FEATURE_MODEL, attn_implementation=attn)
    ids, mask = left_padded_batch(model, lengths=(1, 200), seed=5)
    cache = make_cache(spec, model)  # the preset: KIVI's window of 128 tokens and groups of 32
    out = _greedy(model, ids, cache, 64, attention_mask=mask)
    assert out.shape == (2, 264)
    assert cache.get_seq_length() == 263
    for layer in cache.layers:
        if layer.is_sliding:
            assert layer.sliding_window - 1 <= layer.held_tokens <= layer.sliding_window - 1 + 2 * 8
            assert layer.first_position + layer.held_tokens == 263
        else:
            assert layer.held_tokens == 263
    if spec.startswith("kivi"):
        full = next(layer for layer in cache.layers if not layer.is_sliding)
        assert full.key_stream.split(full.held_tokens)[1] == 256  # the 128-token window flushed twice
    assert_cache_finite(cache)


# Teacher-forced loss of DynamicCache's own greedy continuation through each cache, relative to DynamicCache's
# (tests/helpers/teacher_forced.py). One row's delta moves by up to +-2% between configurations that differ by
# nothing that matters, so the loss is pooled over 24 prompts x 256 tokens. Measured in float32 on the CPU with
# `python -m tests.helpers.teacher_forced int8 fp8-e4m3 ...`: DynamicCache 0.3633; int8 +0.13%; fp8-e4m3 +0.77%
# (per-row mean +1.16%, standard error 0.46%). Not asserted: fp8-e5m2 (2 mantissa bits) +4.61%. On the first 4
# prompts alone fp8-e4m3 measured +1.18%, and ablations there (sinks, headroom 4 or 8, calibrated scales) looked
# better than the preset; over the 24 they are not: sink_tokens=1 +0.77%, sink_tokens=4 +0.75%, headroom=4
# +0.81%, headroom=8 +0.88%, scale=calibrated +1.32%.
TEACHER_FORCED_BOUNDS = {"int8": 0.005, "fp8-e4m3": 0.01}


@pytest.mark.slow
def test_teacher_forced_loss_of_dynamic_cache_continuation(default_model):
    """DynamicCache's own greedy continuation (256 tokens from 24 prompts in a left-padded batch), fed back token
    by token through INT8 and FP8 caches: the teacher-forced loss stays within `TEACHER_FORCED_BOUNDS` of
    DynamicCache's, and the caches stay finite."""
    model, tok = default_model
    cont = teacher_forced.greedy_continuation(model, tok, teacher_forced.default_prompts(), 256)
    losses = {"none": teacher_forced.loss(cont.logits, cont.targets)}
    for spec in TEACHER_FORCED_BOUNDS:
        cache = make_cache(spec, model)
        losses[spec] = teacher_forced.loss(teacher_forced.teacher_forced_logits(model, cont, cache), cont.targets)
        assert_cache_finite(cache)
    deltas = {spec: losses[spec] / losses["none"] - 1 for spec in TEACHER_FORCED_BOUNDS}
    report = ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
    print(f"teacher-forced losses: {report}")
    for spec, bound in TEACHER_FORCED_BOUNDS.items():
        assert abs(deltas[spec]) <= bound, f"{spec}: {deltas[spec]:+.2%} (bound {bound:.1%}); losses {report}"


@pytest.mark.slow
def test_kivi_generates_past_its_window_on_the_default_model(default_model):
    """KIVI on the real model, with a left-padded batch, 160 new tokens (the 128-token window flushes): the
    continuation stays close to DynamicCache's (teacher-forced loss within 1% at 4 bits, 5% at 2) and finite."""
    model, tok = default_model
    cont = teacher_forced.greedy_continuation(model, tok, ["Once upon a time, in a land far away,", "The"], 160)
    losses = {"none": teacher_forced.loss(cont.logits, cont.targets)}
    for spec in ("kivi-4", "kivi-2"):
        cache = make_cache(spec, model)
        losses[spec] = teacher_forced.loss(teacher_forced.teacher_forced_logits(model, cont, cache), cont.targets)
        assert_cache_finite(cache)
        layer = cache.layers[0]
        assert layer.key_stream.split(layer.held_tokens)[1] >= 128  # the window flushed at least once
    print(f"teacher-forced losses: {losses}")
    # Measured: none 0.512, kivi-4 0.512, kivi-2 (the preset) 0.516.
    assert losses["kivi-4"] <= losses["none"] * 1.01, losses
    assert losses["kivi-2"] <= losses["none"] * 1.05, losses
