"""The static form of every quantized cache (`max_cache_len=`): storage for that many tokens allocated once, the
length in a device tensor, and an update plus attention that neither read a value back to the host nor branch in
Python on data, so `torch.compile(fullgraph=True)` traces a decode step and a CUDA graph replays it (DESIGN.md,
"The static form"). The codecs, their kernels and the packed layouts are the dynamic form's (`cache.py`).

Where a token lives, per stream (keys or values), for held index `p` and `i = p - sink_tokens`:
- sink: `p < sink_tokens`, row p of a `(B, H, sink_tokens + 1, D)` buffer in the model dtype;
- packed: every later token, in row `i // block_size` of the codec's fields `(B, H, rows + 1, ...)`;
- ring (a residual window of R tokens): token i also in row `i % R` of a `(B, H, R + 1, D)` buffer in the model
  dtype. A FIFO window reads its last `min(i, R)` tokens from there: every token is also packed as it arrives
  (a per-token code does not depend on its neighbours), which costs R tokens of codes and saves the branch that
  would pack a token as it leaves the window. A block flush (KIVI's keys) reads the `i mod R` tokens past the
  last whole window from the ring's first rows; the block that holds the newest token is packed from the ring
  at every step, by a launch that quantizes it only at the step that completes it (a device-side flag), so that
  it is final when the window closes.
Each buffer has one spare row at the end: a write of a token that belongs elsewhere (or past the capacity) goes
there, so that no write needs a branch. `hf_kvcache.kernels.layout.StaticLayout` tells the kernels this split,
which they derive from the length on the device.

Sliding-window layers keep every token in the static form (the mask restricts them to their window): a ring of
the window would need positions that wrap, and the memory saved is a sliding layer's, a minor part of the cache
of every model we support. Speed and memory of full-attention layers are unaffected.
"""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import CacheLayerMixin

from . import _compat, kernels
from .cache import Codec, KVHandle, LayerPolicy, QuantizedKVLayer, _capacity, check_flush
from .kernels.layout import StaticLayout, StreamTensors


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _mark_static(t: torch.Tensor) -> torch.Tensor:
    # A fixed address, so that CUDA graphs replay over the buffers that `update` mutates in place (as transformers'
    # StaticLayer does); not allowed while tracing, and never needed there: storage is made eagerly.
    if not _compiling():
        torch._dynamo.mark_static_address(t)
    return t


