"""The lm-eval integration: the `hf-kvcache` model type reads its cache in loglikelihood and generation tasks,
the offline tasks build without a network, and `hf-kvcache lm-eval` runs lm-eval's command line."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from hf_kvcache.eval.lm_eval import register, tasks_dir  # noqa: E402
from tests.eval.test_passkey import byte_tokenizer  # noqa: E402
from tests.helpers.checks import deprecations_are_errors  # noqa: E402
from tests.helpers.tiny_models import tiny_input_ids, tiny_model  # noqa: E402


def _lm(kv_cache: str):
    cls = register()
    return cls(pretrained=tiny_model("llama"), tokenizer=byte_tokenizer(), kv_cache=kv_cache, batch_size=2)


def test_register_is_idempotent_and_named():
    from lm_eval.api.registry import get_model

    assert register() is register() is get_model("hf-kvcache")


def test_loglikelihood_prefills_the_context_then_decodes_the_continuation():
    """kv_cache=none: the decode protocol gives a single forward's log-likelihood; int2: the continuation attends to
    the quantized context and it moves. One prefill of the context, then one forward per continuation token."""
    ids = tiny_input_ids(tiny_model("llama"), batch=1, length=60)[0].tolist()
    context, continuation = ids[:48], ids[48:]
    plain = _lm("none")
    with torch.no_grad():
        logp = torch.log_softmax(plain.model(torch.tensor([ids])).logits[0].float(), -1)
    want = logp[47:59].gather(1, torch.tensor(continuation)[:, None]).sum().item()
    ((ll, greedy),) = plain._loglikelihood_tokens([(("c", "x"), context, continuation)])
    assert ll == pytest.approx(want, abs=1e-3) and greedy is bool((logp[47:59].argmax(-1) == torch.tensor(continuation)).all())
    int2 = _lm("int2-g32")
    calls = []
    int2.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                         with_kwargs=True)
    ((ll2, _),) = int2._loglikelihood_tokens([(("c", "x"), context, continuation)])
    assert abs(ll2 - want) > 1e-3 and calls == [48] + [1] * 11
    with pytest.raises(ValueError, match="chunk="):
        register()(pretrained=tiny_model("llama"), tokenizer=byte_tokenizer(), kv_cache="none", chunk=64)


def test_a_spec_with_overrides_and_a_bad_spec():
    lm = _lm("int4-g32:sink_tokens=4;residual_length=8")
    layer = lm._new_cache().layers[0]
    assert layer.key_stream.sink_tokens == 4 and layer.key_stream.residual_length == 8
    with pytest.raises(ValueError, match="unknown cache spec"):
        _lm("int5")


def test_requests_call_transformers_without_a_deprecated_argument():
    """A generation request (`generate`, left-padded by lm-eval) and a loglikelihood request (forwards through the
    cache) with every FutureWarning and DeprecationWarning an error: the cache goes by the name the installed
    transformers takes (`hf_kvcache._compat.cache_kwargs`)."""
    lm = _lm("int2-g32")
    ids = tiny_input_ids(lm.model, batch=2, length=24)
    with deprecations_are_errors():
        out = lm._model_generate(ids, max_length=24 + 4, stop=["</s>"])
        lm._loglikelihood_tokens([(("c", "x"), ids[0, :20].tolist(), ids[0, 20:].tolist())])
    assert out.shape == (2, 24 + 4)


@pytest.mark.parametrize("kv_cache", ["none", "int2-g32"])
def test_offline_tasks_run_through_simple_evaluate(kv_cache):
    """The offline tasks, from the package's task folder, no network: a perplexity task (loglikelihood rolling),
    multiple choice (loglikelihood) and passkey retrieval (generation, left-padded batches)."""
    tok = byte_tokenizer()
    grid = {"n_docs": 2, "min_chars": 300, "lengths": [120, 200], "depths": [0.5], "tokenizer": tok}
    out = simple_evaluate(
        model=_lm(kv_cache), tasks=["hf_kvcache_ppl", "hf_kvcache_passkey", "hf_kvcache_topics"],
        task_manager=TaskManager(include_path=str(tasks_dir()), include_defaults=False, metadata=grid),
    )
    ppl = out["results"]["hf_kvcache_ppl"]
    assert ppl["word_perplexity,none"] > 1 and 0 < ppl["bits_per_byte,none"]
    assert 0 <= out["results"]["hf_kvcache_passkey"]["acc,none"] <= 1
    assert len(out["samples"]["hf_kvcache_passkey"]) == 2
    assert 0 <= out["results"]["hf_kvcache_topics"]["acc,none"] <= 1 and len(out["samples"]["hf_kvcache_topics"]) == 2


@pytest.mark.slow
def test_hf_kvcache_lm_eval_runs_lm_evals_command_line(capsys):
    """`hf-kvcache lm-eval ...` on the default model: the model type is found, the offline task folder added."""
    from hf_kvcache.cli import main

    status = main(["lm-eval", "--model", "hf-kvcache", "--model_args", "kv_cache=int4-g32", "--tasks",
                   "hf_kvcache_passkey", "--metadata", '{"lengths": [256], "depths": [0.5]}', "--device", "cpu"])
    assert status == 0
    out = capsys.readouterr().out
    assert "hf_kvcache_passkey" in out and "kv_cache" in out
