"""GPU benchmarks behind `hf-kvcache bench`: decode-attention kernels, end-to-end `generate`, and capacity.

Each part prints its baseline measured in the same run (STYLE.md #10):
- kernel: one decode step of attention (Llama-3-8B heads: 32 q, 8 kv, head_dim 128) over a (batch x context)
  grid, ours (`hf_kvcache.attention.fused_attention` on a filled cache layer) against PyTorch's
  `scaled_dot_product_attention` on bf16 K/V with its flash backend and GQA (never cuDNN, whose per-length
  planning costs ~13 ms of CPU a call on the GPU host, see DESIGN.md). Reported: GPU time of one call (each side
  captured in a CUDA graph and replayed, so that host time is left out, as serving engines run decode), speed-up,
  GB/s of cache bytes read against the copy bandwidth measured in the same run, and the roofline 2/B; then the
  host time of one call and the eager time and speed-up (calls launched one by one, host time included).
- e2e: `model.generate` as users call it (a fresh cache a call, the prompt prefilled by `generate`) on a
  Llama-3-8B-shaped model with random bf16 weights (fewer layers by default, the per-layer shapes are the 8B's):
  each method eager (built without `max_cache_len`) and compiled (with it) against DynamicCache eager and
  transformers' StaticCache compiled, at batch 1, 16 and 64: decode step, first-call warm-up, recompiles, peak
  memory with and without prefill chunking, host time of one eager layer step (`e2e_part`).
- decode: the same model continuing caches filled with random K/V, step time and GPU time (`decode_part`).
- capacity: the largest batch at a context that fits a fixed KV memory budget, from the bytes a real cache
  allocates for one sequence (all of the model's layers), against a bf16 cache.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig

from . import _compat
from .presets import make_cache

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
)
# the presets on the README's front, and INT2: each read at its own bytes' rate, against fp8-e4m3's (kernel part)
KERNEL_SPECS = ("fp8-e4m3", "int8", "int4-g128", "int4-g32", "kivi-4", "kivi-2", "kvquant-4", "turboquant-4",
                "turboquant-3.5", "turboquant-3", "turboquant-2.75", "turboquant-2.5", "int2-g32")


@dataclass
class BenchConfig:
    parts: tuple[str, ...] = ("kernel", "e2e", "capacity")
    methods: tuple[str, ...] = KERNEL_SPECS
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (4096, 32768)
    e2e_batch: int = 16
    e2e_context: int = 32768
    e2e_layers: int = 8
    e2e_new_tokens: int = 64
    e2e_prefill_chunk: int | None = 2048
    e2e_chunk_all: bool = False  # every e2e call chunked (a batch whose unchunked prefill does not fit: 64 x 32k)
    e2e_modes: tuple[str, ...] = ("eager", "compiled")  # which forms of each method the e2e part runs
    capacity_context: int = 32768
    capacity_budget_gb: float = 80.0
    sweep_batch: int = 16
    sweep_context: int = 32768
    multi_gpu_layers: int = 32
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_methods: tuple[str, ...] = ("fp8-e4m3", "int8", "int4-g128", "int4-g32", "kivi-2")
    # the attention the methods' rows of the e2e and decode parts run under: the model's own ("sdpa", as loaded:
    # what a user gets without an attention argument) and/or "hf_kvcache"; the baselines always run sdpa
    attentions: tuple[str, ...] = ("sdpa",)
    prefill_batches: tuple[int, ...] = (1, 16)
    prefill_turn: int = 2048  # the second turn's tokens over the prefilled history (prefill part)
    results: dict = field(default_factory=dict)


def _llama_config(layers: int, attn: str = "hf_kvcache") -> LlamaConfig:
    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers)
    config._attn_implementation = attn
    return config


def _bench_ms(fn, rep_ms: int = 100) -> float:
    """Median time of `fn` in ms (CUDA events, L2 flushed between calls, Triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def _graph_ms(fn) -> float:
    """GPU time of one call of `fn` in ms, host excluded: `fn` captured once in a CUDA graph (as serving engines
    run decode steps) and its replay timed by `_bench_ms`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:  # something in `fn` cannot be captured: the eager time, said so
        print(f"CUDA graph capture failed ({str(error).splitlines()[0]}); timing eager calls")
        return _bench_ms(fn)
    ms = _bench_ms(graph.replay)
    del graph
    return ms


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, GB/s."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = _bench_ms(lambda: b.copy_(a))
    del a, b
    return 2 * nbytes / ms / 1e6


def _sdpa_decode(q, k, v):
    """bf16 SDPA baseline with GQA: the flash backend if it takes this call, else the efficient one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import torch.nn.functional as F

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            torch.cuda.synchronize()
        except RuntimeError:
            continue

        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        return run, backend.name
    raise RuntimeError("neither the flash nor the efficient SDPA backend takes a GQA decode call here")


_CALIBRATED: dict = {}


def _calibrated(model):
    """`model`'s calibration on 2048 random tokens, made once: the benchmarks' models have random weights, and the
    presets that need one (KVQuant's ranges and codebooks) must find one."""
    if id(model) not in _CALIBRATED:
        from .calibration import calibrate

        ids = torch.randint(0, model.config.vocab_size, (1, 2048), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(1))
        _CALIBRATED[id(model)] = (model, calibrate(model, ids, chunk=1024, progress=False))
    return _CALIBRATED[id(model)][1]


def _needs_model(spec: str) -> bool:
    from .presets import PRESETS, parse_spec

    return PRESETS[parse_spec(spec)[0]].needs_model


def _make_layer_cache(spec: str, config):
    """A cache of `spec` for the one-layer 8B shape; a preset that needs the model gets a one-layer model with
    random weights (built once) and its calibration."""
    if not _needs_model(spec):
        return make_cache(spec, config)
    if "model" not in _CALIBRATED:
        _CALIBRATED["model"] = _random_model(1)
        _set_attention(_CALIBRATED["model"], "hf_kvcache")
    model = _CALIBRATED["model"]
    from .patching import unfuse

    unfuse(model)  # each method on the model it expects (a RotatedCache fuses it again)
    return make_cache(spec, model, **_calibration_kwargs(spec, model))


def _calibration_kwargs(spec: str, model) -> dict:
    """`calibration=` for the presets that read one (KVQuant), nothing for the others (RotatedCache)."""
    import inspect

    from .presets import PRESETS, parse_spec

    build = PRESETS[parse_spec(spec)[0]].build
    return {"calibration": _calibrated(model)} if "calibration" in inspect.signature(build).parameters else {}


def _attend(q, kh, vh, scale):
    """One decode step of the fused attention as the model runs it: the query in the stored keys' frame first
    (RotatedCache's query rotation; nothing for the others)."""
    from .attention import fused_attention

    return fused_attention(kh.layer.rotate_query(q), kh, vh, None, scale)


def _filled_layer(spec: str, k: torch.Tensor, v: torch.Tensor, config):
    """A one-layer cache of `spec` holding `k, v (B, Hkv, S, D)` plus one decode token; returns the cache and the
    handles of that step."""
    cache = _make_layer_cache(spec, config)
    layer = cache.layers[0]
    layer.fused = True
    layer.update(k, v)
    return cache, layer.update(k[:, :, -1:].clone(), v[:, :, -1:].clone())


def kernel_part(cfg: BenchConfig, log=print) -> list[dict]:
    from .attention import reference_attention

    config = _llama_config(1)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    bw = copy_bandwidth_gbs()
    log(f"copy bandwidth: {bw:.0f} GB/s (read + write)")
    rows = []
    free = torch.cuda.mem_get_info()[0]
    for s in cfg.contexts:
        for b in cfg.batches:
            dense_bytes = 2 * b * hkv * s * d * 2
            if 4.5 * dense_bytes > free:
                log(f"skip batch {b} context {s}: {dense_bytes / 1e9:.1f} GB of bf16 K/V does not fit 4.5x")
                continue
            gen = torch.Generator(device="cuda").manual_seed(0)
            k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            k[..., 7] *= 10  # an outlier channel
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            run, backend = _sdpa_decode(q, k, v)
            base_ms = _graph_ms(run)
            base = dict(batch=b, context=s, method="bf16 sdpa", backend=backend, ms=base_ms, bytes=dense_bytes,
                        gbs=dense_bytes / base_ms / 1e6, speedup=1.0, ms_eager=_bench_ms(run))
            rows.append(base)
            log(_kernel_line(base, bw))
            for spec in cfg.methods:
                cache, (kh, vh) = _filled_layer(spec, k, v, config)
                scale = d**-0.5
                out = _attend(q, kh, vh, scale)
                if out is None:
                    log(f"{spec}: no kernel for this layout")
                    continue
                if b * s <= 16 * 32768:  # check against the reference where it is affordable
                    ref = reference_attention(kh.layer.rotate_query(q), kh, vh, None, scale, chunk_tokens=4096)
                    err = (out.float() - ref.transpose(1, 2)).abs().max().item()
                else:
                    err = float("nan")
                ms = _graph_ms(lambda: _attend(q, kh, vh, scale))
                ms_eager = _bench_ms(lambda: _attend(q, kh, vh, scale))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    _attend(q, kh, vh, scale)
                host_us = (time.perf_counter() - t0) / 20 * 1e6  # CPU time to launch one step
                torch.cuda.synchronize()
                nbytes = cache.layers[0].nbytes()
                per_elem = nbytes / (2 * b * hkv * (s + 1) * d)
                row = dict(batch=b, context=s, method=spec, ms=ms, ms_eager=ms_eager, bytes=nbytes,
                           gbs=nbytes / ms / 1e6, speedup=base_ms / ms, speedup_eager=base["ms_eager"] / ms_eager, bytes_per_element=per_elem, roofline=2 / per_elem,
                           max_abs_err_vs_reference=err, host_us=host_us)
                rows.append(row)
                log(_kernel_line(row, bw))
                del cache, kh, vh
            _share_of_fp8([r for r in rows if r["batch"] == b and r["context"] == s], log)
            del k, v, q
            gc.collect()
            torch.cuda.empty_cache()
    cfg.results["kernel"] = dict(copy_gbs=bw, rows=rows)
    return rows


def _share_of_fp8(rows: list[dict], log) -> None:
    """Each method's GB/s of its own bytes as a share of fp8-e4m3's at the same shape (`of_fp8`, None without an
    fp8-e4m3 row): how near a format reads the rate its bytes allow."""
    fp8 = next((r for r in rows if r["method"] == "fp8-e4m3"), None)
    for r in rows:
        r["of_fp8"] = r["gbs"] / fp8["gbs"] if fp8 is not None and r["method"] != "bf16 sdpa" else None
    if fp8 is not None:
        log("  GB/s of own bytes, share of fp8-e4m3's: " + ", ".join(
            f"{r['method']} {r['of_fp8']:.0%}" for r in rows if r["of_fp8"] is not None))


def sweep_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Launch parameters of the fused attention at one (batch, context) per spec: tile tokens, warps, stages."""
    from .attention import fused_attention
    from .kernels import ops

    config = _llama_config(1)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    b, s = cfg.sweep_batch, cfg.sweep_context
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    run, _ = _sdpa_decode(q, k, v)
    base_ms = _bench_ms(run)
    log(f"sweep at batch {b} context {s}: bf16 sdpa {base_ms * 1e3:.1f} us")
    saved = dict(ops.TUNING)
    rows = []
    for spec in cfg.methods:
        cache, (kh, vh) = _filled_layer(spec, k, v, config)
        fmt = cache.layers[0].key_stream.codec.packed_format()
        nuq = fmt.kind == "nuq"  # KVQuant's own kernel: tile tokens and warps (2 stages)
        per_channel_keys = fmt.token_group > 1
        for block_n in (64,) if per_channel_keys else ((16, 32, 64) if nuq else (32, 64, 128)):
            for warps, stages in ((4, 2), (8, 2)) if nuq else ((1, 3), (2, 2), (2, 3), (2, 4), (4, 3)):
                ops.TUNING.update(block_n=block_n, num_warps=warps, num_stages=stages, nuq_block_n=block_n,
                                  nuq_num_warps=warps)
                try:
                    ms = _bench_ms(lambda: fused_attention(q, kh, vh, None, d**-0.5), rep_ms=50)
                except Exception as error:  # a configuration that does not compile (shared memory, ...)
                    log(f"{spec} block_n {block_n} warps {warps} stages {stages}: {type(error).__name__}")
                    continue
                rows.append(dict(method=spec, block_n=block_n, num_warps=warps, num_stages=stages, ms=ms,
                                 speedup=base_ms / ms))
                log(f"{spec:>10} block_n {block_n:>3} warps {warps} stages {stages}: "
                    f"{ms * 1e3:8.1f} us x{base_ms / ms:.2f}")
        ops.TUNING.update(saved)
        del cache, kh, vh
    cfg.results["sweep"] = dict(batch=b, context=s, base_ms=base_ms, rows=rows)
    return rows


def _err(value: float) -> str:
    return "unchecked" if math.isnan(value) else f"{value:.1e}"


def _kernel_line(r: dict, bw: float) -> str:
    extra = ""
    if "roofline" in r:
        extra = (f"  B={r['bytes_per_element']:.3f}  2/B={r['roofline']:.2f}  of 2/B {r['speedup'] / r['roofline']:.0%}"
                 f"  err {_err(r['max_abs_err_vs_reference'])}  host {r['host_us']:.0f} us"
                 f"  eager {r['ms_eager'] * 1e3:.0f} us x{r['speedup_eager']:.2f}")
    return (f"batch {r['batch']:>3} ctx {r['context']:>6} {r['method']:>10}: {r['ms'] * 1e3:9.1f} us  "
            f"x{r['speedup']:5.2f}  {r['gbs']:6.0f} GB/s ({r['gbs'] / bw:4.0%} of copy){extra}")


# ------------------------------------------------------------------------------------------------ end to end


def _random_model(layers: int):
    from transformers import LlamaForCausalLM

    config = _llama_config(layers, attn="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def _set_attention(model, name: str) -> None:
    model.config._attn_implementation = name
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            module.config._attn_implementation = name


def _make_e2e_cache(name: str, model, attention: str = "sdpa"):
    """(cache, the attention its rows run under): our methods under `attention`, the baselines under sdpa."""
    from transformers import DynamicCache

    if name == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if name.startswith("hf-quanto"):
        from transformers import QuantizedCache

        nbits = int(name.split("-int")[1])
        return QuantizedCache(backend="quanto", config=model.config, nbits=nbits), "sdpa"
    if _needs_model(name):
        return make_cache(name, model, **_calibration_kwargs(name, model)), attention
    return make_cache(name, model), attention


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepClock:
    """A logits processor that notes the wall time of every step of `generate` (it runs once a step, after the
    forward): the first note ends the prefill, the gaps between the others are decode steps."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


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
                from .patching import unfuse

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


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a tensor subclass (quanto's packed tensors) is counted through its inner tensors
    (PyTorch's `__tensor_flatten__` protocol), not by its logical dense size."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _dense_layer_bytes(layer) -> int:
    """Bytes held by a transformers cache layer (DynamicCache, QuantizedCache: residual and quantized tensors)."""
    tensors = (getattr(layer, name, None) for name in ("keys", "values", "_quantized_keys", "_quantized_values"))
    return sum(_tensor_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _dense_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: `_dense_layer_bytes` of every layer."""
    return sum(_dense_layer_bytes(layer) for layer in cache.layers)


# ---------------------------------------------------------------------------------------------- prefill


def _prefill_s(model, cache, ids: torch.Tensor, chunk: int | None) -> float:
    """Seconds of `generate`'s prefill of `ids` into `cache` (one new token: its step is the prefill's), in chunks
    of `chunk` tokens when given."""
    clock = _StepClock(ids.device)
    from transformers import LogitsProcessorList

    _sync(ids.device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), disable_compile=True, prefill_chunk_size=chunk,
                   **_compat.cache_kwargs(cache))
    return clock.times[0] - t0


def _turn_s(model, cache, turn: torch.Tensor) -> float:
    """Seconds of one forward of a chat's next turn, `turn (B, T)` tokens, over what `cache` holds."""
    held = int(cache.get_seq_length())
    mask = torch.ones(turn.shape[0], held + turn.shape[1], dtype=torch.long, device=turn.device)
    _sync(turn.device)
    t0 = time.perf_counter()
    model(input_ids=turn, attention_mask=mask, use_cache=True, logits_to_keep=1, **_compat.cache_kwargs(cache))
    _sync(turn.device)
    return time.perf_counter() - t0


def _prefill_row(model, name: str, ids: torch.Tensor, turn: torch.Tensor, chunk: int | None) -> dict:
    """One method's prefill of `ids` in chunks of `chunk` (a fresh cache), then the next turn over it; the peak memory
    above what was allocated before (the weights and the prompt)."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    cache, attention = _make_e2e_cache(name, model)
    _set_attention(model, attention)
    prefill_s = _prefill_s(model, cache, ids, chunk)
    turn_s = _turn_s(model, cache, turn)
    peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    return dict(method=name, batch=ids.shape[0], context=ids.shape[1], chunk=chunk, prefill_s=prefill_s,
                turn=turn.shape[1], turn_s=turn_s, peak_gb=peak)


def prefill_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Prefill over a packed history, as `generate` runs it on a Llama-3-8B-shaped model (random bf16 weights,
    `e2e_layers` layers), at each of `prefill_batches`: a prompt of `e2e_context` tokens prefilled in chunks of
    `e2e_prefill_chunk` (each chunk after the first attends to the packed history), then a next turn of
    `prefill_turn` tokens over it (one forward). DynamicCache prefills the prompt both unchunked and chunked; each
    of `decode_methods` chunked, under the model's own attention. Each row is timed after a warm-up prefill of a
    short prompt (the kernels' compiles): the prefill's time, its ratios to DynamicCache chunked and unchunked in the
    same run, the turn's time and its ratio to DynamicCache's, peak memory."""
    model = _random_model(cfg.e2e_layers)
    chunk = cfg.e2e_prefill_chunk
    rows = []
    for batch in cfg.prefill_batches:
        gen = torch.Generator(device="cuda").manual_seed(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, cfg.e2e_context), device="cuda", generator=gen)
        turn = torch.randint(0, model.config.vocab_size, (batch, cfg.prefill_turn), device="cuda", generator=gen)
        warm = ids[:, : 2 * chunk + 64] if chunk else ids[:, :4096]
        base = {}
        for name, this_chunk in [("dynamic", None), ("dynamic", chunk)] + [(m, chunk) for m in cfg.decode_methods]:
            try:
                _prefill_row(model, name, warm, turn[:, :64], this_chunk)
                r = _prefill_row(model, name, ids, turn, this_chunk)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name} at batch {batch}: out of memory ({str(error).splitlines()[0]})")
                rows.append(dict(method=name, batch=batch, chunk=this_chunk, oom=True))
                continue
            finally:
                from .patching import unfuse

                unfuse(model)
            if name == "dynamic":
                base[this_chunk] = r
            unchunked, chunked = base.get(None), base.get(chunk)
            r["vs_dynamic"] = unchunked["prefill_s"] / r["prefill_s"] if unchunked else None
            r["vs_dynamic_chunked"] = chunked["prefill_s"] / r["prefill_s"] if chunked else None
            r["turn_vs_dynamic"] = chunked["turn_s"] / r["turn_s"] if chunked else None
            rows.append(r)

            def ratio(x):
                return "   -  " if x is None else f"x{x:5.2f}"

            log(f"batch {batch:3d} {name:>14} chunk {str(this_chunk):>5}: prefill {r['prefill_s']:7.3f} s "
                f"{ratio(r['vs_dynamic_chunked'])} DynamicCache chunked, {ratio(r['vs_dynamic'])} unchunked  "
                f"turn of {r['turn']} {r['turn_s'] * 1e3:8.1f} ms {ratio(r['turn_vs_dynamic'])}  "
                f"peak {r['peak_gb']:6.2f} GB")
    cfg.results["prefill"] = dict(context=cfg.e2e_context, layers=cfg.e2e_layers, chunk=chunk,
                                  turn=cfg.prefill_turn, rows=rows)
    del model
    return rows


# ---------------------------------------------------------------------------------------------- decode steps

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
    if name.startswith("hf-quanto"):
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
                from .patching import unfuse

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


# ------------------------------------------------------------------------------------------------- capacity


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


# ------------------------------------------------------------------------------------------------ multi-GPU


def split_model(model, devices: list[int]):
    """`model` (on CPU, or built under accelerate's `init_empty_weights()`) placed over the CUDA `devices` as
    transformers' `device_map="auto"` places a model over several GPUs: accelerate's balanced memory, whole
    decoder layers per device, dispatched with accelerate's hooks (which move hidden states between devices).
    One device: everything on it, no hooks. Parameters still on the meta device are drawn as the model's own init
    draws them (normal(0, initializer_range) for matrices, ones for norms, zeros for biases), directly on their
    device."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device

    dtype = next(model.parameters()).dtype
    if len(devices) == 1:
        device_map = {"": devices[0]}
    else:
        no_split = list(model._no_split_modules or [])
        free = {d: torch.cuda.mem_get_info(d)[0] for d in devices}
        balanced = get_balanced_memory(model, max_memory=free, no_split_module_classes=no_split, dtype=dtype)
        device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=dtype)
    std = getattr(_compat.text_config(model.config), "initializer_range", 0.02)
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        value = torch.empty(p.shape, dtype=p.dtype, device=f"cuda:{device_map[owner]}")
        if p.dim() > 1:
            value.normal_(0, std)
        else:
            value.fill_(0.0 if name.endswith("bias") else 1.0)
        set_module_tensor_to_device(model, name, value.device, value=value)
    if len(devices) == 1:
        return model.to(f"cuda:{devices[0]}").eval()
    return dispatch_model(model, device_map=device_map).eval()


def _layer_devices(model) -> list[torch.device]:
    from .patching import attention_modules

    return [m.k_proj.weight.device for m in attention_modules(model)]


def _fill(cache, model, batch: int, context: int, chunk: int = 256) -> None:
    """Write `context` tokens of random bf16 K/V `(batch, Hkv, T, D)` into every layer of `cache`, each on its
    layer's device, as a prefill would leave them, without running the model (a 32k prefill of a large batch
    would dominate the benchmark's time; the decode step does not care what the numbers are)."""
    from transformers import DynamicCache

    config = _compat.text_config(model.config)
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    gen = {}
    for i, dev in enumerate(_layer_devices(model)):
        if isinstance(cache, DynamicCache):  # it keeps the tensors it is given: fresh ones for every layer
            cache.update(torch.randn(shape, device=dev, dtype=torch.bfloat16),
                         torch.randn(shape, device=dev, dtype=torch.bfloat16), i)
            continue
        layer = cache.layers[i]
        layer.fused = True  # store only: no dense copy of the history
        for s in range(0, context, chunk):
            n = min(chunk, context - s)
            key = (dev, n)
            if key not in gen:  # the packed copies are what the cache holds: one random chunk per device suffices
                gen[key] = (torch.randn(*shape[:2], n, shape[3], device=dev, dtype=torch.bfloat16),
                            torch.randn(*shape[:2], n, shape[3], device=dev, dtype=torch.bfloat16))
            layer.update(*gen[key])


def _decode(model, cache, batch: int, n: int) -> float:
    """Seconds for `n` greedy decode steps of `generate` continuing a cache that already holds tokens (generate
    feeds only the one token past what the cache holds)."""
    first = model.get_input_embeddings().weight.device
    context = cache.get_seq_length()
    ids = torch.randint(0, model.config.vocab_size, (batch, context + 1), device=first)
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, **_compat.cache_kwargs(cache))
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    assert out.shape == (batch, context + 1 + n)
    return time.perf_counter() - t0


