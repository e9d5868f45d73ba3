"""Issue 28, GPU run 12: is the eager step's spread between calls (run 11: the same cache 6.95 then 15.02 ms) the
host's, the GPU's, or the cache's?

Calls of `generate` as the bench makes them (8 Llama-3-8B layers, random bf16 weights, 32k prompt, a fresh cache
built without max_cache_len, 32 greedy tokens), the specs interleaved round by round. Each step is split at the step
clock's synchronization: "host" is from the end of the previous step's synchronization to this step's logits
processor (generate's Python and every launch of the forward; the GPU runs meanwhile), "wait" is the
synchronization itself (the GPU work still queued when the host got there). Beside each call: two probes of the
host's own speed taken just before it (a pure-Python loop, and 200 launches of a tiny CUDA op timed on the host), the
process's CPU time over the call's wall time, its involuntary context switches, the load average, and the GPU's SM
and memory clocks and power after the call. One line per call, as it ends.

python3 results/bench__h200__e2e-bimodal__20261203/diag_bimodal.py 16:dynamic,fp8-e4m3 1:dynamic,fp8-e4m3,int4-g32 4
(batch:specs groups, then the number of rounds)
"""

import gc
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from transformers import LogitsProcessorList

from hf_kvcache import _compat, bench
from hf_kvcache.patching import unfuse

torch.backends.cuda.enable_cudnn_sdp(False)


class SplitClock:
    def __init__(self):
        self.enter, self.done = [], []

    def __call__(self, input_ids, scores):
        self.enter.append(time.perf_counter())
        torch.cuda.synchronize()
        self.done.append(time.perf_counter())
        return scores


def python_probe_ms() -> float:
    t = time.perf_counter()
    s = 0
    for i in range(300_000):
        s += i
    return (time.perf_counter() - t) * 1e3


def launch_probe_us(x: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(200):
        x.add_(1)
    dt = (time.perf_counter() - t) / 200 * 1e6
    torch.cuda.synchronize()
    return dt


def gpu_clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception as error:  # the probe must not end the run
        return f"nvidia-smi: {error}"


def one_call(model, spec, ids, tiny):
    gc.collect()
    torch.cuda.empty_cache()
    cache, attn = bench._decode_cache(spec, model, ids.shape[1] + 32, False)
    bench._set_attention(model, attn)
    probe_py, probe_launch = python_probe_ms(), launch_probe_us(tiny)
    clock = SplitClock()
    ru0, cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, min_new_tokens=32,
                       do_sample=False, logits_processor=LogitsProcessorList([clock]), disable_compile=True,
                       **_compat.cache_kwargs(cache))
    finally:
        unfuse(model)
    torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    steps = [b - a for a, b in zip(clock.done[1:], clock.done[2:])]
    host = [e - d for d, e in zip(clock.done[1:], clock.enter[2:])]
    wait = [d - e for e, d in zip(clock.enter[2:], clock.done[2:])]
    decode_s = clock.done[-1] - clock.done[0]
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    return dict(step=med(steps), host=med(host), wait=med(wait), probe_py=probe_py, probe_launch=probe_launch,
                cpu_frac=cpu / wall, decode_s=decode_s, nivcsw=ru1.ru_nivcsw - ru0.ru_nivcsw,
                load=os.getloadavg()[0], clocks=gpu_clocks())


def main():
    groups = [(int(g.split(":")[0]), g.split(":")[1].split(",")) for g in sys.argv[1:-1]]
    rounds = int(sys.argv[-1])
    model = bench._random_model(8)
    tiny = torch.zeros(1, device="cuda")
    print(f"threads {torch.get_num_threads()}, cpus {os.cpu_count()}, {gpu_clocks()}", flush=True)
    rows = []
    for batch, specs in groups:
        ids = torch.randint(0, model.config.vocab_size, (batch, 32768), device="cuda",
                            generator=torch.Generator(device="cuda").manual_seed(batch))
        for spec in specs:
            one_call(model, spec, ids, tiny)  # Triton's compiles, the first captures
        for r in range(rounds):
            for spec in specs:
                x = one_call(model, spec, ids, tiny)
                rows.append((batch, spec, x))
                print(f"b{batch:<2} r{r} {spec:>14}: step {x['step']:6.2f} ms = host {x['host']:6.2f} + wait "
                      f"{x['wait']:5.2f} | probes py {x['probe_py']:5.1f} ms launch {x['probe_launch']:5.1f} us | "
                      f"cpu/wall {x['cpu_frac']:.2f} nivcsw {x['nivcsw']:5d} load {x['load']:5.2f} | {x['clocks']}",
                      flush=True)
    # Does a slow call go with a slow host (probes, host part) or with a long wait (the GPU)?
    for batch, specs in groups:
        for spec in specs:
            xs = [x for b, s, x in rows if b == batch and s == spec]
            lo, hi = min(xs, key=lambda x: x["step"]), max(xs, key=lambda x: x["step"])
            print(f"b{batch} {spec}: fastest step {lo['step']:.2f} (host {lo['host']:.2f}, wait {lo['wait']:.2f}, "
                  f"launch probe {lo['probe_launch']:.1f} us), slowest {hi['step']:.2f} (host {hi['host']:.2f}, "
                  f"wait {hi['wait']:.2f}, launch probe {hi['probe_launch']:.1f} us)", flush=True)


if __name__ == "__main__":
    main()
