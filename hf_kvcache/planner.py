"""Capacity planning (`hf-kvcache plan`, `hf_kvcache.plan`): for every method, the bytes one token and one sequence
take in the KV cache of a model, how many concurrent sequences fit next to the weights on a GPU, and which format
suits that GPU, citing the accuracy and speed this project measured.

Bytes are measured, not derived from a formula. For each method the real cache is built on the model's real config
(on the CPU, batch 1) and random K/V of the config's shape are stored in one layer of each distinct kind (full
attention, or sliding with its window; every method gives all layers of a kind the same layout); `nbytes()` of the
layer (codes, scales, zeros, residual window, sinks, outlier slots, codec state) is read at a few sizes:

- full attention: past its windows the layer's storage repeats every P tokens (P: the least common multiple of its
  codecs' block sizes and of its block-flushed residual lengths, from the layer's `LayerPolicy`), each period adding
  the same bytes. Bytes at the context = bytes measured at a size congruent to the context modulo P, plus the
  periods in between times the bytes of one period (checked to repeat over two steps). Exact, not fitted; contexts
  up to a few hundred tokens are measured directly.
- sliding window: a prefill up to the window, then one-token decode steps (up to the context, at most
  `_DECODE_STEPS`); the most the layer holds on that path. It stops growing at its window plus the margin the
  cache keeps for rollbacks. A prefill longer than the window is held whole until the next step (the layer trims
  before it appends); the plan counts decoding, not that moment.

No weights are needed: `model` is a shipped shape (`SHIPPED_MODELS`), a local config.json or model directory, or a
config. Presets that need a model are built from the config alone, honestly because their storage layout depends
on shapes and settings only: `kvquant-*` with a calibration of the config's shapes holding placeholder ranges and
codebooks and a RoPE of angle zero (the position field is stored either way), `rotated-*` with a rotation recorded
but fused into no weights.

Weights: the model class built from the config on the meta device, its parameters counted (tied embeddings once)
at `weights_dtype`. KV budget = GPU memory x (1 - reserve) - weights; sequences that fit = budget // bytes of one
sequence. Batch and bytes are linear: every stored field has the batch axis first.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import torch
from torch import nn

from . import _compat
from .cache import _SLIDING_CROP_MARGIN, QuantizedKVLayer
from .eval.memory import layer_nbytes, reference_bytes_per_token
from .kernels import use_backend
from .methods._common import attention_shape
from .methods.kvquant import KVQUANT_BITS, KVQuantCache
from .methods.rotated import RotatedCache, Rotation
from .models import DEFAULT_MODEL, model_name
from .patching import LayerRope, ValueRotation
from .presets import PRESETS, make_cache, parse_spec

__all__ = [
    "GPU",
    "GPUS",
    "SHIPPED_MODELS",
    "MethodPlan",
    "Plan",
    "Recommendation",
    "detect_gpu",
    "load_config",
    "measured",
    "parameter_count",
    "parse_context",
    "parse_memory",
    "plan",
]

# Published shapes (each model's config.json), so that planning needs neither weights nor a hub. The Llama names are
# the 3.1 releases: Llama 3's shapes with its 128k context. `mistral-7b` is v0.1, whose layers all attend through a
# 4096-token sliding window (v0.3 has none).
SHIPPED_MODELS: dict[str, tuple[str, dict]] = {
    "smollm2-135m": ("SmolLM2-135M-Instruct, the embedded default", dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
    )),
    "llama-3-8b": ("Llama-3.1-8B", dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )),
    "llama-3-70b": ("Llama-3.1-70B", dict(
        model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    )),
    "qwen2.5-7b": ("Qwen2.5-7B", dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    )),
    "mistral-7b": ("Mistral-7B-v0.1, a 4096-token sliding window on every layer", dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    )),
}


@dataclass(frozen=True)
class GPU:
    """A GPU as the recommendation sees it: `memory` in bytes, `arch` its family (hopper, blackwell, ada, ampere,
    turing, volta, cdna3, cdna4, unknown), `capability` its compute capability or AMD architecture name."""

    name: str
    memory: int
    arch: str
    capability: str


# Memory is the spec sheet's nominal figure (decimal GB); `gpu_memory` overrides it with an exact one.
GPUS: dict[str, GPU] = {
    "b200": GPU("NVIDIA B200", 180 * 10**9, "blackwell", "sm_100"),
    "h200": GPU("NVIDIA H200", 141 * 10**9, "hopper", "sm_90"),
    "h100": GPU("NVIDIA H100 SXM", 80 * 10**9, "hopper", "sm_90"),
    "a100": GPU("NVIDIA A100 80GB", 80 * 10**9, "ampere", "sm_80"),
    "a100-40gb": GPU("NVIDIA A100 40GB", 40 * 10**9, "ampere", "sm_80"),
    "a10": GPU("NVIDIA A10", 24 * 10**9, "ampere", "sm_86"),
    "rtx3090": GPU("NVIDIA GeForce RTX 3090", 24 * 10**9, "ampere", "sm_86"),
    "l40s": GPU("NVIDIA L40S", 48 * 10**9, "ada", "sm_89"),
    "l4": GPU("NVIDIA L4", 24 * 10**9, "ada", "sm_89"),
    "rtx4090": GPU("NVIDIA GeForce RTX 4090", 24 * 10**9, "ada", "sm_89"),
    "t4": GPU("NVIDIA T4", 16 * 10**9, "turing", "sm_75"),
    "v100": GPU("NVIDIA V100 32GB", 32 * 10**9, "volta", "sm_70"),
    "mi300x": GPU("AMD Instinct MI300X", 192 * 10**9, "cdna3", "gfx942"),
    "mi325x": GPU("AMD Instinct MI325X", 256 * 10**9, "cdna3", "gfx942"),
}
# Where the recommendation is native FP8 (the rule). Ada has FP8 units too, but the rule sends it to INT8 /
# 4-bit with Ampere; this project measured FP8 decode speed on a Hopper GPU only.
FP8_ARCHS = ("hopper", "blackwell", "cdna3", "cdna4")
FP8_METHOD = "fp8-e4m3"
INT_METHODS = ("int8", "int4-g64")  # the first whose batch fits, else the second
# 2-4 bit methods for when memory dominates, tried from the most accurate (measured) to the least.
MEMORY_METHODS = ("kivi-4", "kvquant-4", "kvquant-3", "kivi-2", "kvquant-2")
LONG_CONTEXT = 100_000  # tokens from which memory dominates the choice
DEFAULT_GPU_MEMORY = 80 * 2**30  # without a GPU to read or name
DEFAULT_RESERVE = 0.1  # share of GPU memory kept for activations and the runtime, as vLLM's default utilization 0.9
WEIGHT_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1,
                "int4": 0.5}
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# One-token decode steps simulated on a sliding-window layer past its window: QuantizedKVLayer trims its window in
# bulk every `_SLIDING_CROP_MARGIN` tokens, so four margins show its whole cycle twice.
_DECODE_STEPS = 4 * _SLIDING_CROP_MARGIN
_STEP = 128  # tokens between the sizes a full-attention layer is measured at (rounded up to its period)


# ------------------------------------------------------------------------------------------------ parsing inputs

_CONTEXT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([km]?)\s*$", re.IGNORECASE)
_MEMORY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)\s*$", re.IGNORECASE)
_CONTEXT_FORMS = "a number of tokens, optionally with k (x1024) or M (x1024^2): 131072, 128k, 32K, 1M"
_MEMORY_FORMS = "a number with a unit: 80GiB or 80Gi (x2^30), 80GB or 80G (x10^9); also K, M, T, KiB, MiB, TiB"


def parse_context(value: int | str) -> int:
    """Tokens from an int or a string: `131072`, `128k` (k = 1024, as context lengths are written), `32K`, `1M`."""
    if isinstance(value, int) and not isinstance(value, bool):
        tokens = value
    else:
        match = _CONTEXT.match(str(value))
        if match is None:
            raise ValueError(f"context {value!r} does not parse: write {_CONTEXT_FORMS}")
        exact = float(match[1]) * 1024 ** " km".index(match[2].lower() or " ")
        if exact != int(exact):
            raise ValueError(f"context {value!r} is not a whole number of tokens ({exact}); write {_CONTEXT_FORMS}")
        tokens = int(exact)
    if tokens < 1:
        raise ValueError(f"context must be at least 1 token, got {value!r}")
    return tokens


def parse_memory(value: int | str) -> int:
    """Bytes from an int (bytes) or a string: `80GiB` / `80Gi` (2^30), `80GB` / `80G` (10^9), likewise K, M, T."""
    if isinstance(value, int) and not isinstance(value, bool):
        nbytes = value
    else:
        match = _MEMORY.match(str(value))
        if match is None:
            raise ValueError(f"memory {value!r} does not parse: write {_MEMORY_FORMS}")
        unit = match[2].lower()
        power = "bkmgt".index(unit[0])
        nbytes = int(float(match[1]) * ((1024 if "i" in unit else 1000) ** power))
    if nbytes <= 0:
        raise ValueError(f"memory must be positive, got {value!r}")
    return nbytes


def load_config(model=None):
    """`(name, config)` for a shipped shape name (`SHIPPED_MODELS`; None: the embedded default), a local config.json,
    a local model directory holding one, a config, or a loaded model (its config). Nothing is downloaded."""
    from transformers import AutoConfig, PretrainedConfig

    if model is None:
        model = DEFAULT_MODEL
    if isinstance(model, PretrainedConfig):
        return getattr(model, "_name_or_path", "") or model.model_type, model
    if isinstance(getattr(model, "config", None), PretrainedConfig):
        return model_name(model), model.config
    key = str(model).strip().lower()
    if key in SHIPPED_MODELS:
        values = dict(SHIPPED_MODELS[key][1])
        return key, AutoConfig.for_model(values.pop("model_type"), **values)
    path = Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(
            f"unknown model {str(model)!r}: give a shipped shape ({', '.join(SHIPPED_MODELS)}), a local config.json "
            "or a local model directory holding one (nothing is downloaded)"
        )
    try:
        config = AutoConfig.from_pretrained(file)
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{file} is not a readable transformers config: {error}") from error
    return file.resolve().parent.name, config


def _kv_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[dtype]


# ------------------------------------------------------------------------------------------------ hardware


def detect_gpu() -> GPU | None:
    """The first visible GPU (name, total memory, family from its compute capability), or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        name = props.gcnArchName.split(":")[0]
        arch = {"gfx94": "cdna3", "gfx95": "cdna4"}.get(name[:5], "unknown")
        return GPU(props.name, props.total_memory, arch, name)
    major, minor = torch.cuda.get_device_capability(0)
    if major == 8:
        arch = "ada" if minor == 9 else "ampere"
    else:
        arch = {7: "turing" if minor == 5 else "volta", 9: "hopper", 10: "blackwell", 11: "blackwell",
                12: "blackwell"}.get(major, "unknown")
    return GPU(props.name, props.total_memory, arch, f"sm_{major}{minor}")


