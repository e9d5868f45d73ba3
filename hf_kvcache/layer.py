"""`QuantizedKVLayer`: one decoder layer's cached tokens (`QuantizedKVCache` in `cache.py` holds one per layer).

A cached token of one layer lives in exactly one of three places, separately for keys and for values (a
`hf_kvcache.storage.StreamStorage` each): the first `sink_tokens` in the model dtype, a residual window of the newest
ones in the model dtype, and every other token as codes and scales written by a `Codec` (`codec.py`). The methods in
`hf_kvcache.methods` choose the policy (codecs, window, sink, flush rule); this module knows none of them.

One storage serves every mode. The number of tokens held is a device tensor the kernels read, so that:
- eager on CUDA, a layer's decode step (pack the new token, advance the length, attend, combine) is the same launches
  at every step, and the layer replays them from a CUDA graph (`hf_kvcache.graphs`: `DecodeGraph`): about as
  much host time as DynamicCache's step, with a fraction of its bytes to read (the layer's `graph`);
- with `max_cache_len` (the capacity pinned), `update` and the attention run without host reads or Python branches on
  data, the layers say `is_compileable`, and `generate` compiles the decode step by itself (Inductor and CUDA graphs).
Without `max_cache_len` the capacity grows by itself when a write would not fit: by `_GROWTH` (at least `_MIN_GROW`
tokens) at a decode step, to what a longer write needs plus `_MIN_GROW`; each packed row is copied once per growth,
and a growth that runs out of memory raises before anything held moves.

Two read paths (docs/design.md; the layer's `reads`, a `LayerReads` of `hf_kvcache.read`): fused (`update()` returns a
`KVHandle`, which the attention reads from the packed storage, never building the full dense K/V) and dense
(`update()` returns K/V dequantized to the model dtype, what the model's own attention consumes); the cache decides
which (`QuantizedKVCache.read`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin

from . import _compat, graphs
from .codec import LayerPolicy
from .graphs import DecodeGraph
from .read import LayerReads
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


class QuantizedKVLayer(CacheLayerMixin):
    """One decoder layer's quantized K/V in sink, packed and ring places (`hf_kvcache.storage`), its length on the
    device.

    `max_cache_len`: the capacity, pinned (every place allocated for it at the first update, `is_compileable`); None:
    a capacity that grows as tokens come (sliding-window layers then keep only their window). Shapes:
    `update(keys (B, Hkv, T, D), values (B, Hkv, T, D))` returns, on the dense path, `(B, Hkv, S, D)` tensors (S: the
    tokens held, or the pinned capacity, whose rows past the length the mask `get_mask_sizes` sizes hides), or two
    `KVHandle`s on the fused path. `length` (0-dim int64, on the device) counts the tokens held.

    Its parts are objects over its storage (`streams`, the counts): `reads` (`hf_kvcache.read.LayerReads`: the dense
    reads and the fused one) and `graph` (`hf_kvcache.graphs.DecodeGraph`: the CUDA-graphed decode step and its state).
    `version` changes whenever what a captured step reads moves (storage, codec state, padding).
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
        self.streams = {
            "keys": StreamStorage(policy.key_codec, sink, policy.key_residual_length, policy.key_flush),
            "values": StreamStorage(policy.value_codec, sink, policy.value_residual_length, policy.value_flush),
        }
        self.cuda_graphs = True  # eager decode steps on CUDA replay a CUDA graph (the cache turns it off to offload)
        self.fused = False  # set by the cache at each update (`QuantizedKVCache._reads_fused`)
        self.quantize_before_attention = False
        self.offloaded = False  # every place's storage is in CPU memory (`offload`), until `prefetch`
        self.version = 0  # bumped whenever what a captured step reads moves (storage, codec state, padding)
        self.reads = LayerReads(self)
        self.graph = DecodeGraph(self, graph_pools if graph_pools is not None else graphs.GraphPools())
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
        self.graph.forget()
        self.version += 1

    # ------------------------------------------------------------------ CacheLayerMixin
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch_size, self.num_heads, t, _ = key_states.shape
        for name, x in (("keys", key_states), ("values", value_states)):
            self.streams[name].codec.check_head_dim(x.shape[-1])
        capacity = self.max_cache_len if self.pinned else _grown(t, t)
        for name, x in (("keys", key_states), ("values", value_states)):
            self.streams[name].allocate(self.batch_size, self.num_heads, x.shape[-1], x.dtype, x.device, capacity,
                                         static_address=self.pinned)
        self.capacity = capacity
        self.length = torch.zeros((), dtype=torch.long, device=self.device)
        if self.pinned and not _compiling():
            torch._dynamo.mark_static_address(self.length)
        self.is_initialized = True
        self.version += 1

    def _writable(self) -> None:
        """Storage made under `torch.inference_mode()` cannot be written outside it (a prompt prefilled under
        inference_mode, then `generate`, which runs under no_grad): copy it once into normal tensors."""
        if not (self.is_initialized and self.length.is_inference()) or torch.is_inference_mode_enabled():
            return
        for s in self.streams.values():
            s.move(torch.clone)
        self.length = self.length.clone()
        if isinstance(self._first_position, torch.Tensor):
            self._first_position = self._first_position.clone()
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.clone()
        self.graph.release_inputs()
        self.version += 1

    def _mark_state_static(self) -> None:
        """A pinned layer's per-sequence tensors (its padding, the codecs' frozen state) at fixed addresses, as its
        storage is: the compiled decode step's CUDA graph reads them where they are, instead of copying each into an
        input buffer of its own at every replay (24 copies a step for `fp8-e4m3` on 8 layers, BENCHMARKS.md run 8)."""
        for t in (self.pad_lengths, *(x for s in self.streams.values() for x in s.codec.state.values())):
            if isinstance(t, torch.Tensor):
                mark_static(t)

    @property
    def key_stream(self) -> StreamStorage:
        """The keys' storage, holding every token counted (a decode step's token left for the graphed attention is
        stored first)."""
        self.write_pending()
        return self.streams["keys"]

    @property
    def value_stream(self) -> StreamStorage:
        """The values' storage, as `key_stream`."""
        self.write_pending()
        return self.streams["values"]

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
        self.streams["keys"].write(key_states, p, self.pad_lengths)
        self.streams["values"].write(value_states, p, self.pad_lengths)
        self.length.add_(t)
        if self.fused:
            return KVHandle(self, "keys", key_states), KVHandle(self, "values", value_states)
        return self.reads.capacity_dense("keys", key_states, p), self.reads.capacity_dense("values", value_states, p)

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
                    self.version += 1  # a captured step reads the tensor
                else:
                    self.pad_lengths.copy_(pads)
            self._pads_settled = t > 1
        self._host_length = held + t
        self.cumulative_length += t
        if t == 1 and self.graph.takes(key_states, value_states):
            # The attention stores this token and attends in one CUDA graph (`graph.replay`), which copies it into the
            # graph's buffers with the query in one launch.
            k, v = self.graph.hold(key_states, value_states)
            return KVHandle(self, "keys", k), KVHandle(self, "values", v)
        observed = self.observing()
        if observed:
            self.version += 1  # this write sets a codec's per-sequence state, which a captured step reads
        if self.policy.key_rotation is not None:
            key_states = self.policy.key_rotation.apply(key_states)
        p = self.length + torch.arange(t, device=self.device)
        try:
            for name, x in (("keys", key_states), ("values", value_states)):
                self.streams[name].write(x, p, self.pad_lengths, self._first_position, start=held)
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
            return self.reads.capacity_dense("keys", key_states, p), self.reads.capacity_dense("values", value_states, p)
        return self.reads.held_dense("keys", key_states), self.reads.held_dense("values", value_states)

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
            buffers = {name: s.new_packed(capacity) for name, s in self.streams.items()}
        except torch.OutOfMemoryError as error:
            raise torch.OutOfMemoryError(
                f"resizing this cache layer from {self.capacity} to {capacity} tokens ran out of device memory; the "
                f"{self._host_held()} tokens held are intact. Free memory, use a smaller batch or a cache with fewer "
                f"bytes a token (hf-kvcache plan), or pin the capacity up front (max_cache_len=...). "
                f"{str(error).splitlines()[0]}"
            ) from error
        for name, s in self.streams.items():
            s.resize(capacity, buffers[name])
        self.capacity = capacity
        self.version += 1

    def write_pending(self) -> None:
        """Store a decode step's token that `update` left for the graphed attention, eagerly (that attention did not
        come, or cannot be replayed)."""
        if self.graph.pending:
            self.graph.store_pending()

    def store_token(self, k: torch.Tensor, v: torch.Tensor, start: int | None = None) -> None:
        """Write one token a row `(B, Hkv, 1, D)` (keys in the stored frame) at the length and advance it: device work
        only, what a captured decode step records (`start`: the host's count of tokens held before it, when known)."""
        p = self.length + torch.arange(1, device=self.device)
        for name, x in (("keys", k), ("values", v)):
            self.streams[name].write(x, p, self.pad_lengths, self._first_position, start=start)
        self.length.add_(1)

    def observing(self) -> bool:
        """Whether a codec still observes a per-sequence statistic at its next write (TurboQuant's, at the first)."""
        return any(s.codec.observing for s in self.streams.values())

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
        while n > 0 and not all(s.may_drop(n, held) for s in self.streams.values()):
            n -= 1
        return n

    def _trim_to_window(self) -> None:
        n = self._window_excess()
        if not n:
            return
        held = self._host_held()
        for s in self.streams.values():
            s.drop_front(n, held, self.pad_lengths, self._first_position + n)
        if isinstance(self._first_position, int):
            self._first_position = torch.zeros((), dtype=torch.long, device=self.device)
            self.version += 1
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
        for s in self.streams.values():
            s.codec.reset()
        if not self.pinned:
            # Forget the sequence and give its storage back; how it is read stays (the cache sets these flags once).
            for s in self.streams.values():
                s.release()
            self._forget()
            return
        # A pinned storage stays (a compiled step's CUDA graph replays over its addresses); the next tokens overwrite it.
        if self.is_initialized:
            self._writable()
            self.length.zero_()
            for s in self.streams.values():
                s.reset()
        self._host_length = 0
        self.cumulative_length = 0
        self.pad_lengths = None
        self._pads_settled = False
        self.graph.drop_pending()
        self.version += 1

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
        for s in self.streams.values():
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
        if self.offloaded and self.device.type == "cuda":
            # An offloaded layer is reordered where it is: beam search reorders every step, and bringing every layer
            # back for it would undo the offloading. The copies out are asynchronous: wait for them first.
            torch.cuda.synchronize(self.device)
        in_place = in_place and not self.offloaded
        for s in self.streams.values():
            s.map_batch(fn, in_place)
        if self.pad_lengths is not None:
            self.pad_lengths = self.pad_lengths.copy_(fn(self.pad_lengths)) if in_place else fn(self.pad_lengths)
        self.batch_size = next(iter(self.key_stream.packed.values())).shape[0]
        if not in_place:
            self.version += 1

    def offload(self) -> None:
        """Move the storage of every place (sink, packed fields, ring, codec state) to CPU memory without waiting for
        the copy (transformers' offloading: `QuantizedKVCache.enable_offloading`). `prefetch` brings it back; every
        method that touches the storage does so first. A no-op on a CPU layer. The length stays on the device."""
        if self.is_initialized and not self.offloaded and self.device.type != "cpu":
            for s in self.streams.values():
                s.move(lambda t: t.to("cpu", non_blocking=True))  # from CUDA: into pinned memory
            self.offloaded = True
            self.version += 1

    def prefetch(self) -> None:
        """Move an offloaded layer's storage back to its device, without waiting (on the current stream)."""
        if self.offloaded:
            for s in self.streams.values():
                s.move(lambda t: t.to(self.device, non_blocking=True))
            self.offloaded = False
            self.version += 1

    def stored_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor this layer holds, keys then values (where they live: `offload`, device placement)."""
        for s in self.streams.values():
            yield from s.tensors()

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes the held tokens take: codes, scales, zeros, codec state, window and sinks (the capacity's spare rows
        are `allocated_nbytes`)."""
        held = self.held_tokens
        return sum(s.nbytes(held) for s in self.streams.values())

    def allocated_nbytes(self) -> int:
        """Bytes allocated: what is held plus the capacity not filled yet."""
        return sum(s.allocated_nbytes() for s in self.streams.values())