def storage_devices(layer) -> set[torch.device]:
    """The devices of every tensor a cache layer stores: ours (`stored_tensors`) or a transformers layer's
    `keys`/`values`."""
    if hasattr(layer, "stored_tensors"):
        return {t.device for t in layer.stored_tensors()}
    return {t.device for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)}


def _cache_bytes_by_device(cache, model) -> dict[int, int]:
    out: dict[int, int] = {}
    for layer, dev in zip(cache.layers, _layer_devices(model)):
        held = layer.allocated_nbytes() if hasattr(layer, "allocated_nbytes") else _dense_layer_bytes(layer)
        out[dev.index] = out.get(dev.index, 0) + held
    return out


def _clear(devices) -> None:
    gc.collect()
    for d in devices:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _multi_run(model, name: str, batch: int, context: int, n: int, devices) -> dict:
    """Fill a fresh cache of `name` with `batch` x `context` tokens, decode `n` tokens; tokens/s and, per device,
    the cache's bytes and the peak memory above what was allocated before (cache + decode workspace)."""
    _clear(devices)
    base = {d: torch.cuda.memory_allocated(d) for d in devices}
    cache, attn = _make_e2e_cache(name, model)
    _set_attention(model, attn)
    _fill(cache, model, batch, context)
    _decode(model, cache, batch, 2)  # warm-up at this shape: kernels compile, storage grows past the fill
    for d in devices:  # what counts is the cache and the decode step's workspace, not how the test filled it
        torch.cuda.reset_peak_memory_stats(d)
    seconds = _decode(model, cache, batch, n)
    for layer, dev in zip(cache.layers, _layer_devices(model)):  # every layer's storage on its layer's device
        where = storage_devices(layer)
        assert where == {dev}, f"{name}: a layer on {dev} stores its cache on {where}"
    row = dict(method=name, batch=batch, context=context, decode_tok_s=batch * n / seconds, step_ms=seconds / n * 1e3,
               cache_gb={d: b / 1e9 for d, b in _cache_bytes_by_device(cache, model).items()},
               used_gb={d: (torch.cuda.max_memory_allocated(d) - base[d]) / 1e9 for d in devices})
    del cache
    _clear(devices)
    return row


