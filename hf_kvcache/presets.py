"""`make_cache(spec, model)`: the one vocabulary of method names shared by the CLI, the evaluation and the README.

A spec is a preset name with optional overrides of its keyword arguments:
`int4-g32`, `fp8-e4m3:scale=none`, `int4-g64:sink_tokens=4,residual_length=32`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from transformers import DynamicCache

from .methods.exact import ExactCache
from .methods.fp8 import QuantizedFP8Cache
from .methods.int import QuantizedIntCache
from .methods.kivi import KIVICache
from .methods.kvquant import KVQuantCache
from .methods.rotated import RotatedCache
from .methods.turboquant import TurboQuantCache


@dataclass(frozen=True)
class Preset:
    """A named configuration of one method: the class, its keyword arguments and what it is."""

    build: Callable
    kwargs: dict = field(default_factory=dict)
    description: str = ""
    needs_model: bool = False  # `build` takes the model itself (hooks, rotary embedding), not its config


def _dynamic(config, **kwargs):
    if kwargs:
        raise ValueError(f"spec 'none' takes no overrides, got {sorted(kwargs)}")
    return DynamicCache(config=config)


PRESETS: dict[str, Preset] = {
    "none": Preset(_dynamic, {}, "no quantization: transformers' DynamicCache in the model dtype (the baseline)"),
    "fp8-e4m3": Preset(QuantizedFP8Cache, {"fmt": "e4m3"}, "FP8 E4M3, dynamic per-head scale"),
    "fp8-e5m2": Preset(QuantizedFP8Cache, {"fmt": "e5m2"}, "FP8 E5M2, dynamic per-head scale"),
    "int8": Preset(QuantizedIntCache, {"bits": 8}, "INT8 per-token symmetric, fp16 scale"),
    "int4-g32": Preset(QuantizedIntCache, {"bits": 4, "group_size": 32}, "INT4 asymmetric, groups of 32 along head_dim"),
    "int4-g64": Preset(QuantizedIntCache, {"bits": 4, "group_size": 64}, "INT4 asymmetric, groups of 64 along head_dim"),
    "int4-g128": Preset(
        QuantizedIntCache, {"bits": 4, "group_size": 128}, "INT4 asymmetric, groups of 128 along head_dim"
    ),
    "int2-g32": Preset(QuantizedIntCache, {"bits": 2, "group_size": 32}, "INT2 asymmetric, groups of 32 along head_dim"),
    "kivi-4": Preset(
        KIVICache,
        {"bits": 4, "group_size": 32, "residual_length": 128},
        "KIVI 4-bit: keys per channel, values per token, groups of 32, last 128 tokens exact",
    ),
    # The best measured KIVI-2 within the same bytes: 4 exact sink tokens and least-squares key ranges (see the
    # README); KIVI as published is `kivi-2:sink_tokens=0,key_range_search=false`.
    "kivi-2": Preset(
        KIVICache,
        {"bits": 2, "group_size": 32, "residual_length": 128, "sink_tokens": 4, "key_range_search": True},
        "KIVI 2-bit, groups of 32, last 128 tokens exact, + 4 sink tokens and least-squares key ranges",
    ),
}
for _bits, _what in ((4, "4-bit"), (3, "3-bit"), (2, "2-bit")):
    PRESETS[f"kvquant-{_bits}"] = Preset(
        KVQuantCache.from_model, {"bits": _bits},
        f"KVQuant {_what}: calibrated NUQ codebooks, keys per channel before RoPE, values per token, 1% outliers "
        "in sparse slots, 1 sink token (needs `hf-kvcache calibrate`)", needs_model=True,
    )
for _bits in (4, 3, 2):
    PRESETS[f"rotated-{_bits}"] = Preset(
        RotatedCache.from_model, {"bits": _bits},
        f"{_bits}-bit uniform K/V behind Hadamard rotations (QuaRot-style): values rotated through W_v/W_o (fused "
        "into the model), keys rotated online after RoPE", needs_model=True,
    )
# TurboQuant's widths per stream (the preset's number is their mean), the first tokens exact and the newest tokens
# exact, chosen on the decode protocol at P=6144 on the H200 (bf16, fused kernels; README): a window of 64 exact
# tokens took every width from +2.8-18.7% to +0.3-2.1% for 0.7-0.8% more bytes (at 6k), the one choice that mattered;
# keys half a bit above the values below 4 bits (the earlier stream-protocol measurement, kept); 2.5 bits with a
# window of 16, which keeps it under 0.19x of a 16-bit cache at 6k.
_TURBO_WIDTHS = {4: (4, 4, 1, 64), 3.5: (4, 3, 1, 64), 3: (3.5, 2.5, 1, 64), 2.75: (3, 2.5, 1, 64),
                 2.5: (2.5, 2.5, 0, 16)}
for _bits, (_kb, _vb, _sink, _window) in _TURBO_WIDTHS.items():
    PRESETS[f"turboquant-{_bits:g}"] = Preset(
        TurboQuantCache,
        {"bits": _kb} | ({} if _kb == _vb else {"key_bits": _kb, "value_bits": _vb})
        | ({"sink_tokens": _sink} if _sink else {}) | {"residual_length": _window},
        f"TurboQuant {_bits:g} bits per channel" + ("" if _kb == _vb else f" ({_kb:g}-bit keys, {_vb:g}-bit values)")
        + (", the first token exact" if _sink else "") + f", the last {_window} tokens exact"
        + ": seeded random rotation, then the Lloyd-Max codebook of the rotated coordinate law for every coordinate, "
        "an fp16 length per vector (at .5 bits the half of the channels with most prefill energy coded apart with "
        "the extra bit); no calibration, the model unchanged",
    )


# The 16-bit baseline of this library's storage and kernels (eager, or max_cache_len= and torch.compile): K/V
# unquantized, so that a quantized cache is compared with the same machinery at 16 bits.
PRESETS["exact"] = Preset(
    ExactCache, {}, "no quantization, K/V in the model dtype through this library's core and kernels: the 16-bit "
    "baseline of the quantized caches, eager or compiled (max_cache_len=)"
)


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low == "none":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """`"name:key=value,key=value"` -> `(name, {key: value})`, values parsed as bool/None/int/float/str."""
    name, _, rest = spec.strip().partition(":")
    if name not in PRESETS:
        raise ValueError(f"unknown cache spec {name!r}; available: {', '.join(PRESETS)}")
    overrides = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"bad override {item!r} in spec {spec!r}: write key=value, e.g. int4-g32:sink_tokens=4")
        overrides[key.strip()] = _parse_value(value.strip())
    return name, overrides


def make_cache(spec: str, model, **kwargs):
    """Build the cache a spec names for `model` (a model or its config). Keyword arguments override the spec's."""
    name, overrides = parse_spec(spec)
    preset = PRESETS[name]
    config = getattr(model, "config", model)
    if preset.needs_model and config is model:
        raise ValueError(f"spec {spec!r} needs the model itself (make_cache({spec!r}, model)), not its config")
    merged = {**preset.kwargs, **overrides, **kwargs}
    try:
        return preset.build(model if preset.needs_model else config, **merged)
    except TypeError as e:
        raise ValueError(f"spec {spec!r}: {e}") from e


def describe(spec: str) -> str:
    """One line saying what a spec is."""
    name, overrides = parse_spec(spec)
    extra = f" ({', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else ""
    return PRESETS[name].description + extra
