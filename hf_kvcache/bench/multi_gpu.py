"""The multi_gpu part: a Llama-3-8B-shaped model on one GPU and split over every visible GPU as `device_map="auto"`
splits it (`split_model`): decode tokens/s at a fixed batch and the largest batch that runs, each cache's storage on
its layer's device.
"""

from __future__ import annotations

import gc
import time

import torch

from .. import _compat
from ._common import (_CALIBRATED, BenchConfig, _dense_layer_bytes, _fill, _layer_devices, _llama_config,
                      _make_e2e_cache, _set_attention)


def split_model(model, devices: list[int]):
    """`model` (on CPU, or built under accelerate's `init_empty_weights()`) placed over the CUDA `devices` as
    transformers' `device_map="auto"` places a model over several GPUs: accelerate's balanced memory, whole
    decoder layers per device, dispatched with accelerate's hooks (which move hidden states between devices).
    One device: everything on it, no hooks. Parameters still on the meta device are drawn as the model's own init
    draws them (normal(0, initializer_range) for matrices, ones for norms, zeros for biases), directly on their
    device."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory, set_module_tensor_to_device

    dtype = next(model.parameters()).dtype
    if len(devices) == 1:
        device_map = {"": devices[0]}
    else:
        no_split = list(model._no_split_modules or [])
        free = {d: torch.cuda.mem_get_info(d)[0] for d in devices}
        balanced = get_balanced_memory(model, max_memory=free, no_split_module_classes=no_split, dtype=dtype)
        device_map = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=dtype)
    std = getattr(_compat.text_config(model.config), "initializer_range", 0.02)
    for name, p in list(model.named_parameters()):
        if p.device.type != "meta":
            continue
        owner = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        value = torch.empty(p.shape, dtype=p.dtype, device=f"cuda:{device_map[owner]}")
        if p.dim() > 1:
            value.normal_(0, std)
        else:
            value.fill_(0.0 if name.endswith("bias") else 1.0)
        set_module_tensor_to_device(model, name, value.device, value=value)
    if len(devices) == 1:
        return model.to(f"cuda:{devices[0]}").eval()
    return dispatch_model(model, device_map=device_map).eval()


def _decode(model, cache, batch: int, n: int) -> float:
    """Seconds for `n` greedy decode steps of `generate` continuing a cache that already holds tokens (generate
    feeds only the one token past what the cache holds)."""
    first = model.get_input_embeddings().weight.device
    context = cache.get_seq_length()
    ids = torch.randint(0, model.config.vocab_size, (batch, context + 1), device=first)
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, **_compat.cache_kwargs(cache))
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)
    assert out.shape == (batch, context + 1 + n)
    return time.perf_counter() - t0


def storage_devices(layer) -> set[torch.device]:
    """The devices of every tensor a cache layer stores: ours (`stored_tensors`) or a transformers layer's
    `keys`/`values`."""
    if hasattr(layer, "stored_tensors"):
        return {t.device for t in layer.stored_tensors()}
    return {t.device for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)}


def _cache_bytes_by_device(cache, model) -> dict[int, int]:
    out: dict[int, int] = {}
    for layer, dev in zip(cache.layers, _layer_devices(model)):
        held = layer.allocated_nbytes() if hasattr(layer, "allocated_nbytes") else _dense_layer_bytes(layer)
        out[dev.index] = out.get(dev.index, 0) + held
    return out


def _clear(devices) -> None:
    gc.collect()
    for d in devices:
        with torch.cuda.device(d):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _multi_run(model, name: str, batch: int, context: int, n: int, devices) -> dict:
    """Fill a fresh cache of `name` with `batch` x `context` tokens, decode `n` tokens; tokens/s and, per device,
    the cache's bytes and the peak memory above what was allocated before (cache + decode workspace)."""
    _clear(devices)
    base = {d: torch.cuda.memory_allocated(d) for d in devices}
    cache, attn = _make_e2e_cache(name, model)
    _set_attention(model, attn)
    _fill(cache, model, batch, context)
    _decode(model, cache, batch, 2)  # warm-up at this shape: kernels compile, storage grows past the fill
    for d in devices:  # what counts is the cache and the decode step's workspace, not how the test filled it
        torch.cuda.reset_peak_memory_stats(d)
    seconds = _decode(model, cache, batch, n)
    for layer, dev in zip(cache.layers, _layer_devices(model)):  # every layer's storage on its layer's device
        where = storage_devices(layer)
        assert where == {dev}, f"{name}: a layer on {dev} stores its cache on {where}"
    row = dict(method=name, batch=batch, context=context, decode_tok_s=batch * n / seconds, step_ms=seconds / n * 1e3,
               cache_gb={d: b / 1e9 for d, b in _cache_bytes_by_device(cache, model).items()},
               used_gb={d: (torch.cuda.max_memory_allocated(d) - base[d]) / 1e9 for d in devices})
    del cache
    _clear(devices)
    return row


