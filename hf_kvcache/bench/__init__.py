"""GPU benchmarks behind `hf-kvcache bench`: one module per part (`BenchConfig.parts`, `--parts`), what the parts
share in `_common.py` (`BenchConfig`, the Llama-3-8B shapes and a random model of them, timing), and `run` here.

Each part prints its baseline measured in the same run:
- kernel (`kernel.py`): one decode step of attention (Llama-3-8B heads: 32 q, 8 kv, head_dim 128) over a (batch x
  context) grid, ours (`hf_kvcache.attention.fused_attention` on a filled cache layer) against PyTorch's
  `scaled_dot_product_attention` on bf16 K/V with its flash backend and GQA (never cuDNN, whose per-length
  planning costs ~13 ms of CPU a call on the GPU host, BENCHMARKS.md). Reported: GPU time of one call (each side
  captured in a CUDA graph and replayed, so that host time is left out, as serving engines run decode), speed-up,
  GB/s of cache bytes read against the copy bandwidth measured in the same run, and the roofline 2/B; then the
  host time of one call and the eager time and speed-up (calls launched one by one, host time included).
- sweep (`kernel.py`): the fused attention's launch parameters (`kernels.ops.TUNING`) at one (batch, context).
- e2e (`e2e.py`): `model.generate` as users call it (a fresh cache a call, the prompt prefilled by `generate`) on a
  Llama-3-8B-shaped model with random bf16 weights (fewer layers by default, the per-layer shapes are the 8B's):
  each method eager (built without `max_cache_len`) and compiled (with it) against DynamicCache eager and
  transformers' StaticCache compiled, at batch 1, 16 and 64: decode step, first-call warm-up, recompiles, peak
  memory with and without prefill chunking, host time of one eager layer step (`e2e_part`).
- decode (`e2e.py`): the same model continuing caches filled with random K/V, step time and GPU time (`decode_part`).
- prefill (`prefill.py`): a long prompt prefilled in chunks through each cache, then a chat's next turn over it,
  against DynamicCache chunked and unchunked (`prefill_part`).
- capacity (`capacity.py`): the largest batch at a context that fits a fixed KV memory budget, from the bytes a real
  cache allocates for one sequence (all of the model's layers), against a bf16 cache.
- multi_gpu (`multi_gpu.py`): the model on one GPU and split over every visible GPU (`split_model`), decode tokens/s
  and the largest batch that runs (`multi_gpu_part`).
- compiles (`compiles.py`): the Triton compiles a first `generate` call waits for, counted on the host for a GPU
  target (`compile_arch`); needs no GPU (`compiles_part`).
- sass (`sass.py`): each method's decode body kernel compiled for `compile_arch`, its tile loop's instructions and
  bytes a held token: the share of fp8-e4m3's rate its instruction issue allows; needs no GPU (`sass_part`).
- serving (`serving.py`): many requests through transformers' continuous batching at a fixed KV memory budget, packed
  pages (`hf_kvcache.paged`) against transformers' bf16 pages: tokens held, requests at once, tokens/s, time to first
  token, per-token latency, peak memory (`serving_part`); pages (needs no GPU): each format's bytes a token slot on
  the 8B shape, and the exact tokens a request keeps outside the pages (`pages_part`).
- first_call (`compiles.py`): a first `generate` on an empty Triton cache against the second, with and without
  `hf_kvcache.warm_up` first (`first_call_part`).
"""

from __future__ import annotations

import json
import time

import torch

from ._common import (KERNEL_SPECS, LLAMA3_8B, BenchConfig, _dense_cache_bytes, _layer_devices, _llama_config,
                      _tensor_bytes)
from .capacity import capacity_part
from .compiles import compiles_part, first_call_part
from .e2e import _e2e_line, decode_part, e2e_part, e2e_row, interleaved_part
from .kernel import _attend, _filled_layer, kernel_part, sweep_part
from .multi_gpu import multi_gpu_part, split_model, storage_devices
from .prefill import prefill_part
from .sass import sass_part
from .serving import pages_part, serving_part

__all__ = [
    "CPU_PARTS",
    "KERNEL_SPECS",
    "LLAMA3_8B",
    "BenchConfig",
    "capacity_part",
    "compiles_part",
    "decode_part",
    "e2e_part",
    "e2e_row",
    "first_call_part",
    "kernel_part",
    "multi_gpu_part",
    "prefill_part",
    "sass_part",
    "serving_part",
    "pages_part",
    "run",
    "split_model",
    "storage_devices",
    "sweep_part",
    # details the tests check
    "_attend",
    "_dense_cache_bytes",
    "_e2e_line",
    "_filled_layer",
    "_layer_devices",
    "_llama_config",
    "_tensor_bytes",
]


CPU_PARTS = ("compiles", "sass", "pages")  # the parts that run without a GPU


def run(cfg: BenchConfig, log=print) -> dict:
    gpu = torch.cuda.is_available()
    if not gpu and set(cfg.parts) - set(CPU_PARTS):
        raise RuntimeError("hf-kvcache bench measures GPU speed and needs a CUDA device")
    if gpu:
        # The baselines run without PyTorch's cuDNN attention (per-length plans, BENCHMARKS.md): say so.
        torch.backends.cuda.enable_cudnn_sdp(False)
    import transformers
    import triton

    cfg.results["env"] = dict(
        gpu=torch.cuda.get_device_properties(0).name if gpu else None, torch=torch.__version__,
        transformers=transformers.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
        cudnn_sdp=False,
    )
    log(json.dumps(cfg.results["env"]))
    parts = {"kernel": kernel_part, "e2e": e2e_part, "decode": decode_part, "capacity": capacity_part,
             "sweep": sweep_part, "multi_gpu": multi_gpu_part, "prefill": prefill_part, "compiles": compiles_part,
             "first_call": first_call_part, "sass": sass_part, "batch1": interleaved_part,
             "serving": serving_part, "pages": pages_part}
    for part in cfg.parts:
        log(f"\n== {part}")
        with torch.no_grad():
            parts[part](cfg, log)
    return cfg.results
