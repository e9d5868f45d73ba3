"""Packed pages for transformers' continuous batching (`model.generate_batch`, `init_continuous_batching`).

transformers' paged cache (`PagedAttentionCache`) keeps one flat byte buffer cut into pages by an allocator per
attention kind, sizes it by the allocators' bytes per page, and for sdpa/eager writes each step's new tokens and reads
every request's history back by index. `PackedBatchingConfig` (a `ContinuousBatchingConfig` that names a cache spec)
swaps the allocator of the full-attention layers for `PackedPageAllocator`, whose pages hold a preset's packed bytes:

- a page is `page_size` token slots of one layer; a slot is one row of `[key bytes | value bytes]`, each the share of
  one token of the codec's fields (a codec of G-token blocks, KIVI's keys, spreads one block's fields over the G slots
  of its tokens). Sizing counts these bytes, so the same memory fraction holds proportionally more tokens;
- what a method keeps exact or per sequence lives in the request's lane (`paged_places._Lanes`, a row of device
  tensors per layer and stream, given back by `free_blocks`): sink tokens, the residual window, a codec's
  per-sequence state (FP8's scale, TurboQuant's channel split). The places follow `StreamStorage`'s split, so a
  request reads what `generate` with the same preset reads: its history as stored, its new tokens exact;
- the packed token `i` past the sinks lives in slot `i` of the request's pages (never past its own position, so the
  slot is always allocated);
- forking copies pages as bytes and the lane with them; prefix sharing stays on for a format whose pages are all it
  stores (no sinks, window or per-sequence state: `int*`, `exact`), and transformers turns it off for the others
  (their shared pages alone would not be a request's history).

A step stores the batch's new tokens with one encode a layer and stream (the tokens leaving windows and the blocks
completed, planned once a batch on the host: `paged_places._Batch`), and `update` returns a handle
(`SelfReadingPages`) instead of a dense history: the model's attention, routed to it (`hf_kvcache.attention`), asks the
allocator for the output. Requests that decode one token are read in one launch of the fused kernels where they run
(CUDA): each request's packed slots gathered from its pages, its sinks and window from its lane, a length per row
(`StaticLayout` with a length per batch row). Prefill chunks, and every request on the CPU, are read by the reference:
the history dequantized, then SDPA. CB's CUDA graphs, async batching, block-table decode and CPU offloading are turned
off (`PackedBatchingConfig`), and sliding-window layers keep transformers' own pages. Everything that depends on
transformers' version is in `_compat`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _compat, kernels
from .attention import SelfReading
from .cache import QuantizedKVCache
from .kernels.layout import StreamTensors
from .presets import PRESETS, make_cache, parse_spec
from .paged_places import _Batch, _Lanes, _Rows, _StreamFormat

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


class SelfReadingPages(SelfReading):
    """What a packed allocator's `update` gives transformers' paged cache for keys and values: the batch's new tokens
    are stored; the model's attention (routed here by `hf_kvcache.attention`) asks it for the output, which the
    allocator reads from the pages (`PackedPageAllocator.attend`). transformers' paged cache reshapes what `update`
    returns for the attention (`transpose`, `unsqueeze`): those calls give the handle itself."""

    def __init__(self, allocator: "PackedPageAllocator", layer_idx: int, batch: _Batch, keys: torch.Tensor,
                 values: torch.Tensor):
        self.allocator, self.layer_idx, self.batch = allocator, layer_idx, batch
        self.keys, self.values = keys, values  # (N, H, D) new tokens, keys in the stored frame

    def transpose(self, *args):
        return self

    def unsqueeze(self, *args):
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    def attend(self, module, query: torch.Tensor, attention_mask, scaling: float | None = None,
               softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return self.allocator.attend(self, query, scaling, softcap, s_aux), None


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
        self._lanes = {idx: {name: _Lanes(f) for name, f in fs.items()} for idx, fs in self.formats.items()}
        self._lane_of: dict[str, int] = {}  # request -> its lane
        self._free_lanes: list[int] = []
        self._lane_count = 0  # lanes allocated (rows of every `_Lanes` and of `_pages`)
        self._pages: torch.Tensor | None = None  # (lanes, pages) each request's pages on the device, `_slot_rows`
        self._tables: dict[str, tuple] = {}  # request -> the pages `_pages` holds for it
        self._held: dict[str, int] = {}  # request -> tokens held after its last batch
        self._plan: list[tuple[str, int, int]] = []  # this batch's (request, past, new tokens), in batch order
        self._plan_used = False
        self._batch: _Batch | None = None
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
        lane = self._lane_of.pop(request_id, None)
        if lane is not None:
            self._free_lanes.append(lane)
            for streams in self._lanes.values():
                for lanes in streams.values():
                    lanes.seen.discard(lane)
        self._tables.pop(request_id, None)
        self._held.pop(request_id, None)

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int):
        out = super().fork_blocks(source_request_id, dest_request_id, past_length)
        src = self._lane_of.get(source_request_id)
        if src is not None:
            dst = self._new_lane(dest_request_id)
            for streams in self._lanes.values():
                for lanes in streams.values():
                    lanes.copy_lane(src, dst)
            self._held[dest_request_id] = self._held[source_request_id]
        return out

    def held_requests(self) -> list[str]:
        """Requests with per-request state held (a finished or cancelled one is gone)."""
        return list(self._lane_of)

    def _new_lane(self, request_id: str) -> int:
        if not self._free_lanes:
            count = max(16, 2 * self._lane_count)
            device = self.cache_tensor.device
            for streams in self._lanes.values():
                for lanes in streams.values():
                    lanes.grow(count, self.num_key_value_heads, self.head_dim, self.cache_dtype, device)
            self._grow_pages(count, 1 if self._pages is None else self._pages.shape[1])
            self._free_lanes = list(range(count - 1, self._lane_count - 1, -1))
            self._lane_count = count
        lane = self._lane_of[request_id] = self._free_lanes.pop()
        return lane

    def _grow_pages(self, lanes: int, pages: int) -> None:
        # past a request's pages, entry 0: block 0 lies in the read trash sector (never written), and no write goes there
        table = torch.zeros((lanes, pages), dtype=torch.long, device=self.cache_tensor.device)
        if self._pages is not None:
            table[: self._pages.shape[0], : self._pages.shape[1]] = self._pages
        self._pages = table

    def _sync_pages(self, request_id: str, lane: int) -> None:
        """A request's pages on the device, copied again only when they changed (a new page, or transformers swapping a
        page for an identical shared one), so a step copies no index to the device."""
        table = tuple(self.block_table.get(request_id, ()))
        if self._tables.get(request_id) == table:
            return
        if len(table) > self._pages.shape[1]:
            self._grow_pages(self._pages.shape[0], max(len(table), 2 * self._pages.shape[1]))
        self._pages[lane, : len(table)] = torch.tensor(table, dtype=torch.long).to(self._pages.device)
        self._tables[request_id] = table

    def _slot_rows(self, lanes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The slot rows (in the first layer; a layer adds its offset) of packed tokens `index` of the requests in
        `lanes`, broadcast together: token i of a request is slot `i % page_size` of its page `i // page_size`."""
        p = self.tokens_per_page
        pages = self._pages[lanes, (index // p).clamp(max=self._pages.shape[1] - 1)]
        return pages * self.block_physical_stride + index % p

    def _prepare(self, plan: list, device: torch.device) -> _Batch:
        """The batch's lanes (a new request gets one, a request started again from scratch forgets its state), checked
        against what each request holds, and its slot rows in step: once a forward, for every layer."""
        lanes = []
        for rid, past, q in plan:
            lane = self._lane_of.get(rid)
            if lane is None or past == 0:
                if lane is None:
                    lane = self._new_lane(rid)
                for streams in self._lanes.values():
                    for stream in streams.values():
                        stream.seen.discard(lane)
                if past and not self.use_block_sharing:  # a prefix matched in shared pages: stateless formats only
                    raise RuntimeError(f"packed pages: request {rid!r} starts at token {past} with no state")
            elif self._held.get(rid) != past:
                raise RuntimeError(f"packed pages: request {rid!r} holds {self._held.get(rid)} tokens, the batch "
                                   f"says {past}")
            self._held[rid] = past + q
            self._sync_pages(rid, lane)
            lanes.append(lane)
        return _Batch(plan, lanes, device)

    # --- the forward's update: store the new tokens
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, read_index: torch.Tensor,
               write_index: torch.Tensor):
        """Store each request's new tokens `(q, H, D)` (in batch order) in its pages and lanes; returns the handle the
        attention reads the batch through (`SelfReadingPages`), for keys and values alike. Encoding runs once a
        layer and stream for the whole batch (every token that leaves a window, every block completed)."""
        plan = self._plan
        if not self._plan_used or self._batch is None or self._batch.plan is not plan:
            if sum(q for _, _, q in plan) != key_states.shape[0]:
                raise RuntimeError(f"packed pages: the batch has {key_states.shape[0]} new tokens, its requests "
                                   f"{sum(q for _, _, q in plan)} (padded batches, CUDA graphs or async batching "
                                   "are not supported with packed pages)")
            self._plan_used = True  # the next batch's first request starts a new plan, whatever happens here
            self._batch = self._prepare(plan, key_states.device)
        batch = self._batch
        rotation = self.policies[layer_idx].key_rotation
        if rotation is not None:  # stored rotated; the attention reads them so (the query rotated too)
            key_states = rotation.apply(key_states.transpose(0, 1).unsqueeze(0))[0].transpose(0, 1)
        for name, x in (("keys", key_states), ("values", value_states)):
            self._store(self._lanes[layer_idx][name], batch, x, layer_idx, name)
        handle = SelfReadingPages(self, layer_idx, batch, key_states, value_states)
        return handle, handle

    def _cols(self, layer_idx: int, name: str) -> slice:
        fmts = self.formats[layer_idx]
        if name == "keys":
            return slice(0, fmts["keys"].slot_bytes)
        return slice(self.key_bytes, self.key_bytes + fmts["values"].slot_bytes)

    def _store(self, lanes: _Lanes, batch: _Batch, x: torch.Tensor, layer_idx: int, name: str) -> None:
        fmt, codec = lanes.fmt, lanes.fmt.codec
        w = batch.writes(fmt.rules)
        if w.sink is not None:
            tok, lane, pos = w.sink
            lanes.sink.index_put_((lane, pos), x.index_select(0, tok))
        for lane, lo, hi in w.observe:  # a request's first write past its sinks sets its codec state
            if lane not in lanes.seen:
                codec.state = {}
                if codec.observing:
                    codec.observe(x[lo:hi].transpose(0, 1).unsqueeze(0), None)
                lanes.save_state(lane, codec.state, self._lane_count)
        if w.pack is not None:
            lane, index, from_x, tok, ring_row = w.pack
            # tokens held before this write come from the ring, read before it is written (a decode step: all of them)
            src = x.index_select(0, tok) if w.pack_from != "ring" else None
            if w.pack_from != "x":
                held = lanes.ring.view(-1, *lanes.ring.shape[2:]).index_select(0, ring_row)
                src = held if src is None else torch.where(from_x[:, None, None], src, held)
            g = codec.block_size
            tokens = src.view(-1, g, *src.shape[1:]).transpose(1, 2)  # (blocks, H, G, D)
            codec.state = lanes.states(w.pack_lanes)
            raw = fmt.to_bytes(codec.encode(tokens, None))  # (tokens, slot bytes)
            if w.slot_rows is None:  # the same for every layer
                w.slot_rows = self._slot_rows(lane, index)
            rows = w.slot_rows + self._layer_offset[layer_idx]
            self.cache_tensor[:, self._cols(layer_idx, name)].index_copy_(0, rows, raw)
        if w.ring is not None:
            tok, flat = w.ring
            lanes.ring.view(-1, *lanes.ring.shape[2:]).index_copy_(0, flat, x.index_select(0, tok))

    # --- the attention: read the pages
    def attend(self, handle: SelfReadingPages, query: torch.Tensor, scaling: float, softcap: float | None,
               s_aux: torch.Tensor | None) -> torch.Tensor:
        """The attention of the batch's queries `(1, Hq, N, D)` over each request's history as stored and its new
        tokens exact -> `(1, N, Hq, D)`. Where the kernels run (CUDA): the requests that decode a token in one fused
        launch, each chunk of prompt over a history in its own; the reference for the rest (a first chunk, which
        attends to itself alone; every request on the CPU, and any layout no kernel reads)."""
        batch = handle.batch
        out = torch.empty((1, query.shape[2], query.shape[1], query.shape[3]), dtype=query.dtype, device=query.device)
        fused = set()
        kernel = kernels.use_kernels(query.device)
        for group in batch.groups():
            if kernel:
                fused.update(self._attend_fused(handle, group, query, scaling, softcap, s_aux, out))
            elif group.q == 1:  # the CPU: the decoding requests by the reference, together
                fused.update(self._attend_gathered(handle, group, query, scaling, softcap, s_aux, out))
        for b, (_, past, q) in enumerate(batch.plan):
            if b not in fused:
                start = batch.starts[b]
                out[0, start : start + q] = self._attend_reference(handle, b, query[0, :, start : start + q],
                                                                   scaling, softcap, s_aux)
        return out

    def _attend_fused(self, handle: SelfReadingPages, group: _Rows, query: torch.Tensor, scaling: float, softcap,
                      s_aux, out: torch.Tensor) -> list[int]:
        """The requests of `group` in one launch of the fused kernels (a length per row, `StaticLayout`), reading each
        request's packed slots gathered from its pages, its sinks and window from its lane, its new tokens exact; the
        rows done (none where no kernel reads this layout)."""
        from .kernels import ops
        from .kernels.layout import StaticLayout

        layer_idx = handle.layer_idx
        lanes = self._lanes[layer_idx]
        b, q = len(group.rows), group.q
        hq, d = query.shape[1], query.shape[3]
        tokens = group.tokens
        queries = query[0].index_select(1, tokens).view(hq, b, q, d).transpose(0, 1)  # (B, Hq, q, D)
        rotation = self.policies[layer_idx].key_rotation
        if rotation is not None:
            queries = rotation.apply(queries)
        views = {name: self._kernel_view(lanes[name], handle.batch, group, layer_idx, name)
                 for name in ("keys", "values")}
        if ops.supports(views["keys"], views["values"], queries, static=True) is not None:
            return []
        k_rules, v_rules = lanes["keys"].fmt.rules, lanes["values"].fmt.rules
        layout = StaticLayout(length=group.held, capacity=group.held_most, sink_tokens=k_rules.sink_tokens,
                              key_ring=k_rules.ring_length, value_ring=v_rules.ring_length,
                              key_window=k_rules.window, value_window=v_rules.window)
        new = [x.index_select(0, tokens).view(b, q, *x.shape[1:]).transpose(1, 2) for x in (handle.keys, handle.values)]
        o = ops.static_decode_attention(queries, views["keys"], views["values"], *new, layout, exact_new=True,
                                        attention_mask=None, scaling=scaling, softcap=softcap, s_aux=s_aux)
        out[0].index_copy_(0, tokens, o.reshape(b * q, hq, d))
        return group.rows

    def _kernel_view(self, lanes: _Lanes, batch: _Batch, group: _Rows, layer_idx: int, name: str) -> StreamTensors:
        """One stream of `group`'s requests as the kernels read it: the packed slots of each gathered from its pages
        into `(B, H, T, ...)` fields (T the most any of them has packed, rounded up), sinks and ring from the lanes,
        the codec's format for their stacked states."""
        fmt, codec = lanes.fmt, lanes.fmt.codec
        reads = batch.writes(fmt.rules).reads
        align = math.lcm(16, codec.block_size)
        t = max(-(-max(reads[b][1] for b in group.rows) // align) * align, align)
        rows = group.slot_rows(t, self._slot_rows) + self._layer_offset[layer_idx]
        raw = self.cache_tensor[:, self._cols(layer_idx, name)].index_select(0, rows.reshape(-1))
        fields = fmt.from_bytes(raw, len(group.rows))  # row-major, as KIVI's key layout check wants them
        codec.state = lanes.states(group.lanes)
        lane_rows = (lambda x: None if x is None else x.index_select(0, group.lanes).transpose(1, 2))
        return StreamTensors(sink=lane_rows(lanes.sink), fields=fields, fmt=codec.packed_format(), n_packed=t,
                             residual=lane_rows(lanes.ring))

    def _attend_gathered(self, handle: SelfReadingPages, group: _Rows, query: torch.Tensor, scaling: float, softcap,
                         s_aux, out: torch.Tensor) -> list[int]:
        """The reference of `_attend_fused` for requests that decode a token: the places the kernels read, gathered as
        they gather them, dequantized and put in token order (keys and values of one token at one position, whatever
        their places), the new token exact, then the attention over each request's own tokens."""
        batch, layer_idx = handle.batch, handle.layer_idx
        lanes = self._lanes[layer_idx]
        tokens = group.tokens
        past = [batch.plan[b][1] for b in group.rows]
        span = max(past) + 1  # positions 0..past of every row, and a last one that takes what no row reads
        kv = []
        for name, new in (("keys", handle.keys), ("values", handle.values)):
            view = self._kernel_view(lanes[name], batch, group, layer_idx, name)
            parts = [view.sink, lanes[name].fmt.codec.decode(view.fields, self.cache_dtype), view.residual]
            where = _positions(lanes[name].fmt.rules, [batch.writes(lanes[name].fmt.rules).reads[b] for b in group.rows],
                               past, [0 if p is None else p.shape[2] for p in parts], span)
            x = torch.cat([p for p in parts if p is not None], dim=2)  # (B, H, places, D)
            dense = x.new_zeros((x.shape[0], x.shape[1], span + 1, x.shape[3]))
            dense.scatter_(2, where.to(x.device)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]), x)
            dense[torch.arange(len(past)), :, torch.tensor(past)] = new.index_select(0, tokens)
            kv.append(dense)
        k, v = kv
        rotation = self.policies[layer_idx].key_rotation
        if rotation is not None:
            k = rotation.apply(k, inverse=True)
        allowed = torch.arange(span + 1)[None, :] <= torch.tensor(past)[:, None]
        queries = query[0].index_select(1, tokens).transpose(0, 1).unsqueeze(2)  # (B, Hq, 1, D)
        o = _attention(queries, k, v, allowed.unsqueeze(1).to(k.device), scaling, softcap, s_aux)
        out[0].index_copy_(0, tokens, o[:, :, 0])
        return group.rows

    def _history(self, lanes: _Lanes, batch: _Batch, b: int, layer_idx: int, name: str) -> torch.Tensor:
        """Request b's tokens held before this write as stored, dequantized: `(H, past, D)`."""
        fmt, codec = lanes.fmt, lanes.fmt.codec
        past = batch.plan[b][1]
        lane = batch.lanes[b]
        n_sink, packed, n_res, _ = batch.writes(fmt.rules).reads[b]
        parts = []
        if n_sink:
            parts.append(lanes.sink[lane, :n_sink])
        if packed and past > n_sink:
            lane_t = torch.tensor([lane], device=self._pages.device)
            rows = self._slot_rows(lane_t, torch.arange(packed, device=lane_t.device)) + self._layer_offset[layer_idx]
            raw = self.cache_tensor[:, self._cols(layer_idx, name)].index_select(0, rows)
            codec.state = lanes.states(lane_t)
            parts.append(codec.decode(fmt.from_bytes(raw, 1), self.cache_dtype)[0].transpose(0, 1))
        if n_res and past > n_sink + packed:
            r = fmt.rules.ring_length
            ring_rows = torch.arange(packed, packed + n_res, device=lanes.ring.device) % r
            parts.append(lanes.ring[lane].index_select(0, ring_rows))
        return torch.cat(parts)[:past].transpose(0, 1)

    def _attend_reference(self, handle: SelfReadingPages, b: int, query: torch.Tensor, scaling: float, softcap,
                          s_aux) -> torch.Tensor:
        """Request b's queries `(Hq, q, D)` over its history dequantized and its new tokens exact -> `(q, Hq, D)`."""
        batch, layer_idx = handle.batch, handle.layer_idx
        past, q = batch.plan[b][1], batch.plan[b][2]
        start = batch.starts[b]
        kv = []
        for name, new in (("keys", handle.keys), ("values", handle.values)):
            mine = new[start : start + q].transpose(0, 1)  # (H, q, D)
            if past:
                mine = torch.cat([self._history(self._lanes[layer_idx][name], batch, b, layer_idx, name), mine], 1)
            kv.append(mine)
        k, v = kv
        rotation = self.policies[layer_idx].key_rotation
        if rotation is not None:
            k = rotation.apply(k.unsqueeze(0), inverse=True)[0]
        allowed = torch.arange(past + q, device=k.device)[None, :] <= past + torch.arange(q, device=k.device)[:, None]
        return _attention(query.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), allowed.unsqueeze(0), scaling, softcap,
                          s_aux)[0].transpose(0, 1)

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("packed pages are read by index (max_blocks_per_request=0)")


