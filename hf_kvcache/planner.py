"""Capacity planning (`hf-kvcache plan`, `hf_kvcache.plan`): for every method, the bytes one token and one sequence
take in the KV cache of a model, how many concurrent sequences fit next to the weights on a GPU, and which preset to
pick, citing the accuracy and speed this project measured on a GPU.

Bytes are measured, not derived from a formula (`hf_kvcache.footprint`): the real cache is built on the model's
config (on the CPU, batch 1, no weights) and every tensor it holds is counted: its tokens' bytes at the context
(extrapolated exactly from one layer of each kind), the capacity a prefill of the context leaves unfilled, and what it
holds whatever the length (rotations, codebooks, calibration tables).

Weights: the model class built from the config on the meta device, its parameters counted (tied embeddings once)
at `weights_dtype`. KV budget = GPU memory x (1 - reserve) - weights; sequences that fit = (budget - the tensors held
once per cache) // the bytes of one sequence's tokens and capacity, which are linear in the batch (every stored
field has the batch axis first).

The recommendation reads `hf_kvcache/data/measured.json`: accuracy on the decode protocol and decode (and prefill)
speed in `generate` against DynamicCache, both on a GPU, each with the result file it comes from. `hf-kvcache report
--readme README.md` writes that file from the same result files as the README's table (`docs/readme_sources.json`
names them), and a test checks that the two agree.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from functools import cache
from importlib import resources

import torch

from . import _compat
from .configs import attention_shape
from .eval.memory import reference_bytes_per_token
from .footprint import Measure
from .gpus import FP8_ARCHS, GPU, GPUS, detect_gpu  # noqa: F401  (re-exported: `from hf_kvcache.planner import GPUS`)
from .models import SHIPPED_MODELS, load_config  # noqa: F401  (re-exported: `from hf_kvcache.planner import ...`)
from .presets import PRESETS, parse_spec

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

DEFAULT_MAX_LOSS = 0.5  # ΔNLL (%) on the measured decode protocol a recommendation may cost
UNQUANTIZED = ("none", "exact")  # never recommended: they save nothing
DEFAULT_GPU_MEMORY = 80 * 2**30  # without a GPU to read or name
DEFAULT_RESERVE = 0.1  # share of GPU memory kept for activations and the runtime, as vLLM's default utilization 0.9
WEIGHT_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "int8": 1,
                "int4": 0.5}
KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

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


def _kv_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in KV_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[dtype]


# ------------------------------------------------------------------------------------------------ hardware




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


# ------------------------------------------------------------------------------------------------ results


@cache
def measured() -> dict:
    """The figures this project measured that recommendations cite (`hf_kvcache/data/measured.json`, written by
    `hf-kvcache report --readme`): `accuracy.methods[spec]` on the decode protocol and `speed.methods[spec]`, a list
    of points (decode or prefill, batch, context, ratio against DynamicCache), each with the result file it comes
    from."""
    return json.loads(resources.files("hf_kvcache").joinpath("data/measured.json").read_text())


@dataclass(frozen=True)
class MethodPlan:
    """One method at the plan's context. `sequence_bytes`: every tensor one sequence's cache holds, i.e.
    `held_bytes` (its tokens: `nbytes()`) + `spare_bytes` (the capacity a prefill of the context leaves unfilled) +
    `fixed_bytes` (what the cache holds whatever its length, once per cache). `bytes_per_token` = sequence_bytes /
    context, `ratio` against the 16-bit cache of the same sequence, `max_sequences` of the context that fit the KV
    budget, `max_tokens` that fit at this bytes/token, and whether the requested batch fits."""

    spec: str
    sequence_bytes: int
    held_bytes: int
    spare_bytes: int
    fixed_bytes: int
    bytes_per_token: float
    ratio: float
    max_sequences: int
    max_tokens: int
    fits_batch: bool


@dataclass(frozen=True)
class Recommendation:
    """A spec picked by one rule (`kind`: "bytes", "speed" or "memory"), why, what it fits, and the measured figures
    it cites: `accuracy` and `speed` are the spec's entries of `measured()` (None / empty where there are none)."""

    spec: str
    kind: str
    why: str
    max_sequences: int
    ratio: float
    accuracy: dict | None
    speed: list


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
    max_loss: float
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
            lines.append(f"  accuracy: {_accuracy_text(rec.accuracy)}")
            lines.append(f"  speed: {_speed_text(rec.speed)}")
        if not self.recommendations:
            lines.append("- none: no preset with measured accuracy was planned")
        lines += ["", *(f"Note: {note}" for note in self.notes)]
        return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


