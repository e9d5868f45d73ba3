"""Host cost of one fused attention call (dev only): tiny shapes, so the GPU work is negligible."""
import time

import torch
import triton

from hf_kvcache import bench
from hf_kvcache.attention import fused_attention
from hf_kvcache.kernels import decode

config = bench._llama_config(1)
for spec in ("int4-g32", "kivi-2", "fp8-e4m3"):
    k = torch.randn(1, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    cache, (kh, vh) = bench._filled_layer(spec, k, v, config)
    for _ in range(20):
        fused_attention(q, kh, vh, None, 0.08)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(500):
        fused_attention(q, kh, vh, None, 0.08)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    print(f"{spec}: host {(t1 - t0) / 500 * 1e6:.1f} us per fused_attention call", flush=True)
    t0 = time.perf_counter()
    for _ in range(500):
        cache.layers[0].update(k[:, :, -1:], v[:, :, -1:])
    torch.cuda.synchronize()
    print(f"{spec}: host {(time.perf_counter() - t0) / 500 * 1e6:.1f} us per update (pack) call", flush=True)
# bare launch of the small combine kernel, for scale
acc = torch.zeros(32 * 2, 128, device="cuda")
m = torch.zeros(32 * 2, device="cuda")
out = torch.empty(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
args = (acc, m, m, out, out.stride(0), out.stride(1), out.stride(2), m, 8, 1, 2, 16)
meta = dict(G=4, D=128, NP=2, HAS_SAUX=False, num_warps=4)
decode._combine[(32,)](*args, **meta)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(2000):
    decode._combine[(32,)](*args, **meta)
t1 = time.perf_counter()
torch.cuda.synchronize()
print(f"bare Triton launch of _combine (12 args): {(t1 - t0) / 2000 * 1e6:.1f} us", flush=True)
print("triton", triton.__version__)
