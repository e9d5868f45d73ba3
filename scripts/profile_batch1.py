"""Where a batch-1 decode step's GPU time goes (issue 52): DynamicCache and each preset given, eager, on the bench's
model (8 layers of the Llama-3-8B shape, bf16, CUDA) continuing a filled context. Prints, per cache, the GPU time of
a step and its kernels by GPU time a step (kernels replayed inside the layers' CUDA graphs included), so that the
kernels a packed cache adds or replaces beside DynamicCache's stand side by side. With `prefill`, the same for
`generate`'s prefill of a prompt of `context` tokens in chunks of 2048 (one new token), DynamicCache chunked beside.

    python3 scripts/profile_batch1.py [prefill] [context] turboquant-4 kivi-2 ...
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


def prefill_kernels(model, name: str, context: int, chunk: int = 2048) -> list[tuple[float, float, str]]:
    """(us, calls, name) of every kernel of `generate`'s prefill of `context` random tokens in chunks of `chunk`
    into a fresh cache of `name` (after a warm-up prefill of 2 chunks), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    from hf_kvcache.bench.prefill import _make_e2e_cache, _prefill_s

    ids = torch.randint(0, model.config.vocab_size, (1, context), device="cuda")
    for prompt in (ids[:, : 2 * chunk + 64], ids):
        cache, attn = _make_e2e_cache(name, model)
        _set_attention(model, attn)
        if prompt is ids:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                seconds = _prefill_s(model, cache, prompt, chunk)
        else:
            _prefill_s(model, cache, prompt, chunk)
        del cache
    print(f"prefill wall {seconds:.3f} s")
    rows = [(e.self_device_time_total, e.count, e.key) for e in prof.key_averages() if e.self_device_time_total > 0]
    return sorted(rows, reverse=True)


def main() -> None:
    args = sys.argv[1:]
    prefill = bool(args) and args[0] == "prefill"
    args = args[1:] if prefill else args
    context = int(args.pop(0)) if args and args[0].isdigit() else 32768
    model = _random_model(8)
    for name in ["dynamic"] + (args or ["fp8-e4m3", "turboquant-4", "kivi-2"]):
        if prefill:
            rows = prefill_kernels(model, name, context)
            what, unit = f"prefill of 1 x {context} in chunks of 2048", "ms in all"
        else:
            cache, attn = _decode_cache(name, model, context, False)
            _set_attention(model, attn)
            _fill(cache, model, 1, context)
            _generate_from(model, cache, 1, 4, False)  # compiles, captures the layers' graphs
            rows = kernels_per_step(model, cache)
            what, unit = f"batch 1 x {context}, eager", "ms a step"
            del cache
        total = sum(us for us, _, _ in rows)
        print(f"\n== {name} ({what}): GPU {total / 1e3:.3f} {unit}")
        for us, calls, key in rows[:14]:
            print(f"{us:9.1f} us  {calls:6.1f} calls  {key[:90]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
