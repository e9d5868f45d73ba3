"""Every launcher in one namespace, what the rest of the package calls (`kernels.ops.pack_fp8(...)`,
`kernels.ops.static_decode_attention(...)`): a stable facade over the modules that hold them, each beside its kernel
module (`launch.py` says why). `TUNING` is the very dict the launchers read: an entry set here (the benchmark's
sweep, the tests) changes their next launch.
"""

from . import backend
from .decode_launch import _fmt_meta, _planes, _product_dtype, _stream_args, packed_attention
from .dispatch import decode_attention, static_decode_attention, supports
from .hadamard_launch import hadamard, rotate_rows, rows_times
from .launch import TUNING, _compute_dtype, _place, head_dim_ok, on_input_device
from .nuq_launch import nuq_attention, pack_nuq
from .pack_launch import pack_fp8, pack_per_channel, pack_per_token, pack_turbo, token_places
from .turbo_launch import _codebook_table, _into_frame, codebook_args, turbo_attention

__all__ = [
    "TUNING",
    "backend",
    "codebook_args",
    "decode_attention",
    "hadamard",
    "head_dim_ok",
    "nuq_attention",
    "on_input_device",
    "pack_fp8",
    "pack_nuq",
    "pack_per_channel",
    "pack_per_token",
    "pack_turbo",
    "packed_attention",
    "rotate_rows",
    "rows_times",
    "static_decode_attention",
    "supports",
    "token_places",
    "turbo_attention",
    # argument builders that `hf_kvcache.prefill`'s workspace launchers use, and details the kernel tests check
    "_codebook_table",
    "_compute_dtype",
    "_fmt_meta",
    "_into_frame",
    "_place",
    "_planes",
    "_product_dtype",
    "_stream_args",
]
