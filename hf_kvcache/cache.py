"""The packed cache core: `QuantizedKVLayer` (one decoder layer) and `QuantizedKVCache` (the model's cache).

A cached token of one layer lives in exactly one of three places, separately for keys and for values (a
`_Stream` each):

1. sink: the first `sink_tokens` tokens, kept in the model dtype;
2. packed: codes and scales written by a `Codec`, in blocks of `codec.block_size` tokens, appended in place;
3. residual: the most recent tokens in the model dtype, at most `residual_length` of them after a flush.

Storage is preallocated and grows geometrically (`_Rows`), so an append costs O(new tokens) amortized; tokens
leave the residual only to be quantized once, and nothing packed is ever quantized again. The methods in
`hf_kvcache.methods` choose the policy (codecs, window, sink, flush rule); this module knows none of them.

Two read paths (see DESIGN.md): dense (`update()` returns K/V dequantized to the model dtype, what eager/sdpa
attention consume) and fused (`update()` returns a `KVHandle` that the registered `hf_kvcache` attention reads
block by block, never building the full dense K/V).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _compat
from .kernels.layout import PackedFormat, StreamTensors

# Storage grows by this factor (and at least `_MIN_GROW` tokens), so the capacity never exceeds what is held by
# more than ~6% + a few rows. A smaller factor means more regrows, each copying the whole storage: 1/0.0625 = 16
# row copies amortized per appended row, negligible next to the attention reading every row at every step; a
# larger one (it was 1.25) leaves up to that fraction of a long cache allocated and unused, which the memory
# the README promises (bytes per token, within 10% at 8k: tests/test_long_context.py) cannot afford.
_GROWTH = 1.0625
_MIN_GROW = 64
# Capacities are rounded up so that every field's batch and head strides (capacity x the elements of one row) stay
# multiples of this many elements as the storage grows, which the fused kernels' specialization relies on for
# aligned, vectorized loads (`kernels/decode.py`, `_VARYING`). Per field rather than a fixed 16 rows: a row of
# KIVI's keys is a block of 32 tokens and already 16-aligned, and 16 of them (512 tokens) of slack would be 25%
# of a 2k-token cache.
_STRIDE_ALIGN = 16

# A sliding-window layer keeps this many tokens beyond its window so that `crop` (assisted generation) can roll
# back a few tokens; trimming happens in bulk, amortized.
_SLIDING_CROP_MARGIN = 64


def _capacity(rows: int, fields: dict[str, torch.Tensor]) -> int:
    """`rows` rounded up so that `rows x (elements of one row)` is a multiple of `_STRIDE_ALIGN` for every field."""
    multiple = 1
    for v in fields.values():
        multiple = math.lcm(multiple, _STRIDE_ALIGN // math.gcd(_STRIDE_ALIGN, math.prod(v.shape[3:])))
    return -(-rows // multiple) * multiple


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

    @property
    def observing(self) -> bool:
        """True while the codec wants `observe` (a per-sequence statistic not set yet)."""
        return False

    def observe(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """The first write that reaches past the sinks, before anything is packed: its tokens past the sinks,
        `x (B, H, T, D)` (those headed for the residual window included), `valid (B, T)` as in `encode`. A codec that
        freezes a per-sequence statistic (FP8's dynamic scale) sets it from these (a prefill: the whole prompt)
        rather than from the first packed block, which behind a window can be a single token; the static form
        observes the same write."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a ValueError naming the parameter if this codec cannot store vectors of size `head_dim`."""

    def packed_format(self) -> PackedFormat | None:
        """How the fused kernels read this codec's fields (`hf_kvcache.kernels.layout`); None: they cannot, and
        the attention uses the reference path."""
        return None


class _Rows:
    """Named tensors sharing axis 2 (rows), appended at the end and dropped from the front in O(1) amortized.

    Holds `data[name][:, :, start:end]`; the buffers grow by `_GROWTH` and are compacted (the live rows moved to
    the front) when more than half of the capacity is dead rows at the front.
    """

    def __init__(self, min_grow: int = _MIN_GROW) -> None:
        self.data: dict[str, torch.Tensor] | None = None
        self.start = 0
        self.end = 0
        self.min_grow = min_grow  # rows: at least this many spare rows after a regrow (0 for a fixed-size place)

    def __len__(self) -> int:
        return self.end - self.start

    def view(self) -> dict[str, torch.Tensor]:
        if self.data is None:
            return {}
        return {k: v[:, :, self.start : self.end] for k, v in self.data.items()}

    def slice(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        return {k: v[:, :, self.start + lo : self.start + hi] for k, v in self.data.items()}

    def append(self, fields: dict[str, torch.Tensor]) -> None:
        n = next(iter(fields.values())).shape[2]
        if n == 0:
            return
        if self.data is None:
            cap = _capacity(max(n, self.min_grow), fields)
            self.data = {
                k: torch.empty((*v.shape[:2], cap, *v.shape[3:]), dtype=v.dtype, device=v.device)
                for k, v in fields.items()
            }
        self._make_room(n)
        for k, v in fields.items():
            self.data[k][:, :, self.end : self.end + n] = v
        self.end += n

    def reserve(self, n: int) -> dict[str, torch.Tensor] | None:
        """Claim the next `n` rows (growing the storage if needed) and return views of them to write in place;
        None before the first `append`, when the fields' shapes are not known yet."""
        if self.data is None:
            return None
        self._make_room(n)
        views = {k: v[:, :, self.end : self.end + n] for k, v in self.data.items()}
        self.end += n
        return views

    def _make_room(self, n: int) -> None:
        first = next(iter(self.data.values()))
        if first.is_inference() and not torch.is_inference_mode_enabled():
            # Storage made under torch.inference_mode() cannot be written outside it (a prompt prefilled under
            # inference_mode, then `generate`, which runs under no_grad): copy it once into normal tensors.
            self.data = {k: v.clone() for k, v in self.data.items()}
        cap = first.shape[2]
        if self.end + n > cap:
            live = len(self)
            if self.start > 0 and live + n <= cap and self.start * 2 >= cap:
                self._compact(cap)
            else:
                self._compact(max(int(math.ceil((live + n) * _GROWTH)), live + n + self.min_grow))

    def shrink(self, rows: int) -> None:
        """Reallocate to about `rows` rows of capacity if far more is allocated (never below what is live)."""
        if self.data is None:
            return
        target = max(rows, len(self)) + self.min_grow
        if next(iter(self.data.values())).shape[2] > 2 * target:
            self._compact(target)

    def _compact(self, capacity: int) -> None:
        live = len(self)
        capacity = _capacity(capacity, self.data)
        new = {}
        for k, v in self.data.items():
            buf = torch.empty((*v.shape[:2], capacity, *v.shape[3:]), dtype=v.dtype, device=v.device)
            buf[:, :, :live] = v[:, :, self.start : self.end]
            new[k] = buf
        self.data, self.start, self.end = new, 0, live

    def drop_front(self, n: int) -> None:
        self.start += n
        if len(self) == 0:
            self.start = self.end = 0

    def drop_back(self, n: int) -> None:
        self.end -= n
        if len(self) == 0:
            self.start = self.end = 0

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-axis operation (index_select, repeat_interleave) to the storage."""
        if self.data is None:
            return
        # The whole buffer, spare rows included: the capacity (and the strides' alignment) stays as it was.
        self.data = {k: fn(v) for k, v in self.data.items()}

    def nbytes(self) -> int:
        if self.data is None:
            return 0
        return sum(v[:, :, self.start : self.end].numel() * v.element_size() for v in self.data.values())

    def allocated_nbytes(self) -> int:
        if self.data is None:
            return 0
        return sum(v.numel() * v.element_size() for v in self.data.values())


def check_flush(codec: Codec, residual_length: int, flush: str) -> None:
    """A stream's window rule: "fifo", or "block" with a residual of whole blocks (ValueError otherwise)."""
    if flush not in ("fifo", "block"):
        raise ValueError(f"flush must be 'fifo' or 'block', got {flush!r}")
    if flush == "block" and (residual_length <= 0 or residual_length % codec.block_size):
        raise ValueError(
            f"residual_length={residual_length} must be a positive multiple of the block size "
            f"{codec.block_size} for a block-flushed stream"
        )


class _Stream:
    """Keys or values of one layer: sink, packed and residual places, and the rule that moves tokens between them.

    `flush="fifo"`: the residual keeps the last `residual_length` tokens; older ones are packed as soon as a whole
    block of them exists (KIVI's values, and every per-token method with `residual_length=0`).
    `flush="block"`: the residual fills up to `residual_length` tokens and is then packed all at once (KIVI's keys).
    """

    def __init__(self, codec: Codec, sink_tokens: int, residual_length: int, flush: str):
        check_flush(codec, residual_length, flush)
        self.codec = codec
        self.sink_tokens = sink_tokens
        self.residual_length = residual_length
        self.flush = flush
        self.sink = _Rows(min_grow=0)  # never holds more than sink_tokens: no spare rows
        # Rows of the packed place are blocks of codec.block_size tokens; spare rows are counted in tokens, so that
        # a block codec (KIVI's keys, 32 tokens a row) does not keep 64 blocks spare.
        self.packed = _Rows(min_grow=max(_MIN_GROW // codec.block_size, 1))
        # The residual never holds more than its window and a block once flushed: spare rows beyond that are dense
        # memory held for nothing (64 float32 tokens outweigh 700 packed 2-bit ones).
        self.residual = _Rows(min_grow=min(_MIN_GROW, residual_length + codec.block_size))
        self.first_position = 0  # absolute position of the first held token (> 0 once a window trimmed)

    # --- sizes
    @property
    def n_sink(self) -> int:
        return len(self.sink)

    @property
    def n_packed(self) -> int:
        return len(self.packed) * self.codec.block_size

    @property
    def n_residual(self) -> int:
        return len(self.residual)

    def __len__(self) -> int:
        return self.n_sink + self.n_packed + self.n_residual

    # --- writing
    def append(self, x: torch.Tensor, total_before: int, pad_lengths: torch.Tensor | None = None) -> None:
        """Store `x (B, H, T, D)`; `total_before` counts the tokens this stream saw before (sinks are absolute).
        `pad_lengths (B,)`: how many of each row's first tokens are left padding (None: no padding)."""
        free_sink = min(max(self.sink_tokens - total_before, 0), x.shape[2])
        if free_sink:
            self.sink.append({"x": x[:, :, :free_sink]})
            x = x[:, :, free_sink:]
        if self.codec.observing and x.shape[2]:
            # A per-sequence statistic (FP8's dynamic scale, TurboQuant's channel split) is set from the first write
            # that reaches past the sinks, before anything is packed: what the static form sees too (it packs every
            # token as it arrives), so both forms store the same codes; behind a window the first pack can come
            # steps later, and taking the statistic then gave the two forms different channel splits.
            start = self.first_position + self.n_sink + self.n_packed + self.n_residual
            seen = None
            if pad_lengths is not None:
                index = torch.arange(start, start + x.shape[2], device=x.device)
                seen = index.unsqueeze(0) >= pad_lengths.to(x.device).unsqueeze(1)  # (B, T)
            self.codec.observe(x, seen)
        # No window to pass through (a per-token method at decode): pack the new tokens straight from `x`, which
        # saves the residual's copy and bookkeeping, most of an eager step's host time after the kernels' launches.
        direct = (self.residual_length == 0 and self.n_residual == 0 and x.shape[2] > 0
                  and x.shape[2] % self.codec.block_size == 0)
        if x.shape[2] and not direct:
            self.residual.append({"x": x})
        try:
            if direct:
                x = x if x.stride(-1) == 1 else x.contiguous()  # the pack kernels read rows contiguous
                self._pack(x, pad_lengths)
            else:
                self._flush(pad_lengths)
        except BaseException:
            # The packed place gave its reserved rows back; take this call's tokens out of the others too.
            if not direct:
                self.residual.drop_back(x.shape[2])
            self.sink.drop_back(free_sink)
            raise

    def _n_to_flush(self) -> int:
        n, b, r = self.n_residual, self.codec.block_size, self.residual_length
        if self.flush == "block":
            return (n // r) * r
        return max((n - r) // b, 0) * b

    def _residual_index(self, n: int, device: torch.device) -> torch.Tensor:
        """`(n,)` the sequence indices of the residual's first n tokens."""
        start = self.first_position + self.n_sink + self.n_packed
        return torch.arange(start, start + n, device=device)

    def _flush(self, pad_lengths: torch.Tensor | None) -> None:
        n = self._n_to_flush()
        if n <= 0:
            return
        self._pack(self.residual.slice(0, n)["x"], pad_lengths)
        self.residual.drop_front(n)
        # A prefill passes through the residual once: give its storage back rather than hold a dense copy.
        self.residual.shrink(self.residual_length + self.codec.block_size)

    def _pack(self, x: torch.Tensor, pad_lengths: torch.Tensor | None) -> None:
        """Encode `x (B, H, n, D)`, the next `n` tokens after the packed ones (n a multiple of the block size), into
        the packed place."""
        n = x.shape[2]
        valid = None
        extra = {}
        needs_positions = getattr(self.codec, "needs_positions", False)
        if pad_lengths is not None or needs_positions:
            index = self._residual_index(n, x.device)
        if pad_lengths is not None:
            valid = index.unsqueeze(0) >= pad_lengths.to(x.device).unsqueeze(1)  # (B, n)
        if needs_positions:
            # RoPE positions, as `generate` numbers them: index minus the row's left padding (padding at 0)
            pads = pad_lengths.to(x.device).unsqueeze(1) if pad_lengths is not None else 0
            extra["positions"] = (index.unsqueeze(0) - pads).clamp_min(0).expand(x.shape[0], n)  # (B, n)
        rows = n // self.codec.block_size
        out = self.packed.reserve(rows)
        if out is None:
            self.packed.append(self.codec.encode(x, valid, **extra))
        else:
            try:
                self.codec.encode_into(x, valid, out, **extra)
            except BaseException:
                self.packed.drop_back(rows)  # a failed encode leaves the stored tokens as they were
                raise

    # --- reading
    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """All held tokens, dequantized: `(B, H, S, D)`."""
        parts = []
        if self.n_sink:
            parts.append(self.sink.view()["x"].to(dtype))
        if len(self.packed):
            parts.append(self.codec.decode(self.packed.view(), dtype))
        if self.n_residual:
            parts.append(self.residual.view()["x"].to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)

    def iter_chunks(self, dtype: torch.dtype, chunk_tokens: int, stop: int) -> Iterator[torch.Tensor]:
        """Held tokens `[0, stop)` dequantized piece by piece, at most ~`chunk_tokens` at a time: `(B, H, c, D)`.

        The fused path's reference: no tensor ever holds the whole dequantized stream.
        """
        pos = 0
        if self.n_sink and pos < stop:
            s = self.sink.view()["x"][:, :, : stop - pos].to(dtype)
            pos += s.shape[2]
            yield s
        b = self.codec.block_size
        n_blocks = len(self.packed)
        step = max(chunk_tokens // b, 1)
        for i in range(0, n_blocks, step):
            if pos >= stop:
                return
            j = min(i + step, n_blocks)
            x = self.codec.decode(self.packed.slice(i, j), dtype)[:, :, : stop - pos]
            pos += x.shape[2]
            yield x
        if self.n_residual and pos < stop:
            r = self.residual.view()["x"]
            for i in range(0, min(r.shape[2], stop - pos), chunk_tokens):
                yield r[:, :, i : min(i + chunk_tokens, stop - pos)].to(dtype)

    def kernel_view(self) -> StreamTensors | None:
        """The places as the fused attention reads them (views, no copy), or None if the codec has no kernel."""
        fmt = self.codec.packed_format()
        if fmt is None:
            return None
        return StreamTensors(
            sink=self.sink.view().get("x"),
            fields=self.packed.view(),
            fmt=fmt,
            n_packed=self.n_packed,
            residual=self.residual.view().get("x"),
        )

    # --- bookkeeping
    def drop_front_tokens(self, n: int) -> None:
        """Forget the `n` oldest held tokens (sliding windows). Only called with `can_drop_front(n)`."""
        self.first_position += n
        take = min(n, self.n_sink)
        self.sink.drop_front(take)
        n -= take
        take = min(n, self.n_packed)
        self.packed.drop_front(take // self.codec.block_size)
        n -= take
        self.residual.drop_front(n)
        # Give back the capacity a long chunk (a prefill) left behind: a sliding layer would otherwise keep the
        # largest chunk it ever saw allocated, however short its window.
        self.packed.shrink(0)
        self.residual.shrink(0)

    def can_drop_front(self, n: int) -> bool:
        n -= min(n, self.n_sink)
        if n < self.n_packed:
            return n % self.codec.block_size == 0
        return n - self.n_packed <= self.n_residual

    def crop(self, n: int, dtype: torch.dtype) -> None:
        """Remove the `n` newest tokens; a partly removed packed block is unpacked into the residual."""
        take = min(n, self.n_residual)
        self.residual.drop_back(take)
        n -= take
        if n and len(self.packed):
            b = self.codec.block_size
            n_blocks = min(math.ceil(n / b), len(self.packed))
            lo = len(self.packed) - n_blocks
            tail = self.codec.decode(self.packed.slice(lo, len(self.packed)), dtype)
            self.packed.drop_back(n_blocks)
            removed = min(n, tail.shape[2])
            keep = tail[:, :, : tail.shape[2] - removed]
            n -= removed
            if keep.shape[2]:
                # The kept tokens go back to the front of the (now empty) residual, in order; they will be
                # packed again from their dequantized values, the one case where stored tokens are re-encoded.
                self.residual = _Rows(self.residual.min_grow)
                self.residual.append({"x": keep.to(dtype)})
        if n:
            self.sink.drop_back(min(n, self.n_sink))

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        for rows in (self.sink, self.packed, self.residual):
            rows.map_batch(fn)
        self.codec.state = {k: fn(v) for k, v in self.codec.state.items()}

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this stream holds: each place's buffers (spare rows included) and the codec's state."""
        for rows in (self.sink, self.packed, self.residual):
            yield from (rows.data or {}).values()
        yield from self.codec.state.values()

    def nbytes(self) -> int:
        state = sum(v.numel() * v.element_size() for v in self.codec.state.values())
        return self.sink.nbytes() + self.packed.nbytes() + self.residual.nbytes() + state

    def allocated_nbytes(self) -> int:
        return self.sink.allocated_nbytes() + self.packed.allocated_nbytes() + self.residual.allocated_nbytes()


@dataclass
class KVHandle:
    """What `update()` returns on the fused path instead of a dense tensor: the layer and which of its held
    tokens are the `n_new` tokens of this step (given exactly, so prefill can attend to them unquantized)."""

    layer: QuantizedKVLayer
    stream: str  # "keys" or "values"
    new: torch.Tensor  # the exact new tokens, (B, H, n_new, D)

    @property
    def shape(self) -> torch.Size:
        b, h, _, d = self.new.shape
        return torch.Size((b, h, self.layer.held_tokens, d))

    @property
    def dtype(self) -> torch.dtype:
        return self.new.dtype

    @property
    def device(self) -> torch.device:
        return self.new.device


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


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized K/V, stored as sink + packed + residual (see the module docstring).

    Shapes: `update(keys (B, Hkv, T, D), values (B, Hkv, T, D))` returns `(B, Hkv, S, D)` tensors on the dense
    path (S = tokens held, T of them new), or two `KVHandle`s on the fused path.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, policy: LayerPolicy, sliding_window: int | None = None):
        super().__init__()
        self.policy = policy
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        # A sliding layer never attends to the first tokens once past its window: sinks would be dead weight.
        sink = 0 if self.is_sliding else policy.sink_tokens
        self._streams = {
            "keys": _Stream(policy.key_codec, sink, policy.key_residual_length, policy.key_flush),
            "values": _Stream(policy.value_codec, sink, policy.value_residual_length, policy.value_flush),
        }
        self.cumulative_length = 0  # tokens ever stored (positions), held or trimmed by the sliding window
        self.pad_lengths: torch.Tensor | None = None  # (B,) left padding per row, when transformers tells us
        self.dtype: torch.dtype | None = None
        self.fused = False  # set by the cache from the model's attn_implementation
        self.quantize_before_attention = False
        self._offloaded = False  # every place's storage is in CPU memory (`offload`), until `prefetch`

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        for name, x in (("keys", key_states), ("values", value_states)):
            self._streams[name].codec.check_head_dim(x.shape[-1])
        self.is_initialized = True

    @property
    def key_stream(self) -> _Stream:
        return self._streams["keys"]

    @property
    def value_stream(self) -> _Stream:
        return self._streams["values"]

    @property
    def held_tokens(self) -> int:
        return len(self._streams["keys"])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.prefetch()  # a no-op unless offloaded and not prefetched ahead of time
        # Trim before appending, never after: this step's mask was sized by `get_mask_sizes()` from the
        # trimmed view, and on the fused path the attention reads the layer only after `update()` returns.
        self._trim_to_window()
        pads = _compat.left_padding(kwargs, self.cumulative_length, key_states.shape[2], key_states.shape[0])
        if pads is not None:
            self.pad_lengths = pads
        if self.policy.key_rotation is not None:
            key_states = self.policy.key_rotation.apply(key_states)
        self._streams["keys"].append(key_states, self.cumulative_length, self.pad_lengths)
        try:
            self._streams["values"].append(value_states, self.cumulative_length, self.pad_lengths)
        except BaseException:
            self._streams["keys"].crop(key_states.shape[2], self.dtype)  # a failed update stores nothing
            raise
        self.cumulative_length += key_states.shape[2]
        if self.fused:
            return KVHandle(self, "keys", key_states), KVHandle(self, "values", value_states)
        return self._dense("keys", key_states), self._dense("values", value_states)

    def _dense(self, name: str, new: torch.Tensor) -> torch.Tensor:
        x = self._streams[name].dense(self.dtype)
        if not self.quantize_before_attention:
            # Prefill and decode attend to the exact new tokens, to the stored past (as KIVI, KVQuant, vLLM).
            x[:, :, x.shape[2] - new.shape[2] :] = new
        if name == "keys" and self.policy.key_rotation is not None:
            x = self.policy.key_rotation.apply(x, inverse=True)
        return x

    def rotate_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query in the frame the stored keys are in (`LayerPolicy.key_rotation`): `(B, Hq, Tq, D)`."""
        rotation = self.policy.key_rotation
        return query if rotation is None else rotation.apply(query)

    def iter_kv_chunks(
        self, k_new: torch.Tensor, v_new: torch.Tensor, chunk_tokens: int = 256
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held tokens as `(k (B, Hkv, c, D), v (B, Hkv, c, D))` chunks in order, the new ones exact unless
        `quantize_before_attention`: the fused read path's reference, used by the CPU attention."""
        n_new = k_new.shape[2]
        stop = self.held_tokens if self.quantize_before_attention else self.held_tokens - n_new
        ks = self._stream_chunks("keys", chunk_tokens, stop)
        vs = self._stream_chunks("values", chunk_tokens, stop)
        # The two streams may be split into places differently (KIVI): re-chunk them to common boundaries.
        kbuf, vbuf = [], []
        kn = vn = 0
        for k in ks:
            kbuf.append(k)
            kn += k.shape[2]
            while vn < kn:
                v = next(vs)
                vbuf.append(v)
                vn += v.shape[2]
            c = min(kn, vn)
            kc, vc = torch.cat(kbuf, 2), torch.cat(vbuf, 2)
            yield kc[:, :, :c], vc[:, :, :c]
            kbuf, vbuf = [kc[:, :, c:]], [vc[:, :, c:]]
            kn, vn = kn - c, vn - c
        if not self.quantize_before_attention:
            for i in range(0, n_new, chunk_tokens):  # a long chunk of new tokens, in pieces too
                yield k_new[:, :, i : i + chunk_tokens], v_new[:, :, i : i + chunk_tokens]

    def _stream_chunks(self, name: str, chunk_tokens: int, stop: int) -> Iterator[torch.Tensor]:
        return self._streams[name].iter_chunks(self.dtype, chunk_tokens, stop)

    def _window_excess(self) -> int:
        """How many of the oldest held tokens the next `update()` drops before appending (0 if full)."""
        if not self.is_sliding:
            return 0
        keep = self.sliding_window - 1 + _SLIDING_CROP_MARGIN
        excess = self.held_tokens - keep
        # Trim in bulk (at least a margin's worth), so the amortized cost per token stays O(1).
        if excess < _SLIDING_CROP_MARGIN:
            return 0
        n = excess
        while n > 0 and not all(s.can_drop_front(n) for s in self._streams.values()):
            n -= 1
        return n

    def _trim_to_window(self) -> None:
        n = self._window_excess()
        if n:
            for s in self._streams.values():
                s.drop_front_tokens(n)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Called before `update()`: size the mask from what update() attends to, after its trim.
        held = self.held_tokens - self._window_excess()
        return held + query_length, self.cumulative_length - held

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for s in self._streams.values():
            s.codec.reset()
        # Forget the sequence, not how it is read: the cache sets these flags once (paper protocol).
        fused, quantize_before_attention = self.fused, self.quantize_before_attention
        self.__init__(self.policy, self.sliding_window)
        self.fused, self.quantize_before_attention = fused, quantize_before_attention

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end. Like transformers: a negative value removes that many tokens, a positive
        one is the length to keep (transformers 5.17's legacy form), 0 removes nothing."""
        # 0 removes nothing: transformers 5.24's assisted generation calls `crop(-rejected)` after every step, also
        # when every candidate was accepted, and `DynamicLayer` treats 0 as a no-op. Read as "keep 0 tokens" (the
        # legacy meaning of a length), it emptied the cache whenever prompt lookup accepted all its candidates.
        tokens_to_remove = _compat.crop_argument(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        n = -tokens_to_remove if tokens_to_remove < 0 else self.cumulative_length - tokens_to_remove
        if n <= 0:
            return
        self.prefetch()  # cropping a packed block decodes it, with the codec's tensors on the layer's device
        # A sliding layer that has let its oldest tokens go must still hold the next query's whole window.
        trimmed = self.held_tokens < self.cumulative_length
        if n > self.held_tokens or (trimmed and self.held_tokens - n < self.sliding_window - 1):
            window = f" and must keep the {self.sliding_window - 1} the next query attends to" if trimmed else ""
            raise RuntimeError(
                f"crop would remove {n} tokens but this layer holds only the last {self.held_tokens}{window}; "
                f"a rollback that deep is not possible"
            )
        for s in self._streams.values():
            s.crop(n, self.dtype)
        self.cumulative_length -= n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if self._offloaded and self.device.type == "cuda":
            # An offloaded layer is reordered where it is: beam search reorders every step, and bringing every
            # layer back for it would undo the offloading. The copies out are asynchronous: wait for them before
            # the host reads the tensors.
            torch.cuda.synchronize(self.device)
        for s in self._streams.values():
            s.map_batch(fn)
        if self.pad_lengths is not None:
            self.pad_lengths = fn(self.pad_lengths)

    def offload(self) -> None:
        """Move the storage of every place (sink, packed fields, residual, codec state) to CPU memory without
        waiting for the copy (transformers' offloading: `QuantizedKVCache.enable_offloading`). `prefetch` brings it
        back; every method that touches the storage does so first. A no-op on a CPU layer."""
        if self.is_initialized and not self._offloaded and self.device.type != "cpu":
            for s in self._streams.values():
                s.map_batch(lambda t: t.to("cpu", non_blocking=True))  # from CUDA: into pinned memory
            self._offloaded = True

    def prefetch(self) -> None:
        """Move an offloaded layer's storage back to its device, without waiting (on the current stream)."""
        if self._offloaded:
            for s in self._streams.values():
                s.map_batch(lambda t: t.to(self.device, non_blocking=True))
            self._offloaded = False

    def stored_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this layer holds, keys then values (where they live: `offload`, device placement)."""
        for s in self._streams.values():
            yield from s.tensors()

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes this layer holds: codes, scales, zeros, codec state, residual and sink (live rows only)."""
        return sum(s.nbytes() for s in self._streams.values())

    def allocated_nbytes(self) -> int:
        """Bytes allocated, live rows plus preallocated spare capacity."""
        return sum(s.allocated_nbytes() for s in self._streams.values())


class QuantizedKVCache(Cache):
    """A `transformers.Cache` of `QuantizedKVLayer`s, one per decoder layer, built from the model's config.

    `policy_factory(layer_idx) -> LayerPolicy` gives each layer its codecs and places. Full-attention layers keep
    every token; sliding-window (and chunked) layers keep their window; layers that share another layer's K/V
    get transformers' `DummyLayer`. Models with layers that are not attention (Mamba/linear attention) are
    refused with a ValueError.

    `max_cache_len` (tokens) builds the static form instead (`hf_kvcache.static`): every place allocated up front,
    lengths on the device, `torch.compile` and CUDA graphs over the decode step.
    """

    def __init__(self, config, policy_factory: Callable[[int], LayerPolicy], max_cache_len: int | None = None):
        from .static import StaticQuantizedKVLayer, check_max_cache_len

        self.config = config
        self._max_cache_len = check_max_cache_len(max_cache_len)  # transformers 5.17 has a read-only max_cache_len
        specs = _compat.layer_specs(config)
        layers: list = []
        for idx, spec in enumerate(specs):
            if spec.kind == "dummy":
                layers.append(_compat.DummyLayer())
            elif self._max_cache_len is not None:
                layers.append(StaticQuantizedKVLayer(policy_factory(idx), self._max_cache_len, spec.sliding_window))
            else:
                layers.append(QuantizedKVLayer(policy_factory(idx), sliding_window=spec.sliding_window))
        super().__init__(layers=layers)
        self.quantize_before_attention = False
        self.offloading = False  # `enable_offloading`
        self._pending_offload: int | None = None  # a fused layer whose offload waits for its attention to be queued

    def enable_offloading(self, only_non_sliding: bool = True) -> QuantizedKVCache:
        """Keep each layer's storage in CPU memory except while its decoder layer runs, as transformers'
        `DynamicCache(offloading=True)` does: before layer i runs, layer i+1 is copied back on a side stream,
        and layer i is copied out after its step. Only CUDA layers move (a CPU-only model is unchanged);
        `only_non_sliding` keeps sliding-window layers, which stay small, resident. Returns the cache:
        `make_cache("int4-g32", model).enable_offloading()`."""
        if self._max_cache_len is not None:
            raise ValueError("a static cache (max_cache_len) cannot be offloaded: its storage must stay where CUDA "
                             "graphs replay over it; build the dynamic form (no max_cache_len) to offload")
        self.offloading = True
        self.only_non_sliding = bool(only_non_sliding)
        self.prefetch_stream = None  # created on the device of the first CUDA update
        return self

    def _offloadable(self, layer_idx: int) -> bool:
        layer = self.layers[layer_idx]
        return isinstance(layer, QuantizedKVLayer) and not (self.only_non_sliding and layer.is_sliding)

    @property
    def quantize_before_attention(self) -> bool:
        """Paper protocol: when True, every token attends to quantized K/V, the new ones included."""
        return self._quantize_before_attention

    @quantize_before_attention.setter
    def quantize_before_attention(self, value: bool) -> None:
        self._quantize_before_attention = bool(value)
        for layer in self.layers:
            if isinstance(layer, QuantizedKVLayer):
                layer.quantize_before_attention = self._quantize_before_attention

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, QuantizedKVLayer):
            layer.fused = _compat.attn_implementation(self.config) == "hf_kvcache"
        if not (self.offloading and key_states.device.type == "cuda"):
            return layer.update(key_states, value_states, *args, **kwargs)
        # transformers' `Cache.update` offloading (written out here: its helpers differ between versions), with one
        # difference: on the fused path the attention reads the layer's storage after `update()` returns, so that
        # layer is offloaded when the next update comes (its attention is queued on the stream by then).
        if self.prefetch_stream is None:
            self.prefetch_stream = torch.cuda.Stream(key_states.device)
        if self._pending_offload is not None:
            if self._offloadable(self._pending_offload):
                self.layers[self._pending_offload].offload()
            self._pending_offload = None
        default = torch.cuda.default_stream(key_states.device)
        default.wait_stream(self.prefetch_stream)
        # The prefetch also waits for the default stream: copies out may be in flight, and memory freed there may
        # still be read by queued kernels.
        self.prefetch_stream.wait_stream(default)
        n = len(self.layers)
        following = [(layer_idx + k) % n for k in range(1, n + 1)]  # the next offloadable layer, circling round
        nxt = next((i for i in following if self._offloadable(i)), None)
        if nxt is not None:
            with torch.cuda.stream(self.prefetch_stream):
                self.layers[nxt].prefetch()
        out = layer.update(key_states, value_states, *args, **kwargs)
        if getattr(layer, "fused", False):
            self._pending_offload = layer_idx
        elif self._offloadable(layer_idx):
            layer.offload()
        return out

    def nbytes(self) -> int:
        """Bytes held by every layer (live rows: codes, scales, zeros, residual, sinks)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def allocated_nbytes(self) -> int:
        return sum(layer.allocated_nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def __repr__(self) -> str:
        n = sum(isinstance(layer, QuantizedKVLayer) for layer in self.layers)
        return f"{type(self).__name__}(layers={n}, tokens={self.get_seq_length()}, nbytes={self.nbytes()})"
