"""Triton kernels (installed as `hf_kvcache.kernels`): quantize/pack and fused decode attention over the packed
cache. Triton is imported on first use, so importing this package is cheap and works without Triton."""

from .backend import BACKENDS, get_backend, interpreting, set_backend, triton_available, use_backend, use_kernels
from .layout import PackedFormat, StreamTensors
from . import library  # noqa: F401  (registers the operators that torch.compile calls)
from .ops import head_dim_ok

__all__ = [
    "BACKENDS",
    "PackedFormat",
    "StreamTensors",
    "decode_attention",
    "get_backend",
    "head_dim_ok",
    "ops",
    "interpreting",
    "set_backend",
    "triton_available",
    "use_backend",
    "use_kernels",
]


from . import ops  # noqa: E402  (imports Triton only when a kernel is first launched)

decode_attention = ops.decode_attention
