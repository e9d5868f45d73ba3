"""The cache core: `QuantizedKVLayer` (one decoder layer) and `QuantizedKVCache` (the model's cache).

A cached token of one layer lives in exactly one of three places, separately for keys and for values (a
`hf_kvcache.storage.StreamStorage` each): the first `sink_tokens` in the model dtype, a residual window of the newest
ones in the model dtype, and every other token as codes and scales written by a `Codec`. The methods in
`hf_kvcache.methods` choose the policy (codecs, window, sink, flush rule); this module knows none of them.

One storage serves every mode. The number of tokens held is a device tensor the kernels read, so that:
- eager on CUDA, a layer's decode step (pack the new token, advance the length, attend, combine) is the same launches
  at every step, and the layer replays them from a CUDA graph (`hf_kvcache.graphs`): about as much host time as
  DynamicCache's step, with a fraction of its bytes to read;
- with `max_cache_len` (the capacity pinned), `update` and the attention run without host reads or Python branches on
  data, the layers say `is_compileable`, and `generate` compiles the decode step by itself (Inductor and CUDA graphs).
Without `max_cache_len` the capacity grows by itself when a write would not fit: by `_GROWTH` (at least `_MIN_GROW`
tokens) at a decode step, to what a longer write needs plus `_MIN_GROW`; each packed row is copied once per growth,
and a growth that runs out of memory raises before anything held moves.

Two read paths (see DESIGN.md): fused (`update()` returns a `KVHandle`, which the attention reads from the packed
storage, never building the full dense K/V: on CUDA under the model's own attention too, whose calls
`hf_kvcache.attention` routes) and dense (`update()` returns K/V dequantized to the model dtype, what the model's
own attention consumes: CPU under its default attention, or `cache.read = "dense"`).
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from . import _compat, graphs, kernels
from .kernels.layout import PackedFormat, StaticLayout
from .storage import StreamStorage, mark_static

# A growing capacity takes this factor of what it must hold after a decode step, and at least `_MIN_GROW` tokens more:
# the storage then never exceeds what is held by more than ~6% + 127 tokens (`_grown` rounds up to 64 tokens; the
# planner's bytes within 10% at every length past 1k), and a long generation regrows (copying every packed row once, recapturing each layer's CUDA graph)
# every 6% of its length. A write of several tokens (a prompt, a chunk of one) takes what it needs and `_MIN_GROW`
# tokens: at the end of a chunked prefill, where the chunk's activations peak beside the cache, the capacity not filled
# is 64-127 tokens, not 6% of the cache (0.53 GB of `fp8-e4m3` at batch 16 x 32k, BENCHMARKS.md runs 8 and 10).
_GROWTH = 1.0625
_MIN_GROW = 64

# A growing sliding-window layer keeps this many tokens beyond its window so that `crop` (assisted generation) can roll
# back a few tokens; it lets tokens go in bulk, at least this many at a time (amortized: the kept ones move once per
# margin).
_SLIDING_CROP_MARGIN = 64

# The name the `hf_kvcache` attention and mask functions are registered under (`hf_kvcache.attention`).
ATTENTION_NAME = "hf_kvcache"
# The model's own attention implementations whose calls `hf_kvcache.attention` routes to the fused read when they get a
# `KVHandle` (and whose masks it knows how to read): on CUDA a packed cache reads itself through the kernels under
# any of them, with no attention argument (flex attention's block masks and paged attention keep the dense path).
DEFAULT_ATTENTIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# `QuantizedKVCache.read`: "auto" (the fused read where it runs) or "dense" (dequantized K/V to the model's attention)
READS = ("auto", "dense")


def _grown(needed: int, written: int = 1) -> int:
    """The capacity a growing layer takes to hold `needed` tokens after a write of `written` tokens, a multiple of
    `_MIN_GROW`: the attention kernels specialize on the capacity's divisibility by 16 (`cap_len`), and a capacity of
    the other class would compile them again at a growth (seconds once per process, while `generate` waits)."""
    room = needed + _MIN_GROW if written > 1 else max(math.ceil(needed * _GROWTH), needed + _MIN_GROW)
    return -(-room // _MIN_GROW) * _MIN_GROW


def _compiling() -> bool:
    return torch.compiler.is_compiling()


@torch.compiler.disable
def _outside_compiled_graph(fn, *args, **kwargs):
    """Run `fn` eagerly when torch.compile meets it (a graph break): a growing layer's host bookkeeping and CUDA
    graphs cannot be traced."""
    return fn(*args, **kwargs)


def check_max_cache_len(max_cache_len) -> int | None:
    if max_cache_len is None:
        return None
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len <= 0:
        raise ValueError(f"max_cache_len={max_cache_len!r} must be a positive number of tokens (or None: a capacity "
                         "that grows)")
    return max_cache_len


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
        rather than from the first packed block, which behind a window can be a single token."""

    def check_head_dim(self, head_dim: int) -> None:
        """Raise a ValueError naming the parameter if this codec cannot store vectors of size `head_dim`."""

    def packed_format(self) -> PackedFormat | None:
        """How the fused kernels read this codec's fields (`hf_kvcache.kernels.layout`); None: they cannot, and
        the attention uses the reference path."""
        return None


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


