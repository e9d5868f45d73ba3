"""Where packed pages keep a batch's tokens (`hf_kvcache.paged`): a page slot's bytes (`_StreamFormat`), each request's
exact tokens and codec state in a lane (`_Lanes`), and a batch's writes planned once for every layer (`_Batch`,
`_Writes`). The rules are `StreamStorage`'s (its `split`: sinks, then packed, then the residual window), so a request
reads what `generate` with the same preset reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .storage import StreamStorage


class _StreamFormat:
    """How one stream (keys or values) of one layer sits in a page slot; where its tokens live is `StreamStorage`'s
    rule (`rules.split`: sinks, then packed, then the residual window), the same as a `generate` cache's."""

    def __init__(self, codec, sink_tokens: int, residual_length: int, flush: str, heads: int, head_dim: int,
                 dtype: torch.dtype):
        if getattr(codec, "needs_positions", False):
            raise ValueError(f"packed pages: {type(codec).__name__} stores pre-RoPE keys, which needs the model's "
                             "attention patched per request; kvquant-* is not served under continuous batching yet")
        self.codec = codec
        self.rules = StreamStorage(codec, sink_tokens, residual_length, flush)  # its places, never allocated
        # per field: heads, tail, dtype, bytes of one block row
        self.fields = [(name, h, tail, dt, h * math.prod(tail) * dt.itemsize)
                       for name, (h, tail, dt) in self.rules.field_layout(heads, head_dim, dtype).items()]
        self.row_bytes = sum(f[-1] for f in self.fields)
        self.slot_bytes = -(-self.row_bytes // codec.block_size)  # one token's share of a block row
        self.stateful = bool(sink_tokens or self.rules.ring_length or codec.state or codec.observing)

    def to_bytes(self, fields: dict[str, torch.Tensor]) -> torch.Tensor:
        """Fields `(B, H, n, ...)` -> `(B * n * G, slot_bytes)` uint8, sequence after sequence, each block row spread
        over its G slots."""
        rows = []
        for name, *_ in self.fields:
            f = fields[name]
            rows.append(f.transpose(1, 2).reshape(f.shape[0] * f.shape[2], -1).contiguous().view(torch.uint8))
        flat = torch.cat(rows, dim=1)
        pad = self.codec.block_size * self.slot_bytes - flat.shape[1]
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        return flat.reshape(-1, self.slot_bytes)

    def from_bytes(self, slots: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
        """`(B * n * G, slot_bytes)` uint8 -> fields `(B, H, n, ...)`, row-major (as the kernels and the storage lay
        fields out): one copy of each field's bytes."""
        flat = slots.reshape(-1, self.codec.block_size * self.slot_bytes)
        n, out, at = flat.shape[0] // batch, {}, 0
        for name, heads, tail, dtype, nbytes in self.fields:
            field = torch.empty((batch, heads, n, *tail), dtype=dtype, device=slots.device)
            shape = field.view(torch.uint8).shape  # the last axis in bytes
            src = flat[:, at : at + nbytes].reshape(batch, n, heads, *shape[3:])
            field.view(torch.uint8).copy_(src.transpose(1, 2))
            out[name] = field
            at += nbytes
        return out


class _Lanes:
    """One stream of one layer: every request's exact tokens and codec state, a lane (row) per request. `sink
    (L, S, H, D)` holds token p < S in row p; `ring (L, R, H, D)` token i past the sinks in row `i % R`, as
    `StreamStorage` keeps them (its `split` says which are read from where); `state {name: (L, ...)}` the codec's
    per-sequence state, set at the request's first write past the sinks (`seen`: lanes whose state is set)."""

    def __init__(self, fmt: _StreamFormat):
        self.fmt = fmt
        self.sink: torch.Tensor | None = None
        self.ring: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.seen: set[int] = set()

    def grow(self, lanes: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        def bigger(t: torch.Tensor | None, shape: tuple, dt: torch.dtype) -> torch.Tensor:
            new = torch.zeros((lanes, *shape), dtype=dt, device=device)
            if t is not None:
                new[: t.shape[0]] = t
            return new

        rules = self.fmt.rules
        if rules.sink_tokens:
            self.sink = bigger(self.sink, (rules.sink_tokens, heads, head_dim), dtype)
        if rules.ring_length:
            self.ring = bigger(self.ring, (rules.ring_length, heads, head_dim), dtype)
        self.state = {k: bigger(v, tuple(v.shape[1:]), v.dtype) for k, v in self.state.items()}

    def save_state(self, lane: int, state: dict[str, torch.Tensor], lanes: int) -> None:
        for k, v in state.items():
            if k not in self.state:
                self.state[k] = torch.zeros((lanes, *v.shape[1:]), dtype=v.dtype, device=v.device)
            self.state[k][lane] = v[0]
        self.seen.add(lane)

    def states(self, lanes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The codec state of the requests in `lanes (n,)`, stacked: what the codec reads as a batch of n."""
        return {k: v.index_select(0, lanes) for k, v in self.state.items()}

    def copy_lane(self, src: int, dst: int) -> None:
        for t in (self.sink, self.ring, *self.state.values()):
            if t is not None:
                t[dst] = t[src]
        if src in self.seen:
            self.seen.add(dst)


@dataclass
class _Writes:
    """Where one batch's new tokens go for one stream layout (host lists made device tensors once a batch, shared by
    every layer of that layout): `sink` rows `(token, lane, position)`, `ring` rows `(token, flat row lane * R + row)`,
    and the tokens to pack in encode order `(lane, packed index, from this write?, token, flat ring row)`, with the
    lane of each encoded block; `observe`: `(lane, first token past the sinks, end)` of each request whose write is
    its first to reach past its sinks; `reads`: per request, its split after the write (`StreamStorage.split`)."""

    sink: tuple | None
    ring: tuple | None
    pack: tuple | None
    pack_lanes: torch.Tensor | None
    observe: list
    reads: list
    slot_rows: torch.Tensor | None = None  # the packed tokens' slot rows, the allocator's once a batch
    pack_from: str = "both"  # where the tokens to pack come from: "x" (this write), "ring", or "both"


def _tensors(device: torch.device, *columns: list) -> tuple[torch.Tensor, ...] | None:
    if not columns[0]:
        return None
    return tuple(torch.tensor(c, dtype=torch.bool if isinstance(c[0], bool) else torch.long, device=device)
                 for c in columns)


class _Rows:
    """Requests of a batch read in one launch, each with as many new tokens `q`: `rows` (their indices in the batch),
    `tokens (B * q,)` their new tokens' places in the batch, `lanes (B,)`, `held (B,)` the tokens each holds after
    this step."""

    def __init__(self, batch: "_Batch", rows: list[int]):
        self.rows = rows
        self.q = batch.plan[rows[0]][2]
        device = batch.device
        self.tokens = torch.tensor([batch.starts[b] + i for b in rows for i in range(self.q)], dtype=torch.long,
                                   device=device)
        self.lanes = torch.tensor([batch.lanes[b] for b in rows], dtype=torch.long, device=device)
        self.held_most = max(batch.plan[b][1] + self.q for b in rows)
        self.held = torch.tensor([batch.plan[b][1] + self.q for b in rows], dtype=torch.long, device=device)
        self._slots: dict[int, torch.Tensor] = {}

    def slot_rows(self, tokens: int, rows_of) -> torch.Tensor:
        """`(B, tokens)`: the slot rows of each request's first `tokens` packed tokens (`rows_of(lanes, index)`, the
        allocator's), made once a batch for every layer and stream that reads as many."""
        if tokens not in self._slots:
            index = torch.arange(tokens, device=self.lanes.device)
            self._slots[tokens] = rows_of(self.lanes[:, None], index[None, :])
        return self._slots[tokens]


class _Batch:
    """One forward's requests as the allocator reads them: `plan` (request, past, new tokens) in batch order, their
    lanes, the first new token of each, and the writes of each stream layout (`writes`, made at first use)."""

    def __init__(self, plan: list, lanes: list[int], device: torch.device):
        self.plan = plan
        self.lanes = lanes
        self.starts = [0]
        for _, _, q in plan:
            self.starts.append(self.starts[-1] + q)
        self.device = device
        self._writes: dict[tuple, _Writes] = {}
        # What the fused kernels read where they run: the requests that decode a token, in one launch, and each
        # chunk of prompt over a history, alone (made at first use: the CPU reads every request by the reference)
        self._groups: list[_Rows] | None = None

    def groups(self) -> list[_Rows]:
        if self._groups is None:
            decode = [b for b, (_, _, q) in enumerate(self.plan) if q == 1]
            chunks = [[b] for b, (_, past, q) in enumerate(self.plan) if q > 1 and past]
            self._groups = [_Rows(self, rows) for rows in ([decode] if decode else []) + chunks]
        return self._groups

    def writes(self, rules: StreamStorage) -> _Writes:
        key = (rules.sink_tokens, rules.ring_length, rules.window, rules.block, rules.codec.block_size)
        if key not in self._writes:
            self._writes[key] = self._make_writes(rules)
        return self._writes[key]

    def _make_writes(self, rules: StreamStorage) -> _Writes:
        s, r, g = rules.sink_tokens, rules.ring_length, rules.codec.block_size
        sink, ring, pack, pack_lanes, observe, reads = [[], [], []], [[], []], [[], [], [], [], []], [], [], []

        def packs(lane: int, i: int, i0: int, start: int) -> None:  # token i past the sinks, from the ring or x
            held_before = i < i0
            pack[0].append(lane)
            pack[1].append(i)
            pack[2].append(not held_before)
            pack[3].append(start + i - i0 if not held_before else 0)
            pack[4].append(lane * r + i % r if held_before else 0)

        for (_, past, q), lane, start in zip(self.plan, self.lanes, self.starts):
            held = past + q
            for p in range(past, min(held, s)):
                sink[0].append(start + p - past)
                sink[1].append(lane)
                sink[2].append(p)
            i0, i1 = past - s, held - s  # indices past the sinks of this write's first token and of the next
            if i0 <= 0 < i1:  # the request's first write past its sinks (a later one finds its state set)
                observe.append((lane, start - i0, start + q))
            if rules.block:  # the blocks this write completes, each from the ring and this write
                for blk in range(max(i0, 0) // g, max(i1, 0) // g):
                    pack_lanes.append(lane)
                    for i in range(blk * g, blk * g + g):
                        packs(lane, i, i0, start)
            elif rules.window:  # the tokens this write pushes out of the window
                for i in range(max(i0, 0, r) - r, max(i1 - r, 0)):
                    packs(lane, i, i0, start)
            else:
                for i in range(max(i0, 0), max(i1, 0)):
                    packs(lane, i, i0, start)
            if r:  # the window keeps this write's last R tokens past the sinks
                for i in range(max(i0, 0, i1 - r), max(i1, 0)):
                    ring[0].append(start + i - i0)
                    ring[1].append(lane * r + i % r)
            reads.append(rules.split(held))
        if g == 1:  # one token a block
            pack_lanes = pack[0]
        sources = set(pack[2])
        return _Writes(_tensors(self.device, *sink), _tensors(self.device, *ring), _tensors(self.device, *pack),
                       _tensors(self.device, pack_lanes)[0] if pack_lanes else None, observe, reads,
                       pack_from="both" if len(sources) > 1 else ("x" if True in sources else "ring"))
