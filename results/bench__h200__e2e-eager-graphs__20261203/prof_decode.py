"""Issue 28, GPU run 8: where a decode step of `generate` goes, eager and compiled (the bench's 8-layer Llama-3-8B
shape, random bf16 weights, a 32k random prompt, 32 new tokens, the bench's caches and step clock).

For each `spec:mode:batch` (mode eager or compiled): two warm-up calls (the first compiles), then one call under
torch.profiler with a schedule stepped by a logits processor, so that only decode steps 3-18 are recorded: GPU time a
step (kernels' device time summed, graph replays included) against the step's wall time, the top kernels, the top
host operators; then one call under cProfile (the host's Python time by function, top 18).

python3 results/bench__h200__e2e-eager-graphs__20261203/prof_decode.py fp8-e4m3:compiled:16 fp8-e4m3:eager:1
"""

import cProfile
import io
import pstats
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, schedule
from transformers import LogitsProcessorList

from hf_kvcache import _compat, bench

torch.backends.cuda.enable_cudnn_sdp(False)
N, ACTIVE = 32, 16


class Stepper:
    def __init__(self, prof):
        self.prof, self.times = prof, []

    def __call__(self, input_ids, scores):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        if self.prof is not None:
            self.prof.step()
        return scores


def call(model, spec, ids, compiled, prof=None):
    cache, attn = bench._decode_cache(spec, model, ids.shape[1] + N, compiled)
    bench._set_attention(model, attn)
    clock = Stepper(prof)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), disable_compile=not compiled,
                   **_compat.cache_kwargs(cache))
    torch.cuda.synchronize()
    gaps = sorted(b - a for a, b in zip(clock.times[1:], clock.times[2:]))
    return gaps[len(gaps) // 2] * 1e3


def main():
    model = bench._random_model(8)
    print(f"copy bandwidth {bench.copy_bandwidth_gbs():.0f} GB/s")
    summary = []
    for item in sys.argv[1:]:
        spec, mode, batch = item.split(":")
        batch, compiled = int(batch), mode == "compiled"
        ids = torch.randint(0, model.config.vocab_size, (batch, 32768), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch))
        torch._dynamo.reset()
        if hasattr(model, "_compiled_call"):
            del model._compiled_call
        t0 = time.perf_counter()
        call(model, spec, ids, compiled)
        first = time.perf_counter() - t0
        step = call(model, spec, ids, compiled)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     schedule=schedule(skip_first=3, wait=0, warmup=2, active=ACTIVE, repeat=1)) as prof:
            prof_step = call(model, spec, ids, compiled, prof)
        events = prof.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        gpu_us = sum(e.self_device_time_total for e in kernels) / ACTIVE
        print(f"\n=== {spec} {mode} b{batch}: step {step:.2f} ms ({prof_step:.2f} profiled), GPU {gpu_us / 1e3:.2f} ms "
              f"a step; first call {first:.1f} s")
        print("  top kernels (us a step, launches a step):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]:
            print(f"    {e.self_device_time_total / ACTIVE:9.1f}  x{e.count / ACTIVE:<6.1f} {e.key[:120]}")
        cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        print("  top host ops (us a step, self):")
        for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"    {e.self_cpu_time_total / ACTIVE:9.1f}  x{e.count / ACTIVE:<6.1f} {e.key[:120]}")
        pr = cProfile.Profile()
        pr.enable()
        cprof_step = call(model, spec, ids, compiled)
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
        print(f"  cProfile of one call (step {cprof_step:.2f} ms under it; times for the whole call, prefill in):")
        print("\n".join("    " + line for line in out.getvalue().splitlines() if line.strip())[:5000])
        summary.append(f"{spec:>12} {mode:>8} b{batch:<3d} step {step:6.2f} ms  GPU {gpu_us / 1e3:6.2f} ms  "
                       f"first call {first:5.1f} s")
    print("\n" + "\n".join(summary))


if __name__ == "__main__":
    main()
