"""Issue 28, GPU run 6: where `generate`'s eager decode step goes at batch 1 x 32k (the bench's 8-layer Llama-3-8B
shape, random bf16 weights), for DynamicCache and presets built without max_cache_len.

For each spec, after two warm-up calls: three timed `generate` calls of 32 tokens (the bench's step clock; the specs
interleaved, so that a drift of the host shows in every row), then one call under cProfile (host time per function,
the decode steps' share) and one under `torch.cuda.set_sync_debug_mode("warn")` (the host syncs per step, by the
line of code that caused each).

python3 results/bench__h200__e2e-eager-graphs__20261203/profile_generate.py dynamic,fp8-e4m3,int8,int4-g128
"""

import collections
import cProfile
import io
import pstats
import sys
import warnings

import torch

from hf_kvcache import bench

torch.backends.cuda.enable_cudnn_sdp(False)
N = 32


def one(model, spec, ids):
    from hf_kvcache.patching import unfuse

    try:
        return bench._generate_once(model, spec, ids, N, compiled=False)
    finally:
        unfuse(model)  # a RotatedCache fused its rotation into the weights: the next spec gets the plain model


def main():
    specs = sys.argv[1].split(",")
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    model = bench._random_model(8)
    ids = torch.randint(0, model.config.vocab_size, (batch, 32768), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    for spec in specs:
        for _ in range(2):
            one(model, spec, ids)
    steps = collections.defaultdict(list)
    for _ in range(3):
        for spec in specs:
            steps[spec].append(one(model, spec, ids)["step_ms"])
    lines = []
    for spec in specs:
        prof = cProfile.Profile()
        prof.enable()
        r = one(model, spec, ids)
        prof.disable()
        out = io.StringIO()
        st = pstats.Stats(prof, stream=out)
        st.sort_stats("tottime").print_stats(22)
        print(f"\n=== {spec}: cProfile of one generate (step {r['step_ms']:.2f} ms under the profiler)")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
        syncs = collections.Counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                one(model, spec, ids)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for w in caught:
            if "synchroniz" in str(w.message):
                syncs[f"{w.filename.split('site-packages/')[-1]}:{w.lineno}"] += 1
        print(f"  syncs in one call of {N} tokens: {dict(syncs)}")
        base = min(steps[specs[0]])
        lines.append(f"{spec:>14} b{batch}: step ms {' '.join(f'{s:6.2f}' for s in steps[spec])}  "
                     f"best x{base / min(steps[spec]):.2f} DynamicCache  syncs/call {sum(syncs.values())}")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
