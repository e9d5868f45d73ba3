"""The kernel part: one decode step of attention (Llama-3-8B heads: 32 q, 8 kv, head_dim 128) over a (batch x context)
grid, ours (`hf_kvcache.attention.fused_attention` on a filled cache layer) against PyTorch's
`scaled_dot_product_attention` on bf16 K/V with its flash backend and GQA; and the sweep part: the fused attention's
launch parameters (`kernels.ops.TUNING`) at one shape.
"""

from __future__ import annotations

import gc
import math
import time

import torch

from ._common import BenchConfig, _bench_ms, _graph_ms, _llama_config, _make_layer_cache


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


def _attend(q, kh, vh, scale):
    """One decode step of the fused attention as the model runs it: the query in the stored keys' frame first
    (RotatedCache's query rotation; nothing for the others)."""
    from ..attention import fused_attention

    return fused_attention(kh.layer.reads.rotate_query(q), kh, vh, None, scale)


def _filled_layer(spec: str, k: torch.Tensor, v: torch.Tensor, config):
    """A one-layer cache of `spec` holding `k, v (B, Hkv, S, D)` plus one decode token; returns the cache and the
    handles of that step."""
    cache = _make_layer_cache(spec, config)
    layer = cache.layers[0]
    layer.fused = True
    layer.update(k, v)
    return cache, layer.update(k[:, :, -1:].clone(), v[:, :, -1:].clone())


def kernel_part(cfg: BenchConfig, log=print) -> list[dict]:
    from ..attention import reference_attention

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
                    ref = reference_attention(kh.layer.reads.rotate_query(q), kh, vh, None, scale, chunk_tokens=4096)
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
    from ..attention import fused_attention
    from ..kernels import ops

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
