"""The capacity part: the largest batch at a context that fits a fixed KV memory budget, from the bytes a real cache
allocates for one sequence, against a bf16 cache.
"""

from __future__ import annotations

import torch

from ._common import BenchConfig, _llama_config, _make_layer_cache


def capacity_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Bytes one sequence of `capacity_context` tokens takes in each cache (measured on one layer of the 8B
    shape, times 32 layers), and the largest batch that fits `capacity_budget_gb`."""
    layers = 32
    config = _llama_config(1)
    hkv, d, s = config.num_key_value_heads, config.head_dim, cfg.capacity_context
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    budget = cfg.capacity_budget_gb * 1e9
    bf16_seq = 2 * 2 * hkv * d * s * layers
    rows = [dict(method="bf16", seq_bytes=bf16_seq, batch=int(budget // bf16_seq), ratio=1.0)]
    for spec in cfg.methods:
        cache = _make_layer_cache(spec, config)
        cache.layers[0].update(k, v)
        seq = cache.layers[0].allocated_nbytes() * layers
        rows.append(dict(method=spec, seq_bytes=seq, batch=int(budget // seq), ratio=bf16_seq / seq))
        del cache
    for r in rows:
        log(f"{r['method']:>10}: {r['seq_bytes'] / 1e9:6.3f} GB per {s}-token sequence -> batch {r['batch']:4d} in "
            f"{cfg.capacity_budget_gb:.0f} GB ({r['ratio']:.2f}x the tokens of bf16)")
    cfg.results["capacity"] = dict(context=s, budget_gb=cfg.capacity_budget_gb, layers=layers, rows=rows)
    return rows