def _resolve_gpu(gpu: str | GPU | None) -> tuple[GPU | None, str]:
    """The GPU to plan for and where it came from."""
    if isinstance(gpu, GPU):
        return gpu, "given"
    if gpu is not None:
        key = gpu.strip().lower()
        if key not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)} (or give its memory with gpu_memory)")
        return GPUS[key], "nominal"
    return detect_gpu(), "detected"


# ------------------------------------------------------------------------------------------------ weights


_PARAMETERS: dict[str, int] = {}  # config JSON -> parameters: a 70B model takes a second to build, even on meta


def parameter_count(config) -> int:
    """Parameters of the causal LM `config` describes, from its model class built on the meta device (shapes only:
    no memory, no initialization); tied embeddings are one parameter, counted once."""
    from transformers import AutoModelForCausalLM

    key = config.to_json_string(use_diff=False)
    if key not in _PARAMETERS:
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError) as error:
            raise ValueError(f"cannot build a causal LM from this {config.model_type} config to count its "
                             f"parameters: {error}") from error
        _PARAMETERS[key] = sum(p.numel() for p in model.parameters())
    return _PARAMETERS[key]


# ------------------------------------------------------------------------------------------------ measuring caches


class _ZeroAngleRotary(nn.Module):
    """A rotary embedding whose angle is always zero (cos 1, sin 0): `(x, position_ids (B, T)) -> (cos, sin) (B, T,
    D)`. RoPE's angles change the values a pre-RoPE key cache stores, not its layout."""

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*position_ids.shape, x.shape[-1])
        return torch.ones(shape, device=x.device), torch.zeros(shape, device=x.device)