class _StaticStream:
    """Keys or values of one static layer: fixed sink, packed and ring places (see the module docstring)."""

    def __init__(self, codec: Codec, sink_tokens: int, residual_length: int, flush: str, max_cache_len: int):
        check_flush(codec, residual_length, flush)
        if flush == "fifo" and residual_length and codec.block_size != 1:
            raise ValueError("a FIFO window over a block codec has no static form")
        self.codec = codec
        self.sink_tokens = sink_tokens
        self.ring_length = residual_length
        self.window = flush == "fifo" and residual_length > 0
        self.block = flush == "block"
        self.max_cache_len = max_cache_len
        self.rows = -(-max(max_cache_len - sink_tokens, 0) // codec.block_size)  # packed rows, the spare one aside
        self.sink: torch.Tensor | None = None
        self.packed: dict[str, torch.Tensor] = {}
        self.ring: torch.Tensor | None = None

    # --- storage
    def allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        # The fields' shapes from encoding one block of zeros (one row, on the CPU's reference path) with a copy of
        # the codec: the real one may freeze per-sequence state (FP8's dynamic scale) on the first tokens it sees.
        probe = torch.zeros((1, heads, self.codec.block_size, head_dim), dtype=dtype)
        extra = {}
        if getattr(self.codec, "needs_positions", False):
            extra["positions"] = torch.zeros((1, self.codec.block_size), dtype=torch.long)
        with kernels.use_backend("torch"):
            fields = copy.deepcopy(self.codec).encode(probe, None, **extra)
        self._fields = {k: (v.shape[3:], v.dtype) for k, v in fields.items()}  # per row: tail shape, dtype
        rows = _capacity(self.rows + 1, fields)
        self.packed = {
            k: _mark_static(torch.zeros((batch, heads, rows, *v.shape[3:]), dtype=v.dtype, device=device))
            for k, v in fields.items()
        }
        if self.sink_tokens:
            self.sink = _mark_static(torch.zeros((batch, heads, self.sink_tokens + 1, head_dim), dtype=dtype,
                                                 device=device))
        if self.ring_length:
            self.ring = _mark_static(torch.zeros((batch, heads, self.ring_length + 1, head_dim), dtype=dtype,
                                                 device=device))

    def buffers(self) -> list[torch.Tensor]:
        out = list(self.packed.values())
        out += [t for t in (self.sink, self.ring) if t is not None]
        return out

    # --- the split (host ints or device tensors alike)
    def split(self, held):
        """`(n_sink, packed tokens read, residual tokens, ring row of the oldest residual token)` for `held` tokens,
        the kernels' `_static_places`."""
        if isinstance(held, torch.Tensor):
            n_sink = held.clamp(max=self.sink_tokens)
            after = held - n_sink
            zero = torch.zeros_like(after)
            maximum = torch.maximum
        else:
            n_sink = min(held, self.sink_tokens)
            after = held - n_sink
            zero = 0
            maximum = max
        r = self.ring_length
        if not r:
            return n_sink, after, zero, zero
        packed = maximum(after - r, zero) if self.window else (after // r) * r
        return n_sink, packed, after - packed, packed % r

    # --- writing
    def write(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None) -> None:
        """Store `x (B, H, T, D)` at held indices `p (T,)` (a device tensor); `pads (B,)`: left padding per row."""
        t = x.shape[2]
        s, r = self.sink_tokens, self.ring_length
        i = p - s  # (T,) index past the sinks; negative for sink tokens
        if s:
            self.sink.index_copy_(2, p.clamp(max=s), x)  # tokens past the sinks land in the spare row
        if self.block:
            self._pack_blocks(x, p, pads)
        else:
            valid = self._valid(p, pads)
            # Per-sequence statistics (FP8's dynamic scale) come from the first write that reaches past the sinks
            # (the host check reads a value once, in eager code: a cache's first writes are its prefill's).
            if self.codec.observing and (_compiling() or bool((i >= 0).any())):
                seen = (i >= 0).unsqueeze(0).expand(x.shape[0], t)
                self.codec.observe(x, seen if valid is None else seen & valid)
            fields = self._encode(x, valid, **self._positions(p, pads, x.shape[0]))
            rows = torch.where((i >= 0) & (i < self.rows), i, self.rows)
            for k, v in fields.items():
                self.packed[k].index_copy_(2, rows, v)
        if r:
            keep = min(t, r)  # a longer write keeps only its last R tokens in the ring (each slot written once)
            last = i[t - keep:]
            stored = (last >= 0) & (p[t - keep:] < self.max_cache_len)  # past the capacity: the spare row
            self.ring.index_copy_(2, torch.where(stored, last % r, r), x[:, :, t - keep:])

    def _pack_blocks(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None) -> None:
        """Block flush (KIVI's keys): pack every block of `block_size` tokens this write touches, the block's
        earlier tokens gathered from the ring (still holding them: a block never spans more than the window)."""
        t = x.shape[2]
        g, r, s = self.codec.block_size, self.ring_length, self.sink_tokens
        i0 = p[0] - s  # index past the sinks of this write's first token (negative while sinks fill)
        n_blocks = (t + g - 2) // g + 1  # blocks that T consecutive tokens can touch
        blk = i0.clamp(min=0) // g + torch.arange(n_blocks, device=x.device)  # (n,)
        idx = (blk[:, None] * g + torch.arange(g, device=x.device)).reshape(-1)  # (n*G,) indices past the sinks
        # Source of each: the ring for tokens written before, this write for its own (later ones: the last).
        src = torch.where(idx < i0, idx % r, r + 1 + (idx - i0).clamp(max=t - 1))
        both = torch.cat([self.ring, x], dim=2)  # (B, H, R + 1 + T, D)
        tokens = both.index_select(2, src)
        valid = self._valid(idx + s, pads)
        extra = {}
        if getattr(self.codec, "skips_incomplete_blocks", False):
            # Only a block this write completes is read later (whole windows are): the others are left unpacked.
            extra["complete"] = (blk + 1) * g <= i0 + t
        fields = self._encode(tokens, valid, **extra)
        rows = torch.where(blk < self.rows, blk, self.rows)
        for k, v in fields.items():
            self.packed[k].index_copy_(2, rows, v)

    def _encode(self, x: torch.Tensor, valid: torch.Tensor | None, **extra) -> dict[str, torch.Tensor]:
        """The codec's fields of `x (B, H, T, D)`, through `encode_into` (where codecs run their pack kernels)."""
        b, h, t, _ = x.shape
        out = {k: torch.empty((b, h, t // self.codec.block_size, *tail), dtype=dtype, device=x.device)
               for k, (tail, dtype) in self._fields.items()}
        self.codec.encode_into(x, valid, out, **extra)
        return out

    def _valid(self, p: torch.Tensor, pads: torch.Tensor | None) -> torch.Tensor | None:
        """`(B, T)`: held indices `p` that are not left padding, None when no padding is known."""
        if pads is None:
            return None
        return p.unsqueeze(0) >= pads.to(p.device).unsqueeze(1)

    def _positions(self, p: torch.Tensor, pads: torch.Tensor | None, batch: int) -> dict:
        if not getattr(self.codec, "needs_positions", False):
            return {}
        pos = p.unsqueeze(0).expand(batch, -1)
        if pads is not None:
            pos = (pos - pads.to(p.device).unsqueeze(1)).clamp_min(0)
        return {"positions": pos}

    # --- reading
    def dense(self, dtype: torch.dtype, held: torch.Tensor) -> torch.Tensor:
        """Every capacity row at its held index, dequantized: `(B, H, max_cache_len, D)` (rows past `held`: zeros or
        stale tokens, which the mask hides)."""
        cap, s, r = self.max_cache_len, self.sink_tokens, self.ring_length
        packed = self.codec.decode({k: v[:, :, : self.rows] for k, v in self.packed.items()}, dtype)
        parts = [packed[:, :, : cap - s]]
        if s:
            parts.insert(0, self.sink[:, :, :s].to(dtype))
        full = torch.cat(parts + [torch.zeros_like(packed[:, :, :1])], dim=2)  # (B, H, cap + 1, D)
        if r:
            n_sink, n_packed, n_res, off = self.split(held.clamp(max=cap))
            j = (torch.arange(r, device=full.device) - off) % r  # residual position of each ring row
            dest = torch.where(j < n_res, n_sink + n_packed + j, cap)
            full.index_copy_(2, dest, self.ring[:, :, :r].to(dtype))
        return full[:, :, :cap]

    # --- the dynamic form's read (eager, the fused path's reference): what is held, in the pieces and order of
    # `cache._Stream.iter_chunks`, so that an eager step of either form sums the same values in the same order (a
    # reordered float sum moves the next K/V by rounding, and a quantized cache turns that into flipped codes:
    # greedy tokens of the default model parted after ~20 steps when the static form attended over its capacity)
    def _residual(self, n_res: int, off: int) -> torch.Tensor:
        """`(B, H, n_res, D)`: the residual window's tokens in order, from their ring rows."""
        idx = (off + torch.arange(n_res, device=self.ring.device)) % self.ring_length
        return self.ring.index_select(2, idx)

    def iter_chunks(self, dtype: torch.dtype, chunk_tokens: int, stop: int, held: int):
        """Held tokens `[0, stop)` dequantized in the pieces `_Stream.iter_chunks` gives: `(B, H, c, D)`."""
        n_sink, n_packed, n_res, off = self.split(held)
        pos = 0
        if n_sink and pos < stop:
            x = self.sink[:, :, :n_sink][:, :, : stop - pos].to(dtype)
            pos += x.shape[2]
            yield x
        b = self.codec.block_size
        n_blocks = -(-n_packed // b)
        step = max(chunk_tokens // b, 1)
        for i in range(0, n_blocks, step):
            if pos >= stop:
                return
            j = min(i + step, n_blocks)
            x = self.codec.decode({k: v[:, :, i:j] for k, v in self.packed.items()}, dtype)
            x = x[:, :, : min(n_packed - i * b, stop - pos)]
            pos += x.shape[2]
            yield x
        if n_res and pos < stop:
            r = self._residual(n_res, off)
            for i in range(0, min(n_res, stop - pos), chunk_tokens):
                yield r[:, :, i : min(i + chunk_tokens, stop - pos)].to(dtype)

    def kernel_view(self) -> StreamTensors | None:
        fmt = self.codec.packed_format()
        if fmt is None:
            return None
        return StreamTensors(sink=self.sink, fields=self.packed, fmt=fmt, n_packed=self.rows * self.codec.block_size,
                             residual=self.ring)

    # --- bookkeeping (eager, between generations)
    def refill_ring(self, held: int, removed: int, dtype: torch.dtype) -> None:
        """After a crop from `held + removed` to `held` tokens: residual tokens whose ring rows the removed ones
        overwrote take their value back from the packed place, dequantized (as the dynamic form's crop re-encodes a
        partial block: the one case where a stored token is not exact)."""
        r = self.ring_length
        if not r:
            return
        n_sink, first, n_res, _ = self.split(held)
        # Token i's row was overwritten iff a removed token i + k*R exists: i < (index past the sinks of the
        # first removed token + removed) - R.
        lost_end = min(first + n_res, held + removed - n_sink - r)
        if lost_end <= first:
            return
        block = self.codec.block_size
        lo_row, hi_row = first // block, -(-lost_end // block)
        dec = self.codec.decode({k: v[:, :, lo_row:hi_row] for k, v in self.packed.items()}, dtype)
        idx = torch.arange(first, lost_end, device=dec.device)
        self.ring.index_copy_(2, idx % r, dec[:, :, first - lo_row * block:][:, :, : lost_end - first])

    def map_batch(self, fn, in_place: bool) -> None:
        def apply(t: torch.Tensor) -> torch.Tensor:
            if in_place:
                return t.copy_(fn(t))
            return _mark_static(fn(t))

        self.packed = {k: apply(v) for k, v in self.packed.items()}
        if self.sink is not None:
            self.sink = apply(self.sink)
        if self.ring is not None:
            self.ring = apply(self.ring)
        self.codec.state = {k: fn(v) for k, v in self.codec.state.items()}

    def allocated_nbytes(self) -> int:
        state = sum(v.numel() * v.element_size() for v in self.codec.state.values())
        return sum(t.numel() * t.element_size() for t in self.buffers()) + state


class StaticQuantizedKVLayer(QuantizedKVLayer):
    """A decoder layer's quantized K/V in fixed storage for `max_cache_len` tokens (see the module docstring).

    `update(keys (B, Hkv, T, D), values (B, Hkv, T, D))` returns, on the dense path, `(B, Hkv, max_cache_len, D)`
    tensors (transformers' masks, sized by `get_mask_sizes`, hide the rows not filled), or two `KVHandle`s on the
    fused path. `length` (0-dim int64, on the device) counts the tokens held.
    """

    is_compileable = True
    is_static = True

    def __init__(self, policy: LayerPolicy, max_cache_len: int, sliding_window: int | None = None):
        CacheLayerMixin.__init__(self)
        if not isinstance(max_cache_len, int) or max_cache_len <= 0:
            raise ValueError(f"max_cache_len={max_cache_len!r} must be a positive number of tokens")
        self.policy = policy
        self.max_cache_len = max_cache_len
        self.sliding_window = sliding_window  # every token is kept; the mask applies the window
        self.is_sliding = False
        sink = 0 if sliding_window is not None else policy.sink_tokens  # as the dynamic form: a window has no sinks
        self._streams = {
            "keys": _StaticStream(policy.key_codec, sink, policy.key_residual_length, policy.key_flush, max_cache_len),
            "values": _StaticStream(policy.value_codec, sink, policy.value_residual_length, policy.value_flush,
                                    max_cache_len),
        }
        self.length = torch.zeros((), dtype=torch.long)
        # The host's count of held tokens, advanced by eager updates alone (a compiled step cannot change a Python
        # value without a recompile): it checks an eager write against the capacity before anything is written,
        # and serves the eager bookkeeping (crop). None once a compiled step has run (see `_host_held`).
        self._host_length: int | None = 0
        self.pad_lengths: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.fused = False
        self.quantize_before_attention = False
        self._offloaded = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # device, dtype, the codecs' head_dim checks
        self.batch_size, self.num_heads, _, head_dim = key_states.shape
        for name, x in (("keys", key_states), ("values", value_states)):
            self._streams[name].allocate(self.batch_size, self.num_heads, x.shape[-1], x.dtype, x.device)
        self.length = _mark_static(self.length.to(self.device))

    # ------------------------------------------------------------------ writing
    def _check_input(self, key_states: torch.Tensor) -> None:
        b, h = key_states.shape[:2]
        if (b, h) != (self.batch_size, self.num_heads) or key_states.dtype != self.dtype \
                or key_states.device != self.device:
            raise ValueError(
                f"this static cache was built for batch {self.batch_size} x {self.num_heads} kv-heads of "
                f"{self.dtype} on {self.device} and got {b} x {h} of {key_states.dtype} on {key_states.device}; "
                "build a new cache (make_cache(spec, model, max_cache_len=...)) for another batch, dtype or device"
            )

    def _host_held(self) -> int:
        if self._host_length is None:  # compiled steps ran since: one read, in eager code only
            self._host_length = int(self.length)
        return self._host_length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[2]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states)
        if _compiling():
            self._host_length = None
        else:
            held = self._host_held()
            if held > self.max_cache_len:
                raise ValueError(
                    f"compiled decode steps went past max_cache_len={self.max_cache_len} ({held} tokens): the "
                    f"tokens past it were not stored (nothing held was overwritten), so what was generated after "
                    f"them did not attend to them; build the cache with a larger max_cache_len (make_cache(spec, "
                    f"model, max_cache_len=...)) for prompt plus max_new_tokens"
                )
            if held + t > self.max_cache_len:
                raise ValueError(
                    f"this static cache holds max_cache_len={self.max_cache_len} tokens: {held} are held and "
                    f"{t} more do not fit; build it with a larger max_cache_len (make_cache(spec, model, "
                    f"max_cache_len=...)), or use the dynamic form (no max_cache_len)"
                )
            self._host_length = held + t
        pads = _compat.left_padding(kwargs, self.length, t, key_states.shape[0])
        if pads is not None:
            self.pad_lengths = pads
        if self.policy.key_rotation is not None:
            key_states = self.policy.key_rotation.apply(key_states)
        p = self.length + torch.arange(t, device=self.device)  # (T,) held indices of the new tokens
        # A compiled step cannot raise on data: past the capacity its tokens go to the spare rows and the kernels
        # read at most max_cache_len, so nothing held is overwritten and nothing wraps; the next eager call (above)
        # raises. Eager steps raise before anything is written.
        self._streams["keys"].write(key_states, p, self.pad_lengths)
        self._streams["values"].write(value_states, p, self.pad_lengths)
        self.length.add_(t)
        if self.fused:
            return KVHandle(self, "keys", key_states), KVHandle(self, "values", value_states)
        return self._dense("keys", key_states, p), self._dense("values", value_states, p)

    def _stream_chunks(self, name: str, chunk_tokens: int, stop: int):
        return self._streams[name].iter_chunks(self.dtype, chunk_tokens, stop, self._host_held())

    def _stored_dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`(B, Hkv, max_cache_len, D)` of one stream in the stored frame (keys rotated for RotatedCache), the new
        tokens at held indices `p` exact unless `quantize_before_attention`."""
        x = self._streams[name].dense(self.dtype, self.length)
        if not self.quantize_before_attention:
            x.index_copy_(2, p.clamp(max=self.max_cache_len - 1), new)
        return x

    def _dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        x = self._stored_dense(name, new, p)
        if name == "keys" and self.policy.key_rotation is not None:
            x = self.policy.key_rotation.apply(x, inverse=True)
        return x

    def dense_kv(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as `_stored_dense` gives them: the fused read path's reference for a static layer."""
        p = self.length - k_new.shape[2] + torch.arange(k_new.shape[2], device=k_new.device)
        return self._stored_dense("keys", k_new, p), self._stored_dense("values", v_new, p)

    def static_layout(self) -> StaticLayout:
        k, v = self._streams["keys"], self._streams["values"]
        return StaticLayout(length=self.length, capacity=self.max_cache_len, sink_tokens=k.sink_tokens,
                            key_ring=k.ring_length, value_ring=v.ring_length, key_window=k.window,
                            value_window=v.window)

    # ------------------------------------------------------------------ sizes
    @property
    def held_tokens(self) -> int:
        return self._host_held() if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The whole capacity, eager or not: `generate` builds the mask of a compileable cache eagerly, before the step
        # it compiles. The dense path therefore attends over the capacity under that mask, a longer float sum than
        # the dynamic form's, which rounds differently; the fused path reads only what is held (`iter_kv_chunks`).
        return self.max_cache_len, 0

    def get_seq_length(self):
        # A device tensor, as transformers' StaticLayer returns: generate builds positions from it without a sync.
        return self.length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    # ------------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        # The storage stays (a CUDA graph replays over its addresses); the next tokens overwrite it.
        for s in self._streams.values():
            s.codec.reset()
        if self.is_initialized:
            self.length.zero_()
        self._host_length = 0
        self.pad_lengths = None

    def crop(self, tokens_to_remove) -> None:
        """Remove tokens from the end (a negative count, or the length to keep as transformers' legacy form). Eager
        only, as transformers' own static layers: assisted generation is not compiled."""
        tokens_to_remove = _compat.crop_argument(tokens_to_remove)
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        held = self._host_held()
        n = -tokens_to_remove if tokens_to_remove < 0 else held - tokens_to_remove
        if n <= 0:
            return
        if n > held:
            raise RuntimeError(f"crop would remove {n} tokens but this layer holds {held}")
        kept = held - n
        self.length.fill_(kept)
        self._host_length = kept
        for s in self._streams.values():
            s.refill_ring(kept, n, self.dtype)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # In place: the buffers keep their addresses (and a captured graph its inputs).
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)), in_place=True)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices],
                        in_place=False)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def _map_batch(self, fn, in_place: bool) -> None:
        if not self.is_initialized:
            return
        for s in self._streams.values():
            s.map_batch(fn, in_place)
        if self.pad_lengths is not None:
            self.pad_lengths = fn(self.pad_lengths)
        self.batch_size = next(iter(self._streams["keys"].packed.values())).shape[0]

    def offload(self) -> None:
        raise ValueError("a static cache cannot be offloaded; use the dynamic form (no max_cache_len) to offload")

    def prefetch(self) -> None:
        pass

    def stored_tensors(self):
        for s in self._streams.values():
            yield from s.buffers()
            yield from s.codec.state.values()

    def nbytes(self) -> int:
        """The bytes a static layer holds are what it allocated, filled or not."""
        return self.allocated_nbytes()

    def allocated_nbytes(self) -> int:
        return sum(s.allocated_nbytes() for s in self._streams.values())


