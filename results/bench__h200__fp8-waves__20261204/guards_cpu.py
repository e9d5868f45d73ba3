"""How long dynamo's guards take to check at every compiled decode step, in steady state, for a pinned quantized cache
against transformers' StaticCache: 8-layer tiny Llama on the CPU (the kernel path through Triton's interpreter, so
that the traced code is the GPU's), `generate` compiling its decode step (`_compile_all_devices`), the guard managers
captured at compile time and each checked 2000 times (`profile_guard_manager`). The figure dynamo logs at compile
time ("Guard eval latency", one cold check: 622 us against 235 us on the H200 host, run 1) is not the per-step cost.

TRITON_INTERPRET=1 HF_KVCACHE_BACKEND=triton python3 guards_cpu.py static fp8-e4m3"""
import sys

import torch
import torch._dynamo.guards as G
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM, StaticCache

from hf_kvcache import _compat, make_cache

CAPTURED = []
G.guard_manager_testing_hook_fn = lambda manager, scope, builder: CAPTURED.append((manager, scope))


def model_for(attn: str):
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=8, vocab_size=256, head_dim=16)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.compile_config = CompileConfig()
    model.generation_config.compile_config._compile_all_devices = True
    return model


for spec in sys.argv[1:]:
    torch._dynamo.reset()
    CAPTURED.clear()
    model = model_for("sdpa" if spec == "static" else "hf_kvcache")
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    cache = (StaticCache(config=model.config, max_cache_len=128) if spec == "static"
             else make_cache(spec, model, max_cache_len=128))
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                   **_compat.cache_kwargs(cache))
    for manager, scope in CAPTURED:
        print(f"{spec}: steady-state guard check {G.profile_guard_manager(manager.root, scope, 2000):.1f} us")