# A prompt's first chunk attends to itself through these. Not cuDNN's: it plans a graph for every new length, and each
# request's prompt has its own (4.5 ms of host time a call on an H100, 2026-12-07, scripts/profile_serving.py).
_CAUSAL_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scaling: float, softcap,
               s_aux) -> torch.Tensor:
    """`query (B, Hq, q, D)` over `k, v (B, H, S, D)` where `allowed (B or 1, q, S)` -> `(B, Hq, q, D)`: SDPA, or the
    plain softmax in fp32 where the model caps its logits or adds attention sinks (`s_aux`)."""
    b, hq, q, _ = query.shape
    group = hq // k.shape[1]
    if softcap is None and s_aux is None:
        if q == k.shape[2]:  # a first chunk over itself: plain causal, no mask (a flash kernel)
            with sdpa_kernel(_CAUSAL_BACKENDS):
                return F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling, enable_gqa=group > 1)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=allowed.unsqueeze(1), scale=scaling,
                                              enable_gqa=group > 1)
    allowed = allowed.unsqueeze(1)
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()
    scores = torch.einsum("bhqd,bhkd->bhqk", query.float(), k) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if s_aux is not None:  # one extra logit a head, attended by nothing
        scores = torch.cat([scores, s_aux.float().reshape(1, hq, 1, 1).expand(b, hq, q, 1)], dim=-1)
    p = scores.softmax(-1)[..., : k.shape[2]]
    return torch.einsum("bhqk,bhkd->bhqd", p, v).to(query.dtype)


def _positions(rules, reads: list[tuple], past: list[int], widths: list[int], span: int) -> torch.Tensor:
    """`(B, sinks + packed + ring places)`: the position in its request of the token each gathered place holds (as
    `_kernel_view` gathers them), `span` for a place that holds none of its history (unused, or this step's token)."""
    s, t, r = widths
    out = torch.full((len(past), s + t + r), span, dtype=torch.long)
    for row, ((n_sink, packed, n_res, off), held_before) in enumerate(zip(reads, past)):
        n_sink = min(n_sink, held_before)
        out[row, :n_sink] = torch.arange(n_sink)
        n_packed = max(min(packed, held_before - n_sink), 0)
        out[row, s : s + n_packed] = n_sink + torch.arange(n_packed)
        n_ring = max(min(n_res, held_before - n_sink - packed), 0)
        if n_ring:
            k = torch.arange(n_ring)  # residual token k sits in ring row (off + k) % R
            out[row, s + t + (off + k) % rules.ring_length] = n_sink + packed + k
    return out
