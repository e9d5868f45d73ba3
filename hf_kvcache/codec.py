"""What a method decides for one layer (`LayerPolicy`) and how one stream of it is stored in the packed place (`Codec`):
the interface between a method (`hf_kvcache.methods`) and the cache core (`layer.py`, `cache.py`), which knows no
method by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .kernels.layout import PackedFormat


class Codec(ABC):
    """How one stream (keys or values) of one layer is stored in the packed place.

    A codec turns blocks of `block_size` consecutive tokens into named fields and back. Every field has the
    batch and kv-head axes first and one row per block: `encode(x (B, H, T, D)) -> {name: (B, H, T / block_size,
    *tail)}`. A codec may hold per-sequence state (e.g. a frozen per-head FP8 scale) in `state`, a dict of
    tensors with the batch axis first, which the layer reorders with the rest on beam search.
    """

    block_size: int = 1

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    @abstractmethod
    def encode(self, x: torch.Tensor, valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`x (B, H, T, D)`, T a multiple of `block_size` -> fields `(B, H, T / block_size, ...)`.

        `valid (B, T)` bool, when given, marks the tokens that are not left padding: statistics shared by
        several tokens (a per-channel range, a per-head amax) must ignore the others. None: all valid.
        """

    def encode_into(self, x: torch.Tensor, valid: torch.Tensor | None, out: dict[str, torch.Tensor], **kwargs) -> None:
        """Like `encode`, writing the fields into `out` (views of the storage's next rows). Codecs with a pack
        kernel override this to write in place; the default encodes and copies. A codec with
        `needs_positions = True` also gets `positions (B, T)`, the tokens' RoPE positions, as a keyword."""
        for name, value in self.encode(x, valid, **kwargs).items():
            out[name].copy_(value)

    @abstractmethod
    def decode(self, fields: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Fields `(B, H, n, ...)` -> `(B, H, n * block_size, D)` in `dtype`."""

    def reset(self) -> None:
        """Forget per-sequence state (a new generation starts)."""
        self.state = {}

    def constants_nbytes(self) -> int:
        """Bytes of the constants the codec keeps on the devices it has coded on (rotations, codebook tables): memory
        the cache holds that neither grows with the tokens nor belongs to one sequence. 0 by default."""
        return 0

    @property
    def observing(self) -> bool:
        """True while the codec wants `observe` (a per-sequence statistic not set yet)."""
        return False

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """The first write that reaches past the sinks, before anything is packed: its tokens past the sinks,
        `x (B, H, T, D)` (those headed for the residual window included), `valid (B, T)` as in `encode`. A codec that
        freezes a per-sequence statistic (FP8's dynamic scale) sets it from these (a prefill: the whole prompt)
        rather than from the first packed block, which behind a window can be a single token."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a ValueError naming the parameter if this codec cannot store vectors of size `head_dim`."""

    def packed_format(self) -> PackedFormat | None:
        """How the fused kernels read this codec's fields (`hf_kvcache.kernels.layout`); None: they cannot, and
        the attention uses the reference path."""
        return None


@dataclass
class LayerPolicy:
    """What a method decides for one layer: the two codecs and where tokens live."""

    key_codec: Codec
    value_codec: Codec
    sink_tokens: int = 0
    key_residual_length: int = 0
    value_residual_length: int = 0
    key_flush: str = "fifo"
    value_flush: str = "fifo"
    # An orthogonal rotation of the keys (`apply(x)` = x R, `apply(x, inverse=True)` = x R^T; RotatedCache):
    # every place stores rotated keys, the attention rotates the query the same way (`rotate_query`), and the
    # dense read path returns the keys rotated back.
    key_rotation: object | None = None