def _largest_batch(model, name: str, probe: dict, context: int, n: int, devices, log) -> dict:
    """The largest batch at `context` that runs (fill, then decode): predicted from the probe run's memory per
    sequence on each device (cache + decode workspace, linear in the batch) against that device's free memory
    less 1 GiB, then run; on out-of-memory, 6% fewer sequences (at most 6 tries). Growing storage copies one
    layer at a time (old and new buffers alive together), which the prediction leaves out: the tries find it."""
    _clear(devices)
    free = {d: torch.cuda.mem_get_info(d)[0] - (1 << 30) for d in devices}
    per_seq = {d: probe["used_gb"][d] * 1e9 / probe["batch"] for d in devices}
    batch = int(min(free[d] // per_seq[d] for d in devices if per_seq[d] > 0))
    predicted = batch
    for _ in range(6):
        try:
            return dict(_multi_run(model, name, batch, context, n, devices), predicted_batch=predicted)
        except torch.cuda.OutOfMemoryError:
            log(f"{name}: batch {batch} out of memory, trying {int(batch * 0.94)}")
        _clear(devices)  # outside the handler: the traceback no longer holds the failed run's tensors
        batch = int(batch * 0.94)
    return dict(method=name, batch=None, predicted_batch=predicted, oom=True)


def multi_gpu_part(cfg: BenchConfig, log=print) -> list[dict]:
    """A Llama-3-8B-shaped model (`multi_gpu_layers` layers, random bf16 weights) on one GPU and split over all
    visible GPUs as `device_map="auto"` splits it; for DynamicCache and each method (fused attention): decode
    tokens/s at `e2e_batch` x `e2e_context`, and the largest batch that runs at that context with its
    tokens/s. Both placements in the same run."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from ..patching import unfuse

    n_gpus = torch.cuda.device_count()
    if n_gpus < 2:
        raise RuntimeError(f"the multi-GPU benchmark needs at least 2 GPUs, {n_gpus} visible")
    b, s, n = cfg.e2e_batch, cfg.e2e_context, cfg.e2e_new_tokens
    names = ["dynamic", *cfg.methods]
    rows = []
    start = time.perf_counter()
    for devices in ([0], list(range(n_gpus))):
        _CALIBRATED.clear()
        config = _llama_config(cfg.multi_gpu_layers, attn="sdpa")
        with init_empty_weights(include_buffers=False):  # RoPE's inv_freq stays a real float32 buffer
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        torch.manual_seed(0)
        model = split_model(model, devices)
        where = {d: sum(dev.index == d for dev in _layer_devices(model)) for d in devices}
        log(f"-- {len(devices)} GPU(s): decoder layers per GPU {where}")
        for name in names:
            try:
                # Warm-up: kernels compile, the allocator settles (and KVQuant calibrates, once per model).
                _multi_run(model, name, 2, 512, 2, devices)
                fixed = _multi_run(model, name, b, s, n, devices)
                largest = _largest_batch(model, name, fixed, s, max(n // 4, 4), devices, log)
            except torch.cuda.OutOfMemoryError as error:
                log(f"{name}: out of memory ({str(error).splitlines()[0]})")
                rows.append(dict(method=name, gpus=len(devices), oom=True))
                continue
            except ValueError as error:  # a method that refuses this model: say so, measure the others
                log(f"{name}: refused ({error})")
                rows.append(dict(method=name, gpus=len(devices), error=str(error)))
                continue
            finally:
                unfuse(model)  # a RotatedCache fused its rotation: the next method gets the model it expects
            _clear(devices)
            row = dict(method=name, gpus=len(devices), layers_per_gpu=where, fixed=fixed, largest=largest)
            rows.append(row)
            log(f"{name:>12} on {len(devices)} GPU(s): batch {b}: {fixed['decode_tok_s']:8.1f} tok/s, step "
                f"{fixed['step_ms']:6.1f} ms, cache {sum(fixed['cache_gb'].values()):6.2f} GB, used "
                f"{ {d: round(g, 1) for d, g in fixed['used_gb'].items()} } GB | largest batch {largest.get('batch')} "
                f"(predicted {largest.get('predicted_batch')}) at {largest.get('decode_tok_s', 0):8.1f} tok/s "
                f"[{time.perf_counter() - start:.0f} s]")
        del model
        _clear(devices)
    cfg.results["multi_gpu"] = dict(context=s, batch=b, layers=cfg.multi_gpu_layers, new_tokens=n, rows=rows)
    _multi_summary(rows, log)
    return rows


def _multi_summary(rows: list[dict], log) -> None:
    """The figures side by side, a markdown table: each method on 1 GPU and on all GPUs, tokens/s at the fixed
    batch (and x DynamicCache on the same GPUs), the largest batch (x DynamicCache's) and its tokens/s."""
    ok = [r for r in rows if "largest" in r and not r["largest"].get("oom")]
    counts = sorted({r["gpus"] for r in ok})
    head = "| method |" + "".join(f" {g} GPU tok/s | largest batch | tok/s there |" for g in counts)
    log("\n" + head + "\n" + "|---" * (1 + 3 * len(counts)) + "|")
    for name in dict.fromkeys(r["method"] for r in ok):
        cells = []
        for g in counts:
            r = next((r for r in ok if r["method"] == name and r["gpus"] == g), None)
            base = next((r for r in ok if r["method"] == "dynamic" and r["gpus"] == g), None)
            if r is None or base is None:
                cells.append(" - | - | - |")
                continue
            big, fixed = r["largest"], r["fixed"]
            cells.append(f" {fixed['decode_tok_s']:.0f} (x{fixed['decode_tok_s'] / base['fixed']['decode_tok_s']:.2f}) |"
                         f" {big['batch']} (x{big['batch'] / base['largest']['batch']:.2f}) | {big['decode_tok_s']:.0f} |")
        log(f"| {name} |" + "".join(cells))
