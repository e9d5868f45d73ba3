"""The cache argument's name (`hf_kvcache._compat`): the library's own calls never use a name the installed
transformers deprecates, and a cache works whichever name a user passes.

transformers 5.24 renamed `past_key_values` to `cache` in every model's `forward` (the old name warns with a
FutureWarning, removal announced for 5.40) and in `generate` (removal announced for 6.0); 5.17 knows only
`past_key_values`. The smoke suite runs these on both.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from hf_kvcache import _compat, make_cache
from tests.helpers.checks import assert_cache_finite, deprecations_are_errors
from tests.helpers.tiny_models import TINY_CONFIGS, cache_of, left_padded_batch, tiny_input_ids, tiny_model

OLD_NAME = "past_key_values"


def generate_cache_argument(model_class: type) -> str:
    """The name under which `generate` hands the cache to `prepare_inputs_for_generation`, which is the name
    `generate` itself takes (`cache` on 5.24+, `past_key_values` on 5.17)."""
    params = inspect.signature(model_class.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else OLD_NAME


@pytest.mark.smoke
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_one_name_serves_forward_and_generate(name):
    """`_compat.cache_kwargs` gives `forward`'s name for `model(...)` and `model.generate(...)` alike: the two
    agree on every supported transformers (if they ever part, `cache_kwargs` needs a generate variant)."""
    model_class = type(tiny_model(name))
    forward_name = _compat.forward_parameters(model_class)[0]
    assert generate_cache_argument(model_class) == forward_name
    assert _compat.cache_kwargs("c", tiny_model(name)) == {forward_name: "c"}
    assert _compat.CACHE_ARGUMENT == _compat.forward_parameters(type(tiny_model("llama")))[0]


@pytest.mark.smoke
def test_the_library_calls_transformers_without_a_deprecated_argument(tmp_path):
    """The library's entry points on tiny models with every FutureWarning and DeprecationWarning an error: the
    evaluation as the CLI runs it (decode, strict and stream perplexity, passkey, retrieval through `generate`),
    calibration's forwards, the caches that patch the model (KVQuant's pre-RoPE keys, the fused rotation),
    `load_model` of a local folder, the end-to-end benchmark's `generate`, and `generate` on every tiny config
    with the name `_compat.cache_kwargs` gives."""
    from hf_kvcache.bench import e2e_row
    from hf_kvcache.calibration.calibrate import collect
    from hf_kvcache.cli import run_eval
    from hf_kvcache.models import load_model
    from tests.eval.test_passkey import byte_tokenizer
    from tests.test_cli import tiny_config
    from tests.test_models import _tiny_llama

    llama, tokenizer = tiny_model("llama"), byte_tokenizer()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Some words of a small corpus. " * 40)
    cfg = tiny_config(methods=("int4-g32",), text=str(corpus), protocols=("decode", "strict", "stream"),
                      decode_tokens=4, retrieval=("multikey",), retrieval_lengths=(300,), retrieval_samples=1,
                      retrieval_batch=1)
    _tiny_llama(tmp_path / "local")
    with deprecations_are_errors():
        _, metrics = run_eval(cfg, out=str(tmp_path / "results"), model=llama, tokenizer=tokenizer)
        collect(llama, tiny_input_ids(llama, batch=1, length=32), chunk=16, max_samples=32, weighting="fisher",
                progress=False)
        local, local_tokenizer = load_model(tmp_path / "local")
        batch = local_tokenizer(["w1 w2 w3", "w4"], return_tensors="pt", padding=True)
        local.generate(**batch, max_new_tokens=3, do_sample=False, **_compat.cache_kwargs(make_cache("int8", local)))
        e2e_row(tiny_model("llama", "sdpa"), "int4-g32", tiny_input_ids(llama, batch=2, length=24), 3, False, None)
        runs = [(name, "kivi-2") for name in sorted(TINY_CONFIGS)] + [("llama", "kvquant-3"), ("llama", "rotated-4")]
        for name, spec in runs:
            model = tiny_model(name)
            ids, mask = left_padded_batch(model, lengths=(12, 5))
            cache = make_cache(spec, model)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 return_dict_in_generate=True, **_compat.cache_kwargs(cache, model))
            assert cache_of(out) is cache and cache.get_seq_length() == 12 + 4 - 1, (name, spec)
    assert [m["spec"] for m in metrics["methods"]] == ["none", "int4-g32"]
    assert all({"decode", "strict", "stream", "passkey", "retrieval"} <= set(m) for m in metrics["methods"])


def accepted_names(model) -> list[str]:
    """The cache arguments the installed transformers accepts: `past_key_values` always (deprecated where the
    model's forward takes `cache`), and `cache` where it does."""
    return sorted({OLD_NAME, _compat.forward_parameters(type(model))[0]})


@pytest.mark.smoke
@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
def test_a_cache_works_whichever_name_the_user_passes(attn):
    """`generate` and a forward through the cache, once per name the installed transformers accepts, give the
    same tokens and logits and fill the cache alike. The deprecated name is passed on purpose here: its warning
    is silenced, not flooded into the summary."""
    model = tiny_model("gemma", attn_implementation=attn)  # sliding and full layers
    ids, mask = left_padded_batch(model, lengths=(20, 9), seed=2)
    results = {}
    for name in accepted_names(model):
        with warnings.catch_warnings():
            if name != _compat.forward_parameters(type(model))[0]:
                warnings.filterwarnings("ignore", message=f".*{OLD_NAME}.*", category=FutureWarning)
            cache = make_cache("int4-g32", model, residual_length=4)
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **{name: cache})
            assert cache.get_seq_length() == 20 + 6 - 1, name
            assert_cache_finite(cache)
            forwarded = make_cache("int4-g32", model, residual_length=4)
            with torch.no_grad():
                model(ids, attention_mask=mask, use_cache=True, **{name: forwarded})
                logits = model(tokens[:, 20:21], use_cache=True, **{name: forwarded}).logits
            assert forwarded.get_seq_length() == 21, name
        results[name] = tokens, logits
    (first_tokens, first_logits), *others = results.values()
    for tokens, logits in others:
        assert torch.equal(tokens, first_tokens)
        torch.testing.assert_close(logits, first_logits, rtol=0, atol=0)
