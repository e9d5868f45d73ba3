"""Where one decode step's time goes (dev only): 4-layer Llama-8B shape, batch 16, context 32k."""
import gc
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_kvcache import bench, _compat

torch.backends.cuda.enable_cudnn_sdp(False)
model = bench._random_model(int(os.environ.get("LAYERS", "4")))
b, s = 16, 32768
ids = torch.randint(0, model.config.vocab_size, (b, s), device="cuda")
for name in sys.argv[1:]:
    cache, attn = bench._make_e2e_cache(name, model)
    bench._set_attention(model, attn)
    with torch.no_grad():
        model(ids[:, :-1], use_cache=True, logits_to_keep=1, **_compat.cache_kwargs(cache))
        tok = ids[:, -1:]
        pos = s - 1
        def step():
            global pos
            out = model(tok, use_cache=True, cache_position=torch.tensor([pos], device="cuda"),
                        **_compat.cache_kwargs(cache))
            pos += 1
            return out
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        print(f"== {name}: forward step {(time.perf_counter() - t0) / 5 * 1e3:.2f} ms (no generate)", flush=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
    del cache
    gc.collect()
    torch.cuda.empty_cache()
