"""The serving part: many requests through transformers' continuous batching at a fixed KV memory budget, each preset's
packed pages (`hf_kvcache.paged`) against transformers' bf16 pages in the same run.

Every request is queued at once (an offline batch job, the memory-bound case); the budget fixes the pages each format
gets (`num_blocks`: budget / bytes of one block of that format), so a format of fewer bytes holds more tokens and more
requests at once. Reported per format: tokens the pages hold, the most requests running at once (from the requests'
lifespans), generated tokens/s over the run, time to first token and per-token latency (medians and p90 over
requests), peak GPU memory. EOS is off: every request makes its `new_tokens`.
"""

from __future__ import annotations

import statistics
import time

import torch

from ._common import BenchConfig, _random_model


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * len(values)))]


def block_bytes(spec: str, model, page_size: int) -> int:
    """Bytes of one block (a page of every full-attention layer) in `spec`'s format; "none": the model dtype's."""
    from .. import PRESETS, make_cache
    from .._compat import layer_specs, paged_head_dim
    from ..paged import PackedBatchingConfig, _allocator_for

    config = model.config
    layers = [i for i, s in enumerate(layer_specs(config)) if s.kind == "full"]
    heads = config.num_key_value_heads
    if spec == "none":
        return 2 * heads * paged_head_dim(config) * model.dtype.itemsize * page_size * len(layers)
    kv_cache = make_cache(spec, model) if PRESETS[spec.partition(":")[0]].needs_model else spec
    allocator = _allocator_for(PackedBatchingConfig(kv_cache), config, "full_attention", None, index=0,
                               layer_indices=layers, num_key_value_heads=heads, cache_dtype=model.dtype,
                               page_size=page_size, allow_block_sharing=False)
    return allocator.bytes_per_block


def serve_workload(model, spec: str, prompts: list[list[int]], new_tokens: int, budget_bytes: int,
                   page_size: int = 256, max_batch_tokens: int = 2048) -> dict:
    """Run `prompts` through continuous batching with `spec`'s pages ("none": transformers' own, with the same
    settings) in `budget_bytes` of pages; the figures of one run."""
    from transformers import GenerationConfig

    from ..paged import PackedBatchingConfig

    blocks = budget_bytes // block_bytes(spec, model, page_size)
    if blocks < 2:
        raise ValueError(f"{budget_bytes / 1e9:.3f} GB holds fewer than 2 blocks of {spec}: raise the budget")
    cfg = PackedBatchingConfig(spec, num_blocks=int(blocks), page_size=page_size, max_batch_tokens=max_batch_tokens,
                               allow_block_sharing=False)
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cuda = next(model.parameters()).device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cfg)
    manager.start()
    results = {}
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new_tokens, record_timestamps=True)
        while len(results) < len(prompts):
            out = manager.get_result(timeout=1.0)
            if out is None:
                if not manager.is_running():
                    raise RuntimeError(f"{spec}: the batching loop stopped with {len(results)} of {len(prompts)} done")
                continue
            if out.is_finished():
                if out.error:
                    raise RuntimeError(f"{spec}: request {out.request_id} failed: {out.error}")
                results[out.request_id] = out
        wall = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    spans = [(r.lifespan[0], r.lifespan[1]) for r in results.values()]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    ttft = [r.timestamps[0] - r.created_time for r in results.values() if r.timestamps]
    tpot = [(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1) for r in results.values()
            if r.timestamps and len(r.timestamps) > 1]
    generated = sum(len(r.generated_tokens) for r in results.values())
    return dict(method=spec, blocks=int(blocks), tokens_held=int(blocks) * page_size, most_running=most,
                tokens_per_s=generated / wall, wall_s=wall, generated=generated,
                ttft_s_median=statistics.median(ttft), ttft_s_p90=_quantile(ttft, 0.9),
                tpot_ms_median=1e3 * statistics.median(tpot), tpot_ms_p90=1e3 * _quantile(tpot, 0.9),
                peak_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else None)


