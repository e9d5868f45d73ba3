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
from tests.helpers.tiny_models import tiny_input_ids, tiny_model  # noqa: E402


def _lm(kv_cache: str, chunk: int = 16):
    cls = register()
    return cls(pretrained=tiny_model("llama"), tokenizer=byte_tokenizer(), kv_cache=kv_cache, chunk=chunk,
               batch_size=2)


def test_register_is_idempotent_and_named():
    from lm_eval.api.registry import get_model

    assert register() is register() is get_model("hf-kvcache")


def test_scoring_prefills_through_the_cache():
    """kv_cache=none: chunked prefill through a DynamicCache gives a single forward's logits; int2: the
    continuation attends to the quantized context, and the logits move."""
    ids = tiny_input_ids(tiny_model("llama"), batch=2, length=70)
    plain = _lm("none")
    with torch.no_grad():
        want = plain.model(ids).logits
    torch.testing.assert_close(plain._model_call(ids), want, atol=1e-4, rtol=1e-4)
    got = _lm("int2-g32")._model_call(ids)
    first = (got[:, :16] - want[:, :16]).abs().max().item()
    later = (got[:, 16:] - want[:, 16:]).abs().max().item()
    assert first < 1e-4 < later, f"first chunk {first:.2e} (reads no cache), later chunks {later:.2e}"


def test_a_spec_with_overrides_and_a_bad_spec():
    lm = _lm("int4-g32:sink_tokens=4;residual_length=8")
    layer = lm._new_cache().layers[0]
    assert layer.key_stream.sink_tokens == 4 and layer.key_stream.residual_length == 8
    with pytest.raises(ValueError, match="unknown cache spec"):
        _lm("int5")


@pytest.mark.parametrize("kv_cache", ["none", "int2-g32"])
def test_offline_tasks_run_through_simple_evaluate(kv_cache):
    """The offline tasks, from the package's task folder, no network: a perplexity task (loglikelihood rolling),
    multiple choice (loglikelihood) and passkey retrieval (generation, left-padded batches)."""
    tok = byte_tokenizer()
    grid = {"n_docs": 2, "min_chars": 300, "lengths": [120, 200], "depths": [0.5], "tokenizer": tok}
    out = simple_evaluate(
        model=_lm(kv_cache), tasks=["hf_kvcache_ppl", "hf_kvcache_passkey", "hf_kvcache_topics"],
        task_manager=TaskManager(include_path=str(tasks_dir()), metadata=grid),
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
