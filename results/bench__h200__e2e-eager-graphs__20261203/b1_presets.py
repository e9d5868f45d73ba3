"""Issue 28, GPU run 10: eager `generate` at batch 1 x 32k for many presets (the bench's 8-layer Llama-3-8B shape,
random bf16 weights, caches built without max_cache_len, 32 new tokens, the bench's step clock).

Two warm-up calls a spec (Triton's compiles, the graphs' capture), then three rounds with the specs interleaved, so
that a drift of the host shows in every row; each round's line printed as it ends (a call cut short by its time limit
keeps the rounds done). The ratio is DynamicCache's best step over the spec's best.

python3 results/bench__h200__e2e-eager-graphs__20261203/b1_presets.py dynamic,kivi-4,turboquant-3.5
"""

import collections
import sys

import torch

from hf_kvcache import bench
from hf_kvcache.patching import unfuse

torch.backends.cuda.enable_cudnn_sdp(False)


def one(model, spec, ids):
    try:
        return bench._generate_once(model, spec, ids, 32, compiled=False)["step_ms"]
    finally:
        unfuse(model)  # a RotatedCache fused its rotation into the weights: the next spec gets the plain model


def main():
    run(bench._random_model(8), sys.argv[1].split(","))


def run(model, specs):
    ids = torch.randint(0, model.config.vocab_size, (1, 32768), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    for spec in specs:
        for _ in range(2):
            one(model, spec, ids)
        print(f"warm: {spec}", flush=True)
    steps = collections.defaultdict(list)
    for r in range(3):
        for spec in specs:
            steps[spec].append(one(model, spec, ids))
        base = min(steps[specs[0]])
        print(f"round {r + 1}: " + "  ".join(f"{s} {steps[s][-1]:.2f} ms (best x{base / min(steps[s]):.2f})"
                                             for s in specs), flush=True)


if __name__ == "__main__":
    main()
