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
        assert all(layer.fused for layer in layers) and all(layer.graph.captured for layer in layers)
    assert torch.equal(outs[0], outs[1])


_WARM_UP_SCRIPT = """
import json, sys
import torch
from triton.runtime.jit import JITFunction
from hf_kvcache import _compat, make_cache, warm_up
from tests.helpers.tiny_models import left_padded_batch, tiny_model

run, grew = JITFunction.run, []

def counting(self, *args, grid, warmup, **kwargs):
    cache = self.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    out = run(self, *args, grid=grid, warmup=warmup, **kwargs)
    grew.extend([self.fn.__name__] * (len(cache) - before))
    return out

model = tiny_model("llama", attn_implementation="sdpa").to("cuda", torch.bfloat16)
ids, mask = left_padded_batch(model, lengths=(60, 21))
ids, mask = ids.cuda(), mask.cuda()
found = {}
for spec in sys.argv[1:]:
    summary = warm_up(model, spec, batch_size=2, prefill_chunk_size=16)
    tokens = []
    for counted in (True, False):  # the first call after the warm-up, then a second for its tokens
        JITFunction.run = counting if counted else run
        cache = make_cache(spec, model)
        tokens.append(model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                     prefill_chunk_size=16, **_compat.cache_kwargs(cache)).tolist())
        turn = torch.full((2, 7), 5, device="cuda")
        held = int(cache.get_seq_length())
        more = torch.ones((2, held - mask.shape[1] + 7), dtype=mask.dtype, device="cuda")
        model(input_ids=turn, attention_mask=torch.cat([mask, more], 1), use_cache=True,
              **_compat.cache_kwargs(cache))
    JITFunction.run = run
    found[spec] = dict(warm=summary["kernels"], compiled_after=list(grew), same=tokens[0] == tokens[1])
    grew.clear()
print(json.dumps(found))
"""


def test_warm_up_leaves_nothing_for_the_first_call_to_compile():
    """On an empty Triton cache (a fresh process), `hf_kvcache.warm_up(model, spec, ...)` compiles what a first
    `generate` of a left-padded batch in chunks (and a next turn) launches: that call compiles no kernel, and its
    tokens are a second call's."""
    import json
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    specs = ["fp8-e4m3", "int4-g32", "kivi-2", "turboquant-3"]
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-c", _WARM_UP_SCRIPT, *specs], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_CACHE_DIR": tmp})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    for spec in specs:
        assert found[spec]["warm"] > 0 and found[spec]["same"], (spec, found[spec])
        assert found[spec]["compiled_after"] == [], (spec, found[spec])
