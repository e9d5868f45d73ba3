"""cProfile of the eager update of one TurboQuant layer (one token), batch 16, 8B heads, 1k held:
where the host time goes. `python3 results/bench__h200__turboquant-static__20261201/host_profile.py turboquant-4`."""
import cProfile, pstats, sys, time
import torch
from hf_kvcache import make_cache
from hf_kvcache.bench import _llama_config
cfg = _llama_config(1)
cache = make_cache(sys.argv[1], cfg)
k = torch.randn(16, 8, 1024, 128, device="cuda", dtype=torch.bfloat16)
cache.update(k, k, 0)
k1 = k[:, :, :1].contiguous()
for _ in range(5): cache.update(k1, k1, 0)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(50): cache.update(k1, k1, 0)
print(sys.argv[1], "update host us", (time.perf_counter() - t) / 50 * 1e6); torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(50): cache.update(k1, k1, 0)
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(18)
