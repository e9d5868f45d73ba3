"""Where KVQuant's fused attention spends its time: B16 x 32k, Llama-8B heads, variants timed by CUDA-graph replay."""
import torch
from hf_kvcache import bench, make_cache
from hf_kvcache.attention import fused_attention, reference_attention
from hf_kvcache.kernels import ops

torch.backends.cuda.enable_cudnn_sdp(False)
config = bench._llama_config(1)
hq, hkv, d = 32, 8, 128
b, s = 16, 32768
gen = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=gen)
run, _ = bench._sdpa_decode(q, k, v)
base = bench._graph_ms(run)
print(f"bf16 sdpa {base*1e3:.1f} us")
bench._make_layer_cache("kvquant-3", config)
model, cal = bench._CALIBRATED["model"], bench._calibrated(bench._CALIBRATED["model"])
variants = [
    ("default", {}, {}),
    ("gather lookup", {}, {"nuq_select": False}),
    ("accurate trig", {}, {"nuq_fast_trig": False}),
    ("block_n 16", {}, {"nuq_block_n": 16}),
    ("block_n 64", {}, {"nuq_block_n": 64}),
    ("block_n 16 warps 2", {}, {"nuq_block_n": 16, "num_warps": 2}),
    ("block_n 32 warps 8", {}, {"num_warps": 8}),
    ("post-RoPE (no trig)", {"pre_rope": False}, {}),
    ("no outlier slots", {"outlier_fraction": 0.0}, {}),
    ("no RoPE, no slots", {"pre_rope": False, "outlier_fraction": 0.0}, {}),
    ("4-bit", {"bits": 4}, {}),
]
saved = dict(ops.TUNING)
timings = {}
with torch.no_grad():
    for name, kw, tune in variants:
        cache = make_cache("kvquant-3", model, calibration=cal, **kw)
        layer = cache.layers[0]
        layer.fused = True
        layer.update(k, v)
        kh, vh = layer.update(k[:, :, -1:].clone(), v[:, :, -1:].clone())
        ops.TUNING.update(saved)
        ops.TUNING.update(tune)
        out = fused_attention(q, kh, vh, None, d**-0.5)
        ms = bench._graph_ms(lambda: fused_attention(q, kh, vh, None, d**-0.5))
        print(f"{name:>22}: {ms*1e3:9.1f} us  x{base/ms:.3f}")
        if name.startswith("block_n") or name == "default":
            timings[tune.get("nuq_block_n", 32), tune.get("num_warps", 4)] = ms
        del cache, kh, vh
ops.TUNING.update(saved)
best = min(timings, key=timings.get)
print(f"BEST block_n {best[0]} warps {best[1]}")
open("/tmp/best_nuq.sh", "w").write(f"export HF_KVCACHE_NUQ_BLOCK_N={best[0]} HF_KVCACHE_NUM_WARPS={best[1]}\n")