def _layout_calibration(config):
    """A calibration of `config`'s shapes holding what `KVQuantCache` reads, with placeholder values: per-channel key
    ranges `(Hkv, D)` of [-1, 1] and uniform codebooks `(2^b,)` for every bit width. The layout of KVQuant's storage
    (codes, outlier slots, fp16 ranges, positions) depends on the shapes only."""
    from .calibration import Calibration, fingerprint

    layers, kv_heads, head_dim = attention_shape(config)
    lo, hi = -torch.ones(kv_heads, head_dim), torch.ones(kv_heads, head_dim)
    books = {bits: torch.linspace(-1, 1, 2**bits) for bits in KVQUANT_BITS}
    tensors = {}
    for i in range(layers):
        for place in ("k_pre", "k_post"):
            tensors[f"layers.{i}.{place}.lo"], tensors[f"layers.{i}.{place}.hi"] = lo, hi
        for bits, book in books.items():
            for place in ("k_pre", "k_post", "v"):
                tensors[f"layers.{i}.{place}.nuq{bits}"] = book
    return Calibration({"fingerprint": fingerprint(config), "bits": list(KVQUANT_BITS)}, tensors)


def _build_cache(spec: str, config):
    """The cache `spec` names, built on `config` alone (see the module docstring for the presets that need a model)."""
    name, overrides = parse_spec(spec)
    preset = PRESETS[name]
    if not preset.needs_model:
        return make_cache(spec, config)
    kwargs = {**preset.kwargs, **overrides}
    layers, _, head_dim = attention_shape(config)
    builder = getattr(preset.build, "__self__", None)  # the presets that need a model build through `from_model`
    try:
        if builder is KVQuantCache:
            ropes = [LayerRope(_ZeroAngleRotary())] * layers if kwargs.get("pre_rope", True) else None
            kwargs.setdefault("calibration", _layout_calibration(config))
            return KVQuantCache(config, ropes=ropes, **kwargs)
        if builder is RotatedCache:
            fusion = ValueRotation(Rotation(head_dim, kwargs.pop("seed", 0)), originals={})
            return RotatedCache(config, fusion=fusion, **kwargs)
    except TypeError as error:
        raise ValueError(f"spec {spec!r}: {error}") from error
    raise ValueError(f"spec {spec!r} needs the model's weights to build; the planner cannot build it from a config")


