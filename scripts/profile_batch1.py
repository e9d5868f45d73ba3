"""Where a batch-1 decode step's GPU time goes (issue 52): DynamicCache and each preset given, eager, on the bench's
model (8 layers of the Llama-3-8B shape, bf16, CUDA) continuing a filled context. Prints, per cache, the GPU time of
a step and its kernels by GPU time a step (kernels replayed inside the layers' CUDA graphs included), so that the
kernels a packed cache adds or replaces beside DynamicCache's stand side by side.

    python3 scripts/profile_batch1.py [context] turboquant-4 kivi-2 ...
"""

from __future__ import annotations

import sys

import torch

from hf_kvcache.bench._common import _fill, _random_model, _set_attention
from hf_kvcache.bench.e2e import _decode_cache, _generate_from

STEPS = 16


def kernels_per_step(model, cache, steps: int = STEPS) -> list[tuple[float, float, str]]:
    """(us a step, calls a step, name) of every kernel over `steps` decode steps, the longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _generate_from(model, cache, 1, steps, False)
    rows = [(e.self_device_time_total / steps, e.count / steps, e.key) for e in prof.key_averages()
            if e.self_device_time_total > 0]
    return sorted(rows, reverse=True)


def main() -> None:
    args = sys.argv[1:]
    context = int(args.pop(0)) if args and args[0].isdigit() else 32768
    model = _random_model(8)
    for name in ["dynamic"] + (args or ["fp8-e4m3", "turboquant-4", "kivi-2"]):
        cache, attn = _decode_cache(name, model, context, False)
        _set_attention(model, attn)
        _fill(cache, model, 1, context)
        _generate_from(model, cache, 1, 4, False)  # compiles, captures the layers' graphs
        rows = kernels_per_step(model, cache)
        total = sum(us for us, _, _ in rows)
        print(f"\n== {name} (batch 1 x {context}, eager): GPU {total / 1e3:.3f} ms a step")
        for us, calls, key in rows[:14]:
            print(f"{us:9.1f} us  {calls:6.1f} calls  {key[:90]}")
        del cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
