"""The method matrix: one row per cache spec, with the easy (preset) and hard (every place in use) overrides.
Adding a method adds a row here; the smoke tests over every tiny model config pick it up."""

from __future__ import annotations

METHODS: list[tuple[str, dict, dict]] = [
    ("fp8-e4m3", {}, {"scale": "none", "sink_tokens": 2, "residual_length": 3}),
    ("fp8-e5m2", {}, {"headroom": 1.0, "residual_length": 8}),
    ("int8", {}, {"sink_tokens": 3, "residual_length": 5}),
    ("int4-g32", {}, {"sink_tokens": 1, "residual_length": 16}),
    ("int2-g32", {}, {"sink_tokens": 4}),
    ("kivi-4", {"residual_length": 32}, {"residual_length": 64, "sink_tokens": 2}),
    ("kivi-2", {"residual_length": 32}, {"residual_length": 32, "sink_tokens": 3}),
    ("kvquant-3", {}, {"sink_tokens": 3, "outlier_fraction": 0.05}),
    ("rotated-4", {}, {"sink_tokens": 2, "residual_length": 8, "group_size": 32, "clip_ratio": 0.9}),
    ("turboquant-3.5", {}, {"sink_tokens": 2, "residual_length": 4, "key_qjl": True, "scale": "norm"}),
]

SPECS = [spec for spec, _, _ in METHODS]
# The pinned capacity's matrix (tests/test_pinned_capacity.py): every method and `exact`, the 16-bit baseline through
# this library's storage (the generate matrix covers a lossless codec, tests/helpers/lossless.py, instead).
STATIC_METHODS = [("exact", {}, {"sink_tokens": 2})] + METHODS
# Methods the decode-kernel tests build on a bare config (KVQuant and RotatedCache need a model: their kernel
# paths are tested in tests/kernels/test_nuq.py and tests/kernels/test_hadamard.py; TurboQuant's, whose row here
# has QJL keys that no kernel reads, in tests/kernels/test_turbo.py).
KERNEL_METHODS = [m for m in METHODS if not m[0].startswith(("kvquant", "rotated", "turboquant"))]
# TurboQuant through its kernels (the matrix's row above has QJL keys, which no kernel reads): the energy split's
# channel orders, sinks and a FIFO window
TURBOQUANT_KERNEL = ("turboquant-3", {}, {"sink_tokens": 2, "residual_length": 4})