class _StepInputs:
    """The fixed buffers a layer's CUDA-graphed decode steps read: this step's key and value `(B, Hkv, 1, D)` (one
    pair a layer), and per captured graph its query `(B, Hq, 1, D)` and mask `(B, 1, 1, capacity)` (`_Graph`)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor):
        self.k = torch.empty_like(k, memory_format=torch.contiguous_format)
        self.v = torch.empty_like(v, memory_format=torch.contiguous_format)


@dataclass
class _Graph:
    """A captured decode step: the storage version it was captured at, the graph, its output and its input buffers."""

    version: int
    q: torch.Tensor
    mask: torch.Tensor | None
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized K/V in sink, packed and ring places (`hf_kvcache.storage`), its length on the
    device.

    `max_cache_len`: the capacity, pinned (every place allocated for it at the first update, `is_compileable`); None:
    a capacity that grows as tokens come (sliding-window layers then keep only their window). Shapes:
    `update(keys (B, Hkv, T, D), values (B, Hkv, T, D))` returns, on the dense path, `(B, Hkv, S, D)` tensors (S: the
    tokens held, or the pinned capacity, whose rows past the length the mask `get_mask_sizes` sizes hides), or two
    `KVHandle`s on the fused path. `length` (0-dim int64, on the device) counts the tokens held.
    """

    is_croppable = True

    def __init__(self, policy: LayerPolicy, sliding_window: int | None = None, max_cache_len: int | None = None,
                 graph_pools: graphs.GraphPools | None = None):
        super().__init__()
        self.policy = policy
        self.max_cache_len = check_max_cache_len(max_cache_len)
        self.pinned = self.max_cache_len is not None
        self.is_compileable = self.pinned
        self.sliding_window = sliding_window
        # A pinned capacity keeps every token of a sliding layer (the mask applies the window: a ring of the window would
        # need positions that wrap); a growing one lets the tokens past its window go.
        self.is_sliding = sliding_window is not None and not self.pinned
        # A sliding layer never attends to the first tokens once past its window: sinks would be dead weight.
        sink = 0 if sliding_window is not None else policy.sink_tokens
        self._streams = {
            "keys": StreamStorage(policy.key_codec, sink, policy.key_residual_length, policy.key_flush),
            "values": StreamStorage(policy.value_codec, sink, policy.value_residual_length, policy.value_flush),
        }
        self.graph_pools = graph_pools if graph_pools is not None else graphs.GraphPools()
        self.cuda_graphs = True  # eager decode steps on CUDA replay a CUDA graph (the cache turns it off to offload)
        self.fused = False  # set by the cache at each update (`QuantizedKVCache._reads_fused`)
        self.quantize_before_attention = False
        self._offloaded = False  # every place's storage is in CPU memory (`offload`), until `prefetch`
        self._version = 0  # bumped whenever what a captured step reads moves (storage, codec state, padding)
        self._forget()

    def _forget(self) -> None:
        """No sequence held (a new layer, or `reset` of a growing one)."""
        self.is_initialized = False
        self.capacity = 0
        self.length = torch.zeros((), dtype=torch.long)
        # The host's count of held tokens, advanced by eager updates alone (a compiled step cannot change a Python
        # value without a recompile): it sizes eager writes against the capacity before anything is written, and serves
        # the eager bookkeeping. None once a compiled step has run (see `_host_held`).
        self._host_length: int | None = 0
        self.cumulative_length = 0  # tokens ever stored (positions), held or let go by a sliding window
        self._first_position: torch.Tensor | int = 0  # sequence index of held token 0 (a device tensor once trimmed)
        self.pad_lengths: torch.Tensor | None = None  # (B,) left padding per row, when transformers tells us
        self._pads_settled = False  # the prompt came in one piece: its padding is known
        self.dtype: torch.dtype | None = None
        self._pending = False  # a decode step's K/V (`_step_kv`) wait for the attention to store them (`replay`)
        self._step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._inputs: _StepInputs | None = None
        self._graphs: dict[tuple, _Graph] = {}
        self._replayable: tuple[int, bool] | None = None
        self._version += 1

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size, self.num_heads, t, _ = key_states.shape
        for name, x in (("keys", key_states), ("values", value_states)):
            self._streams[name].codec.check_head_dim(x.shape[-1])
        capacity = self.max_cache_len if self.pinned else _grown(t, t)
        for name, x in (("keys", key_states), ("values", value_states)):
            self._streams[name].allocate(self.batch_size, self.num_heads, x.shape[-1], x.dtype, x.device, capacity,
                                         static_address=self.pinned)
        self.capacity = capacity
        self.length = torch.zeros((), dtype=torch.long, device=self.device)
        if self.pinned and not _compiling():
            torch._dynamo.mark_static_address(self.length)
        self.is_initialized = True
        self._version += 1

    def _writable(self) -> None:
        """Storage made under `torch.inference_mode()` cannot be written outside it (a prompt prefilled under
        inference_mode, then `generate`, which runs under no_grad): copy it once into normal tensors."""
        if not (self.is_initialized and self.length.is_inference()) or torch.is_inference_mode_enabled():
            return
        for s in self._streams.values():
            s.move(torch.clone)
        self.length = self.length.clone()
        if isinstance(self._first_position, torch.Tensor):
            self._first_position = self._first_position.clone()
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.clone()
        self._inputs = None
        self._version += 1

    def _mark_state_static(self) -> None:
        """A pinned layer's per-sequence tensors (its padding, the codecs' frozen state) at fixed addresses, as its
        storage is: the compiled decode step's CUDA graph reads them where they are, instead of copying each into an
        input buffer of its own at every replay (24 copies a step for `fp8-e4m3` on 8 layers, BENCHMARKS.md run 8)."""
        for t in (self.pad_lengths, *(x for s in self._streams.values() for x in s.codec.state.values())):
            if isinstance(t, torch.Tensor):
                mark_static(t)

    @property
    def key_stream(self) -> StreamStorage:
        """The keys' storage, holding every token counted (a decode step's token left for the graphed attention is
        stored first)."""
        self.write_pending()
        return self._streams["keys"]

    @property
    def value_stream(self) -> StreamStorage:
        """The values' storage, as `key_stream`."""
        self.write_pending()
        return self._streams["values"]

    def _host_held(self) -> int:
        if self._host_length is None:  # compiled steps ran since: one read, in eager code only
            self._host_length = int(self.length)
        return self._host_length

    @property
    def first_position(self) -> int:
        """The position of the oldest token held (> 0 once a sliding window let tokens go)."""
        return int(self._first_position)

    @property
    def held_tokens(self) -> int:
        return self._host_held() if self.is_initialized else 0

    # ------------------------------------------------------------------ writing
    def _check_input(self, key_states: torch.Tensor) -> None:
        b, h = key_states.shape[:2]
        if (b, h) != (self.batch_size, self.num_heads) or key_states.dtype != self.dtype \
                or key_states.device != self.device:
            what = "max_cache_len=...)" if self.pinned else "...), or call cache.reset() first"
            raise ValueError(
                f"this cache holds batch {self.batch_size} x {self.num_heads} kv-heads of {self.dtype} on "
                f"{self.device} and got {b} x {h} of {key_states.dtype} on {key_states.device}; build a new cache "
                f"for another batch, dtype or device (make_cache(spec, model{', ' + what})"
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if _compiling():
            if self.pinned:
                return self._traced_update(key_states, value_states, kwargs)
            return _outside_compiled_graph(self._eager_update, key_states, value_states, kwargs)
        return self._eager_update(key_states, value_states, kwargs)

    def _traced_update(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict):
        """A pinned layer's update while torch.compile traces it: no host read, no branch on data. Past the capacity the
        tokens go to the spare rows and the kernels read at most the capacity, so nothing held is overwritten and
        nothing wraps; the next eager call raises (`_make_room`)."""
        t = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states)
        self._host_length = None
        pads = _compat.left_padding(kwargs, self.length, t, key_states.shape[0])
        if pads is not None:
            self.pad_lengths = pads
        if self.policy.key_rotation is not None:
            key_states = self.policy.key_rotation.apply(key_states)
        p = self.length + torch.arange(t, device=self.device)  # (T,) held indices of the new tokens
        self._streams["keys"].write(key_states, p, self.pad_lengths)
        self._streams["values"].write(value_states, p, self.pad_lengths)
        self.length.add_(t)
        if self.fused:
            return KVHandle(self, "keys", key_states), KVHandle(self, "values", value_states)
        return self._capacity_dense("keys", key_states, p), self._capacity_dense("values", value_states, p)

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor, kwargs: dict):
        t = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states)
        self._writable()
        self.write_pending()  # a decode step whose attention never came
        self.prefetch()  # a no-op unless offloaded and not prefetched ahead of time
        # Trim before appending, never after: this step's mask was sized by `get_mask_sizes()` from the trimmed view,
        # and on the fused path the attention reads the layer only after `update()` returns.
        self._trim_to_window()
        held = self._host_held()
        self._make_room(held, t)
        if t > 1 or not self._pads_settled:
            # Left padding is the prompt's: once a prompt came in one piece (t > 1), decode steps do not change it.
            # A prompt fed token by token learns each row's padding as its first real token comes.
            before = self.length if self.pinned else self.cumulative_length
            pads = _compat.left_padding(kwargs, before, t, key_states.shape[0])
            if pads is not None:
                if self.pad_lengths is None or self.pad_lengths.shape != pads.shape:
                    self.pad_lengths = pads
                    self._version += 1  # a captured step reads the tensor
                else:
                    self.pad_lengths.copy_(pads)
            self._pads_settled = t > 1
        self._host_length = held + t
        self.cumulative_length += t
        if t == 1 and self._can_replay(key_states, value_states):
            # The attention stores this token and attends in one CUDA graph (`replay`), which copies it into the
            # graph's buffers with the query in one launch.
            self._step_kv = (key_states, value_states)
            self._pending = True
            return KVHandle(self, "keys", self._inputs.k), KVHandle(self, "values", self._inputs.v)
        observed = any(s.codec.observing for s in self._streams.values())
        if observed:
            self._version += 1  # this write sets a codec's per-sequence state, which a captured step reads
        if self.policy.key_rotation is not None:
            key_states = self.policy.key_rotation.apply(key_states)
        p = self.length + torch.arange(t, device=self.device)
        try:
            for name, x in (("keys", key_states), ("values", value_states)):
                self._streams[name].write(x, p, self.pad_lengths, self._first_position, start=held)
        except BaseException:
            # Nothing of this call is held (a write past the length is never read): the counts go back.
            self._host_length = held
            self.cumulative_length -= t
            raise
        self.length.add_(t)
        if self.pinned and (observed or t > 1):
            self._mark_state_static()
        if self.fused:
            return KVHandle(self, "keys", key_states), KVHandle(self, "values", value_states)
        if self.pinned:
            return self._capacity_dense("keys", key_states, p), self._capacity_dense("values", value_states, p)
        return self._held_dense("keys", key_states), self._held_dense("values", value_states)

    def _make_room(self, held: int, t: int) -> None:
        """Raise (a pinned capacity), or grow, before anything of this write is stored."""
        if held + t <= self.capacity:
            return
        if self.pinned:
            if held > self.max_cache_len:
                raise ValueError(
                    f"compiled decode steps went past max_cache_len={self.max_cache_len} ({held} tokens): the tokens "
                    f"past it were not stored (nothing held was overwritten), so what was generated after them did "
                    f"not attend to them; build the cache with a larger max_cache_len (make_cache(spec, model, "
                    f"max_cache_len=...)) for prompt plus max_new_tokens"
                )
            raise ValueError(
                f"this cache holds max_cache_len={self.max_cache_len} tokens: {held} are held and {t} more do not "
                f"fit; build it with a larger max_cache_len (make_cache(spec, model, max_cache_len=...)), or leave "
                f"max_cache_len out (a capacity that grows)"
            )
        self._resize(_grown(held + t, t))

    def _resize(self, capacity: int) -> None:
        """Every stream to `capacity` tokens (at least what is held): all new buffers allocated first, so that running
        out of memory raises with everything held where it was."""
        try:
            buffers = {name: s.new_packed(capacity) for name, s in self._streams.items()}
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"resizing this cache layer from {self.capacity} to {capacity} tokens ran out of device memory; the "
                f"{self._host_held()} tokens held are intact. Free memory, use a smaller batch or a cache with fewer "
                f"bytes a token (hf-kvcache plan), or pin the capacity up front (max_cache_len=...). "
                f"{str(error).splitlines()[0]}"
            ) from error
        for name, s in self._streams.items():
            s.resize(capacity, buffers[name])
        self.capacity = capacity
        self._version += 1

    def write_pending(self) -> None:
        """Store a decode step's token that `update` left for the graphed attention, eagerly (that attention did not
        come, or cannot be replayed)."""
        if not self._pending:
            return
        self._pending = False
        k, v = self._inputs.k, self._inputs.v
        torch._foreach_copy_([k, v], self._take_step_kv())
        if self.policy.key_rotation is not None:
            k.copy_(self.policy.key_rotation.apply(k))  # in place: the handle's exact new keys are in the stored frame
        held = self._host_held() - 1
        p = self.length + torch.arange(1, device=self.device)
        for name, x in (("keys", k), ("values", v)):
            self._streams[name].write(x, p, self.pad_lengths, self._first_position, start=held)
        self.length.add_(1)

    # ------------------------------------------------------------------ the CUDA-graphed decode step
    def _can_replay(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether this decode step can run as a CUDA graph: CUDA, the fused path and its kernels, no per-sequence
        statistic still to observe, nothing offloaded, and not inside someone else's capture."""
        if not (self.cuda_graphs and self.fused and key_states.is_cuda and not self._offloaded and graphs.enabled()
                and kernels.use_kernels(key_states.device)) or torch.cuda.is_current_stream_capturing():
            return False
        if self._replayable is None or self._replayable[0] != self._version:
            views = self._streams["keys"].kernel_view(), self._streams["values"].kernel_view()
            ok = (None not in views and not any(s.codec.observing for s in self._streams.values())
                  and kernels.ops.supports(*views, key_states, static=True) is None)
            self._replayable = (self._version, ok)
        if not self._replayable[1]:
            return False
        if self._inputs is None or self._inputs.k.shape != key_states.shape or self._inputs.v.shape != value_states.shape:
            self._inputs = _StepInputs(key_states, value_states)
            self._version += 1  # a captured step reads the old buffers
        return True

    def _take_step_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv, self._step_kv = self._step_kv, None
        return kv

    @property
    def has_pending(self) -> bool:
        return self._pending

    def replay(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
               softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor | None:
        """The pending decode step: store the token `update` left in `_inputs`, advance the length and attend, from
        this layer's CUDA graph for these inputs (the first time: eagerly, then captured) -> `(B, 1, Hq, D)`, a buffer
        the next replay overwrites. None when the step cannot be a graph (a float mask): then it is stored eagerly."""
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            self.write_pending()
            return None
        self._pending = False
        new_kv = self._take_step_kv()
        key = (float(scaling), softcap, None if s_aux is None else s_aux.data_ptr(), tuple(query.shape), query.dtype,
               None if attention_mask is None else tuple(attention_mask.shape[:3]), self.quantize_before_attention)
        entry = self._graphs.get(key)
        if entry is not None and entry.version == self._version:
            if self.device.index != torch.cuda.current_device():
                with torch.cuda.device(self.device):
                    self._replay(entry, query, new_kv, attention_mask)
            else:
                self._replay(entry, query, new_kv, attention_mask)
            return entry.out
        # This storage version's first step of this shape: run it eagerly (it compiles the kernels), then capture it
        # for the next ones, over buffers of its own.
        mask = None
        if attention_mask is not None:
            mask = torch.zeros((*attention_mask.shape[:3], self.capacity), dtype=torch.bool, device=self.device)
            mask[..., : attention_mask.shape[-1]].copy_(attention_mask)
        torch._foreach_copy_([self._inputs.k, self._inputs.v], new_kv)
        entry = _Graph(self._version, query.contiguous().clone(), mask)
        out = self._graph_step(entry, scaling, softcap, s_aux)
        try:
            entry.graph, entry.out = self.graph_pools.capture(
                self.device, lambda: self._graph_step(entry, scaling, softcap, s_aux))
        except RuntimeError as error:
            warnings.warn(f"hf_kvcache: a decode step could not be captured in a CUDA graph "
                          f"({str(error).splitlines()[0]}); this layer runs its steps eagerly from now on",
                          RuntimeWarning, stacklevel=2)
            self.cuda_graphs = False
            return out
        self._graphs = {k: v for k, v in self._graphs.items() if v.version == self._version}
        self._graphs[key] = entry
        return out

    def _replay(self, entry: _Graph, query: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None) -> None:
        # the query and the new K/V into the graph's buffers in one launch, not three (each launch costs host time)
        torch._foreach_copy_([entry.q, self._inputs.k, self._inputs.v], [query, *new_kv])
        if attention_mask is not None:
            entry.mask[..., : attention_mask.shape[-1]].copy_(attention_mask)
        entry.graph.replay()

    def _graph_step(self, entry: _Graph, scaling: float, softcap: float | None,
                    s_aux: torch.Tensor | None) -> torch.Tensor:
        """One decode step from `_inputs` and `entry`'s buffers, device work only (what a CUDA graph records): store the
        token at the length, advance it, attend with the kernels (every length read from the device)."""
        inputs = self._inputs
        k = inputs.k
        if self.policy.key_rotation is not None:
            k = self.policy.key_rotation.apply(k)
        p = self.length + torch.arange(1, device=self.device)
        self._streams["keys"].write(k, p, self.pad_lengths, self._first_position)
        self._streams["values"].write(inputs.v, p, self.pad_lengths, self._first_position)
        self.length.add_(1)
        keys, values = self._streams["keys"].kernel_view(), self._streams["values"].kernel_view()
        return kernels.ops.static_decode_attention(
            self.rotate_query(entry.q), keys, values, k, inputs.v, self.static_layout(),
            exact_new=not self.quantize_before_attention, attention_mask=entry.mask, scaling=scaling, softcap=softcap,
            s_aux=s_aux)

    # ------------------------------------------------------------------ reading
    def _held_dense(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """`(B, Hkv, held, D)` of one stream dequantized, the new tokens exact unless `quantize_before_attention`, keys
        rotated back (RotatedCache): the dense read of a growing layer."""
        x = self._streams[name].dense(self.dtype, self._host_held())
        if not self.quantize_before_attention:
            # Prefill and decode attend to the exact new tokens, to the stored past (as KIVI, KVQuant, vLLM).
            x[:, :, x.shape[2] - new.shape[2] :] = new
        if name == "keys" and self.policy.key_rotation is not None:
            x = self.policy.key_rotation.apply(x, inverse=True)
        return x

    def _stored_dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`(B, Hkv, capacity, D)` of one stream in the stored frame (keys rotated for RotatedCache), the new tokens at
        held indices `p` exact unless `quantize_before_attention`."""
        x = self._streams[name].capacity_dense(self.dtype, self.length)
        if not self.quantize_before_attention:
            x.index_copy_(2, p.clamp(max=self.capacity - 1), new)
        return x

    def _capacity_dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The dense read of a pinned layer: the whole capacity (the mask, sized for it, hides what is not held), keys
        rotated back."""
        x = self._stored_dense(name, new, p)
        if name == "keys" and self.policy.key_rotation is not None:
            x = self.policy.key_rotation.apply(x, inverse=True)
        return x

    def dense_kv(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as `_stored_dense` gives them: the traced fused read's reference for a pinned layer."""
        p = self.length - k_new.shape[2] + torch.arange(k_new.shape[2], device=k_new.device)
        return self._stored_dense("keys", k_new, p), self._stored_dense("values", v_new, p)

    def rotate_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query in the frame the stored keys are in (`LayerPolicy.key_rotation`): `(B, Hq, Tq, D)`."""
        rotation = self.policy.key_rotation
        return query if rotation is None else rotation.apply(query)

    def iter_kv_chunks(
        self, k_new: torch.Tensor, v_new: torch.Tensor, chunk_tokens: int = 256
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held tokens as `(k (B, Hkv, c, D), v (B, Hkv, c, D))` chunks in order, the new ones exact unless
        `quantize_before_attention`: the fused read path's reference, used by the CPU attention."""
        self.write_pending()
        held = self._host_held()
        n_new = k_new.shape[2]
        stop = held if self.quantize_before_attention else held - n_new
        ks = self._streams["keys"].iter_chunks(self.dtype, chunk_tokens, stop, held)
        vs = self._streams["values"].iter_chunks(self.dtype, chunk_tokens, stop, held)
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

    def kernel_views(self):
        """`(keys, values)` as the fused kernels read them (`StreamTensors`, None for a codec without a kernel)."""
        return self.key_stream.kernel_view(), self.value_stream.kernel_view()

    def static_layout(self) -> StaticLayout:
        k, v = self._streams["keys"], self._streams["values"]
        return StaticLayout(length=self.length, capacity=self.capacity, sink_tokens=k.sink_tokens,
                            key_ring=k.ring_length, value_ring=v.ring_length, key_window=k.window,
                            value_window=v.window)

    # ------------------------------------------------------------------ sliding windows (a growing layer)
    def _window_excess(self) -> int:
        """How many of the oldest held tokens the next `update()` lets go before appending (0 if none): in bulk, at
        least a margin's worth, as many as keep every packed block whole (`StreamStorage.may_drop`)."""
        if not self.is_sliding or not self.is_initialized:
            return 0
        keep = self.sliding_window - 1 + _SLIDING_CROP_MARGIN
        excess = self._host_held() - keep
        if excess < _SLIDING_CROP_MARGIN:
            return 0
        held = self._host_held()
        n = excess
        while n > 0 and not all(s.may_drop(n, held) for s in self._streams.values()):
            n -= 1
        return n

    def _trim_to_window(self) -> None:
        n = self._window_excess()
        if not n:
            return
        held = self._host_held()
        for s in self._streams.values():
            s.drop_front(n, held, self.pad_lengths, self._first_position + n)
        if isinstance(self._first_position, int):
            self._first_position = torch.zeros((), dtype=torch.long, device=self.device)
            self._version += 1
        self._first_position.add_(n)  # in place: a captured step reads it
        self.length.sub_(n)
        self._host_length = held - n
        if self.capacity > 2 * _grown(held - n):
            # Give back the capacity a long chunk (a prefill) left behind: a sliding layer would otherwise keep the
            # largest chunk it ever saw allocated, however short its window.
            self._resize(_grown(held - n))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.pinned:
            # The whole capacity, eager or not: `generate` builds the mask of a compileable cache eagerly, before the
            # step it compiles.
            return self.max_cache_len, 0
        # Called before `update()`: size the mask from what update() attends to, after its trim.
        held = self.held_tokens - self._window_excess()
        return held + query_length, self.cumulative_length - held

    def get_seq_length(self):
        if self.pinned:
            # A device tensor, as transformers' StaticLayer returns: generate builds positions from it without a sync.
            return self.length if self.is_initialized else 0
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.max_cache_len if self.pinned else -1

    def get_max_cache_shape(self) -> int:
        return self.get_max_length()

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        for s in self._streams.values():
            s.codec.reset()
        if not self.pinned:
            # Forget the sequence and give its storage back; how it is read stays (the cache sets these flags once).
            for s in self._streams.values():
                s.release()
            self._forget()
            return
        # A pinned storage stays (a compiled step's CUDA graph replays over its addresses); the next tokens overwrite it.
        if self.is_initialized:
            self._writable()
            self.length.zero_()
            for s in self._streams.values():
                s.reset()
        self._host_length = 0
        self.cumulative_length = 0
        self.pad_lengths = None
        self._pads_settled = False
        self._pending, self._step_kv = False, None
        self._version += 1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the end. Like transformers: a negative value removes that many tokens, a positive
        one is the length to keep (transformers 5.17's legacy form), 0 removes nothing."""
        # 0 removes nothing: transformers 5.24's assisted generation calls `crop(-rejected)` after every step, also
        # when every candidate was accepted, and `DynamicLayer` treats 0 as a no-op. Read as "keep 0 tokens" (the
        # legacy meaning of a length), it emptied the cache whenever prompt lookup accepted all its candidates.
        tokens_to_remove = _compat.crop_argument(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._writable()
        self.write_pending()
        self.prefetch()  # refilling a window decodes packed rows, with the codec's tensors on the layer's device
        held = self._host_held()
        length = self.cumulative_length if not self.pinned else held
        n = -tokens_to_remove if tokens_to_remove < 0 else length - tokens_to_remove
        if n <= 0:
            return
        # A sliding layer that has let its oldest tokens go must still hold the next query's whole window.
        trimmed = held < self.cumulative_length and not self.pinned
        if n > held or (trimmed and held - n < self.sliding_window - 1):
            window = f" and must keep the {self.sliding_window - 1} the next query attends to" if trimmed else ""
            raise RuntimeError(
                f"crop would remove {n} tokens but this layer holds only the last {held}{window}; a rollback that "
                f"deep is not possible"
            )
        kept = held - n
        self.length.fill_(kept)
        self._host_length = kept
        self.cumulative_length -= n
        for s in self._streams.values():
            s.refill_ring(kept, self.dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # In place: the buffers keep their addresses (and a captured step its inputs).
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), in_place=True)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices],
                        in_place=False)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def _map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor], in_place: bool) -> None:
        if not self.is_initialized:
            return
        self._writable()
        self.write_pending()
        if self._offloaded and self.device.type == "cuda":
            # An offloaded layer is reordered where it is: beam search reorders every step, and bringing every layer
            # back for it would undo the offloading. The copies out are asynchronous: wait for them first.
            torch.cuda.synchronize(self.device)
        in_place = in_place and not self._offloaded
        for s in self._streams.values():
            s.map_batch(fn, in_place)
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.copy_(fn(self.pad_lengths)) if in_place else fn(self.pad_lengths)
        self.batch_size = next(iter(self.key_stream.packed.values())).shape[0]
        if not in_place:
            self._version += 1

    def offload(self) -> None:
        """Move the storage of every place (sink, packed fields, ring, codec state) to CPU memory without waiting for
        the copy (transformers' offloading: `QuantizedKVCache.enable_offloading`). `prefetch` brings it back; every
        method that touches the storage does so first. A no-op on a CPU layer. The length stays on the device."""
        if self.is_initialized and not self._offloaded and self.device.type != "cpu":
            for s in self._streams.values():
                s.move(lambda t: t.to("cpu", non_blocking=True))  # from CUDA: into pinned memory
            self._offloaded = True
            self._version += 1

    def prefetch(self) -> None:
        """Move an offloaded layer's storage back to its device, without waiting (on the current stream)."""
        if self._offloaded:
            for s in self._streams.values():
                s.move(lambda t: t.to(self.device, non_blocking=True))
            self._offloaded = False
            self._version += 1

    def stored_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this layer holds, keys then values (where they live: `offload`, device placement)."""
        for s in self._streams.values():
            yield from s.tensors()

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes the held tokens take: codes, scales, zeros, codec state, window and sinks (the capacity's spare rows
        are `allocated_nbytes`)."""
        held = self.held_tokens
        return sum(s.nbytes(held) for s in self._streams.values())

    def allocated_nbytes(self) -> int:
        """Bytes allocated: what is held plus the capacity not filled yet."""
        return sum(s.allocated_nbytes() for s in self._streams.values())


class QuantizedKVCache(Cache):
    """A `transformers.Cache` of `QuantizedKVLayer`s, one per decoder layer, built from the model's config.

    `policy_factory(layer_idx) -> LayerPolicy` gives each layer its codecs and places. Full-attention layers keep
    every token; sliding-window (and chunked) layers keep their window (with a pinned capacity: every token, masked);
    layers that share another layer's K/V get transformers' `DummyLayer`. Models with layers that are not attention
    (Mamba/linear attention) are refused with a ValueError.

    `max_cache_len` (tokens) pins the capacity: every place allocated up front, and `generate` compiles the decode
    step (transformers' rule: every layer `is_compileable`). None: the capacity grows with what is held, and eager
    decode steps on CUDA replay a CUDA graph per layer.
    """

    def __init__(self, config, policy_factory: Callable[[int], LayerPolicy], max_cache_len: int | None = None):
        self.config = config
        self._max_cache_len = check_max_cache_len(max_cache_len)  # transformers 5.17 has a read-only max_cache_len
        self.graph_pools = graphs.GraphPools()
        specs = _compat.layer_specs(config)
        layers: list = []
        for idx, spec in enumerate(specs):
            if spec.kind == "dummy":
                layers.append(_compat.DummyLayer())
            else:
                layers.append(QuantizedKVLayer(policy_factory(idx), spec.sliding_window, self._max_cache_len,
                                               self.graph_pools))
        super().__init__(layers=layers)
        self.read = "auto"
        self.quantize_before_attention = False
        self.offloading = False  # `enable_offloading`
        self._pending_offload: int | None = None  # a fused layer whose offload waits for its attention to be queued

    def enable_offloading(self, only_non_sliding: bool = True) -> QuantizedKVCache:
        """Keep each layer's storage in CPU memory except while its decoder layer runs, as transformers'
        `DynamicCache(offloading=True)` does: before layer i runs, layer i+1 is copied back on a side stream,
        and layer i is copied out after its step. Only CUDA layers move (a CPU-only model is unchanged);
        `only_non_sliding` keeps sliding-window layers, which stay small, resident. Offloaded layers run their steps
        eagerly, without CUDA graphs. Returns the cache: `make_cache("int4-g32", model).enable_offloading()`."""
        if self._max_cache_len is not None:
            raise ValueError("a cache with a pinned capacity (max_cache_len) cannot be offloaded: its storage must stay "
                             "where compiled CUDA graphs replay over it; leave max_cache_len out to offload")
        self.offloading = True
        self.only_non_sliding = bool(only_non_sliding)
        self.prefetch_stream = None  # created on the device of the first CUDA update
        for idx, layer in enumerate(self.layers):
            if isinstance(layer, QuantizedKVLayer) and self._offloadable(idx):
                layer.cuda_graphs = False
        return self

    def _offloadable(self, layer_idx: int) -> bool:
        layer = self.layers[layer_idx]
        return isinstance(layer, QuantizedKVLayer) and not (self.only_non_sliding and layer.is_sliding)

    @property
    def read(self) -> str:
        """How attention reads this cache. "auto" (default): on CUDA the fused kernels read the packed storage
        directly, whatever attention the model was loaded with (sdpa, eager, flash: `hf_kvcache.attention` routes their
        calls), and `attn_implementation="hf_kvcache"` reads it on every device (the PyTorch reference on CPU); on CPU
        under the model's own attention, `update()` returns K/V dequantized to the model dtype. "dense": always that
        dequantized K/V, to the model's own attention (the reference behaviour, a full-length dense copy at every
        step)."""
        return self._read

    @read.setter
    def read(self, value: str) -> None:
        if value not in READS:
            raise ValueError(f"read={value!r}: choose one of {READS} (\"auto\": the fused kernels where they run, "
                             "\"dense\": dequantized K/V to the model's own attention)")
        self._read = value

    def _reads_fused(self, device: torch.device) -> bool:
        """Whether `update()` returns `KVHandle`s, which the attention reads as packed (see `read`)."""
        if self._read != "auto":
            return False
        implementation = _compat.attn_implementation(self.config)
        if implementation == ATTENTION_NAME:
            return True
        return implementation in DEFAULT_ATTENTIONS and kernels.use_kernels(device)

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
            layer.fused = self._reads_fused(key_states.device)
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
        """Bytes the held tokens take in every layer (codes, scales, zeros, windows, sinks)."""
        return sum(layer.nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def allocated_nbytes(self) -> int:
        """Bytes allocated by every layer: what is held plus the capacity not filled yet."""
        return sum(layer.allocated_nbytes() for layer in self.layers if isinstance(layer, QuantizedKVLayer))

    def __repr__(self) -> str:
        n = sum(isinstance(layer, QuantizedKVLayer) for layer in self.layers)
        return f"{type(self).__name__}(layers={n}, tokens={self.get_seq_length()}, nbytes={self.nbytes()})"
