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
`hf_kvcache.prefill`), then a fresh cache with a prompt of another length, which should compile nothing more. The
outputs are garbage (nothing runs); only which kernels launch matters.
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

# (prompt past two chunks, next turns over it): each prompt is two of the part's chunks and this many tokens more;
# the last call is a fresh cache
CALLS = ((1000, (7, 100)), (1500, ()))
NEW_TOKENS = 17  # decode steps write at 16 offsets in a row: every alignment class of a token's bytes


@contextmanager
def compile_only(arch: int = 90):
    """Inside, every Triton launch compiles for CUDA sm_<arch> (cached as usual) and nothing runs; yields the list
    that each compile appends to: `{"kernel", "seconds", "error"}`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime.jit import JITFunction

    from ..kernels import backend

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

    compiles: list[dict] = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        cache = self.device_caches[0][0]  # (the per-device kernel cache: a new entry is a compile)
        before, t0 = len(cache), time.perf_counter()
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        except Exception as error:
            compiles.append(dict(kernel=self.fn.__name__, seconds=time.perf_counter() - t0,
                                 error=f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"))
            raise
        if len(cache) > before:
            seconds = time.perf_counter() - t0
            # what this variant was compiled for: each argument's Triton type and specialization (a constexpr's value;
            # an integer's or a pointer's class, "D" for divisible by 16) (Triton's binder, as `run` calls it)
            _, spec, _ = self.device_caches[0][4](*args, **kwargs)
            variant = {p.name: f"{v[0]}:{v[1]}" for p, v in zip(self.params, spec)}
            compiles.append(dict(kernel=self.fn.__name__, seconds=seconds, error=None, variant=variant))
        return kernel

    triton.runtime.driver.set_active(_Target())
    JITFunction.run = compile_launch
    try:
        with backend.compiling_only():
            yield compiles
    finally:
        JITFunction.run = run
        triton.runtime.driver._active = None  # back to the default driver, found again when next needed


def _model(layers: int = 1):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ._common import LLAMA3_8B

    # the attention's shape is the heads' (head_dim given): a narrow hidden size keeps the CPU's matmuls cheap
    shape = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 64, "vocab_size": 512, "num_hidden_layers": layers}
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**shape)).to(torch.bfloat16).eval()


def census(spec: str, chunk: int, arch: int = 90, batch: int = 1) -> list[dict]:
    """The compiles of `CALLS` for one method (in this process: see `compiles_part` for a fresh one)."""
    import warnings

    from .. import _compat
    from ._common import _calibrated, _make_e2e_cache, _needs_model, _set_attention

    model = _model()
    if _needs_model(spec):
        _calibrated(model, tokens=256)  # (before the kernels stop running; the cache's build takes this one)
    out = []
    gen = torch.Generator().manual_seed(0)
    with compile_only(arch) as compiles, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the kernels' garbage outputs)
        for prompt, turns in CALLS:
            cache, attention = _make_e2e_cache(spec, model, attention="hf_kvcache")
            _set_attention(model, attention)
            ids = torch.randint(0, 512, (batch, 2 * chunk + prompt), generator=gen)
            steps = [("prompt", ids.shape[1])] + [("turn", t) for t in turns]
            for what, n in steps:
                start = len(compiles)
                error = None
                try:
                    if what == "prompt":
                        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                       do_sample=False, prefill_chunk_size=chunk or None, disable_compile=True,
                                       **_compat.cache_kwargs(cache))
                    else:
                        turn = torch.randint(0, 512, (batch, n), generator=gen)
                        held = int(cache.get_seq_length())
                        mask = torch.ones(batch, held + n, dtype=torch.long)
                        model(input_ids=turn, attention_mask=mask, use_cache=True, logits_to_keep=1,
                              **_compat.cache_kwargs(cache))
                except Exception as e:  # a failed compile is reported with its call, not raised
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                out.append(dict(call=what, tokens=n, chunk=chunk if what == "prompt" else None,
                                compiles=compiles[start:], error=error))
    return out


def _census_in_fresh_process(spec: str, chunk: int, arch: int) -> list[dict]:
    """`census` in a new Python with an empty Triton cache (a compile cached on disk would not count)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TRITON_CACHE_DIR": tmp, "TRITON_INTERPRET": "0", "HF_KVCACHE_BACKEND": "auto"}
        done = subprocess.run([sys.executable, "-m", "hf_kvcache.bench.compiles", spec, str(chunk), str(arch)],
                              env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the compile census of {spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def compiles_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Each of `methods`' compiles for `compile_arch` (module text), `e2e_prefill_chunk` the prompt's chunks."""
    chunk = cfg.e2e_prefill_chunk or 0
    rows = []
    for spec in cfg.methods:
        calls = _census_in_fresh_process(spec, chunk, cfg.compile_arch)
        variants: dict[str, list[dict]] = {}  # each kernel's variants so far
        for c in calls:
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
            what = f"{c['call']} of {c['tokens']}" + (f" in chunks of {c['chunk']}" if c["chunk"] else "")
            log(f"{spec:>16} {what:<28} {len(c['compiles']):3d} compiles {seconds:6.2f} s  "
                + " ".join(f"{k}x{v}" if v > 1 else k for k, v in names.items())
                + "".join(f"\n{'':17}FAILED {x['kernel']}: {x['error']}" for x in failed)
                + (f"\n{'':17}call error: {c['error']}" if c["error"] else "")
                + "".join(f"\n{'':17}{k} again, for another {', '.join(sorted(v))}" for k, v in differ))
        rows.append(dict(method=spec, arch=cfg.compile_arch, calls=calls))
    cfg.results["compiles"] = rows
    return rows


if __name__ == "__main__":  # the fresh process of `_census_in_fresh_process`: SPEC CHUNK ARCH -> JSON on stdout
    calls = census(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(calls))