def _largest_batch(model, name: str, probe: dict, context: int, n: int, devices, log) -> dict:
    """The largest batch at `context` that runs (fill, then decode): predicted from the probe run's memory per
    sequence on each device (cache + decode workspace, linear in the batch) against that device's free memory
    less 1 GiB, then run; on out-of-memory, 6% fewer sequences (at most 6 tries). Growing storage copies one
    layer at a time (old and new buffers alive together), which the prediction leaves out: the tries find it."""
    _clear(devices)
    free = {d: torch.cuda.mem_get_info(d)[0] - (1 << 30) for d in devices}
    per_seq = {d: probe["used_gb"][d] * 1e9 / probe["batch"] for d in devices}
    batch = int(min(free[d] // per_seq[d] for d in devices if per_seq[d] > 0))
    predicted = batch
    for _ in range(6):
        try:
            return dict(_multi_run(model, name, batch, context, n, devices), predicted_batch=predicted)
        except torch.cuda.OutOfMemoryError:
            log(f"{name}: batch {batch} out of memory, trying {int(batch * 0.94)}")
        _clear(devices)  # outside the handler: the traceback no longer holds the failed run's tensors
        batch = int(batch * 0.94)
    return dict(method=name, batch=None, predicted_batch=predicted, oom=True)


def multi_gpu_part(cfg: BenchConfig, log=print) -> list[dict]:
    """A Llama-3-8B-shaped model (`multi_gpu_layers` layers, random bf16 weights) on one GPU and split over all
    visible GPUs as `device_map="auto"` splits it; for DynamicCache and each method (fused attention): decode
    tokens/s at `e2e_batch` x `e2e_context`, and the largest batch that runs at that context with its
    tokens/s. Both placements in the same run."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .patching import unfuse

    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        raise RuntimeError(f"the multi-GPU benchmark needs at least 2 GPUs, {n_gpus} visible")
    b, s, n = cfg.e2e_batch, cfg.e2e_context, cfg.e2e_new_tokens
    names = ["dynamic", *cfg.methods]
    rows = []
    start = time.perf_counter()
    for devices in ([0], list(range(n_gpus))):
        _CALIBRATED.clear()
        config = _llama_config(cfg.multi_gpu_layers, attn="sdpa")
        with init_empty_weights(include_buffers=False):  # RoPE's inv_freq stays a real float32 buffer
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        torch.manual_seed(0)
        model = split_model(model, devices)
        where = {d: sum(dev.index == d for dev in _layer_devices(model)) for d in devices}
        log(f"-- {len(devices)} GPU(s): decoder layers per GPU {where}")
        for name in names:
            try:
                # Warm-up: kernels compile, the allocator settles (and KVQuant calibrates, once per model).
                _multi_run(model, name, 2, 512, 2, devices)
                fixed = _multi_run(model, name, b, s, n, devices)
                largest = _largest_batch(model, name, fixed, s, max(n // 4, 4), devices, log)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name}: out of memory ({str(error).splitlines()[0]})")
                rows.append(dict(method=name, gpus=len(devices), oom=True))
                continue
            except ValueError as error:  # a method that refuses this model: say so, measure the others
                log(f"{name}: refused ({error})")
                rows.append(dict(method=name, gpus=len(devices), error=str(error)))
                continue
            finally:
                unfuse(model)  # a RotatedCache fused its rotation: the next method gets the model it expects
            _clear(devices)
            row = dict(method=name, gpus=len(devices), layers_per_gpu=where, fixed=fixed, largest=largest)
            rows.append(row)
            log(f"{name:>12} on {len(devices)} GPU(s): batch {b}: {fixed['decode_tok_s']:8.1f} tok/s, step "
                f"{fixed['step_ms']:6.1f} ms, cache {sum(fixed['cache_gb'].values()):6.2f} GB, used "
                f"{ {d: round(g, 1) for d, g in fixed['used_gb'].items()} } GB | largest batch {largest.get('batch')} "
                f"(predicted {largest.get('predicted_batch')}) at {largest.get('decode_tok_s', 0):8.1f} tok/s "
                f"[{time.perf_counter() - start:.0f} s]")
        del model
        _clear(devices)
    cfg.results["multi_gpu"] = dict(context=s, batch=b, layers=cfg.multi_gpu_layers, new_tokens=n, rows=rows)
    _multi_summary(rows, log)
    return rows


def _multi_summary(rows: list[dict], log) -> None:
    """The figures side by side, a markdown table: each method on 1 GPU and on all GPUs, tokens/s at the fixed
    batch (and x DynamicCache on the same GPUs), the largest batch (x DynamicCache's) and its tokens/s."""
    ok = [r for r in rows if "largest" in r and not r["largest"].get("oom")]
    counts = sorted({r["gpus"] for r in ok})
    head = "| method |" + "".join(f" {g} GPU tok/s | largest batch | tok/s there |" for g in counts)
    log("\n" + head + "\n" + "|---" * (1 + 3 * len(counts)) + "|")
    for name in dict.fromkeys(r["method"] for r in ok):
        cells = []
        for g in counts:
            r = next((r for r in ok if r["method"] == name and r["gpus"] == g), None)
            base = next((r for r in ok if r["method"] == "dynamic" and r["gpus"] == g), None)
            if r is None or base is None:
                cells.append(" - | - | - |")
                continue
            big, fixed = r["largest"], r["fixed"]
            cells.append(f" {fixed['decode_tok_s']:.0f} (x{fixed['decode_tok_s'] / base['fixed']['decode_tok_s']:.2f}) |"
                         f" {big['batch']} (x{big['batch'] / base['largest']['batch']:.2f}) | {big['decode_tok_s']:.0f} |")
        log(f"| {name} |" + "".join(cells))


def run(cfg: BenchConfig, log=print) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("hf-kvcache bench measures GPU speed and needs a CUDA device")
    # The baselines run without PyTorch's cuDNN attention (per-length plans, see DESIGN.md): say so.
    torch.backends.cuda.enable_cudnn_sdp(False)
    props = torch.cuda.get_device_properties(0)
    import transformers
    import triton

    cfg.results["env"] = dict(
        gpu=props.name, torch=torch.__version__, transformers=transformers.__version__, triton=triton.__version__,
        date=time.strftime("%Y-%m-%d"), cudnn_sdp=False,
    )
    log(json.dumps(cfg.results["env"]))
    parts = {"kernel": kernel_part, "e2e": e2e_part, "decode": decode_part, "capacity": capacity_part,
             "sweep": sweep_part, "multi_gpu": multi_gpu_part, "prefill": prefill_part}
    for part in cfg.parts:
        log(f"\n== {part}")
        with torch.no_grad():
            parts[part](cfg, log)
    return cfg.results