def _gpu_line(gpu: GPU | None) -> str:
    return "unknown (none named, none visible)" if gpu is None else f"{gpu.name} ({gpu.capability}, {gpu.arch})"


def _length(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _accuracy_text(entry: dict | None) -> str:
    if entry is None:
        return "not measured on the decode protocol"
    figures = measured()["accuracy"]
    half = f" ± {entry['delta_half_width']:.2f}" if entry.get("delta_half_width") else ""
    return (f"ΔNLL {entry['decode_delta_pct']:+.2f}%{half}, KL {entry['kl']:.4f}, top-1 {entry['top1']:.1%} "
            f"({figures['protocol']}; {figures['model']}; {figures['platform']}) [{entry['source']}]")


def _point_text(point: dict) -> str:
    where = f"batch {point['batch']} x {_length(point['context'])}"
    if point["what"] == "prefill":
        unchunked = point.get("vs_dynamic")
        return (f"prefill in chunks of {point['chunk']} x{point['vs_dynamic_chunked']:.2f} at {where}"
                + ("" if unchunked is None else f" (x{unchunked:.2f} against DynamicCache unchunked)"))
    return f"decode x{point['vs_dynamic']:.2f} at {where}"


def _speed_text(points: list) -> str:
    if not points:
        return "not benchmarked in generate on a GPU"
    sources = sorted({p["source"] for p in points})
    return (f"{', '.join(_point_text(p) for p in points)} ({measured()['speed']['protocol']}) "
            f"[{', '.join(sources)}]")


# ------------------------------------------------------------------------------------------------ recommendation


def _decode_speed(points: list) -> tuple[int, float] | None:
    """`(batch, ratio against DynamicCache)` of the largest-batch decode point measured, or None."""
    decode = [p for p in points if p["what"] == "decode"]
    return None if not decode else max((p["batch"], p["vs_dynamic"]) for p in decode)


def _recommend(rows: dict[str, MethodPlan], gpu: GPU | None, context: int, batch: int,
               max_loss: float) -> list[Recommendation]:
    """Candidates: the planned presets with a measured accuracy, quantized, FP8 only on GPUs that convert it natively,
    and none measured slower than DynamicCache in `generate`. Then:
    - "bytes": the fewest bytes among the candidates within `max_loss` ΔNLL that fit the batch;
    - "speed": the fastest decode (largest measured batch) among the same, when it is another preset;
    - "memory": when none within `max_loss` fits the batch, the most accurate candidate that does (or, if none
      does, the one holding the most sequences)."""
    figures = measured()
    accuracy, speed = figures["accuracy"]["methods"], figures["speed"]["methods"]
    fp8 = gpu is not None and gpu.arch in FP8_ARCHS

    def usable(spec: str) -> bool:
        fast = _decode_speed(speed.get(spec, []))
        return (spec in accuracy and spec not in UNQUANTIZED and (fp8 or not spec.startswith("fp8"))
                and (fast is None or fast[1] >= 1.0))

    def rec(spec: str, kind: str, why: str) -> Recommendation:
        r = rows[spec]
        fits = f"{r.ratio:.3f}x the 16-bit cache, {r.max_sequences:,} sequences of {context:,} tokens fit"
        return Recommendation(spec, kind, f"{why}; {fits}.", r.max_sequences, r.ratio, accuracy.get(spec),
                              speed.get(spec, []))

    candidates = [s for s in rows if usable(s)]
    if not candidates:
        return []
    loss = {s: accuracy[s]["decode_delta_pct"] for s in candidates}
    within = [s for s in candidates if loss[s] <= max_loss and rows[s].fits_batch]
    hardware = "" if fp8 else " (FP8 left out: " + ("no GPU named" if gpu is None else f"{gpu.arch}") + ")"
    budget = f"within {max_loss:g}% ΔNLL that fit batch {batch}{hardware}"
    if not within:
        fitting = [s for s in candidates if rows[s].fits_batch]
        if fitting:
            pick = min(fitting, key=lambda s: loss[s])
            why = f"no preset within {max_loss:g}% ΔNLL fits batch {batch}{hardware}: the most accurate that does"
        else:
            pick = max(candidates, key=lambda s: rows[s].max_sequences)
            why = f"no preset fits batch {batch}: the one that holds the most sequences"
        return [rec(pick, "memory", why)]
    smallest = min(within, key=lambda s: (rows[s].sequence_bytes, loss[s]))
    out = [rec(smallest, "bytes", f"the fewest bytes among the presets {budget}")]
    timed = {s: _decode_speed(speed.get(s, [])) for s in within}
    timed = {s: t for s, t in timed.items() if t is not None}
    if timed:
        fastest = max(timed, key=lambda s: timed[s])
        if fastest != smallest:
            b, ratio = timed[fastest]
            out.append(rec(fastest, "speed", f"the fastest decode at batch {b} (x{ratio:.2f} DynamicCache's) among "
                                             f"the presets {budget}"))
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
    max_loss: float = DEFAULT_MAX_LOSS,
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
        methods: specs to plan (default: every preset); the recommendation's candidates (the presets with a measured
            accuracy) are planned in any case.
        dtype: the dtype the model computes K/V in, which the baseline and every exact window hold (default bf16).
        max_loss: the ΔNLL (%, measured on the decode protocol) a recommended preset may cost (default 0.5).

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
    if not max_loss >= 0:
        raise ValueError(f"max_loss is a ΔNLL in % (0 or more), got {max_loss!r}")
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

    measure = Measure(config, kv_dtype)
    sixteen_bit = measure if kv_dtype.itemsize == 2 else Measure(config, torch.bfloat16)
    reference = sixteen_bit.footprint("none", context).total  # "vs 16-bit" is against this, whatever `dtype` is
    candidates = [s for s in measured()["accuracy"]["methods"] if s in PRESETS]  # what a recommendation weighs
    rows, skipped = {}, []
    for spec in dict.fromkeys([*specs, *candidates]):
        try:
            fp = measure.footprint(spec, context)
        except ValueError as error:
            if methods is not None and spec in specs:
                raise
            skipped.append(f"`{spec}` does not apply to this model: {error}")  # e.g. groups of 128 at head_dim 64
            continue
        per_sequence = fp.held + fp.spare  # the fixed tensors are held once, whatever the batch
        fitting = max(budget - fp.fixed, 0) // per_sequence
        rows[spec] = MethodPlan(
            spec=spec, sequence_bytes=fp.total, held_bytes=fp.held, spare_bytes=fp.spare, fixed_bytes=fp.fixed,
            bytes_per_token=fp.total / context, ratio=fp.total / reference, max_sequences=fitting,
            max_tokens=int(max(budget - fp.fixed, 0) // (per_sequence / context)), fits_batch=fitting >= batch,
        )
    layers, kv_heads, head_dim = attention_shape(config)
    windows: dict = {}
    for _, count, window in measure.kinds:
        windows["full" if window is None else window] = count
    notes = [
        *skipped,
        (f"bytes: every tensor one sequence's cache holds with K/V in {str(kv_dtype).removeprefix('torch.')}: its "
         "tokens (codes, scales, windows, sinks), the capacity a prefill of the context leaves unfilled (64-127 "
         "tokens) and what the cache holds whatever its length (rotations, codebooks), counted once per cache; "
         "decoding past the prompt grows the capacity by 6.25% steps"),
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
        max_loss=max_loss, recommendations=tuple(_recommend(rows, hardware, context, batch, max_loss)),
        notes=tuple(notes),
    )
