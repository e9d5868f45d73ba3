"""Generated retrieval tasks: prompts (length, needles, the same for every cache), scoring, intervals, and the grid's
batched `generate` through a fresh cache a batch, on the byte-level tokenizer and a tiny random model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvcache import make_cache
from hf_kvcache.eval import retrieval
from hf_kvcache.eval.retrieval import TASKS, make_sample, retrieval_grid, score, wilson_interval
from tests.eval.test_passkey import LONGEST_FILLER, byte_tokenizer
from tests.helpers.tiny_models import tiny_model


@pytest.fixture(scope="module")
def tokenizer():
    return byte_tokenizer()


@pytest.mark.parametrize("task", TASKS)
def test_samples_hold_their_needles_at_about_the_length(tokenizer, task):
    sample = make_sample(tokenizer, task, 1500, seed=3)
    text = tokenizer.decode(sample.input_ids)
    assert abs(sample.length - 1500) <= LONGEST_FILLER
    assert all(answer in text for answer in sample.answers)
    assert list(sample.depths) == sorted(sample.depths) and all(0 <= d <= 1 for d in sample.depths)
    assert text.endswith(" is") or text.endswith(" are")  # the answer starts right after the prompt
    again, other = make_sample(tokenizer, task, 1500, seed=3), make_sample(tokenizer, task, 1500, seed=4)
    assert torch.equal(again.input_ids, sample.input_ids) and again.answers == sample.answers
    assert other.answers != sample.answers
    with pytest.raises(ValueError, match="unknown retrieval task"):
        make_sample(tokenizer, "needle", 1500, seed=0)


def test_scores_and_intervals(tokenizer):
    one = make_sample(tokenizer, "multikey", 600, seed=0)
    (value,) = one.answers
    assert score(one, f" {value}.") == 1.0 and score(one, f" {value}1.") == 0.0 and score(one, "no idea") == 0.0
    many = make_sample(tokenizer, "multivalue", 600, seed=0)
    assert score(many, " and ".join(many.answers[:2])) == pytest.approx(2 / len(many.answers))
    low, high = wilson_interval(50, 50)
    assert high == 1.0 and low == pytest.approx(0.9287, abs=1e-3)
    low, high = wilson_interval(25, 50)
    assert low == pytest.approx(0.3664, abs=1e-3) and high == pytest.approx(0.6336, abs=1e-3)


def test_grid_generates_through_a_fresh_cache_a_batch(tokenizer, monkeypatch):
    model = tiny_model("llama")
    built = []

    def factory():
        built.append(make_cache("int4-g32", model))
        return built[-1]

    out = retrieval_grid(model, tokenizer, factory, tasks=("multikey", "vartrack"), lengths=(300,), samples=3,
                         batch_size=2, max_new_tokens=4, progress=False)
    assert len(built) == 2 * 2  # two tasks, batches of 2 and 1
    assert [c["task"] for c in out["cells"]] == ["multikey", "vartrack"]
    for cell in out["cells"]:
        assert cell["n"] == 3 and len(cell["answers"]) == 3 and 0 <= cell["low"] <= cell["accuracy"] <= cell["high"]
    assert all(layer.get_seq_length() > 300 for layer in built[0].layers)  # the prompt went through the cache
    # a model that answers right scores 1 (every answer found), whatever the batch
    monkeypatch.setattr(retrieval, "_generate", lambda m, t, c, samples, n: [" ".join(s.answers) for s in samples])
    perfect = retrieval_grid(model, tokenizer, lambda: DynamicCache(config=model.config), lengths=(300,), samples=4,
                             batch_size=3, progress=False)
    assert perfect["accuracy"] == 1.0
