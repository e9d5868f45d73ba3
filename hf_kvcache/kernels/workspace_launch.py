"""Launchers of `workspace.py`'s gathers: a packed history, or a piece of it, dequantized into `(B, Hkv, n, D)`
workspaces in the model dtype (`hf_kvcache.prefill` reads them with flash attention)."""

from __future__ import annotations

import torch

from .decode_launch import _fmt_meta, _stream_args
from .launch import _compute_dtype, _place
from .layout import StaticLayout, StreamTensors
from .turbo_launch import codebook_args

_BLOCK_T = 32  # tokens a gather program writes


def gather_places(keys: StreamTensors, values: StreamTensors, k_new: torch.Tensor, static: StaticLayout,
                  wk: torch.Tensor, wv: torch.Tensor, start: int, n: int) -> None:
    """History tokens `start .. start + n` of a `decode.py` format (fp8, integer groups, KIVI's key blocks, exact),
    from whichever place holds each, dequantized as the reference codecs do -> `wk`/`wv (B, Hkv, n, D)` in the model
    dtype. `keys`/`values`: the layer's kernel views; `k_new (B, Hkv, Tq, D)`: this chunk's keys (only their count is
    read); every other count from `static.length` on the device."""
    from . import workspace

    b, hkv, _, d = k_new.shape
    dt, _ = _compute_dtype(k_new)
    if wk.stride() != wv.stride():
        raise ValueError("the key and value workspaces must share a layout")
    workspace._gather_places[(b * hkv, -(-n // _BLOCK_T))](
        # (the new tokens are never read: the keys' tensor stands in for both streams')
        *_stream_args(keys, k_new, k_new, d), *_stream_args(values, k_new, k_new, d),
        wk, wv, *wk.stride()[:3], static.length, static.capacity, hkv, start, n, k_new.shape[2],
        D=d, BLOCK_T=_BLOCK_T, DT=dt, **_fmt_meta(keys, values, d, k_new.device), SINK_CAP=static.sink_tokens,
        K_RING=static.key_ring, V_RING=static.value_ring, K_WINDOW=static.key_window, V_WINDOW=static.value_window,
    )


def gather_codebook(keys: StreamTensors, values: StreamTensors, k_new: torch.Tensor, static: StaticLayout,
                    wk: torch.Tensor, wv: torch.Tensor, start: int, n: int, exact: bool) -> None:
    """TurboQuant's packed body tokens `start .. start + n` in the codec's frame (`norm * codebook[code]` per part),
    or (`exact`) its first n exact history tokens (sinks, then the residual before this chunk) in the model's ->
    `wk`/`wv (B, Hkv, n, D)` in the model dtype; arguments as `gather_places`."""
    from . import workspace

    b, hkv, tq, d = k_new.shape
    dt, _ = _compute_dtype(k_new)
    k_args, k_meta = codebook_args(keys, k_new, torch.float32)
    v_args, v_meta = codebook_args(values, k_new, torch.float32)
    workspace._gather_codebook[(b * hkv, -(-n // _BLOCK_T))](
        *k_args, *v_args,
        *_place(keys.sink, k_new), *_place(keys.residual, k_new), *_place(None, k_new),
        *_place(values.sink, k_new), *_place(values.residual, k_new), *_place(None, k_new),
        wk, wv, *wk.stride()[:3], static.length, static.capacity, hkv, start, n, tq,
        D=d, BLOCK_T=_BLOCK_T, DT=dt, EXACT=exact,
        K_TWO=len(keys.fmt.parts) == 2, K_WA=k_meta[0][0], K_BA=k_meta[0][1], K_BB=k_meta[1][1],
        V_TWO=len(values.fmt.parts) == 2, V_WA=v_meta[0][0], V_BA=v_meta[0][1], V_BB=v_meta[1][1],
        SINK_CAP=static.sink_tokens, RING=static.key_ring, WINDOW=static.key_window,
    )
