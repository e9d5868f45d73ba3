"""The fused decode attention of the whole-row formats at batch 16 (and 1, 64) x 32k, Llama-3-8B heads, bf16, read the
way a cache's decode step reads it (its storage's capacity-sized launch, lengths from the device): how the split-K
count (`programs_per_sm`, `min_tiles_per_split`), stages, warps and tile size move the GPU time, with the compiled
body kernel's registers and shared memory (the programs a multiprocessor holds). GPU time by CUDA-graph replay
(`bench._graph_ms`), bf16 SDPA (cuDNN off) as the baseline. Figures printed last.

usage: python3 sweep.py [spec ...]   (default: fp8-e4m3 int8 int4-g128 exact)"""
import sys

import torch

from hf_kvcache import bench
from hf_kvcache.attention import reference_attention
from hf_kvcache.kernels import decode, ops

torch.backends.cuda.enable_cudnn_sdp(False)
config = bench._llama_config(1)
hq, hkv, d = 32, 8, 128
s = 32768
bw = bench.copy_bandwidth_gbs()
sms = torch.cuda.get_device_properties(0).multi_processor_count
saved = dict(ops.TUNING)
specs = sys.argv[1:] or ["fp8-e4m3", "int8", "int4-g128", "exact"]
B16 = [  # (name, TUNING)
    ("default", {}),
    ("pps 4", {"programs_per_sm": 4}),
    ("pps 6", {"programs_per_sm": 6}),
    ("pps 8", {"programs_per_sm": 8}),
    ("pps 12", {"programs_per_sm": 12}),
    ("pps 24", {"programs_per_sm": 24}),
    ("pps 32", {"programs_per_sm": 32}),
    ("pps 64, min 2", {"programs_per_sm": 64, "min_tiles_per_split": 2}),
    ("stages 2", {"num_stages": 2}),
    ("stages 4", {"num_stages": 4}),
    ("warps 4", {"num_warps": 4}),
    ("warps 4, pps 8", {"num_warps": 4, "programs_per_sm": 8}),
    ("block_n 128, warps 4", {"block_n": 128, "num_warps": 4}),
    ("block_n 32", {"block_n": 32}),
]
OTHER = [("default", {}), ("pps 8", {"programs_per_sm": 8}), ("pps 32", {"programs_per_sm": 32})]


def body_kernels():
    """(n_regs, n_spills, shared bytes, warps) of every compiled `_attn_fwd` variant, keyed by Triton's key."""
    out = {}
    try:
        for cache in getattr(decode._attn_fwd, "device_caches", {}).values():
            for key, kern in cache[0].items():
                md = kern.metadata
                out[key] = (kern.n_regs, kern.n_spills, md.shared, md.num_warps)
    except Exception as error:  # another Triton's layout of its caches: no resource report
        print(f"(no resource report: {type(error).__name__}: {error})")
    return out


def occupancy(regs, shared, warps):
    by_regs = 65536 // max(regs * 32 * warps, 1)
    by_smem = (233472 // shared) if shared else 32
    return min(by_regs, by_smem, 64 // warps, 32)


rows, seen = [], set()
with torch.no_grad():
    for b in (16, 1, 64):
        gen = torch.Generator(device="cuda").manual_seed(0)
        k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k[..., 7] *= 10
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        run, _ = bench._sdpa_decode(q, k, v)
        base = bench._graph_ms(run)
        del run
        for spec in specs:
            cache, (kh, vh) = bench._filled_layer(spec, k, v, config)
            nbytes = cache.layers[0].nbytes()
            err = None
            for name, tune in (B16 if b == 16 else OTHER):
                ops.TUNING.update(saved)
                ops.TUNING.update(tune)
                before = set(body_kernels())
                try:
                    out = bench._attend(q, kh, vh, d**-0.5)
                    if err is None and b <= 16:
                        want = reference_attention(kh.layer.rotate_query(q), kh, vh, None, d**-0.5,
                                                   chunk_tokens=4096).transpose(1, 2)
                        err = (out.float() - want.float()).abs().max().item()
                    ms = bench._graph_ms(lambda: bench._attend(q, kh, vh, d**-0.5))
                except Exception as error:
                    print(f"{b} {spec} {name}: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
                    continue
                new = {kk: vv for kk, vv in body_kernels().items() if kk not in before}
                res = " ".join(f"[{r} regs {sp} spills {sh} B smem {w} warps -> {occupancy(r, sh, w)}/SM]"
                               for r, sp, sh, w in new.values())
                tiles = (s // ops.TUNING["block_n"])
                n_splits, _ = ops._split_k(q, tiles, b * hkv)
                row = (b, spec, name, ms * 1e3, base / ms, nbytes / ms / 1e6, n_splits, b * hkv * n_splits)
                rows.append(row + (err,))
                print("%3d x 32k %-10s %-22s %8.1f us  x%.3f SDPA  %6.0f GB/s  splits %3d  programs %5d" % row,
                      res, flush=True)
            del cache, kh, vh
        del k, v, q
        torch.cuda.empty_cache()
ops.TUNING.update(saved)
print(f"\n{sms} multiprocessors; copy bandwidth {bw:.0f} GB/s")
print("| batch x 32k | preset | variant | us | vs bf16 SDPA | GB/s of cache (of copy) | splits | programs | max abs err |")
print("|---|---|---|---|---|---|---|---|---|")
for b, spec, name, us, x, gbs, ns, npg, err in rows:
    e = "-" if err is None else f"{err:.1e}"
    print(f"| {b} | {spec} | {name} | {us:.1f} | x{x:.3f} | {gbs:.0f} ({gbs / bw:.0%}) | {ns} | {npg} | {e} |")
