"""The decode, strict and streaming protocols on a tiny random model: the scoring bookkeeping against one full
forward, the comparison with a baseline (KL, top-1, intervals), and the protocols' meaning (which tokens see stored
K/V)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from hf_kvcache.eval.perplexity import (
    _t_quantile,
    decode_perplexity,
    paired_interval,
    strict_perplexity,
    streaming_perplexity,
    window_starts,
)
from tests.helpers.tiny_models import FIRST_TOKEN_ID, VOCAB_SIZE, tiny_model

pytestmark = pytest.mark.smoke  # feeding a cache in steps, and a DynamicCache subclass's update()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def corpus():
    g = torch.Generator().manual_seed(1)
    return torch.randint(FIRST_TOKEN_ID, VOCAB_SIZE, (700,), generator=g)  # (N,)


class NoisyPastCache(DynamicCache):
    """A DynamicCache whose reads of past tokens carry noise: what a (bad) quantized cache looks like to
    the tokens that attend to stored K/V. The tokens of the current forward are returned exactly."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)  # (B, H, S, D)
        past = keys.shape[-2] - key_states.shape[-2]
        if past == 0:
            return keys, values
        g = torch.Generator().manual_seed(layer_idx + 7 * past)
        noise = torch.randn(keys[..., :past, :].shape, generator=g)
        keys, values = keys.clone(), values.clone()
        keys[..., :past, :] += 0.5 * noise * keys[..., :past, :].std()
        values[..., :past, :] += 0.5 * noise.flip(-1) * values[..., :past, :].std()
        return keys, values


def reference_nll(model, corpus, *, context, windows, skip):
    """Mean NLL from one full forward per window (no cache), scoring targets at positions >= max(skip, 1)."""
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in window_starts(corpus.numel(), context, windows):
            window = corpus[start : start + context]
            logp = F.log_softmax(model(window[None]).logits[0].float(), dim=-1)  # (context, V)
            first = max(skip, 1)
            targets = window[first:]
            total -= logp[first - 1 : context - 1].gather(1, targets[:, None]).sum().item()
            count += targets.numel()
    return total / count, count


def factory(model, cls=DynamicCache):
    return lambda: cls(config=model.config)


