"""GPU run: where an eager layer step (update + fused attention) spends its host time, batch 1 x 32k, 8B heads.

Prints per spec: host us per layer step (update + attention, launched back to back, synchronized at the end), the
same for update alone and attention alone, and cProfile's top functions; then the torch.profiler CPU table of one
eager model step of fp8 (8 layers) to see what else a generate step pays."""
import cProfile, io, os, pstats, sys, time
import torch
from hf_kvcache import bench
from hf_kvcache.attention import fused_attention
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

torch.backends.cuda.enable_cudnn_sdp(False)
config = bench._llama_config(1)
hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
b, s = int(sys.argv[1]) if len(sys.argv) > 1 else 1, 32768
specs = sys.argv[2].split(",") if len(sys.argv) > 2 else ["fp8-e4m3", "int8", "int4-g128", "kivi-2", "exact"]
g = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn_like(k)
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
kn = k[:, :, -1:].clone()
mod = torch.nn.Module()
mod.num_key_value_groups = hq // hkv
mod.is_causal = True
summary = []


def timed(fn, n=100):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e6
    return host, wall


dyn = DynamicCache(config=config)
dyn.update(k, v, 0)
def dyn_step():
    kk, vv = dyn.update(kn, kn, 0)
    sdpa_attention_forward(mod, q, kk, vv, None, scaling=d ** -0.5)
h, w = timed(dyn_step, 20)
summary.append(f"dynamic+sdpa  step host {h:6.0f} us  wall {w:6.0f} us")
del dyn

for spec in specs:
    cache, (kh, vh) = bench._filled_layer(spec, k, v, config)
    layer = cache.layers[0]
    state = {}
    def upd():
        state["h"] = layer.update(kn, kn)
    def att():
        kh2, vh2 = state["h"]
        fused_attention(layer.rotate_query(q), kh2, vh2, None, d ** -0.5)
    def step():
        upd(); att()
    hs, ws = timed(step)
    hu, _ = timed(upd)
    ha, wa = timed(att)
    summary.append(f"{spec:12s}  step host {hs:6.0f} us  wall {ws:6.0f} us  update {hu:5.0f} us  attention {ha:5.0f} us (wall {wa:5.0f})")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        step()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(22)
    if not os.environ.get("NO_PROFILE"):
        print(f"==== {spec}\n" + out.getvalue()[-6000:], flush=True)
    del cache, kh, vh, layer, state
print("\n".join(summary))

# The whole eager model step (8 layers), batch b x 32k: what the host does besides the cache.
import os
if os.environ.get("NO_MODEL"):
    sys.exit(0)
from torch.profiler import ProfilerActivity, profile
model = bench._random_model(8)
for name in ["dynamic", "fp8-e4m3"]:
    cache, attn = bench._decode_cache(name, model, s, False)
    bench._set_attention(model, attn)
    bench._fill(cache, model, b, s)
    bench._generate_from(model, cache, b, 4, False)
    t = bench._generate_from(model, cache, b, 16, False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench._generate_from(model, cache, b, 16, False)
    print(f"==== model step {name}: {t / 16 * 1e3:.2f} ms/step")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
    del cache
print("\n".join(summary))
