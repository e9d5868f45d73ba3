"""The host time of one eager layer step (update of one token + the attention; issue 28's target: at most 50 us) for
every preset and DynamicCache, measured the way the bench measures it (`bench._host_us_per_layer`: 20 steps launched
back to back on layer 0, the least of 5 rounds), but in one process, on one-layer caches of batch 16 x 4096 tokens of
the Llama-3-8B shape, the presets interleaved over 3 passes so that a drift of the host's speed shows in every row
rather than in one. Also: how many nodes each layer's CUDA graph holds (a graph's launch costs host time per node).

usage: python3 host_steps.py [spec ...]   (default: every preset)"""
import sys

import torch

from hf_kvcache import bench
from hf_kvcache.presets import PRESETS

torch.backends.cuda.enable_cudnn_sdp(False)
B, S = 16, 4096
specs = sys.argv[1:] or ["dynamic"] + [p for p in PRESETS if p not in ("none", "int4-g64", "kvquant-2", "rotated-3",
                                                                         "rotated-2", "turboquant-2.75", "turboquant-2.5")]
config = bench._llama_config(1)
hq, hkv, d = 32, 8, 128
gen = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16, generator=gen)
v = torch.randn(B, hkv, S, d, device="cuda", dtype=torch.bfloat16, generator=gen)
model = bench._random_model(1)
caches = {}
for spec in specs:
    if spec == "dynamic":
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
        cache.update(k, v, 0)
        caches[spec] = (cache, "sdpa")
        continue
    cache, _ = bench._filled_layer(spec, k, v, config)
    caches[spec] = (cache, "hf_kvcache")
times = {s: [] for s in specs}
with torch.no_grad():
    for _ in range(3):
        for spec in specs:
            cache, attn = caches[spec]
            bench._set_attention(model, attn)
            try:
                times[spec].append(bench._host_us_per_layer(model, cache, B))
            except Exception as error:
                print(f"{spec}: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
                times[spec].append(float("nan"))
            finally:
                from hf_kvcache.patching import unfuse

                unfuse(model)
print("\n| cache | host us a layer step (least of 3 passes) | the 3 passes |")
print("|---|---|---|")
for spec in specs:
    t = times[spec]
    print(f"| {spec} | {min(t):.0f} | {' / '.join(f'{x:.0f}' for x in t)} |")
