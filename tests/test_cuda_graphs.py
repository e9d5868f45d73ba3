"""Eager decode steps replayed from CUDA graphs (`QuantizedKVLayer.replay`, `hf_kvcache.graphs`), on CUDA: the same
greedy tokens as the same kernels launched one by one and as the PyTorch reference, on every tiny config, through
growth, sliding windows, left padding, beam search, crops and reset. Float32, where the kernels' products are exact
fp32 like the reference's. Skipped without CUDA; run on the GPU host with `python3 -m pytest tests/test_cuda_graphs.py`."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat, kernels, make_cache
from tests.helpers.methods import METHODS, TURBOQUANT_KERNEL
from tests.helpers.tiny_models import TINY_CONFIGS, left_padded_batch, tiny_model

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# QJL keys (the TurboQuant row of METHODS) have no kernel: the kernel row of TurboQuant instead
GRAPH_METHODS = [m for m in METHODS if m[0] != "turboquant-3.5"] + [TURBOQUANT_KERNEL]


def _generate(model, ids, mask, cache, n, **kwargs):
    return model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          **kwargs, **_compat.cache_kwargs(cache))


def _replays(cache) -> int:
    """Graphs captured over the cache's layers (each replayed from then on)."""
    return sum(len(layer.graph.captured) for layer in cache.layers)


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("spec,easy,hard", GRAPH_METHODS, ids=[m[0] for m in GRAPH_METHODS])
def test_graphed_steps_give_the_reference_tokens(spec, easy, hard, name, monkeypatch):
    """Every place in use (the hard overrides), a left-padded batch, 160 tokens from a short prompt (the capacity grows
    several times, KIVI's window flushes, sliding layers let tokens go): the graphed steps give the kernels' tokens
    launched one by one, bit for bit, and the PyTorch reference's for the first 16. Further on the kernels' and the
    reference's summation orders part near-tied tokens of low-bit caches (int2-g32, kvquant-3 and rotated-4 parted
    after 23-125 tokens on the H200, 2026-12-02): a last-bit difference in a new token's K/V becomes another code."""
    model = tiny_model(name, "hf_kvcache").to("cuda")
    ids, mask = left_padded_batch(model, lengths=(20, 7))
    ids, mask = ids.cuda(), mask.cuda()
    cache = make_cache(spec, model, **hard)
    graphed = _generate(model, ids, mask, cache, 160)
    views = cache.layers[0].reads.kernel_views()
    query = torch.empty(1, 1, 1, model.model.layers[0].self_attn.head_dim, device="cuda")
    if None not in views and kernels.ops.supports(*views, query, static=True) is None:  # a layout the kernels read
        assert _replays(cache) > 0, "no step was replayed"
    monkeypatch.setenv("HF_KVCACHE_CUDA_GRAPHS", "0")
    launched = _generate(model, ids, mask, make_cache(spec, model, **hard), 160)
    assert torch.equal(graphed, launched)
    with kernels.use_backend("torch"):
        reference = _generate(model, ids, mask, make_cache(spec, model, **hard), 16)
    parted = (graphed[:, : reference.shape[1]] != reference).nonzero()
    assert not parted.numel(), f"parted from the reference at position {parted[0].tolist()}"


@pytest.mark.parametrize("spec", ["fp8-e4m3", "int4-g32", "kivi-2", "turboquant-3"])
def test_beam_search_crops_and_reset_with_graphs(spec, monkeypatch):
    """Beam search's reorders (in place: the graphs stay), prompt lookup's crops, reset and reuse: the tokens of the
    kernels launched one by one."""
    model = tiny_model("llama", "hf_kvcache").to("cuda")
    prompt = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(1)).repeat(1, 5).cuda()
    runs = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("HF_KVCACHE_CUDA_GRAPHS", graphs)
        cache = make_cache(spec, model)
        beams = _generate(model, prompt, None, cache, 40, num_beams=3)
        cache = make_cache(spec, model)
        looked_up = _generate(model, prompt, None, cache, 40, prompt_lookup_num_tokens=4)
        cache.reset()
        again = _generate(model, prompt, None, cache, 40)
        runs[graphs] = beams, looked_up, again
    for a, b in zip(*runs.values()):
        assert torch.equal(a, b)


def test_bf16_default_model_shape_graphs_match_launches(monkeypatch):
    """The default model's shape in bf16 (random weights), 2 x 600 tokens then 64 decoded: the graphed steps equal the
    same kernels launched one by one, bit for bit (same launches, same inputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0,
                         tie_word_embeddings=True)
    config._attn_implementation = "hf_kvcache"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (2, 600), device="cuda")
    for spec in ("fp8-e4m3", "int8", "int4-g64", "kivi-4", "turboquant-4", "turboquant-2.5"):
        monkeypatch.setenv("HF_KVCACHE_CUDA_GRAPHS", "1")
        graphed = model(ids, **_compat.cache_kwargs(cache := make_cache(spec, model))).logits
        out_g = _generate(model, ids, torch.ones_like(ids), make_cache(spec, model), 64)
        monkeypatch.setenv("HF_KVCACHE_CUDA_GRAPHS", "0")
        out_l = _generate(model, ids, torch.ones_like(ids), make_cache(spec, model), 64)
        assert torch.isfinite(graphed).all() and cache.nbytes() > 0
        assert torch.equal(out_g, out_l), spec


@pytest.mark.parametrize("spec,easy,hard", GRAPH_METHODS, ids=[m[0] for m in GRAPH_METHODS])
def test_captured_steps_hold_no_more_than_their_outputs(spec, easy, hard):
    """What the cache's graphs keep allocated in their pool is their outputs. cuBLAS inside a captured step would keep
    its workspace there too (32 MiB on Hopper, one per capture stream, uncounted by the cache's bytes): TurboQuant's
    dense rotation did, 29.8 MB beyond the cache of the default model's shape at 8k (H100, 2026-12-06). cuBLAS's
    workspaces are dropped first, so that an earlier cache's on a recycled stream cannot hide one."""
    model = tiny_model("llama", "hf_kvcache").to("cuda")
    ids, mask = left_padded_batch(model, lengths=(20, 7))
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    cache = make_cache(spec, model, **hard)
    _generate(model, ids.cuda(), mask.cuda(), cache, 6)
    torch.cuda.synchronize()
    pooled = [b["size"] for s in torch.cuda.memory._snapshot()["segments"] if s.get("segment_pool_id", (0, 0)) != (0, 0)
              for b in s["blocks"] if b["state"] == "active_allocated"]
    assert _replays(cache) == 0 or sum(pooled) < 1 << 20, f"{len(pooled)} blocks, {sum(pooled)} bytes in graph pools"