def _period(layer) -> tuple[int, int]:
    """`(P, start)`: past `start` tokens a full-attention layer's storage repeats every P tokens, each period adding
    the same bytes. A FIFO residual holds between R and R + block - 1 tokens once R have passed; a block-flushed one
    cycles through R from the first token. A transformers layer adds the same bytes every token."""
    if not isinstance(layer, QuantizedKVLayer):
        return 1, 0
    p = layer.policy
    periods = [p.key_codec.block_size, p.value_codec.block_size]
    for flush, residual in ((p.key_flush, p.key_residual_length), (p.value_flush, p.value_residual_length)):
        if flush == "block":
            periods.append(residual)
    return math.lcm(*periods), p.sink_tokens + max(p.key_residual_length, p.value_residual_length)


class _Measure:
    """Stores random K/V `(1, Hkv, n, D)` in fresh cache layers of one config and reads the bytes they hold."""

    def __init__(self, config, dtype: torch.dtype):
        self.config = config
        self.dtype = dtype
        _, self.kv_heads, self.head_dim = attention_shape(config)
        groups: dict[int | None, list[int]] = {}
        for idx, spec in enumerate(_compat.layer_specs(config)):
            if spec.kind != "dummy":  # a layer reading another layer's K/V holds nothing
                groups.setdefault(spec.sliding_window, []).append(idx)
        # (representative layer, layers of its kind, sliding window or None)
        self.kinds = [(indices[0], len(indices), window) for window, indices in groups.items()]
        self.generator = torch.Generator().manual_seed(0)

    def _feed(self, layer, n: int) -> None:
        shape = (1, self.kv_heads, n, self.head_dim)
        k = torch.randn(shape, generator=self.generator).to(self.dtype)
        v = torch.randn(shape, generator=self.generator).to(self.dtype)
        layer.update(k, v)

    def _fresh(self, spec: str, index: int):
        layer = _build_cache(spec, self.config).layers[index]
        if isinstance(layer, QuantizedKVLayer):
            layer.fused = True  # update() returns handles: only storage is measured, no dense K/V is built
        return layer

    def _full(self, spec: str, index: int, context: int) -> int:
        layer = self._fresh(spec, index)
        period, start = _period(layer)
        step = period * -(-_STEP // period)
        first = start + period + (context - start - period) % period  # past every window, = context (mod P)
        if context <= first + 2 * step:
            self._feed(layer, context)
            return layer_nbytes(layer)
        sizes = []
        for n in (first, step, step):  # the final layout of a full layer does not depend on how tokens arrived
            self._feed(layer, n)
            sizes.append(layer_nbytes(layer))
        periods_per_step = step // period
        grown = sizes[1] - sizes[0]
        if sizes[2] - sizes[1] != grown or grown % periods_per_step:
            raise RuntimeError(
                f"{spec}: the storage does not repeat every {period} tokens (bytes {sizes} at {first}, "
                f"+{step}, +{step} tokens); the planner cannot extrapolate it"
            )
        return sizes[0] + (context - first) // period * (grown // periods_per_step)

    def _sliding(self, spec: str, index: int, context: int, window: int) -> int:
        layer = self._fresh(spec, index)
        prefill = min(context, window)
        self._feed(layer, prefill)
        most = layer_nbytes(layer)
        for _ in range(min(context - prefill, _DECODE_STEPS)):
            self._feed(layer, 1)
            most = max(most, layer_nbytes(layer))
        return most

    def sequence_bytes(self, spec: str, context: int) -> int:
        """KV bytes one sequence of `context` tokens takes in the cache `spec` names, every layer included."""
        threads = torch.get_num_threads()
        # The tensors are small (one layer, a few hundred tokens): waking other threads costs more than it gives,
        # up to 30x on a loaded machine (measured on 2 shared cores).
        torch.set_num_threads(1)
        try:
            with use_backend("torch"):  # the kernels write the same fields as the reference: same bytes, no GPU
                return sum(
                    count * (self._full(spec, index, context) if window is None
                             else self._sliding(spec, index, context, window))
                    for index, count, window in self.kinds
                )
        finally:
            torch.set_num_threads(threads)


# ------------------------------------------------------------------------------------------------ results


@cache
def measured() -> dict:
    """The figures this project measured that recommendations cite (`hf_kvcache/data/measured.json`): accuracy per
    spec on the default model and decode-attention speed-ups per spec on an H200, each with its results directory."""
    return json.loads(resources.files("hf_kvcache").joinpath("data/measured.json").read_text())


@dataclass(frozen=True)
class MethodPlan:
    """One method at the plan's context: `sequence_bytes` of KV for one sequence, `bytes_per_token` =
    sequence_bytes / context, `ratio` against the 16-bit cache of the same sequence, `max_sequences` of the context
    that fit the KV budget, `max_tokens` that fit at this bytes/token, and whether the requested batch fits."""

    spec: str
    sequence_bytes: int
    bytes_per_token: float
    ratio: float
    max_sequences: int
    max_tokens: int
    fits_batch: bool


@dataclass(frozen=True)
class Recommendation:
    """A spec picked by one rule (`kind`: "hardware" or "memory"), why, what it fits, and the measured figures it
    cites: `accuracy` and `speed` are the spec's entries of `measured()` (None where there is none)."""

    spec: str
    kind: str
    why: str
    max_sequences: int
    ratio: float
    accuracy: dict | None
    speed: dict | None


@dataclass(frozen=True)
class Plan:
    """What `plan()` returns; `format()` prints it, `to_dict()` is its JSON."""

    model: str
    description: str
    layers: int
    kv_heads: int
    head_dim: int
    windows: dict  # sliding window -> layers ("full" for full attention)
    max_position_embeddings: int | None
    context: int
    batch: int
    kv_dtype: str
    reference_bytes_per_token: int  # 2 bytes x 2 (K, V) x layers x kv_heads x head_dim
    parameters: int
    weights_dtype: str
    weights_bytes: int
    gpu: GPU | None
    gpu_source: str  # "nominal" (the GPU table), "detected", "given" or "none"
    gpu_memory: int
    gpu_memory_source: str
    reserve: float
    kv_budget: int
    rows: tuple[MethodPlan, ...]
    recommendations: tuple[Recommendation, ...]
    notes: tuple[str, ...]

    def row(self, spec: str) -> MethodPlan:
        for r in self.rows:
            if r.spec == spec:
                return r
        raise KeyError(f"{spec!r} is not in this plan; planned: {', '.join(r.spec for r in self.rows)}")

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        """The plan as text: a header with the budget, a markdown table, the recommendations and notes."""
        gb = _gb
        layers = ", ".join(f"{n} full-attention" if w == "full" else f"{n} sliding-window ({w} tokens)"
                           for w, n in self.windows.items())
        lines = [
            (f"{self.model} ({self.description}): {self.layers} layers ({layers}), {self.kv_heads} kv-heads, "
             f"head_dim {self.head_dim}"),
            f"context {self.context:,} tokens, batch {self.batch}, K/V in {self.kv_dtype}",
            (f"16-bit cache: 2 bytes x 2 (K, V) x {self.layers} layers x {self.kv_heads} kv-heads x {self.head_dim} = "
             f"{self.reference_bytes_per_token:,} bytes per token"),
            (f"GPU: {_gpu_line(self.gpu)}, {gb(self.gpu_memory)} ({self.gpu_memory_source}); weights "
             f"{self.parameters / 1e9:.2f}B parameters x {WEIGHT_BYTES[self.weights_dtype]:g} B "
             f"({self.weights_dtype}) = {gb(self.weights_bytes)}; reserve {self.reserve:.0%} = "
             f"{gb(self.reserve * self.gpu_memory)}; KV budget {gb(self.kv_budget)}"),
            "",
            (f"| method | bytes/token | vs 16-bit | GB per sequence | sequences that fit | tokens that fit | "
             f"batch {self.batch} fits |"),
            "|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            lines.append(
                f"| `{r.spec}` | {r.bytes_per_token:,.0f} | {r.ratio:.3f}x | {r.sequence_bytes / 1e9:,.2f} | "
                f"{r.max_sequences:,} | {r.max_tokens:,} | {'yes' if r.fits_batch else 'no'} |"
            )
        lines += ["", "Recommendation:"]
        for rec in self.recommendations:
            lines.append(f"- `{rec.spec}` ({rec.kind}): {rec.why}")
            if rec.accuracy is not None:
                lines.append(f"  accuracy: {_accuracy_text(rec.accuracy)}")
            lines.append(f"  speed: {_speed_text(rec.spec)}")
        lines += ["", *(f"Note: {note}" for note in self.notes)]
        return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def _gpu_line(gpu: GPU | None) -> str:
    return "unknown (none named, none visible)" if gpu is None else f"{gpu.name} ({gpu.capability}, {gpu.arch})"


def _length(tokens: str) -> str:
    n = int(tokens)
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def _accuracy_text(entry: dict) -> str:
    half = f" ± {entry['delta_half_width']:.2f}" if entry.get("delta_half_width") else ""
    text = (f"ΔNLL {entry['decode_delta_pct']:+.2f}%{half}, KL {entry['kl']:.4f}, top-1 {entry['top1']:.1%} "
            f"(decode protocol, prefill {entry['prefill']})")
    return f"{text} on {measured()['accuracy']['model']} [{entry['source']}]"


def _speed_points(entry: dict) -> str:
    return ", ".join(f"x{v:.2f} at {key.split('x')[0]} x {_length(key.split('x')[1])}"
                     for key, v in entry["speedup"].items())


def _speed_text(spec: str) -> str:
    speed = measured()["speed"]
    entry = speed["methods"].get(spec)
    where = f"decode attention against bf16 SDPA on an {speed['gpu']}, batch x context"
    if entry is None:
        return "not benchmarked on a GPU"
    if "speedup" not in entry:
        near = "; ".join(f"`{s}` {_speed_points(speed['methods'][s])} [{speed['methods'][s]['source']}]"
                         for s in entry["nearest"])
        return f"{entry['not_measured']}: {near} ({where})"
    return f"{_speed_points(entry)} ({where}) [{entry['source']}]"


# ------------------------------------------------------------------------------------------------ recommendation


def _recommend(rows: dict[str, MethodPlan], gpu: GPU | None, context: int, batch: int) -> list[Recommendation]:
    """The issue's rules: native FP8 on Hopper/Blackwell/MI300-class GPUs, INT8 (or INT4 group 64 when INT8 does not
    fit the batch) elsewhere; and a 2-4 bit KIVI/KVQuant cache, the most accurate that fits the batch, when memory
    dominates (a context of `LONG_CONTEXT` tokens or more, or the batch does not fit the first pick)."""
    figures = measured()
    accuracy, speed = figures["accuracy"]["methods"], figures["speed"]["methods"]

    def rec(spec: str, kind: str, why: str) -> Recommendation:
        r = rows[spec]
        return Recommendation(spec, kind, why, r.max_sequences, r.ratio, accuracy.get(spec), speed.get(spec))

    def fits(spec: str) -> str:
        r = rows[spec]
        return f"{r.ratio:.3f}x the 16-bit cache, {r.max_sequences:,} sequences of {context:,} tokens fit"

    out = []
    if gpu is not None and gpu.arch in FP8_ARCHS:
        first = FP8_METHOD
        out.append(rec(first, "hardware", f"{gpu.name} ({gpu.arch}) converts FP8 natively; {fits(first)}."))
    else:
        first = next((s for s in INT_METHODS if rows[s].fits_batch), INT_METHODS[-1])
        hardware = ("unknown hardware (name it with --gpu), assumed without native FP8" if gpu is None
                    else f"{gpu.name} ({gpu.arch}): native FP8 is recommended on Hopper, Blackwell and MI300-class "
                    "GPUs only")
        choice = ("INT8, the most accurate at half the bytes, fits the batch" if first == INT_METHODS[0] else
                  f"INT8 does not fit batch {batch}, so INT4 in groups of 64")
        out.append(rec(first, "hardware", f"{hardware}: {choice}; {fits(first)}."))
    if context >= LONG_CONTEXT or not rows[first].fits_batch:
        ranked = sorted(MEMORY_METHODS, key=lambda s: accuracy[s]["decode_delta_pct"])
        fitting = [s for s in ranked if rows[s].fits_batch]
        reason = (f"at {context:,} tokens memory dominates" if context >= LONG_CONTEXT
                  else f"`{first}` does not fit batch {batch}")
        if fitting:
            pick = fitting[0]
            why = f"{reason}: the most accurate 2-4 bit cache (measured) that fits batch {batch}; {fits(pick)}."
        else:
            pick = max(ranked, key=lambda s: rows[s].max_sequences)
            why = f"{reason}, and no 2-4 bit cache fits batch {batch}: this one holds the most; {fits(pick)}."
        out.append(rec(pick, "memory", why))
    return out


# ------------------------------------------------------------------------------------------------ plan


def plan(
    model=None,
    *,
    context: int | str | None = None,
    gpu_memory: int | str | None = None,
    gpu: str | GPU | None = None,
    batch: int = 1,
    weights_dtype: str = "bf16",
    reserve: float = DEFAULT_RESERVE,
    methods: list[str] | tuple[str, ...] | None = None,
    dtype: torch.dtype | str = torch.bfloat16,
) -> Plan:
    """Plan the KV cache of `model` for every method (see the module docstring for how bytes are measured).

    Args:
        model: a shipped shape name (`SHIPPED_MODELS`, default the embedded "smollm2-135m"), a local config.json, a
            local model directory, a config or a loaded model.
        context: tokens per sequence, int or "128k" / "131072" / "32K" (default: the model's
            max_position_embeddings).
        gpu_memory: bytes, or "80GiB" / "80GB" / "141G" (default: the GPU's memory, else 80 GiB).
        gpu: a name of `GPUS` ("h100", "a100", "l4", ...); default: the visible CUDA device, else unknown.
        batch: concurrent sequences wanted.
        weights_dtype: bf16, fp16, fp32, fp8, int8 or int4 (bytes per parameter 2, 2, 4, 1, 1, 0.5).
        reserve: share of GPU memory kept for activations and the runtime (default 0.1).
        methods: specs to plan (default: every preset); the recommendation's candidates are planned in any case.
        dtype: the dtype the model computes K/V in, which the baseline and every exact window hold (default bf16).

    Raises:
        ValueError: an unknown model, GPU or spec, a context or memory that does not parse, or weights (plus the
            reserve) that leave no memory for the KV cache.
    """
    name, config = load_config(model)
    config = _compat.text_config(config)
    kv_dtype = _kv_dtype(dtype)
    max_positions = getattr(config, "max_position_embeddings", None)
    if context is None and not max_positions:
        raise ValueError("this config has no max_position_embeddings: give the context")
    context = parse_context(max_positions if context is None else context)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch!r}")
    if not 0 <= reserve < 1:
        raise ValueError(f"reserve is a share of GPU memory in [0, 1), got {reserve!r}")
    if weights_dtype not in WEIGHT_BYTES:
        raise ValueError(f"weights dtype {weights_dtype!r} is not one of {', '.join(WEIGHT_BYTES)}")
    specs = list(dict.fromkeys(PRESETS if methods is None else methods))
    for spec in specs:
        parse_spec(spec)  # an unknown spec fails before anything is measured, with the list of presets
    hardware, gpu_source = _resolve_gpu(gpu)
    if gpu_memory is not None:
        memory, memory_source = parse_memory(gpu_memory), "given"
    elif hardware is not None:
        memory, memory_source = hardware.memory, gpu_source
    else:
        memory, memory_source = DEFAULT_GPU_MEMORY, "80 GiB assumed: no GPU named or visible"

    parameters = parameter_count(config)
    weights = int(parameters * WEIGHT_BYTES[weights_dtype])
    budget = int(memory * (1 - reserve)) - weights
    if weights >= memory:
        raise ValueError(f"the weights ({_gb(weights)}: {parameters / 1e9:.2f}B parameters in {weights_dtype}) do not "
                         f"fit in the GPU memory ({_gb(memory)}); give more memory or a smaller weights dtype")
    if budget <= 0:
        raise ValueError(f"the weights ({_gb(weights)}) and the reserve ({reserve:.0%} = {_gb(reserve * memory)}) "
                         f"leave no memory for the KV cache in {_gb(memory)}; lower the reserve or the weights dtype")

    measure = _Measure(config, kv_dtype)
    sixteen_bit = measure if kv_dtype.itemsize == 2 else _Measure(config, torch.bfloat16)
    reference = sixteen_bit.sequence_bytes("none", context)  # "vs 16-bit" is against this, whatever `dtype` is
    candidates = (FP8_METHOD, *INT_METHODS, *MEMORY_METHODS)
    rows, skipped = {}, []
    for spec in dict.fromkeys([*specs, *candidates]):
        try:
            seq = measure.sequence_bytes(spec, context)
        except ValueError as error:
            if methods is not None and spec in specs:
                raise
            skipped.append(f"`{spec}` does not apply to this model: {error}")  # e.g. groups of 128 at head_dim 64
            continue
        rows[spec] = MethodPlan(
            spec=spec, sequence_bytes=seq, bytes_per_token=seq / context, ratio=seq / reference,
            max_sequences=budget // seq, max_tokens=int(budget // (seq / context)), fits_batch=budget // seq >= batch,
        )
    layers, kv_heads, head_dim = attention_shape(config)
    windows: dict = {}
    for _, count, window in measure.kinds:
        windows["full" if window is None else window] = count
    notes = [
        *skipped,
        (f"bytes are what the caches hold (nbytes) with K/V in {str(kv_dtype).removeprefix('torch.')}; a cache "
         "that grows also holds capacity not filled yet, at most the larger of 6.25% and 64 tokens, rounded up "
         "to 64 tokens (allocated_nbytes)"),
        (f"weights: every parameter at {weights_dtype}; the scales of quantized weights and the activations are not "
         f"counted (the {reserve:.0%} reserve is meant for activations and the runtime)"),
        ("a long prompt's prefill takes activations for every token at once, far more than the cache at large "
         "batches: generate(..., prefill_chunk_size=N) forwards it N tokens at a time, so that the peak is the cache "
         "plus one chunk's activations (README, Speed)"),
    ]
    if any(parse_spec(s)[0].startswith("kvquant") for s in rows):
        notes.append("kvquant-*: built from the config with placeholder calibration values and RoPE angles; their "
                     "layout (codes, outlier slots, ranges, positions) depends on shapes only")
    if any(parse_spec(s)[0].startswith("rotated") for s in rows):
        notes.append("rotated-*: the rotation is not fused into any weights; it moves values, not bytes")
    if any(w != "full" for w in windows):
        notes.append("sliding-window layers: the most a layer holds while decoding past its window (the window plus "
                     "the cache's rollback margin)")
    if max_positions and context > max_positions:
        notes.append(f"the context exceeds the model's max_position_embeddings ({max_positions:,})")
    return Plan(
        model=name,
        description=SHIPPED_MODELS[name][0] if name in SHIPPED_MODELS else getattr(config, "model_type", "?"),
        layers=layers, kv_heads=kv_heads, head_dim=head_dim, windows=windows, max_position_embeddings=max_positions,
        context=context, batch=batch, kv_dtype=str(kv_dtype).removeprefix("torch."),
        reference_bytes_per_token=reference_bytes_per_token(config), parameters=parameters,
        weights_dtype=weights_dtype, weights_bytes=weights, gpu=hardware,
        gpu_source=gpu_source if hardware is not None else "none", gpu_memory=memory,
        gpu_memory_source=memory_source, reserve=reserve, kv_budget=budget,
        rows=tuple(rows[s] for s in specs if s in rows),
        recommendations=tuple(_recommend(rows, hardware, context, batch)),
        notes=tuple(notes),
    )
