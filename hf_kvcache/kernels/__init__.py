"""Triton kernels (installed as `hf_kvcache.kernels`): quantize/pack and fused decode attention over the packed
cache. Triton is imported on first use, so importing this package is cheap and works without Triton.

Each kernel module `X.py` (`decode`, `nuq`, `turbo`, `pack`, `hadamard`: Triton, imported when one of its kernels
first launches) has its launchers beside it in `X_launch.py`. `launch.py` holds what the launchers share,
`dispatch.py` picks the attention launcher of a layer's formats, `library.py` registers the launchers as operators for
torch.compile, and `ops.py` gathers them in one namespace, what the rest of the package calls. `layout.py` describes
a codec's packed fields to the kernels, `backend.py` says which implementation runs, and `workspace.py` holds the
gather kernels of prefill over a packed history (launched by `hf_kvcache.prefill`)."""

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
