"""The compiles part: the Triton compiles that a first `generate` call waits for, counted on the host for a GPU
target, with no GPU.

On a machine whose Triton cache is empty, a cache's first `generate` compiles every kernel variant it launches: each
kernel for each combination of its constexprs and of the classes Triton specializes integers into (1, a multiple of
16, neither). This part runs `generate` on CPU tensors with the launchers taking them for the GPU's
(`kernels.backend.compiling_only`) and a stand-in Triton driver that compiles each launch for CUDA sm_<arch> and runs
nothing. It reports, per method and call, the kernels compiled, each compile's seconds on this host, and the error of
any compile that failed (which on the GPU is a fallback to the reference, or a crash). What it leaves out of a GPU's
first call: Triton's build of each launcher stub, loading the modules, CUDA's own start.

Each method runs in its own process with an empty Triton cache, on a random model of the benchmark's Llama-3-8B
attention shape (32 query and 8 kv heads, head_dim 128; one layer, narrow otherwise) in bf16, under the
`hf_kvcache` attention. Its calls (`CALLS`): a prompt prefilled in chunks (two whole ones and a part) and decoded a
few steps, a next turn of a few tokens over it (the chunk kernel) and one of more (the workspace path of
`hf_kvcache.prefill`), then a fresh cache with a prompt of another length and one with a prompt short enough that
nothing is packed yet (`SHORT`), which should compile nothing more. The
outputs are garbage (nothing runs); only which kernels launch matters. With `compile_warm_up` (`--warm-up`),
`hf_kvcache.warm_up` runs first, its compiles side by side on this host's threads, and the calls after it should
compile nothing.

The first_call part (`first_call_part`, on the GPU) times what the census cannot: a first `generate` on an empty
Triton cache against the second, with and without `warm_up` first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager

import torch

from ._common import BenchConfig

# (prompt past two chunks, next turns over it): each prompt is two of the part's chunks and this many tokens more,
# decoded `warmup.NEW_TOKENS` steps; each prompt is a fresh cache
CALLS = ((1000, (7, 100)), (1500, ()))
# then a fresh cache with a prompt this short: inside every preset's residual window, so its decode steps read a packed
# place that holds nothing yet, which must launch the kernel variants a filled place launches
SHORT = 40


@contextmanager
def compile_only(arch: int = 90):
    """Inside, on CPU tensors, every Triton launch compiles for CUDA sm_<arch> (cached as usual) and nothing runs;
    yields the list each compile appends to (`warmup.compile_only_launches`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    from ..kernels import backend
    from ..warmup import compile_only_launches

    class _Target(DriverBase):
        """Triton's view of a GPU that is not there: a target to compile for, device 0, stream 0."""

        @classmethod
        def is_active(cls):
            return False

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError

        def get_benchmarker(self):
            raise NotImplementedError

    triton.runtime.driver.set_active(_Target())
    try:
        with backend.compiling_only(), compile_only_launches() as compiles:
            yield compiles
    finally:
        triton.runtime.driver._active = None  # back to the default driver, found again when next needed


def _model(layers: int = 1, dtype: torch.dtype = torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ._common import LLAMA3_8B

    # the attention's shape is the heads' (head_dim given): a narrow hidden size keeps the CPU's matmuls cheap
    shape = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 64, "vocab_size": 512, "num_hidden_layers": layers}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**shape)).to(dtype).eval()


