"""Where one stream (keys or values) of a cache layer keeps its tokens: `StreamStorage`.

One storage serves every mode (docs/design.md, "Capacity: growing or pinned"): buffers of a capacity, the number of
tokens held in a device tensor that the kernels read, and writes addressed by device indices, so that an eager decode
step is a fixed sequence of launches a CUDA graph replays and a compiled step traces without host reads. The capacity
is pinned (`max_cache_len`) or grows in steps (`QuantizedKVLayer` decides; `resize` copies the held rows once).

Where a token lives, for held index `p` and `i = p - sink_tokens`:
- sink: `p < sink_tokens`, row p of a `(B, H, sink_tokens + 1, D)` buffer in the model dtype;
- ring (a residual window of R tokens), a `(B, H, R + 1, D)` buffer in the model dtype, token i in row `i % R`:
  - FIFO window (`flush="fifo"`, R > 0): the last `min(i, R)` tokens are read from the ring; a token is packed when
    it leaves the window (token `i - R`, read from its ring row before token i takes it), so the packed place holds
    exactly the tokens outside the window, as many bytes as a window that packs on eviction;
  - block flush (`flush="block"`, KIVI's keys): the `i mod R` tokens past the last whole window are read from the
    ring; every block of `block_size` tokens a write touches is packed from the ring and the write (a compiled or
    replayed step packs the newest token's block every step, and the kernel quantizes it only at the step that
    completes it: a device-side flag), so that it is final when the window closes;
- packed: every other token, in row `i // block_size` (FIFO: `(i - R) // block_size`) of the codec's fields
  `(B, H, rows + 1, ...)`. A codec of blocks without a window keeps its incomplete block in a ring of one block.
Each buffer has one spare row at the end: a write of a token that belongs elsewhere (or past the capacity) goes
there, so that no write needs a branch. `hf_kvcache.kernels.layout.StaticLayout` tells the kernels this split, which
they derive from the length on the device (`split` here).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import torch

from . import kernels
from .kernels.layout import StreamTensors

# Capacities are rounded up so that every field's batch and head strides (capacity x the elements of one row) stay
# multiples of this many elements as the storage grows, which the fused kernels' specialization relies on for
# aligned, vectorized loads (`kernels/decode.py`, `_VARYING`). Per field rather than a fixed 16 rows: a row of KIVI's
# keys is a block of 32 tokens and already 16-aligned.
_STRIDE_ALIGN = 16


def _capacity(rows: int, fields: dict[str, torch.Tensor]) -> int:
    """`rows` rounded up so that `rows x (elements of one row)` is a multiple of `_STRIDE_ALIGN` for every field."""
    multiple = 1
    for v in fields.values():
        multiple = math.lcm(multiple, _STRIDE_ALIGN // math.gcd(_STRIDE_ALIGN, math.prod(v.shape[3:])))
    return -(-rows // multiple) * multiple


def check_flush(codec, residual_length: int, flush: str) -> None:
    """A stream's window rule: "fifo" (over a per-token codec when there is a window), or "block" with a residual
    of whole blocks (ValueError otherwise)."""
    if flush not in ("fifo", "block"):
        raise ValueError(f"flush must be 'fifo' or 'block', got {flush!r}")
    if flush == "block" and (residual_length <= 0 or residual_length % codec.block_size):
        raise ValueError(
            f"residual_length={residual_length} must be a positive multiple of the block size "
            f"{codec.block_size} for a block-flushed stream"
        )
    if flush == "fifo" and residual_length and codec.block_size != 1:
        raise ValueError(
            f"a FIFO window (residual_length={residual_length}) packs one token at a time as it leaves, which a codec "
            f"of {codec.block_size}-token blocks cannot: use flush='block' (a window flushed in whole blocks)"
        )


def _compiling() -> bool:
    return torch.compiler.is_compiling()


class StreamStorage:
    """Keys or values of one layer: sink, packed and ring places (see the module docstring).

    `allocate` makes the buffers for `capacity` tokens (batch, kv-heads, head_dim, dtype and device from the first
    write); `resize` moves them to a larger capacity. Reads and writes take the number of held tokens from the caller
    (the layer owns the length)."""

    def __init__(self, codec, sink_tokens: int, residual_length: int, flush: str):
        check_flush(codec, residual_length, flush)
        if codec.block_size > 1 and not residual_length:
            # Without a window, a block codec keeps the tokens of its incomplete block exact: a window of one block,
            # flushed whole.
            residual_length, flush = codec.block_size, "block"
        self.codec = codec
        self.sink_tokens = sink_tokens
        self.ring_length = residual_length
        self.window = flush == "fifo" and residual_length > 0
        self.block = flush == "block"
        self.capacity = 0
        self.rows = 0  # packed rows in use for `capacity` tokens, the spare one aside
        self.sink: torch.Tensor | None = None
        self.packed: dict[str, torch.Tensor] = {}
        self.ring: torch.Tensor | None = None
        self.ring_index: torch.Tensor | None = None  # (R + 1,) int64: the index past the sinks each ring row holds
        # a crop since the sequence began: later tokens, since cropped, may hold the ring rows of packed ones (host)
        self._cropped = False
        self._fields: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}  # per field: heads, row tail, dtype

    # --- storage
    def _rows_for(self, capacity: int) -> int:
        """Packed rows for `capacity` held tokens: a FIFO window's last R tokens are never packed."""
        outside = capacity - self.sink_tokens - (self.ring_length if self.window else 0)
        return -(-max(outside, 0) // self.codec.block_size)

    def allocate(self, batch: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int, static_address: bool) -> None:
        """Buffers for `capacity` tokens, zero-filled (the dense read of a pinned capacity attends to every row under a
        mask, and zeros, unlike uninitialized memory, never turn into NaN there). `static_address`: mark them for
        torch.compile's CUDA graphs, which replay over buffers that `update` mutates in place."""
        self._fields = self.field_layout(heads, head_dim, dtype)
        mark = mark_static if static_address else (lambda t: t)
        self.capacity, self.rows = capacity, self._rows_for(capacity)
        self.packed = {k: mark(t) for k, t in self._packed_buffers(batch, heads, device, self.rows).items()}
        self.sink = self.ring = self.ring_index = None
        if self.sink_tokens:
            self.sink = mark(torch.zeros((batch, heads, self.sink_tokens + 1, head_dim), dtype=dtype, device=device))
        if self.ring_length:
            self.ring = mark(torch.zeros((batch, heads, self.ring_length + 1, head_dim), dtype=dtype, device=device))
            self.ring_index = mark(torch.full((self.ring_length + 1,), -1, dtype=torch.long, device=device))

    def field_layout(self, heads: int, head_dim: int, dtype: torch.dtype) -> dict[str, tuple[int, tuple, torch.dtype]]:
        """Per field of the codec: heads (1 for a field a sequence shares across heads: KVQuant's positions), the tail
        shape of one row, dtype. From encoding one block of zeros (one row, on the CPU's reference path) with a copy of
        the codec: the real one may freeze per-sequence state (FP8's dynamic scale) on the first tokens it sees."""
        probe = torch.zeros((1, heads, self.codec.block_size, head_dim), dtype=dtype)
        extra = {}
        if getattr(self.codec, "needs_positions", False):
            extra["positions"] = torch.zeros((1, self.codec.block_size), dtype=torch.long)
        with kernels.use_backend("torch"):
            twin = copy.deepcopy(self.codec)
            fields = type(twin).encode(twin, probe, None, **extra)  # the class's encode: not a wrapper set on the codec
        return {k: (v.shape[1], tuple(v.shape[3:]), v.dtype) for k, v in fields.items()}

    def _packed_buffers(self, batch: int, heads: int, device: torch.device, rows: int) -> dict[str, torch.Tensor]:
        shapes = {k: torch.empty((1, 1, 1, *tail), dtype=dt) for k, (_, tail, dt) in self._fields.items()}
        total = _capacity(rows + 1, shapes)
        return {k: torch.zeros((batch, heads if h > 1 else 1, total, *tail), dtype=dt, device=device)
                for k, (h, tail, dt) in self._fields.items()}

    def new_packed(self, capacity: int) -> dict[str, torch.Tensor]:
        """Packed buffers for a larger capacity, allocated and not yet in use (`resize` takes them): a growth that
        runs out of memory raises here, before anything held has moved."""
        first = next(iter(self.packed.values()))
        heads = max(v.shape[1] for v in self.packed.values())
        return self._packed_buffers(first.shape[0], heads, first.device, self._rows_for(capacity))

    def resize(self, capacity: int, buffers: dict[str, torch.Tensor]) -> None:
        """Move to `capacity` tokens with the `new_packed(capacity)` buffers: every packed row copied once (sink and
        ring do not depend on the capacity)."""
        for k, old in self.packed.items():
            n = min(old.shape[2], buffers[k].shape[2])
            buffers[k][:, :, :n].copy_(old[:, :, :n])
        self.packed, self.capacity, self.rows = buffers, capacity, self._rows_for(capacity)

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
    def write(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None, offset=0,
              start: int | None = None) -> None:
        """Store `x (B, H, T, D)` at held indices `p (T,)` (a device tensor). `offset`: the index in the sequence of
        held token 0 (a 0-dim device tensor once a sliding layer let tokens go, else 0); `pads (B,)`: each row's left
        padding, the sequence indices below it are padding. `start`: `p[0]` as a host int, in eager code (None while
        tracing or capturing a graph)."""
        if (start is None and x.shape[2] == 1 and not _compiling() and kernels.use_kernels(x.device)
                and kernels.ops.TUNING["token_places"]):
            self._write_token(x, p, pads, offset)
        else:
            self._write(x, p, pads, offset, start)

    def _write(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None, offset, start: int | None) -> None:
        """`write` with its index arithmetic in PyTorch operations (every write but one token with `start` unknown)."""
        s, r = self.sink_tokens, self.ring_length
        if start is not None and start < s:  # eager: the sinks' share of the write, then the rest if any
            k = min(s - start, x.shape[2])
            self.sink[:, :, start : start + k].copy_(x[:, :, :k])
            if k == x.shape[2]:
                return
            x, p, start = x[:, :, k:], p[k:], start + k
        elif start is None and s:
            self.sink.index_copy_(2, p.clamp(max=s), x)  # tokens past the sinks land in the spare row
        t = x.shape[2]
        i = p - s  # (T,) index past the sinks; negative for sink tokens
        # Per-sequence statistics (FP8's dynamic scale, TurboQuant's channel split) come from the first write that
        # reaches past the sinks, before anything is packed, in every mode; eager code knows from `start` whether this
        # write does, a traced one observes always (the statistic is not set yet only in a cache's first steps).
        if self.codec.observing and (start + t > s if start is not None else _compiling()):
            seen = (i >= 0).unsqueeze(0).expand(x.shape[0], t)
            valid = self._valid(p, offset, pads)
            self.codec.observe(x, seen if valid is None else seen & valid)
        if self.block:
            self._pack_blocks(x, p, pads, offset, start)
        elif self.window:
            self._pack_leaving(x, p, pads, offset)
        elif start is not None and start - s + t <= self.rows:
            # Eager, every token packed into consecutive rows: encode straight into them.
            rows = {k: v[:, :, start - s : start - s + t] for k, v in self.packed.items()}
            self.codec.encode_into(x, self._valid(p, offset, pads), rows,
                                   **self._positions(p, offset, pads, x.shape[0]))
        else:
            fields = self._encode(x, self._valid(p, offset, pads), **self._positions(p, offset, pads, x.shape[0]))
            rows = torch.where((i >= 0) & (i < self.rows), i, self.rows)
            for k, v in fields.items():
                self.packed[k].index_copy_(2, rows, v)
        if r:
            keep = min(t, r)  # a longer write keeps only its last R tokens in the ring (each slot written once)
            last = i[t - keep:]
            stored = (last >= 0) & (p[t - keep:] < self.capacity)  # past the capacity: the spare row
            rows = torch.where(stored, last % r, r)
            self.ring.index_copy_(2, rows, x[:, :, t - keep:])
            self.ring_index.index_copy_(0, rows, last)

    def _write_token(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None, offset) -> None:
        """One token `x (B, H, 1, D)` at held index `p (1,)`, with `start` unknown (a decode step captured in a layer's
        CUDA graph): what `write` does, its index arithmetic in one launch (`kernels.ops.token_places`) instead of the
        ~15-35 small PyTorch kernels a stream it takes there, ~1 us each of a replayed step (`kivi-2` at batch 1 x 32k,
        8 layers: 3.71 -> 3.18 ms of GPU a step, H100, 2026-12-07). The same rows are written but for a block not yet
        complete, which is never read: the ring takes the token first and the block's tokens all come from it, where
        `_write` fills the block's later rows with this token (KIVI's pack kernel writes such a block as zeros)."""
        from .kernels import pack

        s = self.sink_tokens
        g = self.codec.block_size if self.block else 1
        mode = self._place_mode()
        places = self.token_places(p)
        gp = (len(places) - 8) // 2
        src, held = places[8 : 8 + g], places[8 + gp : 8 + gp + g]
        if s:
            self.sink.index_copy_(2, places[0:1], x)
        extra = {}
        if mode == pack.PLACE_BLOCK:
            self._ring_token(x, places)
            tokens = self.ring.index_select(2, src)
            if getattr(self.codec, "skips_incomplete_blocks", False):  # the flag's low byte, as a bool
                extra["complete"] = places[4:5].view(torch.uint8)[:1].view(torch.bool)
        else:
            tokens = self.ring.index_select(2, src) if mode == pack.PLACE_WINDOW else x
            extra = self._positions(held, offset, pads, x.shape[0])
        fields = self._encode(tokens, self._valid(held, offset, pads), **extra)
        for k, v in fields.items():
            self.packed[k].index_copy_(2, places[1:2], v)
        if mode == pack.PLACE_WINDOW:  # after the token leaving the window was read from its row
            self._ring_token(x, places)

    def _place_mode(self) -> int:
        from .kernels import pack

        return pack.PLACE_BLOCK if self.block else pack.PLACE_WINDOW if self.window else pack.PLACE_PLAIN

    def token_places(self, p: torch.Tensor) -> torch.Tensor:
        """Where one new token at held index `p (1,)` goes, one launch (`kernels.ops.token_places`, whose layout it
        returns); `warmup.calls` launches it too, for the graphed decode steps that eager calls do not make."""
        g = self.codec.block_size if self.block else 1
        return kernels.ops.token_places(p, self.sink_tokens, self.ring_length, g, self._place_mode(), self.rows,
                                        self.capacity)

    def _ring_token(self, x: torch.Tensor, places: torch.Tensor) -> None:
        """`_write_token`'s token into its ring row (`places[2]`) and its index past the sinks into `ring_index`."""
        self.ring.index_copy_(2, places[2:3], x)
        self.ring_index.index_copy_(0, places[2:3], places[3:4])

    def _pack_leaving(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None, offset) -> None:
        """FIFO window: pack the tokens this write pushes out of the window, `j = i - R` for each new token i, from
        their ring rows (written before) or from this write (a write longer than the window); those with j < 0 go to
        the spare row."""
        t = x.shape[2]
        r, s = self.ring_length, self.sink_tokens
        j = p - s - r  # (T,) indices past the sinks of the tokens leaving the window
        i0 = p[0] - s
        src = torch.where(j < i0, j % r, r + 1 + (j - i0).clamp(min=0, max=t - 1))
        tokens = torch.cat([self.ring, x], dim=2).index_select(2, src)  # (B, H, T, D)
        fields = self._encode(tokens, self._valid(j + s, offset, pads),
                              **self._positions(j + s, offset, pads, x.shape[0]))
        rows = torch.where((j >= 0) & (j < self.rows), j, self.rows)
        for k, v in fields.items():
            self.packed[k].index_copy_(2, rows, v)

    def _pack_blocks(self, x: torch.Tensor, p: torch.Tensor, pads: torch.Tensor | None, offset,
                     start: int | None) -> None:
        """Block flush (KIVI's keys): pack the blocks of `block_size` tokens this write touches, each block's earlier
        tokens gathered from the ring (still holding them: a block never spans more than the window). Eager code
        (`start` known) packs only the blocks the write completes; a traced or captured step packs every block it
        touches, and the codec quantizes only those it completes (`complete`, a device flag)."""
        t = x.shape[2]
        g, r, s = self.codec.block_size, self.ring_length, self.sink_tokens
        extra = {}
        if start is not None:
            first, stop = (start - s) // g, (start - s + t) // g  # the blocks this write completes
            if stop <= first:
                return
            blk = torch.arange(first, stop, device=x.device)
        else:
            n_blocks = (t + g - 2) // g + 1  # blocks that T consecutive tokens can touch
            blk = (p[0] - s).clamp(min=0) // g + torch.arange(n_blocks, device=x.device)  # (n,)
        i0 = p[0] - s  # index past the sinks of this write's first token (negative while sinks fill)
        idx = (blk[:, None] * g + torch.arange(g, device=x.device)).reshape(-1)  # (n*G,) indices past the sinks
        # Source of each: the ring for tokens written before, this write for its own (later ones: the last).
        src = torch.where(idx < i0, idx % r, r + 1 + (idx - i0).clamp(max=t - 1))
        tokens = torch.cat([self.ring, x], dim=2).index_select(2, src)
        if start is None and getattr(self.codec, "skips_incomplete_blocks", False):
            # Only a block this write completes is read later (whole windows are): the others are left unpacked.
            extra["complete"] = (blk + 1) * g <= i0 + t
        fields = self._encode(tokens, self._valid(idx + s, offset, pads), **extra)
        rows = torch.where(blk < self.rows, blk, self.rows)
        for k, v in fields.items():
            self.packed[k].index_copy_(2, rows, v)

    def _encode(self, x: torch.Tensor, valid: torch.Tensor | None, **extra) -> dict[str, torch.Tensor]:
        """The codec's fields of `x (B, H, T, D)`, through `encode_into` (where codecs run their pack kernels)."""
        b, h, t, _ = x.shape
        n = t // self.codec.block_size
        # Rows for a multiple of 16 blocks, of which the first n are written: the pack kernels then see batch and head
        # strides of the same divisibility whatever the write's length, as in the storage itself (whose capacity is a
        # multiple of 16 rows). Sized to n, a field's strides followed the prompt's length, and each of their classes
        # (1, a multiple of 16, neither) compiled its own variant of the kernel: 12 of TurboQuant's for a first chunked
        # `generate` of `turboquant-3`, now 3 (`hf-kvcache bench --parts compiles`, BENCHMARKS.md 2026-12-05).
        rows = -(-n // 16) * 16
        out = {k: torch.empty((b, h if heads > 1 else 1, rows, *tail), dtype=dtype, device=x.device)[:, :, :n]
               for k, (heads, tail, dtype) in self._fields.items()}
        self.codec.encode_into(x, valid, out, **extra)
        return out

    def _valid(self, p: torch.Tensor, offset, pads: torch.Tensor | None) -> torch.Tensor | None:
        """`(B, T)`: which tokens at held indices `p (T,)` are not left padding (their sequence index, `p + offset`,
        is at least the row's padding), None when no padding is known."""
        if pads is None:
            return None
        return _sequence_index(p, offset).unsqueeze(0) >= pads.to(p.device).unsqueeze(1)

    def _positions(self, p: torch.Tensor, offset, pads: torch.Tensor | None, batch: int) -> dict:
        """RoPE positions of the tokens at held indices `p (T,)`, as `generate` numbers them: their sequence index minus
        each row's left padding (padding at 0)."""
        if not getattr(self.codec, "needs_positions", False):
            return {}
        pos = _sequence_index(p, offset).unsqueeze(0).expand(batch, -1)
        if pads is not None:
            pos = (pos - pads.to(p.device).unsqueeze(1)).clamp_min(0)
        return {"positions": pos}

    # --- reading
    def dense(self, dtype: torch.dtype, held: int) -> torch.Tensor:
        """The `held` tokens dequantized, in order: `(B, H, held, D)`."""
        return torch.cat(list(self.iter_chunks(dtype, max(held, 1), held, held)), dim=2)

    def capacity_dense(self, dtype: torch.dtype, held: torch.Tensor) -> torch.Tensor:
        """Every capacity row at its held index, dequantized: `(B, H, capacity, D)` (rows past `held`: zeros or stale
        tokens, which the mask hides). The traced dense read of a pinned capacity."""
        cap, s, r = self.capacity, self.sink_tokens, self.ring_length
        if self.rows:
            packed = self.codec.decode({k: v[:, :, : self.rows] for k, v in self.packed.items()}, dtype)
        else:  # a window as long as the capacity: nothing is ever packed
            ref = self.ring if self.ring is not None else self.sink
            packed = torch.zeros((*ref.shape[:2], 0, ref.shape[-1]), dtype=dtype, device=ref.device)
        parts = [packed[:, :, : cap - s]]
        if s:
            parts.insert(0, self.sink[:, :, :s].to(dtype))
        ref = parts[0]
        full = torch.cat(parts + [ref.new_zeros((*ref.shape[:2], 1, ref.shape[-1]))], dim=2)  # (B, H, >= cap + 1, D)
        if full.shape[2] < cap + 1:  # a FIFO window's last R tokens have no packed rows
            full = torch.cat([full, full.new_zeros((*full.shape[:2], cap + 1 - full.shape[2], full.shape[3]))], 2)
        if r:
            n_sink, n_packed, n_res, off = self.split(held.clamp(max=cap))
            j = (torch.arange(r, device=full.device) - off) % r  # residual position of each ring row
            dest = torch.where(j < n_res, n_sink + n_packed + j, cap)
            full.index_copy_(2, dest, self.ring[:, :, :r].to(dtype))
        return full[:, :, :cap]

    def _residual(self, n_res: int, off: int) -> torch.Tensor:
        """`(B, H, n_res, D)`: the residual window's tokens in order, from their ring rows."""
        idx = (off + torch.arange(n_res, device=self.ring.device)) % self.ring_length
        return self.ring.index_select(2, idx)

    def iter_chunks(self, dtype: torch.dtype, chunk_tokens: int, stop: int, held: int) -> Iterator[torch.Tensor]:
        """Held tokens `[0, stop)` dequantized piece by piece, at most ~`chunk_tokens` at a time: `(B, H, c, D)`. The
        fused path's reference: no tensor ever holds the whole dequantized stream."""
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
        """The whole buffers as the fused attention reads them (`n_packed`: the packed place's capacity in tokens; the
        kernels take the split from the length on the device), or None if the codec has no kernel."""
        fmt = self.codec.packed_format()
        if fmt is None:
            return None
        return StreamTensors(sink=self.sink, fields=self.packed, fmt=fmt, n_packed=self.rows * self.codec.block_size,
                             residual=self.ring)

    # --- bookkeeping (eager)
    def refill_ring(self, held: int, dtype: torch.dtype) -> None:
        """After a crop to `held` tokens: residual tokens whose ring rows later tokens took (`ring_index` says which
        index each row holds) take their value back from the packed place, dequantized. The packed place has each of
        them: a FIFO window packed a token when the token R later pushed it out, a block flush packed its window's
        blocks as they completed. The one case where a stored token is not exact."""
        if not self.ring_length:
            return
        self._cropped = True
        _, first, n_res, _ = self.split(held)
        self._refill(first, n_res, dtype)

    def _refill(self, first: int, n: int, dtype: torch.dtype) -> None:
        """`refill_ring` for the tokens of indices `first .. first + n` (past the sinks): those whose ring rows later
        tokens took, from the packed place."""
        r = self.ring_length
        if not n:
            return
        idx = torch.arange(first, first + n, device=self.ring.device)
        stale = idx[self.ring_index[idx % r] != idx]
        if not stale.numel():
            return
        block = self.codec.block_size
        lo, hi = int(stale[0]), int(stale[-1]) + 1
        lo_row, hi_row = lo // block, -(-hi // block)
        dec = self.codec.decode({k: v[:, :, lo_row:hi_row] for k, v in self.packed.items()}, dtype)
        self.ring.index_copy_(2, stale % r, dec.index_select(2, stale - lo_row * block))
        self.ring_index.index_copy_(0, stale % r, stale)

    def release(self) -> None:
        """Give every buffer back (a growing layer's `reset`); `allocate` makes them again at the next write."""
        self.packed, self.sink, self.ring, self.ring_index = {}, None, None, None
        self.capacity = self.rows = 0
        self._cropped = False

    def reset(self) -> None:
        """A new sequence in the same buffers: no ring row holds a token of it yet."""
        if self.ring_index is not None:
            self.ring_index.fill_(-1)
        self._cropped = False

    def drop_front(self, n: int, held: int, pads: torch.Tensor | None = None, offset=0) -> None:
        """Forget the `n` oldest of `held` tokens (a sliding window's bulk trim; no sinks; `n` a multiple of the block
        size if whole windows of a block flush remain, `may_drop`): the packed rows move to the front, and the ring's
        rows turn by `n` so that token i sits in row i mod R again (the ring holds the last R tokens written, which
        covers every residual token after the trim, but for those a crop let later tokens overwrite: taken back from
        the packed rows first). A block flush then packs again, from the ring, the complete blocks of its window as
        they now align. `pads`, `offset`: as in `write`, for the tokens held after the trim."""
        b = self.codec.block_size
        if self.block and self._cropped:
            # The tokens the trim leaves in the window must be in their ring rows: after a crop, later tokens (since
            # cropped) may hold the rows of tokens that were packed and that a block flush's realigned window now reads
            # from the ring. They come back from the packed rows first, in the numbering before the trim. (A FIFO
            # window's residual after a trim is the newest of its residual before it.) Found by
            # tests/test_cache_properties.py: a sliding layer, keys block-flushed, cropped, then trimmed.
            _, first, n_res, _ = self.split(held - n)
            self._refill(n + first, n_res, self.ring.dtype)
        _, n_packed, _, _ = self.split(held)
        stored = n_packed if not self.block else held  # a block flush packs the blocks of its window as they fill
        live = min(-(-stored // b), self.rows)
        first = min(n // b, live)
        if live > first:
            for v in self.packed.values():
                moved = v[:, :, first:live].clone()  # the source and destination overlap
                v[:, :, : live - first].copy_(moved)
        r = self.ring_length
        if r:
            if n % r:
                self.ring[:, :, :r].copy_(self.ring[:, :, :r].roll(-(n % r), dims=2))
                self.ring_index[:r].copy_(self.ring_index[:r].roll(-(n % r)))
            self.ring_index.sub_(n)
        if self.block and n % b:
            after = held - n
            lo, hi = (after // r) * r // b, after // b  # the window's complete blocks
            if hi > lo:
                idx = torch.arange(lo * b, hi * b, device=self.ring.device)
                fields = self._encode(self.ring.index_select(2, idx % r), self._valid(idx, offset, pads))
                for k, v in fields.items():
                    self.packed[k][:, :, lo:hi].copy_(v)

    def may_drop(self, n: int, held: int) -> bool:
        """Whether a trim of the `n` oldest of `held` tokens keeps every packed block whole: always for one-token codes;
        for a block flush, unless whole windows remain (their blocks were packed where they were)."""
        b = self.codec.block_size
        return b == 1 or n % b == 0 or (self.block and held - n < self.ring_length)

    @property
    def residual_length(self) -> int:
        """Tokens of the exact window (the ring's rows)."""
        return self.ring_length

    def map_batch(self, fn, in_place: bool) -> None:
        """A batch-axis operation (beam search's reorder in place, keeping every address; a batch selection or
        repetition into new buffers) on every buffer and on the codec's per-sequence state."""

        def apply(t: torch.Tensor) -> torch.Tensor:
            return t.copy_(fn(t)) if in_place else fn(t)

        self.packed = {k: apply(v) for k, v in self.packed.items()}
        if self.sink is not None:
            self.sink = apply(self.sink)
        if self.ring is not None:
            self.ring = apply(self.ring)
        self.codec.state = {k: apply(v) for k, v in self.codec.state.items()}

    def move(self, fn) -> None:
        """Every buffer and the codec's state through `fn` (a device move: offloading)."""
        self.packed = {k: fn(v) for k, v in self.packed.items()}
        self.sink = None if self.sink is None else fn(self.sink)
        self.ring = None if self.ring is None else fn(self.ring)
        self.ring_index = None if self.ring_index is None else fn(self.ring_index)
        self.codec.state = {k: fn(v) for k, v in self.codec.state.items()}

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.buffers()
        yield from self.codec.state.values()

    # --- accounting
    def _row_bytes(self) -> int:
        return sum(v[0, 0, 0].numel() * v.element_size() * v.shape[0] * v.shape[1] for v in self.packed.values())

    def nbytes(self, held: int) -> int:
        """Bytes a sequence of `held` tokens takes: the packed rows of the tokens outside the window, the sinks and the
        window at their full size (a block-flushed window empties at every flush and fills again: what a sequence
        needs is all of it), and the codec's state. The capacity not filled yet is not counted
        (`allocated_nbytes`)."""
        if not self.packed or not held:
            return 0
        _, n_packed, _, _ = self.split(held)
        dense = sum(t[:, :, :-1].numel() * t.element_size() for t in (self.sink, self.ring) if t is not None)
        state = sum(v.numel() * v.element_size() for v in self.codec.state.values())
        return -(-n_packed // self.codec.block_size) * self._row_bytes() + dense + state

    def allocated_nbytes(self) -> int:
        """Bytes allocated: the buffers (held and not yet filled), the codec's state and its constants (a TurboQuant
        codec's rotations: 2.0 MB of the default model's 30 layers, which `tests/test_long_context.py` saw grow
        beside the cache's own bytes on the H100)."""
        state = sum(v.numel() * v.element_size() for v in self.codec.state.values())
        return sum(t.numel() * t.element_size() for t in self.buffers()) + state + self.codec.constants_nbytes()


def _sequence_index(p: torch.Tensor, offset) -> torch.Tensor:
    """Held indices -> indices in the sequence (`offset`: a 0-dim tensor, or 0 when no token was let go)."""
    return p if isinstance(offset, int) and offset == 0 else p + offset


def mark_static(t: torch.Tensor) -> torch.Tensor:
    # A fixed address, so that CUDA graphs replay over the buffers that `update` mutates in place (as transformers'
    # StaticLayer does); not allowed while tracing, and never needed there: storage is made eagerly.
    if not _compiling():
        torch._dynamo.mark_static_address(t)
    return t
