"""KVQuant's fused decode attention at batch 16 (and 1, 64) x 32k, Llama-3-8B heads, bf16: the register lookup with
the dequantization, RoPE and products in fp16 (the slots by a packed compare) against the same lookup in float32,
the selects, and the tile / warp / register-cap choices the fp16 path changes. GPU time by CUDA-graph replay
(`bench._graph_ms`), bf16 SDPA (cuDNN off) as the baseline, every variant's largest error against the reference
attention over the same cache. Figures printed last."""
import sys

import torch

from hf_kvcache import bench, make_cache
from hf_kvcache.attention import fused_attention, reference_attention
from hf_kvcache.kernels import ops

torch.backends.cuda.enable_cudnn_sdp(False)
config = bench._llama_config(1)
hq, hkv, d = 32, 8, 128
s = 32768
bw = bench.copy_bandwidth_gbs()
bench._make_layer_cache("kvquant-4", config)
model, cal = bench._CALIBRATED["model"], bench._calibrated(bench._CALIBRATED["model"])
saved = dict(ops.TUNING)
R = {"selects": {"nuq_lookup": "selects"}, "registers": {}}
variants = [  # (batch, bits, name, cache kwargs, TUNING)
    (16, 4, "selects", {}, R["selects"]),
    (16, 4, "registers, fp32 dequant", {}, {"nuq_fp16": False}),
    (16, 4, "registers, fp16 dequant", {}, {}),
    (16, 4, "fp16, cap 168 regs", {}, {"nuq_maxnreg": 168}),
    (16, 4, "fp16, 8 warps", {}, {"nuq_num_warps": 8}),
    (16, 4, "fp16, block_n 64, 8 warps", {}, {"nuq_block_n": 64, "nuq_num_warps": 8}),
    (16, 4, "fp16, block_n 16", {}, {"nuq_block_n": 16}),
    (16, 4, "fp16, no slots", {"outlier_fraction": 0.0}, {}),
    (16, 3, "registers, fp32 dequant", {}, {"nuq_fp16": False}),
    (16, 3, "registers, fp16 dequant", {}, {}),
    (16, 2, "registers, fp32 dequant", {}, {"nuq_fp16": False}),
    (16, 2, "registers, fp16 dequant", {}, {}),
    (1, 4, "registers, fp32 dequant", {}, {"nuq_fp16": False}),
    (1, 4, "registers, fp16 dequant", {}, {}),
    (64, 4, "registers, fp32 dequant", {}, {"nuq_fp16": False}),
    (64, 4, "registers, fp16 dequant", {}, {}),
]
only = sys.argv[1:]  # optional: names to keep
rows, kv, bases = [], {}, {}
with torch.no_grad():
    for b, bits, name, kw, tune in variants:
        if only and name not in only:
            continue
        if b not in kv:
            kv.clear()
            torch.cuda.empty_cache()
            gen = torch.Generator(device="cuda").manual_seed(0)
            k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
            run, _ = bench._sdpa_decode(q, k, v)
            kv[b] = (k, v, q, bench._graph_ms(run))
            bases[b] = kv[b][3]
            del run
        k, v, q, base = kv[b]
        cache = make_cache(f"kvquant-{bits}", model, calibration=cal, **kw)
        layer = cache.layers[0]
        layer.fused = True
        layer.update(k, v)
        kh, vh = layer.update(k[:, :, -1:].clone(), v[:, :, -1:].clone())
        ops.TUNING.update(saved)
        ops.TUNING.update(tune)
        out = fused_attention(q, kh, vh, None, d**-0.5)
        want = reference_attention(q, kh, vh, None, d**-0.5).transpose(1, 2)
        err = (out.float() - want.float()).abs().max().item()
        ms = bench._graph_ms(lambda: fused_attention(q, kh, vh, None, d**-0.5))
        nbytes = sum(t.numel() * t.element_size() for t in layer.key_stream.kernel_view().fields.values())
        nbytes += sum(t.numel() * t.element_size() for t in layer.value_stream.kernel_view().fields.values())
        row = (b, bits, name, ms * 1e3, base / ms, nbytes / ms / 1e6, err)
        rows.append(row)
        print("%3d x 32k kvquant-%d %-34s %8.1f us  x%.3f SDPA  %6.0f GB/s  max err %.2e" % row, flush=True)
        del cache, layer, kh, vh, out, want
ops.TUNING.update(saved)
print(f"\ncopy bandwidth {bw:.0f} GB/s; bf16 SDPA " + ", ".join(f"b{b} {ms * 1e3:.1f} us" for b, ms in bases.items()))
print("| batch x 32k | preset | variant | us | vs bf16 SDPA | GB/s of cache | max abs err vs reference |")
print("|---|---|---|---|---|---|---|")
for b, bits, name, us, x, gbs, err in rows:
    print(f"| {b} | kvquant-{bits} | {name} | {us:.1f} | x{x:.3f} | {gbs:.0f} | {err:.1e} |")
