"""Packed pages for transformers' continuous batching (`model.generate_batch`, `init_continuous_batching`).

transformers' paged cache (`PagedAttentionCache`) keeps one flat byte buffer cut into pages by an allocator per
attention kind, sizes it by the allocators' bytes per page, and for sdpa/eager writes each step's new tokens and reads
every request's history back by index. `PackedBatchingConfig` (a `ContinuousBatchingConfig` that names a cache spec)
swaps the allocator of the full-attention layers for `PackedPageAllocator`, whose pages hold a preset's packed bytes:

- a page is `page_size` token slots of one layer; a slot is one row of `[key bytes | value bytes]`, each the share of
  one token of the codec's fields (a codec of G-token blocks, KIVI's keys, spreads one block's fields over the G slots
  of its tokens). Sizing counts these bytes, so the same memory fraction holds proportionally more tokens;
- what a method keeps exact or per sequence lives per request and goes with it (`free_blocks`): sink tokens, the
  residual window, a codec's per-sequence state (FP8's scale, TurboQuant's channel split). The places follow
  `StreamStorage`'s split, so a request reads what `generate` with the same preset reads: its history as stored, its
  new tokens exact;
- the packed token `i` past the sinks lives in slot `i` of the request's pages (never past its own position, so the
  slot is always allocated);
- forking copies pages as bytes and the per-request state with them; prefix sharing stays on for a format whose pages
  are all it stores (no sinks, window or per-sequence state: `int*`, `exact`), and transformers turns it off for the
  others (their shared pages alone would not be a request's history).

This is the reference read (each request's history dequantized, then the model's own attention), on every device,
with one encode and one gather-and-decode a layer and stream for the batch's requests of one layout: the paged fused
kernels are not built yet, so on CUDA it is correct but not the fast path. CB's CUDA graphs, async
batching, block-table decode and CPU offloading are turned off for it (`PackedBatchingConfig`), and sliding-window
layers keep transformers' own pages. Everything that depends on transformers' version is in `_compat`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch

from . import _compat, kernels
from .cache import QuantizedKVCache
from .presets import PRESETS, make_cache, parse_spec
from .storage import StreamStorage

_parts = _compat.continuous_batching_parts()
_FullAllocator = _parts.FullAttentionCacheAllocator


def _check_spec(kv_cache) -> None:
    if isinstance(kv_cache, QuantizedKVCache):
        return
    if not isinstance(kv_cache, str):
        raise TypeError(f"kv_cache must be a spec (a string such as 'turboquant-4') or a cache built by make_cache, "
                        f"got {type(kv_cache).__name__}")
    name, _ = parse_spec(kv_cache)  # raises for an unknown name, with the list
    if PRESETS[name].needs_model:
        raise ValueError(f"spec {kv_cache!r} needs the model itself: pass kv_cache=make_cache({kv_cache!r}, model)")


@dataclass
class PackedBatchingConfig(_parts.ContinuousBatchingConfig):
    """A `ContinuousBatchingConfig` whose pages hold the packed format of `kv_cache`: a spec of `make_cache`
    (`"turboquant-4"`, `"fp8-e4m3"`, `"kivi-2"`, ...; `"none"` keeps transformers' pages in the model dtype), or a cache
    built by `make_cache(spec, model)` for the presets that need the model (`rotated-*`). Pass it where continuous
    batching is set up::

        model.generate_batch(inputs, generation_config=gc, continuous_batching_config=PackedBatchingConfig("kivi-2"))

    CUDA graphs, async batching and the block-table decode path stay off (the index-based read serves packed pages),
    as does CPU offloading (`cpu_offload_space`): the per-request state of a packed request does not travel with its
    pages yet. Every other field is transformers'."""

    kv_cache: object = "turboquant-4"

    def __init__(self, kv_cache="turboquant-4", **kwargs):
        _check_spec(kv_cache)
        for name, off in (("use_cuda_graph", False), ("use_async_batching", False), ("max_blocks_per_request", 0)):
            if kwargs.get(name):
                raise ValueError(f"{name}={kwargs[name]!r} is not available with packed pages: leave it out")
            kwargs[name] = off
        if kwargs.get("cpu_offload_space"):
            raise ValueError("cpu_offload_space: packed pages are not offloaded to the CPU yet (each request's exact "
                             "window and codec state would have to travel with its pages); leave it at 0")
        kwargs.setdefault("auto_switch_to_flash", False)
        known = {f.name for f in dataclasses.fields(_parts.ContinuousBatchingConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown ContinuousBatchingConfig field(s) {sorted(unknown)}")
        super().__init__(**kwargs)
        self.kv_cache = kv_cache
        _compat.install_allocator_factory(_allocator_for)


def _allocator_for(cb_config, model_config, attn_type: str, make_default, **kwargs):
    """The allocator of one attention kind (`_compat.install_allocator_factory` calls this for every paged cache
    transformers builds): `PackedPageAllocator` for the full-attention layers under a `PackedBatchingConfig` that names
    a packed format, transformers' own otherwise."""
    spec = getattr(cb_config, "kv_cache", None)
    if not isinstance(cb_config, PackedBatchingConfig) or attn_type != _parts.FULL_ATTENTION:
        return make_default()
    if getattr(model_config, "kv_lora_rank", None) is not None:
        raise ValueError("packed pages: this model caches compressed latents (MLA), which no preset packs")
    cache = spec if isinstance(spec, QuantizedKVCache) else make_cache(spec, model_config)
    if not isinstance(cache, QuantizedKVCache):  # "none": transformers' pages in the model dtype
        return make_default()
    policies = {}
    for idx in kwargs["layer_indices"]:
        layer = cache.layers[idx]
        policy = getattr(layer, "policy", None)
        if policy is None:
            raise ValueError(f"packed pages: layer {idx} of {spec!r} has no packed format (a layer of another kind)")
        policies[idx] = copy.deepcopy(policy)
    return PackedPageAllocator(policies=policies, config=model_config, **kwargs)


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

    def packed(self, held: int) -> int:
        """Tokens past the sinks that are packed when `held` are held."""
        return self.rules.split(held)[1]

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
        """`(B * n * G, slot_bytes)` uint8 -> fields `(B, H, n, ...)`."""
        flat = slots.reshape(-1, self.codec.block_size * self.slot_bytes)
        n, out, at = flat.shape[0] // batch, {}, 0
        for name, heads, tail, dtype, nbytes in self.fields:
            raw = flat[:, at : at + nbytes].contiguous().view(dtype)
            out[name] = raw.reshape(batch, n, heads, *tail).transpose(1, 2)
            at += nbytes
        return out


def _stacked(states: list[dict]) -> dict:
    """Per-sequence codec states (batch axis first, one sequence each) as one state of as many sequences."""
    return {k: torch.cat([st[k] for st in states]) for k in states[0]} if states and states[0] else {}


def _state_key(state: dict) -> tuple:
    return tuple(sorted((k, tuple(v.shape[1:]), v.dtype) for k, v in state.items()))


@dataclass
class _StreamState:
    """One request's exact tokens and codec state for one stream of one layer."""

    sink: torch.Tensor | None = None  # (H, n, D)
    ring: torch.Tensor | None = None  # (H, n, D): held past the packed ones
    packed: int = 0  # tokens past the sinks that are packed (in slots 0 .. packed - 1)
    held: int = 0
    state: dict = dataclasses.field(default_factory=dict)


def _first(n: int, parts: list) -> list[torch.Tensor]:
    """The first `n` tokens of the pieces `parts` (each `(H, t, D)` or None), in order, as views."""
    out = []
    for part in parts:
        if part is None or n <= 0:
            continue
        out.append(part[:, :n])
        n -= part.shape[1]
    return out


class PackedPageAllocator(_FullAllocator):
    """Pages of packed tokens for a group of full-attention layers (see the module docstring). One slot row per token
    (`rows_per_token = 1`): `[key bytes | value bytes]`, the widest layer's if layers differ."""

    supports_block_table = False
    rows_per_token = 1

    def __init__(self, *, policies: dict, index: int, config, num_key_value_heads: int, cache_dtype: torch.dtype,
                 page_size: int, layer_indices: list[int], allow_block_sharing: bool) -> None:
        self.head_dim = _compat.paged_head_dim(config)
        self.num_key_value_heads = num_key_value_heads
        self.cache_dtype = cache_dtype
        self.policies = policies
        self.formats = {}
        for idx in layer_indices:
            p = policies[idx]
            self.formats[idx] = {
                name: _StreamFormat(codec, p.sink_tokens, residual, flush, num_key_value_heads, self.head_dim,
                                    cache_dtype)
                for name, codec, residual, flush in (
                    ("keys", p.key_codec, p.key_residual_length, p.key_flush),
                    ("values", p.value_codec, p.value_residual_length, p.value_flush))}
            if page_size % max(f.codec.block_size for f in self.formats[idx].values()):
                raise ValueError(f"page_size={page_size} must be a multiple of the codec's block of "
                                 f"{max(f.codec.block_size for f in self.formats[idx].values())} tokens")
        self.key_bytes = max(f["keys"].slot_bytes for f in self.formats.values())
        self.slot_bytes = self.key_bytes + max(f["values"].slot_bytes for f in self.formats.values())
        # Shared pages are a request's whole history only where nothing lives outside them.
        self.supports_block_sharing = not any(f.stateful for fs in self.formats.values() for f in fs.values())
        self._layer_offset = {idx: i * page_size for i, idx in enumerate(layer_indices)}
        self._requests: dict[str, dict[int, dict[str, _StreamState]]] = {}
        self._plan: list[tuple[str, int, int]] = []  # this batch's (request, past, new tokens), in batch order
        self._plan_used = False
        self._order_of: tuple | None = None  # (plan, its permutation), `_order`
        self._bases: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (its pages, slot rows), `_slots`
        self._before_cache_tensor_init(index=index, layer_indices=layer_indices, tokens_per_page=page_size,
                                       bytes_per_page=self.slot_bytes * page_size,
                                       allow_block_sharing=allow_block_sharing)

    def register_cache_tensor(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor,
                              pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)  # forks and offloads copy whole blocks
        total = (non_trash_bytes + 2 * bytes_per_sector) // self.slot_bytes
        slots = cache_tensor[: total * self.slot_bytes].view(total, self.slot_bytes)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, slots, pool)

    # --- requests
    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        # Called for each request of a batch, in batch order, before its forward: the batch's plan. A request already
        # in the plan starts a new one too (a batch whose forward never came, after an error).
        if self._plan_used or any(r == request_id for r, _, _ in self._plan):
            self._plan, self._plan_used = [], False
        self._plan.append((request_id, past_length, query_length))
        return super().get_write_indices(request_id, past_length, query_length)

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        self._requests.pop(request_id, None)
        self._bases.pop(request_id, None)

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int):
        out = super().fork_blocks(source_request_id, dest_request_id, past_length)
        if source_request_id in self._requests:
            self._requests[dest_request_id] = copy.deepcopy(self._requests[source_request_id])
        return out

    def held_requests(self) -> list[str]:
        """Requests with per-request state held (a finished or cancelled one is gone)."""
        return list(self._requests)

    def _streams(self, request_id: str, layer_idx: int, past: int) -> dict[str, _StreamState]:
        layers = self._requests.setdefault(request_id, {})
        streams = layers.get(layer_idx)
        if streams is None or (past == 0 and streams["keys"].held):  # a new request, or one restarted from scratch
            streams = layers[layer_idx] = {"keys": _StreamState(), "values": _StreamState()}
            if past:  # a prefix matched in shared pages: stateless formats only, every token packed
                if not self.use_block_sharing:
                    raise RuntimeError(f"packed pages: request {request_id!r} starts at token {past} with no state")
                for st in streams.values():
                    st.packed = st.held = past
        elif streams["keys"].held != past:
            raise RuntimeError(f"packed pages: request {request_id!r} holds {streams['keys'].held} tokens, the batch "
                               f"says {past}")
        return streams

    def _slots(self, request_id: str) -> torch.Tensor:
        """Slot rows of a request's token positions in the first layer (a layer adds its offset), on the cache's
        device: rebuilt only when the request has gained a page, so a step copies no index to the device."""
        table = self.block_table[request_id]
        held = self._bases.get(request_id)
        if held is None or held[0] != len(table):
            p = self.tokens_per_page
            idx = torch.arange(len(table) * p)
            rows = torch.tensor(table, dtype=torch.long)[idx // p] * self.block_physical_stride + idx % p
            held = self._bases[request_id] = (len(table), rows.to(self.cache_tensor.device))
        return held[1]

    # --- one stream of one layer, every request of the batch
    def _append(self, fmt: _StreamFormat, st: _StreamState, x: torch.Tensor) -> int:
        """Take a request's next tokens `x (H, q, D)` into its sinks and window (observing a codec's per-sequence
        statistic on the first past the sinks); returns how many window tokens are to be packed now."""
        s, codec = fmt.rules.sink_tokens, fmt.codec
        past = st.held
        st.held += x.shape[1]
        if past < s:
            k = min(s - past, x.shape[1])
            st.sink = x[:, :k].clone() if st.sink is None else torch.cat([st.sink, x[:, :k]], dim=1)
            x = x[:, k:]
        if x.shape[1]:
            codec.state = st.state
            if codec.observing:
                codec.observe(x.unsqueeze(0), None)
                st.state = codec.state
            st.ring = x.clone() if st.ring is None else torch.cat([st.ring, x], dim=1)
        return fmt.packed(st.held) - st.packed

    def _pack(self, fmt: _StreamFormat, jobs: list, layer_idx: int, cols: slice) -> None:
        """Encode the tokens leaving the requests' windows into their slots: `jobs` of `(request, state, n)`, one
        encode for the requests that pack as many tokens with states of one layout (a decode step: all of them)."""
        groups: dict[tuple, list] = {}
        for job in jobs:
            groups.setdefault((job[2], _state_key(job[1].state)), []).append(job)
        codec = fmt.codec
        for (n, _), group in groups.items():
            codec.state = _stacked([st.state for _, st, _ in group])
            fields = codec.encode(torch.stack([st.ring[:, :n] for _, st, _ in group]), None)
            rows = torch.cat([self._slots(rid)[st.packed : st.packed + n] for rid, st, _ in group])
            self.cache_tensor[:, cols].index_copy_(0, rows + self._layer_offset[layer_idx], fmt.to_bytes(fields))
            for r, (_, st, _) in enumerate(group):
                st.ring, st.packed = st.ring[:, n:], st.packed + n
                st.state = {k: v[r : r + 1] for k, v in codec.state.items()}

    def _packed_dense(self, fmt: _StreamFormat, readers: list, layer_idx: int, cols: slice,
                      dtype: torch.dtype) -> dict:
        """Each request's packed tokens dequantized, `{request: (H, packed, D)}`: one gather and one decode for
        requests whose states share a layout and whose lengths are close (rows padded to the group's longest with the
        read trash row, zeros, at most a quarter of those read)."""
        layouts: dict[tuple, list] = {}
        for job in sorted(readers, key=lambda job: -job[1].packed):
            if job[1].packed:
                layouts.setdefault(_state_key(job[1].state), []).append(job)
        groups = []  # longest first, cut where padding would pass a quarter of the rows read
        for jobs in layouts.values():
            group, held = [], 0
            for job in jobs:
                if group and (len(group) + 1) * group[0][1].packed > 1.25 * (held + job[1].packed):
                    groups.append(group)
                    group, held = [], 0
                group.append(job)
                held += job[1].packed
            groups.append(group)
        out = {}
        for group in groups:
            offset = self._layer_offset[layer_idx]
            rows = torch.nn.utils.rnn.pad_sequence([self._slots(rid)[: st.packed] for rid, st in group],
                                                   batch_first=True, padding_value=self.read_trash_index - offset)
            slots = self.cache_tensor[:, cols].index_select(0, rows.reshape(-1) + offset)
            fmt.codec.state = _stacked([st.state for _, st in group])
            dense = fmt.codec.decode(fmt.from_bytes(slots, len(group)), dtype)  # (R, H, longest, D)
            for r, (rid, st) in enumerate(group):
                out[rid] = dense[r, :, : st.packed]
        return out

    # --- the forward's update
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, read_index: torch.Tensor,
               write_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store each request's new tokens `(q, H, D)` in its pages and return, request after request in batch order,
        its history as stored followed by its new tokens exact: `(sum of past + q, H, D)`. Encoding and decoding run
        once for the batch's requests of one layout (per-request work is bookkeeping and the windows' appends)."""
        self._plan_used = True  # the next batch's first request starts a new plan, whatever happens here
        plan = self._plan
        if sum(q for _, _, q in plan) != key_states.shape[0]:
            raise RuntimeError(f"packed pages: the batch has {key_states.shape[0]} new tokens, its requests "
                               f"{sum(q for _, _, q in plan)} (padded batches, CUDA graphs or async batching "
                               "are not supported with packed pages)")
        fmts, rotation = self.formats[layer_idx], self.policies[layer_idx].key_rotation
        cols = {"keys": slice(0, fmts["keys"].slot_bytes),
                "values": slice(self.key_bytes, self.key_bytes + fmts["values"].slot_bytes)}
        streams = [self._streams(rid, layer_idx, past) for rid, past, _ in plan]
        new = {"keys": key_states.transpose(0, 1), "values": value_states.transpose(0, 1)}  # (H, sum q, D)
        out = {}
        with kernels.use_backend("torch"):
            for name in ("keys", "values"):
                fmt, x = fmts[name], new[name]
                if name == "keys" and rotation is not None:  # stored rotated; the attention gets them back
                    x = rotation.apply(x.unsqueeze(0))[0]
                jobs, start = [], 0
                for (rid, _, q), st in zip(plan, streams):
                    n = self._append(fmt, st[name], x[:, start : start + q])
                    start += q
                    if n > 0:
                        jobs.append((rid, st[name], n))
                self._pack(fmt, jobs, layer_idx, cols[name])
                readers = [(rid, st[name]) for (rid, past, _), st in zip(plan, streams) if past]
                if not readers:  # first prefills only: each attends to its own tokens, exact
                    out[name] = new[name]
                    continue
                packed = self._packed_dense(fmt, readers, layer_idx, cols[name], key_states.dtype)
                pieces = []
                for (rid, past, _), st in zip(plan, streams):
                    if past:
                        pieces += _first(past, [st[name].sink, packed.get(rid), st[name].ring])
                history = torch.cat(pieces, dim=1)  # (H, sum past, D), stored frame
                if name == "keys" and rotation is not None:
                    history = rotation.apply(history.unsqueeze(0), inverse=True)[0]
                out[name] = torch.cat([history, new[name]], dim=1).index_select(1, self._order(plan, x.device))
        return out["keys"].transpose(0, 1), out["values"].transpose(0, 1)

    def _order(self, plan: list, device: torch.device) -> torch.Tensor:
        """Where each request's history and new tokens sit in `cat([histories], [new tokens])`: the permutation to
        `[history 0, new 0, history 1, new 1, ...]`, computed once a batch."""
        if self._order_of is not None and self._order_of[0] is plan:
            return self._order_of[1]
        total_past = sum(past for _, past, _ in plan)
        order, h, q0 = [], 0, total_past
        for _, past, q in plan:
            order += list(range(h, h + past)) + list(range(q0, q0 + q))
            h, q0 = h + past, q0 + q
        self._order_of = (plan, torch.tensor(order, dtype=torch.long, device=device))
        return self._order_of[1]

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("packed pages are read by index (max_blocks_per_request=0)")
