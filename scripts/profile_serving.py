"""Where a serving step's time goes (issue 54): one format's pages through transformers' continuous batching on the
bench's model (8 layers of the Llama-3-8B shape, bf16, CUDA) under torch.profiler. Prints the run's figures, the GPU's
busy time against the wall time (a GPU far from busy: the host bounds the step), and the kernels by GPU time.

    python3 scripts/profile_serving.py turboquant-4 [requests] [new tokens]
"""

from __future__ import annotations

import sys
import time

import torch

from hf_kvcache.bench._common import _random_model
from hf_kvcache.bench.serving import serve_workload, workload


def host_profile(run):
    """`run()` with the packed allocator's own host work (`update` and the read) under cProfile: the functions by
    their own time."""
    import cProfile
    import pstats

    from hf_kvcache import paged

    profile = cProfile.Profile()
    originals = {name: getattr(paged.PackedPageAllocator, name) for name in ("update", "attend")}

    def timed(fn):
        def wrapper(*args, **kwargs):
            profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                profile.disable()
        return wrapper

    for name, fn in originals.items():
        setattr(paged.PackedPageAllocator, name, timed(fn))
    try:
        start = time.perf_counter()
        run()
        wall = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(paged.PackedPageAllocator, name, fn)
    stats = pstats.Stats(profile)
    print(f"wall {wall:.2f} s, in the allocator's update and read {stats.total_tt:.2f} s")
    stats.sort_stats("tottime").print_stats(25)


def main() -> None:
    spec = sys.argv[1]
    requests = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    new = int(sys.argv[3]) if len(sys.argv) > 3 else 32
    model = _random_model(8)
    prompts = workload(requests, 512, 1536, vocab=model.config.vocab_size)
    serve_workload(model, spec, prompts[:4], 4, int(1e9))  # compiles the kernels
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        row = serve_workload(model, spec, prompts, new, int(1e9))
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e6
    print({k: row[k] for k in ("method", "most_running", "tokens_per_s", "tpot_ms_median")})
    print(f"wall {wall:.2f} s, GPU busy {gpu:.2f} s ({100 * gpu / wall:.0f}%)")
    print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
    host_profile(lambda: serve_workload(model, spec, prompts, new, int(1e9)))


if __name__ == "__main__":
    main()
