"""transformers' own quantized caches, by name, so that `hf-kvcache eval` and `hf-kvcache bench` measure them beside
the presets in the same run (README.md, "Against transformers' QuantizedCache").

`QuantizedCache` stores the history in its backend's format and dequantizes all of it at every `update`, so that the
model's own attention reads a full 16-bit copy each step; its quanto and hqq backends keep the last
`residual_length` tokens (128) in 16 bits and requantize the whole history whenever that window fills. The names:

- `hf-quanto-int4`, `hf-quanto-int2`: the quanto backend (`pip install optimum-quanto`) at 4 and 2 bits, its own
  defaults otherwise (groups of 64, per token, 128 residual tokens);
- `hf-fp8`: the fp8 backend (transformers 5.24 on): E4M3 with one scale a layer for keys and one for values, set by
  the first `update` (the prompt) and kept.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

from .. import _compat

__all__ = ["COMPARED", "Compared", "build", "describe", "is_compared"]


@dataclass(frozen=True)
class Compared:
    backend: str
    kwargs: dict = field(default_factory=dict)
    description: str = ""
    package: str | None = None  # the module the backend imports, and the distribution that installs it
    distribution: str | None = None


COMPARED: dict[str, Compared] = {
    "hf-quanto-int4": Compared(
        "quanto", {"nbits": 4}, "transformers' QuantizedCache, quanto int4 (groups of 64, 128 residual tokens)",
        "optimum.quanto", "optimum-quanto"),
    "hf-quanto-int2": Compared(
        "quanto", {"nbits": 2}, "transformers' QuantizedCache, quanto int2 (groups of 64, 128 residual tokens)",
        "optimum.quanto", "optimum-quanto"),
    "hf-fp8": Compared("fp8", {}, "transformers' QuantizedCache, fp8 E4M3, one scale a layer set by the prompt"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def is_compared(spec: str) -> bool:
    return spec.strip() in COMPARED


def describe(spec: str) -> str:
    return COMPARED[spec.strip()].description


def build(spec: str, model):
    """A fresh `QuantizedCache` of the name `spec` for `model` (a model or its config). A missing backend package or
    a transformers without the backend is an ImportError or ValueError that says what to install."""
    entry = COMPARED[spec.strip()]
    if entry.package and not _installed(entry.package):
        raise ImportError(f"{spec} needs the {entry.distribution} package: pip install {entry.distribution}")
    return _compat.quantized_cache(entry.backend, getattr(model, "config", model), **entry.kwargs)
