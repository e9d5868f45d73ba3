"""Issue 28, GPU run 5: where an eager decode step's time goes at batch 1 x 32k (the bench's 8-layer Llama-3-8B shape,
random bf16 weights), for DynamicCache and presets built without max_cache_len.

For each spec: one `generate` of 16 tokens (compiles, captures), then a manual decode loop on that cache (the forward
`generate` runs, its mask of ones): the wall time of a step synchronized at its end (what the e2e clock sees) and of
steps launched back to back; the GPU time of one step (torch.profiler, kernels' device time summed) and its top
kernels; the host's top operators; the host syncs of one step (`torch.cuda.set_sync_debug_mode`, with the line of
library code that caused each); how many steps replayed a CUDA graph.

python3 results/bench__h200__e2e-eager-graphs__20261203/profile_step.py dynamic,fp8-e4m3,int8,int4-g128,turboquant-4

As run (run 5), the manual loop ran without `torch.no_grad()`: its wall and host times include autograd recording the
model's forward (17-20 ms a step against generate's 7), so only its GPU times, kernels and replay counts stand; run 6
(`profile_generate.py`) measured the host inside `generate` itself.
"""

import collections
import sys
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from hf_kvcache import _compat, bench, cache as cache_mod

torch.backends.cuda.enable_cudnn_sdp(False)
REPLAYS = collections.Counter()
_orig_capture = cache_mod.graphs.GraphPools.capture


def _counting_capture(self, device, fn):
    REPLAYS["captures"] += 1
    return _orig_capture(self, device, fn)


cache_mod.graphs.GraphPools.capture = _counting_capture
_orig_replay = torch.cuda.CUDAGraph.replay


def _counting_replay(self):
    REPLAYS["replays"] += 1
    return _orig_replay(self)


torch.cuda.CUDAGraph.replay = _counting_replay


def step_fn(model, cache, batch, s0):
    tok = torch.ones((batch, 1), dtype=torch.long, device="cuda")
    mask = torch.ones((batch, s0 + 200), dtype=torch.long, device="cuda")
    state = {"n": int(cache.get_seq_length())}

    def step():
        n = state["n"]
        out = model(input_ids=tok, attention_mask=mask[:, : n + 1], past_key_values=cache, use_cache=True,
                    logits_to_keep=1)
        state["n"] = n + 1
        return out.logits

    return step


def main():
    specs = sys.argv[1].split(",")
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    s = 32768
    model = bench._random_model(8)
    ids = torch.randint(0, model.config.vocab_size, (batch, s), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    summary = []
    for spec in specs:
        cache, attn = bench._make_e2e_cache(spec, model)
        bench._set_attention(model, attn)
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                       do_sample=False, disable_compile=True, **_compat.cache_kwargs(cache))
        torch.cuda.synchronize()
        step = step_fn(model, cache, batch, s + 16)
        REPLAYS.clear()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        synced = []
        for _ in range(20):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            synced.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        host_launch = (time.perf_counter() - t0) / 20
        torch.cuda.synchronize()
        free = (time.perf_counter() - t0) / 20
        replays = dict(REPLAYS)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 5
        kernels = sorted((e for e in events if e.self_device_time_total > 0), key=lambda e: -e.self_device_time_total)
        cpu_ops = sorted(events, key=lambda e: -e.self_cpu_time_total)
        # host syncs of one step, located in library code
        syncs = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" not in str(w.message):
                continue
            syncs[f"{w.filename}:{w.lineno}"] += 1
        print(f"\n=== {spec} batch {batch}: step synced {sorted(synced)[10] * 1e3:.2f} ms, launched back to back "
              f"{free * 1e3:.2f} ms a step (host {host_launch * 1e3:.2f} ms), GPU {gpu_us / 1e3:.2f} ms a step; "
              f"25 steps: {replays}")
        print("  top kernels (us a step):")
        for e in kernels[:10]:
            print(f"    {e.self_device_time_total / 5:9.1f}  x{e.count // 5:<4d} {e.key[:110]}")
        print("  top host ops (us a step, self):")
        for e in cpu_ops[:14]:
            print(f"    {e.self_cpu_time_total / 5:9.1f}  x{e.count // 5:<4d} {e.key[:110]}")
        print(f"  syncs in one step: {dict(syncs) or 'none'}")
        summary.append(f"{spec:>14} b{batch}: synced {sorted(synced)[10] * 1e3:6.2f} ms  free-running "
                       f"{free * 1e3:6.2f} ms  host {host_launch * 1e3:6.2f} ms  GPU {gpu_us / 1e3:6.2f} ms  "
                       f"syncs {sum(syncs.values())}  {replays}")
        del cache, step
        torch.cuda.empty_cache()
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
