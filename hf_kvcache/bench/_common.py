"""What the benchmark's parts share: `BenchConfig`, the Llama-3-8B shapes and a random model of them, the caches of
a spec (calibrated on that model where the preset needs it), timing on the GPU, caches filled without running the
model, and the bytes a transformers cache holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig

from .. import _compat
from ..eval import compared
from ..presets import make_cache

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
)


# the presets on the README's front, and INT2: each read at its own bytes' rate, against fp8-e4m3's (kernel part)
KERNEL_SPECS = ("fp8-e4m3", "int8", "int4-g128", "int4-g32", "kivi-4", "kivi-2", "kvquant-4", "turboquant-4",
                "turboquant-3.5", "turboquant-3", "turboquant-2.75", "turboquant-2.5", "int2-g32")


@dataclass
class BenchConfig:
    parts: tuple[str, ...] = ("kernel", "e2e", "capacity")
    methods: tuple[str, ...] = KERNEL_SPECS
    batches: tuple[int, ...] = (1, 16, 64)
    contexts: tuple[int, ...] = (4096, 32768)
    e2e_batch: int = 16
    e2e_context: int = 32768
    e2e_layers: int = 8
    e2e_new_tokens: int = 64
    e2e_prefill_chunk: int | None = 2048
    e2e_chunk_all: bool = False  # every e2e call chunked (a batch whose unchunked prefill does not fit: 64 x 32k)
    e2e_modes: tuple[str, ...] = ("eager", "compiled")  # which forms of each method the e2e part runs
    capacity_context: int = 32768
    capacity_budget_gb: float = 80.0
    sweep_batch: int = 16
    sweep_context: int = 32768
    multi_gpu_layers: int = 32
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_methods: tuple[str, ...] = ("fp8-e4m3", "int8", "int4-g128", "int4-g32", "kivi-2")
    # the attention the methods' rows of the e2e and decode parts run under: the model's own ("sdpa", as loaded:
    # what a user gets without an attention argument) and/or "hf_kvcache"; the baselines always run sdpa
    attentions: tuple[str, ...] = ("sdpa",)
    repeats: int = 7  # the batch1 part's interleaved rounds
    prefill_batches: tuple[int, ...] = (1, 16)
    prefill_turn: int = 2048  # the second turn's tokens over the prefilled history (prefill part)
    prefill_pad: int = 0  # left padding of every other row of the prefill part's batch (a batch of unequal prompts)
    compile_arch: int = 90  # the CUDA architecture the compiles part compiles for (sm_90: Hopper)
    compile_warm_up: bool = False  # the compiles part runs `hf_kvcache.warm_up` before the calls
    serving_requests: int = 128  # the serving part's workload: requests, prompt tokens (shortest, longest), new tokens
    serving_prompt: tuple[int, int] = (1024, 4096)
    serving_new_tokens: int = 128
    serving_budget_gb: float = 2.0  # the pages' memory, the same for every format
    serving_methods: tuple[str, ...] = ("fp8-e4m3", "turboquant-4", "kivi-2")
    results: dict = field(default_factory=dict)


def _llama_config(layers: int, attn: str = "hf_kvcache") -> LlamaConfig:
    config = LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers)
    config._attn_implementation = attn
    return config


def _random_model(layers: int):
    from transformers import LlamaForCausalLM

    config = _llama_config(layers, attn="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.eval()


def _set_attention(model, name: str) -> None:
    model.config._attn_implementation = name
    for module in model.modules():
        if getattr(module, "config", None) is not None:
            module.config._attn_implementation = name


def _bench_ms(fn, rep_ms: int = 100) -> float:
    """Median time of `fn` in ms (CUDA events, L2 flushed between calls, Triton's do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def _graph_ms(fn) -> float:
    """GPU time of one call of `fn` in ms, host excluded: `fn` captured once in a CUDA graph (as serving engines
    run decode steps) and its replay timed by `_bench_ms`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:  # something in `fn` cannot be captured: the eager time, said so
        print(f"CUDA graph capture failed ({str(error).splitlines()[0]}); timing eager calls")
        return _bench_ms(fn)
    ms = _bench_ms(graph.replay)
    del graph
    return ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _StepClock:
    """A logits processor that notes the wall time of every step of `generate` (it runs once a step, after the
    forward): the first note ends the prefill, the gaps between the others are decode steps."""

    def __init__(self, device: torch.device):
        self.device, self.times = device, []

    def __call__(self, input_ids, scores):
        _sync(self.device)
        self.times.append(time.perf_counter())
        return scores


_CALIBRATED: dict = {}


def _calibrated(model, tokens: int = 2048):
    """`model`'s calibration on `tokens` random tokens, made once: the benchmarks' models have random weights, and
    the presets that need one (KVQuant's ranges and codebooks) must find one."""
    if id(model) not in _CALIBRATED:
        from ..calibration import calibrate

        device = model.device
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device,
                            generator=torch.Generator(device=device).manual_seed(1))
        _CALIBRATED[id(model)] = (model, calibrate(model, ids, chunk=1024, progress=False))
    return _CALIBRATED[id(model)][1]


def _needs_model(spec: str) -> bool:
    from ..presets import PRESETS, parse_spec

    return PRESETS[parse_spec(spec)[0]].needs_model


def _make_layer_cache(spec: str, config):
    """A cache of `spec` for the one-layer 8B shape; a preset that needs the model gets a one-layer model with
    random weights (built once) and its calibration."""
    if not _needs_model(spec):
        return make_cache(spec, config)
    if "model" not in _CALIBRATED:
        _CALIBRATED["model"] = _random_model(1)
        _set_attention(_CALIBRATED["model"], "hf_kvcache")
    model = _CALIBRATED["model"]
    from ..patching import unfuse

    unfuse(model)  # each method on the model it expects (a RotatedCache fuses it again)
    return make_cache(spec, model, **_calibration_kwargs(spec, model))


def _calibration_kwargs(spec: str, model) -> dict:
    """`calibration=` for the presets that read one (KVQuant), nothing for the others (RotatedCache)."""
    import inspect

    from ..presets import PRESETS, parse_spec

    build = PRESETS[parse_spec(spec)[0]].build
    return {"calibration": _calibrated(model)} if "calibration" in inspect.signature(build).parameters else {}


def _make_e2e_cache(name: str, model, attention: str = "sdpa"):
    """(cache, the attention its rows run under): our methods under `attention`, the baselines under sdpa."""
    from transformers import DynamicCache

    if name == "dynamic":
        return DynamicCache(config=model.config), "sdpa"
    if compared.is_compared(name):  # transformers' QuantizedCache: the model's own attention reads its copy
        return compared.build(name, model), "sdpa"
    if _needs_model(name):
        return make_cache(name, model, **_calibration_kwargs(name, model)), attention
    return make_cache(name, model), attention


def _layer_devices(model) -> list[torch.device]:
    from ..patching import attention_modules

    return [m.k_proj.weight.device for m in attention_modules(model)]


def _fill(cache, model, batch: int, context: int, chunk: int = 256) -> None:
    """Write `context` tokens of random bf16 K/V `(batch, Hkv, T, D)` into every layer of `cache`, each on its
    layer's device, as a prefill would leave them, without running the model (a 32k prefill of a large batch
    would dominate the benchmark's time; the decode step does not care what the numbers are)."""
    from ..cache import QuantizedKVLayer

    config = _compat.text_config(model.config)
    shape = (batch, config.num_key_value_heads, context, config.head_dim)
    gen = {}
    layers = getattr(cache, "layers", [])
    for i, dev in enumerate(_layer_devices(model)):
        if i >= len(layers) or not isinstance(layers[i], QuantizedKVLayer):
            # transformers' caches keep (or quantize) the tensors they are given: fresh ones, in one update, as a
            # prefill writes them (QuantizedCache dequantizes its whole history at every update)
            cache.update(torch.randn(shape, device=dev, dtype=torch.bfloat16),
                         torch.randn(shape, device=dev, dtype=torch.bfloat16), i)
            continue
        layer = cache.layers[i]
        layer.fused = True  # store only: no dense copy of the history
        for s in range(0, context, chunk):
            n = min(chunk, context - s)
            key = (dev, n)
            if key not in gen:  # the packed copies are what the cache holds: one random chunk per device suffices
                gen[key] = (torch.randn(*shape[:2], n, shape[3], device=dev, dtype=torch.bfloat16),
                            torch.randn(*shape[:2], n, shape[3], device=dev, dtype=torch.bfloat16))
            layer.update(*gen[key])


def _tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a tensor subclass (quanto's packed tensors) is counted through its inner tensors
    (PyTorch's `__tensor_flatten__` protocol), not by its logical dense size."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, name)) for name in names)
    return t.numel() * t.element_size()


def _dense_layer_bytes(layer) -> int:
    """Bytes held by a transformers cache layer (DynamicCache, QuantizedCache: residual and quantized tensors)."""
    tensors = (getattr(layer, name, None) for name in ("keys", "values", "_quantized_keys", "_quantized_values"))
    return sum(_tensor_bytes(t) for t in tensors if isinstance(t, torch.Tensor))


def _dense_cache_bytes(cache) -> int:
    """Bytes held by a transformers cache: `_dense_layer_bytes` of every layer."""
    return sum(_dense_layer_bytes(layer) for layer in cache.layers)