def check_max_cache_len(max_cache_len) -> int | None:
    if max_cache_len is None:
        return None
    if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len <= 0:
        raise ValueError(f"max_cache_len={max_cache_len!r} must be a positive number of tokens (or None: dynamic)")
    return max_cache_len


def static_attention(query, key: KVHandle, value: KVHandle, attention_mask, scaling: float, softcap=None,
                     s_aux=None) -> torch.Tensor:
    """The fused read of a static layer -> `(B, Tq, Hq, D)` in the query dtype: the static kernel on CUDA (the
    operator `hf_kvcache::static_attention` under torch.compile); else, while tracing, attention over `dense_kv` (the
    whole capacity, masked); else None: the caller reads it as the dynamic form (`reference_attention` over
    `iter_kv_chunks`)."""
    layer = key.layer
    keys, values = layer.key_stream.kernel_view(), layer.value_stream.kernel_view()
    b, hq, tq, d = query.shape
    if (kernels.use_kernels(query.device) and keys is not None and values is not None
            and kernels.ops.supports(keys, values, query, static=True) is None
            and (attention_mask is None or attention_mask.dtype == torch.bool)):
        exact_new = not layer.quantize_before_attention
        if (not _compiling() and exact_new and tq > 1 and layer.held_tokens == tq and softcap is None
                and s_aux is None):
            # A prefill (eager): nothing stored before, attention over its own exact tokens (held indices 0..T-1).
            mask = None if attention_mask is None else attention_mask[..., :tq]
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key.new, value.new, attn_mask=mask, scale=scaling, enable_gqa=True, is_causal=mask is None)
            return out.transpose(1, 2).contiguous()
        return kernels.ops.static_decode_attention(
            query, keys, values, key.new, value.new, layer.static_layout(), exact_new=exact_new,
            attention_mask=attention_mask, scaling=scaling, softcap=softcap, s_aux=s_aux,
        )
    if not _compiling():
        return None
    return _dense_attention(query, key, value, attention_mask, scaling, softcap, s_aux)


