"""What a decode step's boolean mask costs the fused attention, and what loading its row a tile ahead gives back: one
decode step at batch 16 x 32k (Llama-3-8B heads, bf16) of each preset with no mask, with the all-True mask over the
capacity that `generate` passes a compileable cache at every step (`TUNING["mask_ahead"]` on, the default, and off:
the row loaded in the tile that uses it), and with a padded mask (the kernel against the reference). GPU time by
CUDA-graph replay (`bench._graph_ms`), bf16 SDPA (cuDNN off) as the baseline. Figures printed last.

usage: python3 sweep_mask.py [spec ...]   (default: fp8-e4m3 int8 int4-g128 turboquant-4)"""
import sys

import torch

from hf_kvcache import bench
from hf_kvcache.attention import fused_attention, reference_attention
from hf_kvcache.kernels import ops

torch.backends.cuda.enable_cudnn_sdp(False)
config = bench._llama_config(1)
hq, hkv, d = 32, 8, 128
b, s = 16, 32768
specs = sys.argv[1:] or ["fp8-e4m3", "int8", "int4-g128", "turboquant-4"]
gen = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
k[..., 7] *= 10
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
run, _ = bench._sdpa_decode(q, k, v)
base = bench._graph_ms(run)
del run
saved = dict(ops.TUNING)
rows = []
with torch.no_grad():
    for spec in specs:
        cache, (kh, vh) = bench._filled_layer(spec, k, v, config)
        layer = cache.layers[0]
        cap = layer.capacity
        held = layer.held_tokens
        ones = torch.zeros(b, 1, 1, cap, dtype=torch.bool, device="cuda")
        ones[..., :held] = True
        padded = ones.clone()
        padded[1::2, ..., :1000] = False
        padded[::3, ..., 20000:20100] = False
        qr = layer.rotate_query(q)
        for name, mask, ahead in (("no mask", None, True), ("mask, row a tile ahead", ones, True),
                                  ("mask, row in its tile", ones, False)):
            ops.TUNING.update(saved)
            ops.TUNING["mask_ahead"] = ahead
            ms = bench._graph_ms(lambda: fused_attention(qr, kh, vh, mask, d**-0.5))
            rows.append((spec, name, ms * 1e3, base / ms))
            print("%-14s %-24s %8.1f us  x%.3f SDPA" % rows[-1], flush=True)
        ops.TUNING.update(saved)
        out = fused_attention(qr, kh, vh, padded, d**-0.5)
        want = reference_attention(qr, kh, vh, padded[..., :held], d**-0.5, chunk_tokens=4096).transpose(1, 2)
        err = (out.float() - want.float()).abs().max().item()
        print(f"{spec}: padded mask, max abs err against the reference {err:.1e}", flush=True)
        rows.append((spec, f"padded mask: max abs err {err:.1e}", float("nan"), float("nan")))
        del cache, layer, kh, vh
ops.TUNING.update(saved)
print(f"\nbf16 SDPA {base * 1e3:.1f} us (batch {b} x 32k)")
print("| preset | mask | us | vs bf16 SDPA |")
print("|---|---|---|---|")
for spec, name, us, x in rows:
    print(f"| {spec} | {name} | {us:.1f} | x{x:.3f} |")