def workload(count: int, shortest: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of `shortest`..`longest` tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def format_rows(rows: list[dict]) -> list[str]:
    base = rows[0]
    lines = ["| pages | tokens held | x bf16 | most running | tokens/s | x bf16 | TTFT median / p90 s | per-token ms "
             "median / p90 | peak GB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "" if r["peak_gb"] is None else f"{r['peak_gb']:.1f}"
        name = "bf16 (transformers')" if r["method"] == "none" else f"`{r['method']}`"
        lines.append(f"| {name} | {r['tokens_held']} | x{r['tokens_held'] / base['tokens_held']:.2f} | "
                     f"{r['most_running']} | {r['tokens_per_s']:.0f} | x{r['tokens_per_s'] / base['tokens_per_s']:.2f} | "
                     f"{r['ttft_s_median']:.2f} / {r['ttft_s_p90']:.2f} | {r['tpot_ms_median']:.1f} / "
                     f"{r['tpot_ms_p90']:.1f} | {peak} |")
    return lines


def serving_part(cfg: BenchConfig, log=print) -> list[dict]:
    """The workload of `cfg.serving_*` on the 8B-shaped model with `cfg.e2e_layers` layers, bf16 pages first."""
    model = _random_model(cfg.e2e_layers)
    prompts = workload(cfg.serving_requests, *cfg.serving_prompt, vocab=model.config.vocab_size)
    budget = int(cfg.serving_budget_gb * 1e9)
    rows = []
    for spec in ("none", *cfg.serving_methods):
        rows.append(serve_workload(model, spec, prompts, cfg.serving_new_tokens, budget))
        log(format_rows(rows)[-1])
    log(f"{cfg.serving_requests} requests of {cfg.serving_prompt[0]}-{cfg.serving_prompt[1]} prompt tokens, "
        f"{cfg.serving_new_tokens} new each (EOS off), {cfg.serving_budget_gb:g} GB of pages, {cfg.e2e_layers} layers "
        "of the Llama-3-8B shape, bf16, continuous batching (sdpa, index-based reads; packed pages: decode steps through "
        "the fused kernels over the pages)")
    for line in format_rows(rows):
        log(line)
    cfg.results["serving"] = dict(requests=cfg.serving_requests, prompt=list(cfg.serving_prompt),
                                  new_tokens=cfg.serving_new_tokens, budget_gb=cfg.serving_budget_gb,
                                  layers=cfg.e2e_layers, rows=rows)
    return rows


def pages_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Bytes of one token's page slot in each format on the Llama-3-8B shape (one layer's K and V, bf16 model), the
    tokens a page budget holds against bf16 pages, and what each request keeps outside the pages (exact sinks and
    window, per layer). Needs no GPU: the allocators are built, not run."""
    from .._compat import paged_head_dim
    from ..paged import PackedBatchingConfig, _allocator_for
    from ._common import _llama_config

    config = _llama_config(1, attn="sdpa")
    heads, dim = config.num_key_value_heads, paged_head_dim(config)
    bf16 = 2 * heads * dim * 2
    rows = [dict(method="none", slot_bytes=bf16, ratio=1.0, exact_tokens=0)]
    for spec in cfg.serving_methods:
        allocator = _allocator_for(PackedBatchingConfig(spec), config, "full_attention", None, index=0,
                                   layer_indices=[0], num_key_value_heads=heads, cache_dtype=torch.bfloat16,
                                   page_size=256, allow_block_sharing=True)
        p = allocator.policies[0]
        exact = p.sink_tokens + max(p.key_residual_length, p.value_residual_length)
        rows.append(dict(method=spec, slot_bytes=allocator.slot_bytes, ratio=bf16 / allocator.slot_bytes,
                         exact_tokens=exact, prefix_sharing=allocator.supports_block_sharing))
    log("| pages | bytes a token a layer | tokens in the same pages | exact tokens a request a layer, outside them |")
    log("|---|---|---|---|")
    for r in rows:
        name = "bf16 (transformers')" if r["method"] == "none" else f"`{r['method']}`"
        log(f"| {name} | {r['slot_bytes']} | x{r['ratio']:.2f} | {r['exact_tokens']} |")
    cfg.results["pages"] = dict(shape="llama-3-8b", dtype="bf16", rows=rows)
    return rows