def census(spec: str, chunk: int, arch: int = 90, batch: int = 1, warm: bool = False, prompts=None,
           dtype: torch.dtype = torch.bfloat16) -> dict:
    """The compiles of `prompts` (pairs as in `CALLS`; by default `CALLS`, then `SHORT`) for one method, in this
    process (see `compiles_part` for a fresh one), for a model in `dtype`: `{"warm_up": None, or what
    `hf_kvcache.warm_up` did first (its variants and wall seconds), "calls": [each call's compiles]}`."""
    import warnings

    from ..warmup import calls, default_workers, warm_up
    from ._common import _calibrated, _make_e2e_cache, _needs_model, _set_attention

    model = _model(dtype=dtype)
    if _needs_model(spec):
        _calibrated(model, tokens=256)  # (before the kernels stop running; the cache's build takes this one)
    out = {"warm_up": None, "calls": []}
    gen = torch.Generator().manual_seed(0)
    with compile_only(arch) as compiles, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the kernels' garbage outputs)
        if warm:
            cache, attention = _make_e2e_cache(spec, model, attention="hf_kvcache")
            _set_attention(model, attention)
            out["warm_up"] = dict(warm_up(model, cache, batch_size=batch, prefill_chunk_size=chunk or None),
                                  workers=default_workers())
        plan = [*((2 * chunk + n, turns) for n, turns in CALLS), (SHORT, ())] if prompts is None else \
            [(2 * chunk + n, turns) for n, turns in prompts]
        for prompt, turns in plan:
            cache, attention = _make_e2e_cache(spec, model, attention="hf_kvcache")
            _set_attention(model, attention)
            ids = torch.randint(0, 512, (batch, prompt), generator=gen)
            steps = calls(model, cache, ids, torch.ones_like(ids), chunk or None, turns, gen)
            start = len(compiles)
            try:
                for what, n in steps:
                    out["calls"].append(dict(call=what, tokens=n, chunk=chunk if what == "prompt" else None,
                                             compiles=compiles[start:], error=None))
                    start = len(compiles)
            except Exception as e:  # a failed compile is reported with the call it stopped, not raised
                out["calls"].append(dict(call="failed", tokens=None, chunk=None, compiles=compiles[start:],
                                         error=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"))
    return out


# Every NVIDIA architecture the kernels are built for (Turing on: `kernels.backend.MIN_ARCH`), and a preset of each
# kernel family: FP8 (by its bits before sm_89), grouped integers (bit planes by PTX), KIVI (per-channel key blocks),
# KVQuant's NUQ kernels, TurboQuant's (an energy split: 3- and 4-bit parts, both register lookups)
ARCHS = (75, 80, 86, 89, 90, 100, 120)
FAMILIES = ("fp8-e4m3", "fp8-e5m2", "int4-g32", "kivi-2", "kvquant-4", "turboquant-3.5")


# The model dtype each architecture is compiled with: fp16 where users run fp16 (Turing has no bf16; RTX 30xx), bf16
# elsewhere (the census's sm_90 is bf16 too)
ARCH_DTYPES = {75: torch.float16, 86: torch.float16}


def arch_census(arch: int, specs=FAMILIES) -> dict[str, list[dict]]:
    """Each of `specs`' kernels compiled for sm_<arch> (in this process) for a model in `ARCH_DTYPES`' dtype: a prompt
    in chunks of 64 (the pack kernel, and the chunk kernel over what the first chunk stored) and its decode steps ->
    `{spec: [{"kernel", "error"} of each compile that failed, and of a call that stopped]}`."""
    found = {}
    for spec in specs:
        row = census(spec, 64, arch, prompts=((100, ()),), dtype=ARCH_DTYPES.get(arch, torch.bfloat16))
        found[spec] = [dict(kernel=x["kernel"], error=x["error"]) for c in row["calls"] for x in c["compiles"]
                       if x["error"]] + [dict(kernel=c["call"], error=c["error"]) for c in row["calls"] if c["error"]]
    return found


def _census_in_fresh_process(spec: str, chunk: int, arch: int, warm: bool = False) -> dict:
    """`census` in a new Python with an empty Triton cache."""
    return _fresh_process("census", spec, chunk, arch, int(warm))


def compiles_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Each of `methods`' compiles for `compile_arch` (module text), `e2e_prefill_chunk` the prompt's chunks."""
    chunk = cfg.e2e_prefill_chunk or 0
    rows = []
    for spec in cfg.methods:
        found = _census_in_fresh_process(spec, chunk, cfg.compile_arch, cfg.compile_warm_up)
        if found["warm_up"]:
            w = found["warm_up"]
            log(f"{spec:>16} warm_up: {w['kernels']} variants in {w['seconds']:.2f} s ({w['workers']} threads)")
        variants: dict[str, list[dict]] = {}  # each kernel's variants so far
        for c in found["calls"]:
            names = Counter(x["kernel"] for x in c["compiles"])
            differ = []  # (kernel, the arguments a variant differs in from the nearest earlier one)
            for x in c["compiles"]:
                if x["error"]:
                    continue
                seen = variants.setdefault(x["kernel"], [])
                if seen:
                    near = min(({k for k, v in x["variant"].items() if old[k] != v} for old in seen), key=len)
                    differ.append((x["kernel"], near))
                seen.append(x["variant"])
            seconds = sum(x["seconds"] for x in c["compiles"])
            failed = [x for x in c["compiles"] if x["error"]]
            what = (f"{c['call']} of {c['tokens']}" if c["tokens"] else "the next call")
            what += f" in chunks of {c['chunk']}" if c["chunk"] else ""
            log(f"{spec:>16} {what:<28} {len(c['compiles']):3d} compiles {seconds:6.2f} s  "
                + " ".join(f"{k}x{v}" if v > 1 else k for k, v in names.items())
                + "".join(f"\n{'':17}FAILED {x['kernel']}: {x['error']}" for x in failed)
                + (f"\n{'':17}call error: {c['error']}" if c["error"] else "")
                + "".join(f"\n{'':17}{k} again, for another {', '.join(sorted(v))}" for k, v in differ))
        rows.append(dict(method=spec, arch=cfg.compile_arch, **found))
    cfg.results["compiles"] = rows
    return rows


# ------------------------------------------------------------------ the first call on the GPU


def first_call(spec: str, batch: int, warm: bool, layers: int, context: int, chunk: int) -> dict:
    """On the GPU, in this process (its Triton cache empty: see `first_call_part`): DynamicCache's `generate` first
    (CUDA's, cuBLAS's and SDPA's own start), then `warm_up` if `warm`, then two calls through fresh caches of `spec`,
    each a prompt of `context` tokens in chunks of `chunk` and 16 new tokens -> their seconds."""
    from .. import _compat
    from ..warmup import warm_up
    from ._common import _make_e2e_cache, _random_model, _set_attention, _sync

    model = _random_model(layers)
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device,
                        generator=torch.Generator(device=device).manual_seed(0))

    def call(name: str) -> float:
        cache, attention = _make_e2e_cache(name, model)
        _set_attention(model, attention)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                       prefill_chunk_size=chunk or None, disable_compile=True, **_compat.cache_kwargs(cache))
        _sync(device)
        return time.perf_counter() - t0

    with torch.no_grad():
        call("dynamic")
        warm_s = None
        if warm:
            cache, attention = _make_e2e_cache(spec, model)
            _set_attention(model, attention)
            warm_s = warm_up(model, cache, batch_size=batch, prefill_chunk_size=chunk or None)["seconds"]
        first = call(spec)
        second = call(spec)
    return dict(method=spec, batch=batch, warm_up_s=warm_s, first_s=first, second_s=second)


def _fresh_process(*args, module: str = "hf_kvcache.bench.compiles") -> dict:
    """`module`'s `__main__` (this one's by default) with `args` in a new Python whose Triton cache is empty (a compile
    cached on disk would not count) -> the JSON it prints last."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRITON_CACHE_DIR": tmp, "TRITON_INTERPRET": "0", "HF_KVCACHE_BACKEND": "auto"}
        done = subprocess.run([sys.executable, "-m", module, *map(str, args)], env=env, capture_output=True,
                              text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} failed in its own process:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def first_call_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Each of `methods`' first `generate` on an empty Triton cache against its second, at each of `prefill_batches`
    (a prompt of 4096 tokens in chunks of `e2e_prefill_chunk`, the 8B-shaped model of `e2e_layers` layers), without
    and with `warm_up` first: issue 39's target is a first call at most 5 s slower than the second."""
    rows = []
    for spec in cfg.methods:
        for batch in cfg.prefill_batches:
            for warm in (False, True):
                r = _fresh_process("first_call", spec, batch, int(warm), cfg.e2e_layers, 4096,
                                   cfg.e2e_prefill_chunk or 0)
                rows.append(r)
                warmed = f"after warm_up of {r['warm_up_s']:6.2f} s" if warm else "cold" + " " * 22
                log(f"{spec:>16} batch {batch:3d} {warmed}: first call {r['first_s']:7.2f} s, second "
                    f"{r['second_s']:7.2f} s, first - second {r['first_s'] - r['second_s']:+7.2f} s")
    cfg.results["first_call"] = rows
    return rows


if __name__ == "__main__":  # the fresh processes of `_fresh_process`: the part's function and its arguments -> JSON
    what, spec, args = sys.argv[1], sys.argv[2], [int(a) for a in sys.argv[3:]]
    if what == "archs":  # (spec: the presets, comma-separated)
        print(json.dumps(arch_census(args[0], spec.split(","))))
    elif what == "census":
        print(json.dumps(census(spec, args[0], args[1], warm=bool(args[2]))))
    else:
        print(json.dumps(first_call(spec, args[0], bool(args[1]), *args[2:])))