@pytest.mark.parametrize(
    ("context", "chunk", "windows", "skip"),
    [(96, 20, 3, 17), (64, 64, 2, 0), (50, 7, 2, 1), (40, 1, 1, 39)],
)
def test_streaming_matches_one_full_forward(model, corpus, context, chunk, windows, skip):
    # Chunk boundaries not aligned with skip or context: the last logit of each chunk must score the
    # first token of the next one, and unscored chunks must not leak into the count.
    result = streaming_perplexity(
        model,
        corpus,
        factory(model),
        context=context,
        chunk=chunk,
        windows=windows,
        skip=skip,
        progress=False,
    )
    nll, count = reference_nll(model, corpus, context=context, windows=windows, skip=skip)
    assert result["tokens"] == count == windows * (context - max(skip, 1))
    assert result["nll"] == pytest.approx(nll, rel=1e-4), (result["nll"], nll)
    assert result["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    assert len(result["windows"]) == windows
    assert all(w["cache_tokens"] == context for w in result["windows"])


def test_strict_with_dynamic_cache_equals_streaming(model, corpus):
    kwargs = {"context": 96, "windows": 3, "skip": 16, "progress": False}
    stream = streaming_perplexity(model, corpus, factory(model), chunk=32, **kwargs)
    strict = strict_perplexity(model, corpus, factory(model), **kwargs)
    assert strict["tokens"] == stream["tokens"]
    assert strict["nll"] == pytest.approx(stream["nll"], rel=1e-4)
    assert strict["quantize_before_attention"] is False  # a DynamicCache has no such switch


def test_noisy_past_changes_streaming_but_not_a_single_forward(model, corpus):
    kwargs = {"context": 96, "windows": 2, "skip": 16, "progress": False}
    clean = streaming_perplexity(model, corpus, factory(model), chunk=16, **kwargs)
    noisy = streaming_perplexity(model, corpus, factory(model, NoisyPastCache), chunk=16, **kwargs)
    assert abs(noisy["nll"] - clean["nll"]) > 1e-3, (noisy["nll"], clean["nll"])
    # One forward never reads stored K/V: the strict protocol needs `quantize_before_attention` to see
    # quantization, and a cache without it measures the baseline.
    strict = strict_perplexity(model, corpus, factory(model, NoisyPastCache), **kwargs)
    assert strict["nll"] == pytest.approx(clean["nll"], rel=1e-4)


def test_strict_sets_quantize_before_attention(model, corpus):
    seen = []

    class Switchable(DynamicCache):
        quantize_before_attention = False

        def update(self, *args, **kwargs):
            seen.append(self.quantize_before_attention)
            return super().update(*args, **kwargs)

    result = strict_perplexity(
        model, corpus, factory(model, Switchable), context=32, windows=1, skip=4, progress=False
    )
    assert result["quantize_before_attention"] is True
    assert seen and all(seen)


def test_window_starts_are_deterministic_and_spread():
    assert window_starts(1000, 100, 4) == [0, 300, 600, 900]
    assert window_starts(100, 100, 3) == [0, 0, 0]
    assert window_starts(5000, 1024, 1) == [0]
    with pytest.raises(ValueError, match="fewer than one window"):
        window_starts(99, 100, 1)


def test_decode_with_dynamic_cache_equals_one_full_forward(model, corpus):
    """Teacher forcing through an exact cache is one forward: step t's logit (fed token P + t) scores token P + t + 1,
    batch by batch, and against itself the baseline has KL 0, top-1 1 and a zero interval."""
    kwargs = {"prefill": 40, "decode": 9, "windows": 5, "progress": False}
    result = decode_perplexity(model, corpus, factory(model), batch_size=2, keep_logprobs=True, **kwargs)
    total, count = 0.0, 0
    with torch.inference_mode():
        for start in result["starts"]:
            window = corpus[start : start + 50]  # P + T + 1
            logp = F.log_softmax(model(window[None]).logits[0].float(), dim=-1)
            total -= logp[40:49].gather(1, window[41:50, None]).sum().item()
            count += 9
    assert result["tokens"] == count and result["protocol"] == "decode"
    assert result["nll"] == pytest.approx(total / count, rel=1e-4)
    assert result["logprobs"].shape == (5, 9, VOCAB_SIZE)
    assert result["windows"][0]["cache_tokens"] == 49 and result["cache_rows"] == 1  # the last batch: 5 = 2 + 2 + 1
    same = decode_perplexity(model, corpus, factory(model), reference=result, **kwargs)
    # (batches of 2 against one of 5: the same windows, summed in other orders)
    assert same["delta_nll_pct"] == pytest.approx(0.0, abs=1e-4) and same["kl"] == pytest.approx(0.0, abs=1e-5)
    assert same["top1"] == 1.0 and same["delta_interval"]["half_width"] == pytest.approx(0.0, abs=1e-4)


def test_decode_sees_a_noisy_past_and_says_how_much(model, corpus):
    kwargs = {"prefill": 30, "decode": 8, "windows": 4, "progress": False}
    base = decode_perplexity(model, corpus, factory(model), keep_logprobs=True, **kwargs)
    noisy = decode_perplexity(model, corpus, factory(model, NoisyPastCache), reference=base, **kwargs)
    assert noisy["kl"] > 1e-4 and noisy["top1"] < 1.0
    interval = noisy["delta_interval"]
    assert interval["n"] == 4 and interval["low"] < noisy["delta_nll_pct"] < interval["high"]
    assert noisy["delta_nll_pct"] == pytest.approx(interval["mean"], rel=1e-6)  # equal windows: the same mean
    with pytest.raises(ValueError, match="other windows"):
        decode_perplexity(model, corpus, factory(model), reference=base, **{**kwargs, "windows": 3})


def test_paired_interval_is_students_t():
    assert _t_quantile(9) == pytest.approx(2.2622, abs=2e-3) and _t_quantile(5) == pytest.approx(2.5706, rel=2e-3)
    assert _t_quantile(30) == pytest.approx(2.0423, abs=1e-3)
    got = paired_interval([1.0, 2.0, 3.0], scale=10.0)
    assert got["mean"] == pytest.approx(20.0) and got["half_width"] == pytest.approx(10 * 4.3027 / math.sqrt(3))
    assert paired_interval([5.0])["half_width"] is None
