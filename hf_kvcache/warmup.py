"""`warm_up`: compile, side by side, every kernel variant a cache's `generate` launches, before the first call.

On a machine whose Triton cache is empty, the first `generate` through a cache waits for each kernel variant it
launches to compile, one after another, as each is first launched (5-10 variants for a front preset:
`hf-kvcache bench --parts compiles`). `warm_up` finds them all at once: it runs short calls (a prompt in chunks,
decode steps, two next turns; a left-padded batch too) through a copy of the cache in which no kernel runs, each
launch only submitting its compile to a pool of threads (Triton's `AsyncCompileMode`), and waits for the pool. The
kernels stay in Triton's caches (in the process and on disk), where the real calls find them. What it cannot take
ahead: a pinned capacity's compiled step (`torch.compile` builds its own graph on the first call).
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext

import torch

from . import _compat, kernels

# the next turns over the prompt: a few tokens (the chunk kernel) and more (the workspace of `hf_kvcache.prefill`)
TURNS = (7, 100)
NEW_TOKENS = 17  # decode steps write at 16 offsets in a row: every alignment class of a token's bytes


def _current_device() -> int:
    from triton.runtime import driver

    return driver.active.get_current_device()


@contextmanager
def compile_only_launches():
    """Inside, every Triton launch compiles its kernel variant as usual (cached in the process and on disk) and runs
    nothing; yields the list each compile made here appends to, `{"kernel", "seconds", "error", "variant"}`. Under
    Triton's `AsyncCompileMode` a compile is only submitted here, and not listed."""
    from triton.runtime.jit import JITFunction

    compiles: list[dict] = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        cache = self.device_caches[_current_device()][0]  # (the device's kernel cache: a new entry is a compile)
        before, t0 = len(cache), time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:
            compiles.append(dict(kernel=self.fn.__name__, seconds=time.perf_counter() - t0, variant=None,
                                 error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"))
            raise
        if len(cache) > before:
            seconds = time.perf_counter() - t0
            # what this variant was compiled for: each argument's Triton type and specialization (a constexpr's value;
            # an integer's or a pointer's class, "D" for divisible by 16), from Triton's binder as `run` calls it
            _, spec, _ = self.device_caches[_current_device()][4](*args, **kwargs)
            variant = {p.name: f"{v[0]}:{v[1]}" for p, v in zip(self.params, spec)}
            compiles.append(dict(kernel=self.fn.__name__, seconds=seconds, error=None, variant=variant))
        return kernel

    JITFunction.run = compile_launch
    try:
        yield compiles
    finally:
        JITFunction.run = run


def default_workers() -> int:
    """`warm_up`'s threads by default: the CPUs this process may use, at most 16."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(16, cpus or 1)


def calls(model, cache, ids: torch.Tensor, mask: torch.Tensor, prefill_chunk_size: int | None, turns=TURNS,
          generator: torch.Generator | None = None):
    """The calls through `cache` that `warm_up` (and the compiles part) make, one at a time: `generate` of `ids` in
    chunks of `prefill_chunk_size`, `NEW_TOKENS` new tokens, then a forward of each of `turns` random tokens over
    what is held; yields `("prompt", ids' length)`, then `("turn", n)` after each. With the prompt it launches what a
    decode step captured in a CUDA graph launches and an eager one does not (`StreamStorage.token_places`)."""
    device = model.device
    vocab = _compat.text_config(model.config).vocab_size
    batch = ids.shape[0]
    model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                   prefill_chunk_size=prefill_chunk_size, disable_compile=True, **_compat.cache_kwargs(cache))
    # what a decode step captured in a layer's CUDA graph launches and an eager one does not: its token's places
    for layer in getattr(cache, "layers", ()):
        for stream in getattr(layer, "streams", {}).values():
            if stream.capacity:
                stream.token_places(torch.zeros(1, dtype=torch.long, device=device))
    yield "prompt", ids.shape[1]
    for n in turns:
        turn = torch.randint(0, vocab, (batch, n), generator=generator).to(device)
        held = int(cache.get_seq_length())
        mask = torch.cat([mask, torch.ones((batch, held - mask.shape[1] + n), dtype=mask.dtype, device=device)], 1)
        model(input_ids=turn, attention_mask=mask, use_cache=True, logits_to_keep=1, **_compat.cache_kwargs(cache))
        yield "turn", n


def _short_calls(model, cache, batch_size: int, prefill_chunk_size: int | None, padded: bool,
                 generator: torch.Generator | None = None) -> None:
    """`calls` with a prompt of two chunks and 100 tokens more (300 unchunked); `padded`: the batch's first row
    left-padded by 5 tokens."""
    vocab = _compat.text_config(model.config).vocab_size
    chunk = prefill_chunk_size or 0
    ids = torch.randint(0, vocab, (batch_size, 2 * chunk + (100 if chunk else 300)), generator=generator)
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :5] = 0
    for _ in calls(model, cache, ids, mask, prefill_chunk_size, generator=generator):
        pass


def warm_up(model, cache, *, batch_size: int = 1, prefill_chunk_size: int | None = None,
            workers: int | None = None) -> dict:
    """Compile every kernel variant that `model.generate(..., past_key_values=cache)` launches, `workers` at a time
    (default: the CPUs this process may use, at most 16), before the first real call (see the module's text).

    `cache`: a spec (`make_cache(spec, model)`, which for `rotated-*` fuses the model's weights as building that
    cache does) or a cache that holds nothing yet, which is copied and left as it is.
    `batch_size`, `prefill_chunk_size`: as the calls to come will run (a batch of more than one is warmed both
    left-padded and not). Returns `{"kernels": variants compiled, "seconds": the wall time}`; a model whose tensors
    do not go through the kernels (on the CPU) returns at once. Call it before serving starts: while it runs, a Triton
    kernel that another thread launches is compiled and not run."""
    from .presets import make_cache

    if batch_size < 1 or (prefill_chunk_size is not None and prefill_chunk_size < 1):
        raise ValueError(f"batch_size must be at least 1 (got {batch_size}) and prefill_chunk_size at least 1 or None "
                         f"(got {prefill_chunk_size})")
    if isinstance(cache, str):
        cache = make_cache(cache, model)
    elif cache.get_seq_length() > 0:
        raise ValueError("warm_up takes a cache that holds nothing yet (it warms a copy): call it before the cache's "
                         "first generate, or pass the spec instead")
    else:
        cache = copy.deepcopy(cache)
    t0 = time.perf_counter()
    if not kernels.use_kernels(model.device):
        return {"kernels": 0, "seconds": 0.0}
    import triton

    workers = workers or default_workers()
    asynchronous = getattr(triton, "AsyncCompileMode", None)  # (Triton 3.5 and later; else one compile at a time)
    pool = ThreadPoolExecutor(workers) if asynchronous else None
    mode = asynchronous(pool, ignore_errors=True) if asynchronous else nullcontext()
    submitted = {}  # each variant's future kernel by its key (the mode forgets them on leaving, from Triton 3.7)
    if asynchronous:
        submit = mode.submit

        def keep(key, *args):
            submitted[key] = submit(key, *args)
            return submitted[key]

        mode.submit = keep
    generator = torch.Generator().manual_seed(0)
    try:
        with compile_only_launches() as compiled, torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (nothing runs: the outputs are garbage)
            with mode:
                for padded in ([False, True] if batch_size > 1 else [False]):
                    _short_calls(model, copy.deepcopy(cache), batch_size, prefill_chunk_size, padded, generator)
    finally:
        if pool is not None:
            pool.shutdown()
    if not asynchronous:
        return {"kernels": len(compiled), "seconds": time.perf_counter() - t0}
    done = [f.kernel for f in submitted.values() if f.kernel is not None]  # (a failed compile leaves None)
    if len(done) < len(submitted):
        warnings.warn(f"warm_up: {len(submitted) - len(done)} kernel variant(s) failed to compile; the calls will "
                      "compile them again and say why (the library reads through its reference where a kernel "
                      "cannot)", stacklevel=2)
    devices = {p.device for p in model.parameters()}
    if devices == {model.device} and model.device.type == "cuda":
        # what a first launch does besides compiling: build the launcher of each signature (a C compile, cached on
        # disk) and load the module onto the device (Triton's `CompiledKernel._init_handles`, where it has one). Only
        # for a model on one GPU: a kernel is loaded onto the current device, which must be the one it serves.
        with torch.cuda.device(model.device):
            for kernel in done:
                if hasattr(kernel, "_init_handles"):
                    kernel._init_handles()
    return {"kernels": len(done), "seconds": time.perf_counter() - t0}
