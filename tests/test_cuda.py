"""Every cache on CUDA in bfloat16: generate (beam search, left padding) on every tiny config, dense and fused
paths, storage on the GPU and finite. Skipped without CUDA; run on the GPU host with
`python3 -m pytest tests/test_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat, make_cache
from tests.helpers.methods import METHODS
from tests.helpers.tiny_models import TINY_CONFIGS, left_padded_batch, tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("attn", ["sdpa", "hf_kvcache"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("spec,easy,hard", METHODS, ids=[m[0] for m in METHODS])
def test_generate_on_cuda_bf16(spec, easy, hard, name, attn):
    model = tiny_model(name, attn_implementation=attn).to("cuda", torch.bfloat16)
    ids, mask = left_padded_batch(model, lengths=(40, 11))
    for kwargs in (easy, hard):
        cache = make_cache(spec, model, **kwargs)
        out = model.generate(
            ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=70, do_sample=False, num_beams=2,
            **_compat.cache_kwargs(cache),
        )
        assert out.shape == (2, 110)
        for layer in cache.layers:
            if getattr(layer, "held_tokens", 0):
                for stream in (layer.key_stream, layer.value_stream):
                    dense = stream.dense(torch.float32, layer.held_tokens)
                    assert dense.is_cuda and torch.isfinite(dense).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("spec", ["int4-g32", "turboquant-4", "kivi-2", "fp8-e4m3"])
def test_the_models_own_attention_reads_through_the_kernels(spec, attn):
    """A model loaded with its own attention and no attention argument: `generate` reads the packed cache through the
    kernels (handles, each layer's decode step replayed from its CUDA graph), the tokens those of
    `attn_implementation="hf_kvcache"`, a left-padded batch included."""
    own = tiny_model("llama", attn_implementation=attn).to("cuda", torch.bfloat16)
    ref = tiny_model("llama", attn_implementation="hf_kvcache").to("cuda", torch.bfloat16)
    ids, mask = left_padded_batch(own, lengths=(40, 11))
    outs = []
    for model in (own, ref):
        cache = make_cache(spec, model)
        outs.append(model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=30, do_sample=False,
                                   **_compat.cache_kwargs(cache)))
        layers = [layer for layer in cache.layers if hasattr(layer, "fused")]
        assert all(layer.fused for layer in layers) and all(layer._graphs for layer in layers)
    assert torch.equal(outs[0], outs[1])
