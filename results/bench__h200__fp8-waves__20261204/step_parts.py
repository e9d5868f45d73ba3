"""Where a compiled decode step of `generate` goes on the host (issue 28: compiled `fp8-e4m3` at batch 16 x 32k was
x2.57 of DynamicCache against a 3.0 target; 4.43 ms of its 6.13 ms step were GPU work, BENCHMARKS.md run 8).

`generate` reads a device flag every step (its stop check), so after each step the GPU idles until the host has
finished the step's tail, prepared the next inputs and dispatched the compiled forward (dynamo's guards, the CUDA
graph tree, the launch). This script times those parts with host clocks around transformers' own functions (no
profiler), on the bench's model (8 Llama-3-8B layers, random bf16 weights), a fresh cache a call, the second call
timed; then the dispatch alone under cProfile, and the guards dynamo installed (counted from its guards log).

usage: python3 step_parts.py SPEC:BATCH [SPEC:BATCH ...]   (SPEC: a preset, or "static" for transformers' StaticCache)
"""
import collections
import cProfile
import io
import logging
import pstats
import statistics
import sys
import time

import torch
from transformers import LogitsProcessorList

from hf_kvcache import _compat, bench

torch.backends.cuda.enable_cudnn_sdp(False)
N = 32
GUARDS = []
IDLE = "GPU idle before launch (host up to the call's return)"


class _Guards(logging.Handler):
    def emit(self, record):
        if record.name.endswith("__guards"):
            GUARDS.extend(record.getMessage().splitlines())


torch._logging.set_logs(guards=True)
logging.getLogger("torch._dynamo").addHandler(_Guards())


def timed_generate(model, spec, ids):
    T = collections.defaultdict(list)
    last = {}
    prep_orig, gcc_orig = type(model).prepare_inputs_for_generation, type(model).get_compiled_call

    def prep(*args, **kwargs):
        T["prep0"].append(time.perf_counter())
        out = prep_orig(model, *args, **kwargs)
        T["prep1"].append(time.perf_counter())
        last["inputs"] = out
        return out

    def gcc(cfg):
        fn = gcc_orig(model, cfg)
        last["fn"] = fn

        def call(*a, **k):
            T["call0"].append(time.perf_counter())
            out = fn(*a, **k)
            T["call1"].append(time.perf_counter())
            return out
        return call

    class Clock:
        def __call__(self, input_ids, scores):
            T["proc"].append(time.perf_counter())
            torch.cuda.synchronize()
            T["sync"].append(time.perf_counter())
            return scores

    cache, attn = bench._decode_cache(spec, model, ids.shape[1] + N, compiled=True)
    bench._set_attention(model, attn)
    model.prepare_inputs_for_generation, model.get_compiled_call = prep, gcc
    try:
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                       logits_processor=LogitsProcessorList([Clock()]), **_compat.cache_kwargs(cache))
        torch.cuda.synchronize()
        call_s = time.perf_counter() - t0
    finally:
        del model.prepare_inputs_for_generation, model.get_compiled_call
    return T, last, cache, call_s


def parts(T):
    """Median host times (us) of the parts of decode steps 4..N-2, each step from one stop-check sync to the next."""
    rows = collections.defaultdict(list)
    for i in range(4, len(T["call0"]) - 1):
        # decode step i: prepare_inputs call i+1 (call 0 was the prefill's), compiled call i, processor call i+1
        s0, s1 = T["sync"][i], T["sync"][i + 1]
        rows["step"].append(s1 - s0)
        rows["tail (argmax, stop check)"].append(T["prep0"][i + 1] - s0)
        rows["prepare_inputs (mask)"].append(T["prep1"][i + 1] - T["prep0"][i + 1])
        rows["to the call"].append(T["call0"][i] - T["prep1"][i + 1])
        rows["compiled call returns"].append(T["call1"][i] - T["call0"][i])
        rows["call to processor"].append(T["proc"][i + 1] - T["call1"][i])
        rows["wait for the GPU"].append(T["sync"][i + 1] - T["proc"][i + 1])
        rows[IDLE].append(T["call1"][i] - s0)
    return {k: statistics.median(v) * 1e6 for k, v in rows.items()}


@torch.no_grad()
def dispatch_profile(last, calls=30):
    """The compiled forward alone on the last step's inputs (the cache takes `calls` more tokens into its spare
    rows): host us per call, synchronized before each, and cProfile's top functions."""
    fn, inputs = last["fn"], last["inputs"]
    ts = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(**inputs, return_dict=True)
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        fn(**inputs, return_dict=True)
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(16)
    text = "\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())
    return statistics.median(ts) * 1e6, min(ts) * 1e6, text


def main():
    model = bench._random_model(8)
    summary = []
    for arg in sys.argv[1:]:
        spec, batch = arg.split(":")
        batch = int(batch)
        ids = torch.randint(0, model.config.vocab_size, (batch, 32768), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch))
        torch._dynamo.reset()
        if hasattr(model, "_compiled_call"):
            del model._compiled_call
        GUARDS.clear()
        _, _, cache, first_s = timed_generate(model, spec, ids)
        del cache
        leaves = [ln for ln in GUARDS if "+- " in ln and "GuardManager" not in ln]
        n_lines = len(leaves)
        n_cache = sum("past_key_values" in ln for ln in leaves)
        latency = [ln.split("=")[-1].strip() for ln in GUARDS if "Guard eval latency" in ln]
        T, last, cache, call_s = timed_generate(model, spec, ids)
        if "fn" not in last:
            print(f"\n=== {spec} batch {batch}: generate did not compile its decode step")
            continue
        p = parts(T)
        med, best, text = dispatch_profile(last)
        print(f"\n=== {spec} batch {batch}: first call {first_s:.1f} s, second {call_s:.1f} s; guard lines {n_lines}, "
              f"of them naming past_key_values {n_cache}; dynamo's guard eval latency {latency}")
        for k, v in p.items():
            print(f"  {k:55s} {v:8.0f} us")
        print(f"  compiled forward alone, synchronized before each: median {med:.0f} us, best {best:.0f} us")
        print(text[:5000])
        kinds = collections.Counter(ln.split("+- ", 1)[1].split(":")[0] for ln in leaves)
        print("  guards by kind:", kinds.most_common(10))
        cache_kinds = collections.Counter(ln.split("+- ", 1)[1].split(":")[0] for ln in leaves if "past_key_values" in ln)
        print("  guards naming the cache, by kind:", cache_kinds.most_common(10))
        summary.append((spec, batch, p, med))
        del cache, last, T
        torch.cuda.empty_cache()
    print("\n| cache | batch | step | GPU idle before launch | tail | prepare_inputs | compiled call returns | forward alone |")
    print("|---|---|---|---|---|---|---|---|")
    for spec, batch, p, med in summary:
        print(f"| {spec} | {batch} | {p['step'] / 1e3:.2f} ms | {p[IDLE]:.0f} us | "
              f"{p['tail (argmax, stop check)']:.0f} us | {p['prepare_inputs (mask)']:.0f} us | "
              f"{p['compiled call returns']:.0f} us | {med:.0f} us |")


if __name__ == "__main__":
    main()
