"""The e2e part: `model.generate` as users call it, a fresh cache a call (`e2e_row`); the decode part: caches
filled with random K/V continued by `generate`, step time and GPU time (`decode_part`); and the batch1 part, the same
eager steps at batch 1 in interleaved repeats (`interleaved_part`). All on a Llama-3-8B-shaped
model with random bf16 weights, each method eager and compiled against DynamicCache eager and transformers'
StaticCache compiled.
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch

from .. import _compat
from ..eval import compared
from ..presets import make_cache
from ._common import (BenchConfig, _calibration_kwargs, _dense_cache_bytes, _fill, _make_e2e_cache, _needs_model,
                      _random_model, _set_attention, _StepClock, _sync)


def _generate_once(model, name: str, ids: torch.Tensor, n: int, compiled: bool, chunk: int | None = None,
                   attention: str = "sdpa") -> dict:
    """One `model.generate` as a user calls it: a fresh cache built the plain way (eager) or with `max_cache_len`
    (compiled, transformers' own compile rule), the whole prompt prefilled by `generate` itself (in chunks of
    `chunk` tokens when given), `n` greedy tokens. Times from `_StepClock`; peak memory above what was allocated
    before the call (the weights and the prompt), CUDA only."""
    from transformers import LogitsProcessorList

    device = ids.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    cache, attn = _decode_cache(name, model, ids.shape[1] + n, compiled, attention)
    _set_attention(model, attn)
    clock = _StepClock(device)
    _sync(device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, logits_processor=LogitsProcessorList([clock]), disable_compile=not compiled,
                         prefill_chunk_size=chunk, **_compat.cache_kwargs(cache))
    _sync(device)
    call_s = time.perf_counter() - t0
    assert out.shape == (ids.shape[0], ids.shape[1] + n)
    gaps = sorted(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
    peak = (torch.cuda.max_memory_allocated(device) - base) / 1e9 if device.type == "cuda" else None
    cache_bytes = cache.nbytes() if hasattr(cache, "nbytes") else _dense_cache_bytes(cache)
    return dict(cache=cache, call_s=call_s, prefill_s=clock.times[0] - t0, step_ms=gaps[len(gaps) // 2] * 1e3,
                peak_gb=peak, cache_gb=cache_bytes / 1e9)


def e2e_row(model, name: str, ids: torch.Tensor, n: int, compiled: bool, chunk: int | None,
            chunk_all: bool = False, attention: str = "sdpa") -> dict:
    """A row of the end-to-end table: two `_generate_once` calls, each with a fresh cache (the first pays what
    a first call pays in this process: Triton's and Inductor's compiles, CUDA graph capture), then, eager, one with
    the prompt prefilled in chunks of `chunk` tokens (its peak memory) and the host time of one layer step.
    `chunk_all`: the two timed calls prefill in chunks too (a batch whose whole prompt's activations do not fit),
    and their peak is the chunked peak."""
    from torch._dynamo.utils import counters

    if chunk_all and chunk is None:
        raise ValueError("chunk_all needs a prefill chunk size")
    timed_chunk = chunk if chunk_all else None
    torch._dynamo.reset()
    if hasattr(model, "_compiled_call"):
        del model._compiled_call  # transformers keeps the compiled forward of the last cache type
    first = _generate_once(model, name, ids, n, compiled, chunk=timed_chunk, attention=attention)
    del first["cache"]
    graphs = counters["stats"]["unique_graphs"]
    second = _generate_once(model, name, ids, n, compiled, chunk=timed_chunk, attention=attention)
    recompiles = counters["stats"]["unique_graphs"] - graphs
    attention = _set_by(model)
    row = dict(method=name, mode="compiled" if compiled else "eager", attention=attention, batch=ids.shape[0],
               context=ids.shape[1],
               new_tokens=n, step_ms=second["step_ms"], tok_s=ids.shape[0] / second["step_ms"] * 1e3,
               prefill_s=second["prefill_s"], first_call_s=first["call_s"], second_call_s=second["call_s"],
               recompiles=recompiles, peak_gb=second["peak_gb"], cache_gb=second["cache_gb"],
               chunked_peak_gb=None, host_us_per_layer=None, prefill_chunk=chunk)
    if not compiled:
        # the eager host cost of one layer step (a compiled step replays a graph: it has none)
        row["host_us_per_layer"] = _host_us_per_layer(model, second["cache"], ids.shape[0])
    del second
    if chunk_all:
        row["chunked_peak_gb"], row["peak_gb"] = row["peak_gb"], None
    elif chunk is not None and not compiled:  # transformers compiles each chunk's forward under compile: eager only
        row["chunked_peak_gb"] = _generate_once(model, name, ids, n, compiled, chunk=chunk,
                                                attention=attention)["peak_gb"]
    return row


def _set_by(model) -> str:
    return model.config._attn_implementation


def e2e_part(cfg: BenchConfig, log=print) -> list[dict]:
    """`model.generate` as users call it (`e2e_row`) on a Llama-3-8B-shaped model with random bf16 weights
    (`e2e_layers` layers) and a random prompt of `e2e_context` tokens, at each of `decode_batches`: DynamicCache
    eager, transformers' StaticCache compiled, and each of `decode_methods` eager (built without `max_cache_len`)
    and compiled (with it), as `e2e_modes` says. Reported: the median decode step, its ratio to DynamicCache's at
    the same batch, the first and second calls' times (the difference is the warm-up), recompiles in the second
    call, peak memory above the weights without and with `prefill_chunk_size=e2e_prefill_chunk`, and the host
    time of one eager layer step."""
    model = _random_model(cfg.e2e_layers)
    s, n = cfg.e2e_context, cfg.e2e_new_tokens
    compiled_modes = [mode == "compiled" for mode in cfg.e2e_modes]
    plan = [("dynamic", False, "sdpa")] + ([("static", True, "sdpa")] if True in compiled_modes else [])
    plan += [(m, compiled, a) for m in cfg.decode_methods for compiled in compiled_modes for a in cfg.attentions]
    rows = []
    for batch in cfg.decode_batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, s), device="cuda", generator=gen)
        base = None
        for name, compiled, attention in plan:
            try:
                r = e2e_row(model, name, ids, n, compiled, cfg.e2e_prefill_chunk, cfg.e2e_chunk_all, attention)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name} ({'compiled' if compiled else 'eager'}) at batch {batch}: out of memory "
                    f"({str(error).splitlines()[0]})")
                rows.append(dict(method=name, batch=batch, mode="compiled" if compiled else "eager", oom=True))
                continue
            finally:
                from ..patching import unfuse

                unfuse(model)  # a RotatedCache fused its rotation: the next method gets the model it expects
            base = r["step_ms"] if name == "dynamic" else base
            r["vs_dynamic"] = None if base is None else base / r["step_ms"]  # None: DynamicCache did not run
            rows.append(r)
            log(_e2e_line(r))
    cfg.results["e2e"] = dict(context=s, layers=cfg.e2e_layers, new_tokens=n, prefill_chunk=cfg.e2e_prefill_chunk,
                              chunk_all=cfg.e2e_chunk_all, rows=rows)
    del model
    return rows


def _vs_dynamic(r: dict) -> str:
    """The row's ratio to DynamicCache at its batch, or why there is none."""
    return "(DynamicCache did not run)" if r["vs_dynamic"] is None else f"x{r['vs_dynamic']:.2f} DynamicCache"


def _e2e_line(r: dict) -> str:
    def gb(x):
        return "-" if x is None else f"{x:6.2f} GB"

    return (f"batch {r['batch']:3d} {r['method']:>14} {r['mode']:>8} {r.get('attention', ''):>10}: "
            f"step {r['step_ms']:7.2f} ms  "
            f"{_vs_dynamic(r)}  first call {r['first_call_s']:6.1f} s, second "
            f"{r['second_call_s']:6.1f} s  recompiles {r['recompiles']}  peak {gb(r['peak_gb'])}, chunked "
            f"{gb(r['chunked_peak_gb'])}  cache {r['cache_gb']:.2f} GB"
            + ("" if r["host_us_per_layer"] is None else f"  host {r['host_us_per_layer']:.0f} us/layer"))


# The decode-step table (`--parts decode`, also run by `e2e`): rows are baselines and each method eager (built
# without max_cache_len, what `generate` gives without compiling) and compiled (max_cache_len, under transformers' own
# compile rule, `mode="reduce-overhead"`: Inductor plus CUDA graphs).
DECODE_BASELINES = ("dynamic", "static", "exact")  # DynamicCache eager; the other two compiled


def _decode_cache(name: str, model, context: int, compiled: bool, attention: str = "sdpa"):
    """(cache, attn_implementation) of a decode-table row, our methods under `attention`; compiled rows pin
    `context` + slack (max_cache_len)."""
    from transformers import DynamicCache, StaticCache

    capacity = context + 256  # the fill, the warm-up and the timed steps
    if name == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if name == "static":
        return StaticCache(config=model.config, max_cache_len=capacity), "sdpa"
    if compared.is_compared(name):
        return _make_e2e_cache(name, model)
    kwargs = _calibration_kwargs(name, model) if _needs_model(name) else {}
    if compiled:
        kwargs["max_cache_len"] = capacity
    return make_cache(name, model, **kwargs), attention


def _generate_from(model, cache, batch: int, n: int, compiled: bool) -> float:
    """Seconds of `generate` continuing a filled cache for `n` new tokens (its first forward, on the one token
    past the cache, is eager; the rest compiled when `compiled`)."""
    held = int(cache.get_seq_length())
    ids = torch.randint(0, model.config.vocab_size, (batch, held + 1), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                   disable_compile=not compiled, **_compat.cache_kwargs(cache))
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _gpu_ms_per_step(model, cache, batch: int, n: int, compiled: bool) -> float:
    """GPU kernel time of one decode step from the profiler (kernels replayed inside CUDA graphs included)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate_from(model, cache, batch, n, compiled)
    us = sum(e.self_device_time_total for e in prof.key_averages())
    return us / 1e3 / n


def _host_us_per_layer(model, cache, batch: int, n: int = 20, rounds: int = 5) -> float:
    """Host time of one eager layer step, the cache's `update` of one token plus the attention over the layer
    (transformers' SDPA for a plain cache, ours for a quantized one), in us: `n` steps launched back to back on layer
    0 and timed on the host before synchronizing (the host is the bound at decode; the GPU runs behind it), the least
    of `rounds` such rounds (another process on the host only ever adds to a round). Adds `n * rounds` tokens to that
    layer: measured last, on a cache about to be dropped."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    attn = model.model.layers[0].self_attn
    config = model.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    # the lookup the model's attention makes, through which a packed cache's handles reach the fused read
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)
    device = model.device
    q = torch.randn(batch, hq, 1, d, device=device, dtype=model.dtype)
    k = torch.randn(batch, hkv, 1, d, device=device, dtype=model.dtype)

    def step():
        kk, vv = cache.update(k, k, 0)
        fn(attn, q, kk, vv, None, scaling=d**-0.5)

    for _ in range(5):
        step()
    best = math.inf
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    _sync(device)
    return best


def _decode_row(model, name: str, batch: int, context: int, compiled: bool, log, attention: str = "sdpa") -> dict:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    if hasattr(model, "_compiled_call"):
        del model._compiled_call  # transformers keeps the compiled forward of the last cache type
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache, attn = _decode_cache(name, model, context, compiled, attention)
    _set_attention(model, attn)
    _fill(cache, model, batch, context)
    t0 = time.perf_counter()
    _generate_from(model, cache, batch, 4, compiled)  # warm-up: Triton and Inductor compiles, CUDA graph capture
    warmup_s = time.perf_counter() - t0
    graphs = counters["stats"]["unique_graphs"]
    short, long = 8, 40
    t_short = _generate_from(model, cache, batch, short, compiled)
    t_long = _generate_from(model, cache, batch, long, compiled)
    step_ms = (t_long - t_short) / (long - short) * 1e3  # the fixed cost of a generate call cancels out
    gpu_ms = _gpu_ms_per_step(model, cache, batch, 16, compiled)
    recompiles = counters["stats"]["unique_graphs"] - graphs
    cache_bytes = cache.nbytes() if hasattr(cache, "nbytes") else _dense_cache_bytes(cache)
    # the eager host cost of one layer step (the compiled step has none: it replays a graph)
    host_us = _host_us_per_layer(model, cache, batch) if not compiled else float("nan")
    row = dict(method=name, mode="compiled" if compiled else "eager", attention=attn, batch=batch, context=context,
               step_ms=step_ms,
               tok_s=batch / step_ms * 1e3, gpu_ms=gpu_ms, wall_over_gpu=step_ms / gpu_ms, warmup_s=warmup_s,
               recompiles=recompiles, peak_gb=(torch.cuda.max_memory_allocated() - base) / 1e9,
               cache_gb=cache_bytes / 1e9, host_us_per_layer=host_us)
    del cache
    return row


def decode_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Decode-step time of a Llama-3-8B-shaped model (random bf16 weights, `e2e_layers` layers) continuing caches
    filled with `e2e_context` tokens of random K/V, at each of `decode_batches`: DynamicCache eager, transformers'
    StaticCache compiled, our `exact` (16-bit) static cache compiled, and each method eager and compiled. Step time
    is the difference of two `generate` runs (8 and 40 tokens) over 32 steps; the GPU time of a step is the
    profiler's kernel time; recompiles are dynamo's new graphs after the warm-up."""
    model = _random_model(cfg.e2e_layers)
    rows = []
    plan = [(name, name != "dynamic", "sdpa") for name in DECODE_BASELINES
            if name == "dynamic" or "compiled" in cfg.e2e_modes]
    plan += [(m, compiled, a) for m in cfg.decode_methods for compiled in [mode == "compiled" for mode in cfg.e2e_modes]
             for a in cfg.attentions]
    for batch in cfg.decode_batches:
        base = None
        for name, compiled, attention in plan:
            try:
                r = _decode_row(model, name, batch, cfg.e2e_context, compiled, log, attention)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name} ({'compiled' if compiled else 'eager'}) at batch {batch}: out of memory "
                    f"({str(error).splitlines()[0]})")
                rows.append(dict(method=name, batch=batch, oom=True))
                continue
            finally:
                from ..patching import unfuse

                unfuse(model)
            base = r["step_ms"] if name == "dynamic" else base
            r["vs_dynamic"] = None if base is None else base / r["step_ms"]  # None: DynamicCache did not run
            rows.append(r)
            log(f"batch {batch:3d} {name:>10} {r['mode']:>8} {attention:>10}: step {r['step_ms']:7.2f} ms  "
                f"{r['tok_s']:8.1f} tok/s  "
                f"{_vs_dynamic(r)}  GPU {r['gpu_ms']:6.2f} ms (wall/GPU {r['wall_over_gpu']:.2f})  "
                f"warm-up {r['warmup_s']:5.1f} s  recompiles {r['recompiles']}  peak {r['peak_gb']:6.2f} GB"
                + (f"  host {r['host_us_per_layer']:.0f} us/layer" if r["mode"] == "eager" else ""))
    cfg.results["decode"] = dict(context=cfg.e2e_context, layers=cfg.e2e_layers, rows=rows)
    del model
    return rows


def interleaved_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Eager decode steps at batch 1 (most `generate` calls), as `decode_part` times them but interleaved: every cache
    (DynamicCache and each of `decode_methods`, under each of `attentions`) filled with `e2e_context` tokens once, then
    `repeats` rounds, each timing every cache in turn (A, B, C, A, B, C, ...), each cache cropped back to its fill
    after its turn. A host whose speed drifts between calls (up to 40% on the H100 host, 2026-12-06) then moves every
    cache's samples alike. Reported per cache: the median step, its spread (the least and largest sample), the ratio
    of DynamicCache's median to its own, the median of the rounds' own ratios, the GPU time of a step (profiler) and
    the host time of a layer step."""
    model = _random_model(cfg.e2e_layers)
    batch, context = 1, cfg.e2e_context
    names = [("dynamic", "sdpa")] + [(m, a) for m in cfg.decode_methods for a in cfg.attentions]
    caches = {}
    for name, attention in names:
        cache, attn = _decode_cache(name, model, context, False, attention)
        _set_attention(model, attn)
        _fill(cache, model, batch, context)
        _generate_from(model, cache, batch, 4, False)  # compiles, graph captures
        caches[name, attention] = (cache, attn, int(cache.get_seq_length()))
    short, long = 8, 40
    samples = {key: [] for key in caches}
    for _ in range(cfg.repeats):
        for key, (cache, attn, held) in caches.items():
            _set_attention(model, attn)
            t_short = _generate_from(model, cache, batch, short, False)
            cache.crop(held)
            t_long = _generate_from(model, cache, batch, long, False)
            cache.crop(held)
            samples[key].append((t_long - t_short) / (long - short) * 1e3)
    rows = []
    base = statistics.median(samples["dynamic", "sdpa"])
    for key, (cache, attn, held) in caches.items():
        _set_attention(model, attn)
        steps = samples[key]
        rounds = [d / s for d, s in zip(samples["dynamic", "sdpa"], steps)]
        gpu_ms = _gpu_ms_per_step(model, cache, batch, 16, False)
        cache.crop(held)
        row = dict(method=key[0], attention=attn, batch=batch, context=context, repeats=len(steps),
                   step_ms=statistics.median(steps), step_min_ms=min(steps), step_max_ms=max(steps),
                   vs_dynamic=base / statistics.median(steps), vs_dynamic_rounds=statistics.median(rounds),
                   gpu_ms=gpu_ms, host_us_per_layer=_host_us_per_layer(model, cache, batch))
        rows.append(row)
        log(f"batch 1 {key[0]:>15} {attn:>10}: step {row['step_ms']:6.2f} ms (median of {len(steps)}, "
            f"{row['step_min_ms']:.2f}-{row['step_max_ms']:.2f})  x{row['vs_dynamic']:.2f} DynamicCache "
            f"(rounds' median x{row['vs_dynamic_rounds']:.2f})  GPU {gpu_ms:6.2f} ms  "
            f"host {row['host_us_per_layer']:.0f} us/layer")
    cfg.results["batch1"] = dict(context=context, layers=cfg.e2e_layers, rows=rows)
    del caches, model
    return rows