def _dense_attention(query, key: KVHandle, value: KVHandle, attention_mask, scaling, softcap, s_aux):
    """Plain attention over the whole capacity, masked to the held tokens (and by `attention_mask`), in float32
    (float64 for a float64 query, as `reference_attention`)."""
    layer = key.layer
    k, v = layer.dense_kv(key.new, value.new)
    b, hq, tq, d = query.shape
    hkv = k.shape[1]
    work = torch.promote_types(query.dtype, torch.float32)
    qg = query.to(work).reshape(b, hkv, hq // hkv, tq, d)
    s = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(work)) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    kpos = torch.arange(layer.max_cache_len, device=query.device)
    qpos = layer.length - tq + torch.arange(tq, device=query.device)
    allowed = (kpos[None, :] <= qpos[:, None]).view(1, 1, 1, tq, -1)  # causal over what is held
    if attention_mask is not None:
        mk = attention_mask[..., : layer.max_cache_len].unsqueeze(2)  # (B, 1, 1, Tq, S)
        if mk.dtype == torch.bool:
            allowed = allowed & mk
        else:
            s = s + mk.to(work)
    s = s.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:
        sink = s_aux.to(work).reshape(1, hkv, hq // hkv, 1, 1).expand(b, -1, -1, tq, 1)
        s = torch.cat([s, sink], dim=-1)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    if s_aux is not None:
        p_kv = p[..., :-1]
    else:
        p_kv = p
    denom = p.sum(-1, keepdim=True)
    out = torch.einsum("bhgqk,bhkd->bhgqd", p_kv, v.to(work))
    out = torch.where(denom > 0, out / denom.clamp_min(1e-30), torch.zeros_like(out))
    return out.reshape(b, hq, tq, -1).to(query.dtype).transpose(1, 2).contiguous()


