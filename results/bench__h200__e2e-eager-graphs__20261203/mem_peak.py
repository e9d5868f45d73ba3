"""Issue 28, GPU run 8: what is live at the peak of `generate(..., prefill_chunk_size=2048)` at batch 16 x 32k (the
bench's 8-layer Llama-3-8B shape, random bf16 weights), for a cache built without max_cache_len.

One warm-up call (Triton's compiles, the graphs' pools), then one call under
`torch.cuda.memory._record_memory_history`: the allocator's trace replayed to find the moment of the peak, and the
blocks live then (allocated during the call) grouped by the innermost frame in hf_kvcache or transformers, largest
first. Also the peak as the allocator counts it (`max_memory_allocated`, reserved) and the cache's own bytes.

python3 results/bench__h200__e2e-eager-graphs__20261203/mem_peak.py fp8-e4m3 16 2048
"""

import collections
import sys

import torch

from hf_kvcache import bench

torch.backends.cuda.enable_cudnn_sdp(False)


def site(frames):
    """The innermost frame in library or transformers code, and the one above it (who asked)."""
    ours = [f for f in frames if "hf_kvcache" in f["filename"] or "transformers" in f["filename"]]
    if not ours:
        return "(torch) " + (f"{frames[0]['filename'].split('/')[-1]}:{frames[0]['line']}" if frames else "?")
    inner = ours[0]
    name = inner["filename"].split("site-packages/")[-1].split("/work/")[-1]
    outer = ours[1] if len(ours) > 1 else None
    tail = f" <- {outer['filename'].split('/')[-1]}:{outer['line']} {outer['name']}" if outer else ""
    return f"{name}:{inner['line']} {inner['name']}{tail}"


def main():
    spec, batch, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = bench._random_model(8)
    ids = torch.randint(0, model.config.vocab_size, (batch, 32768), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(batch))
    warm = bench._generate_once(model, spec, ids, 32, compiled=False, chunk=chunk)
    print(f"{spec} b{batch} chunk {chunk}: warm-up call peak {warm['peak_gb']:.2f} GB over the weights, cache "
          f"{warm['cache_gb']:.2f} GB ({warm['peak_gb'] / warm['cache_gb']:.2f}x)")
    del warm
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=300_000)
    r = bench._generate_once(model, spec, ids, 32, compiled=False, chunk=chunk)
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f"recorded call: peak {r['peak_gb']:.2f} GB over the weights, cache {r['cache_gb']:.2f} GB "
          f"({r['peak_gb'] / r['cache_gb']:.2f}x); reserved now {torch.cuda.memory_reserved() / 1e9:.2f} GB, "
          f"allocated before the call {base / 1e9:.2f} GB")
    trace = snap["device_traces"][torch.cuda.current_device()]
    print(f"trace: {len(trace)} events")
    live, cur, best, best_i = {}, 0, 0, -1
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
        if cur > best:
            best, best_i = cur, i
    live = {}
    for e in trace[: best_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    by_site = collections.defaultdict(lambda: [0, 0])
    for e in live.values():
        s = by_site[site(e.get("frames", []))]
        s[0] += e["size"]
        s[1] += 1
    print(f"peak of the call's own allocations: {best / 1e9:.2f} GB at event {best_i} of {len(trace)}; "
          f"its last frames: {site(trace[best_i].get('frames', []))}")
    for name, (size, count) in sorted(by_site.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {size / 1e9:8.3f} GB  x{count:<5d} {name}")


if __name__ == "__main__":
    main()
