"""The sass part: what a decode step's body kernel asks of the GPU's instruction issue, counted from its machine code
for a GPU target, with no GPU.

A decode kernel reads a packed history at the rate of its bytes only if the instructions that dequantize them issue
faster than the bytes arrive. For each method this part compiles one decode step (the benchmark's Llama-3-8B
attention shape: 32 query and 8 kv heads, head_dim 128, bf16; 4096 held tokens) for CUDA sm_<arch> through the
compiles part's stand-in driver (`compiles.compile_only`), takes the body program's machine code (`cuobjdump -sass`,
shipped with Triton), finds its tile loop (the longest backward branch's span) and counts, per held token of one kv
head: the warp instructions issued (loop instructions x warps / tile tokens) and the bytes read (the cache's own
bytes). Bytes per instruction, against `fp8-e4m3`'s, is the share of `fp8-e4m3`'s GB/s a kernel can reach where
issue, not memory, is what limits it (`of_fp8_issue`): on the H200 on 2026-12-04 (BENCHMARKS.md) `turboquant-4` read
its bytes at 31% of `fp8-e4m3`'s rate and this count gives 27%, `int4-g128` 39% and 32%. It is a static count:
stalls, occupancy and shared-memory bank conflicts are the GPU's to measure (`ncu`). With `HF_KVCACHE_SASS_DIR`
set, each method's body kernel is also written there (`<method>.sass`, `.ttgir`, `.ptx`), to read.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

from ._common import BenchConfig

# the body kernels of the fused reads (the tail program and the combine are per step, not per token); KVQuant's
# kernel holds its tail program too, and its longest loop is the body's (its keys' RoPE: checked on the SASS, 909
# instructions against the tail's 812, 2026-12-05)
BODY_KERNELS = ("_attn_fwd", "_turbo_attn", "_nuq_attn")
HELD = 4096


def cuobjdump() -> str:
    """Triton's own `cuobjdump` (its NVIDIA backend ships one)."""
    import triton.backends.nvidia as nvidia

    path = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    if not os.path.exists(path):
        raise RuntimeError(f"no cuobjdump at {path}: this Triton does not ship its NVIDIA tools")
    return path


def tile_loop(sass: str) -> list[str]:
    """The instructions (predicates dropped) of the longest loop of `cuobjdump -sass` text: the span from a backward
    branch's target to the branch."""
    found = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*?)\s*;", sass)]
    spans = [(int(m.group(1), 16), a) for a, t in found
             if (m := re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", t)) and int(m.group(1), 16) <= a]
    if not spans:
        return []
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return [re.sub(r"^@!?U?P\w+\s+", "", t) for a, t in found if lo <= a <= hi]


def opcode_counts(instructions: list[str]) -> collections.Counter:
    """Each opcode's count, modifiers dropped (`IMAD.MOV.U32` counts as `IMAD`)."""
    return collections.Counter(t.split()[0].split(".")[0] for t in instructions if t)


def _resources(cubin: bytes) -> tuple[dict, str]:
    """Registers, stack and local (spilled) bytes a thread (`cuobjdump -res-usage`), and the machine code (`-sass`)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    use = {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", text)}
    return dict(registers=use.get("reg"), stack=use.get("stack"), local=use.get("local")), sass


def count(spec: str, arch: int = 90) -> dict:
    """One decode step of `spec` compiled for sm_<arch>, in this process -> its body kernel's figures."""
    import warnings

    from triton.runtime.jit import JITFunction

    from ..presets import make_cache
    from ._common import _calibration_kwargs
    from .compiles import _model, compile_only

    model = _model()
    hkv, hq, d = (model.config.num_key_value_heads, model.config.num_attention_heads, model.config.head_dim)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, hkv, HELD, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, hkv, HELD, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, hq, 1, d, generator=gen).to(torch.bfloat16)
    launched = []
    with compile_only(arch), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (nothing runs: the outputs are garbage)
        cache = make_cache(spec, model, **_calibration_kwargs(spec, model))
        layer = cache.layers[0]
        layer.fused = True
        layer.update(k, v)
        run = JITFunction.run

        def keep(self, *args, **kwargs):
            kernel = run(self, *args, **kwargs)
            launched.append((self.fn.__name__, kwargs, kernel))
            return kernel

        JITFunction.run = keep
        try:
            from ..attention import fused_attention

            kh, vh = layer.update(k[:, :, -1:].clone(), v[:, :, -1:].clone())
            fused_attention(kh.layer.reads.rotate_query(q), kh, vh, None, d**-0.5)
        finally:
            JITFunction.run = run
    body = [(name, kw, kern) for name, kw, kern in launched if name in BODY_KERNELS and kw.get("BODY", True)]
    if not body:
        raise RuntimeError(f"{spec}: no body kernel launched (launched: {[n for n, _, _ in launched]})")
    name, kw, kernel = body[0]
    use, sass = _resources(kernel.asm["cubin"])
    if os.environ.get("HF_KVCACHE_SASS_DIR"):  # the machine code and Triton's IR kept, to read
        for ext, text in (("sass", sass), ("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"])):
            with open(os.path.join(os.environ["HF_KVCACHE_SASS_DIR"], f"{spec}.{ext}"), "w") as f:
                f.write(text)
    loop = tile_loop(sass)
    ops = opcode_counts(loop)
    warps, block_n = kernel.metadata.num_warps, kw["BLOCK_N"]
    per_token = len(loop) * warps / block_n
    token_bytes = layer.nbytes() / (hkv * (HELD + 1))  # K and V of one token of one kv head, scales included
    # the products' operand layouts: kWidth 4 is the 8-bit operands' (`tiles.opaque` says why it matters)
    k_widths = sorted({int(w) for w in re.findall(r"kWidth = (\d+)", kernel.asm["ttgir"])})
    return dict(method=spec, arch=arch, kernel=name, warps=warps, block_n=block_n, shared=kernel.metadata.shared,
                **use, loop_instructions=len(loop), instructions_per_token=per_token, bytes_per_token=token_bytes,
                bytes_per_instruction=token_bytes / per_token, opcodes=dict(ops.most_common()), k_widths=k_widths)


def sass_part(cfg: BenchConfig, log=print) -> list[dict]:
    """Each of `methods`' decode body kernel for `compile_arch`, each method in a fresh process (module text)."""
    from .compiles import _fresh_process

    rows = [_fresh_process(spec, cfg.compile_arch, module="hf_kvcache.bench.sass") for spec in cfg.methods]
    fp8 = next((r for r in rows if r["method"] == "fp8-e4m3"), None)
    for r in rows:
        r["of_fp8_issue"] = r["bytes_per_instruction"] / fp8["bytes_per_instruction"] if fp8 else None
        top = ", ".join(f"{k} {v * r['warps'] / r['block_n']:.1f}" for k, v in list(r["opcodes"].items())[:6])
        share = f"{r['of_fp8_issue']:4.0%} of fp8-e4m3" if fp8 else ""
        log(f"{r['method']:>16} {r['kernel']:>11} {r['warps']} warps x {r['block_n']:3d} tokens, "
            f"{r['registers']} regs, {r['local'] + r['stack']} B stack+local, {r['shared'] // 1024} KiB shared: "
            f"{r['instructions_per_token']:5.1f} instructions and {r['bytes_per_token']:5.1f} B a token "
            f"({r['bytes_per_instruction']:.2f} B each) {share}  [{top}]")
    cfg.results["sass"] = rows
    return rows


if __name__ == "__main__":  # `sass_part`'s fresh processes: a spec and an arch -> JSON
    print(json.dumps(count(sys.argv[1], int(sys.argv[2]))))
