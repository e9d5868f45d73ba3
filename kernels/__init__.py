"""Triton kernels (installed as `hf_kvcache.kernels`): quantize/pack and fused decode attention over the packed
cache. Triton is imported on first use, so importing this package is cheap and works without Triton."""

from .backend import BACKENDS, get_backend, interpreting, set_backend, triton_available, use_backend, use_kernels
from .layout import PackedFormat, StreamTensors

__all__ = [
    "BACKENDS",
    "PackedFormat",
    "StreamTensors",
    "decode_attention",
    "get_backend",
    "interpreting",
    "set_backend",
    "triton_available",
    "use_backend",
    "use_kernels",
]


def decode_attention(*args, **kwargs):
    """See `hf_kvcache.kernels.ops.decode_attention`."""
    from .ops import decode_attention as impl

    return impl(*args, **kwargs)
