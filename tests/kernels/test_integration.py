"""The kernels inside generation: `attn_implementation="hf_kvcache"` with the Triton backend (the interpreter on
CPU, compiled on CUDA) against the dense path over the same caches."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat, kernels, make_cache
from tests.helpers.tiny_models import TINY_CONFIGS, left_padded_batch, tiny_model
from tests.kernels.test_decode import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)

CASES = [("int4-g32", {"residual_length": 8}), ("kivi-2", {"residual_length": 32}),
         ("turboquant-3", {})]  # TurboQuant's kernel: a per-sequence frame (the energy split), a sink
# The interpreter runs every program in Python (~20 s a generation): GQA with full attention, and a mix of
# sliding-window and full layers, cover the kernel's paths; the decode tests cover every format. On CUDA, all.
MODELS = sorted(TINY_CONFIGS) if DEVICE == "cuda" else ["llama", "gemma"]


@pytest.mark.parametrize("spec,kwargs", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("name", MODELS)
def test_greedy_generation_through_the_kernels_equals_the_dense_path(name, spec, kwargs):
    """Left-padded batch, past the KIVI window's first flush (32 tokens) and a sliding window (16): same tokens from
    both read paths."""
    outs = {}
    for attn, backend in (("sdpa", "torch"), ("hf_kvcache", "triton")):
        model = tiny_model(name, attn_implementation=attn).to(DEVICE)
        ids, mask = left_padded_batch(model, lengths=(30, 12))
        cache = make_cache(spec, model, **kwargs)
        with kernels.use_backend(backend):
            outs[attn] = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=16,
                                        do_sample=False, **_compat.cache_kwargs(cache))
    assert torch.equal(outs["sdpa"], outs["hf_kvcache"])


@pytest.mark.slow
# The session's default model lives on the CPU: this is the interpreter's check. On CUDA the default model runs
# through the kernels in the decode protocol (`hf-kvcache eval`), and tests/test_cuda.py covers every format.
@pytest.mark.skipif(not kernels.interpreting(), reason="the default model's fixtures are on the CPU: TRITON_INTERPRET=1")
def test_default_model_logits_through_the_kernels(default_model, default_model_fused):
    """The default model under KIVI-2 (per-channel keys, per-token values, residual window, sinks): a 4-token
    chunk over 200 stored tokens (chunked prefill, speculative verification), then a decode step; logits of the
    kernel path equal the dense path's. (The interpreter runs 30 layers of programs in Python: kept small.)"""
    spec = "kivi-2"
    ids = torch.randint(100, 4000, (1, 205), generator=torch.Generator().manual_seed(0))
    logits = {}
    for key, (model, _), backend in (("dense", default_model, "torch"), ("fused", default_model_fused, "triton")):
        cache = make_cache(spec, model)
        out = []
        with kernels.use_backend(backend), torch.no_grad():
            for lo, hi in ((0, 200), (200, 204), (204, 205)):
                out.append(model(ids[:, lo:hi], use_cache=True, **_compat.cache_kwargs(cache)).logits[:, -4:])
        logits[key] = torch.cat(out, 1)
    torch.testing.assert_close(logits["fused"], logits["dense"], atol=2e-3, rtol=2e-3)
