"""CUDA graphs of eager decode steps (docs/design.md, "Capacity: growing or pinned").

A cache layer's decode step on CUDA (pack the new token, advance the length, attend, combine) reads every length from
the device, so its launches do not change from step to step: the layer runs it eagerly once, captures it in a CUDA
graph, and from then on replays the graph, one launch instead of five to eight with their Python (measured on an
H200: 32-63 us of host time a layer step instead of 590-2000 us, BENCHMARKS.md 2026-12-02). `GraphPools` holds the
memory pool the graphs of one cache share on each device: a layer's graph keeps only its output between replays,
and layers run one after another, so their temporaries can share memory. A captured step launches no cuBLAS: cuBLAS
would leave its workspace (32 MiB on Hopper) allocated in that pool, beyond the cache's bytes (`kernels.ops.rows_times`
does the steps' small products instead; `tests/test_cuda_graphs.py` checks what the pools keep). `DecodeGraph` is
the layer's side, an object each layer keeps as `layer.graph`: whether a step can replay, its capture and its replays.
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from dataclasses import dataclass

import torch

from . import kernels


def enabled() -> bool:
    """Whether eager decode steps replay CUDA graphs (`HF_KVCACHE_CUDA_GRAPHS=0` turns them off)."""
    return os.environ.get("HF_KVCACHE_CUDA_GRAPHS", "1") != "0"


class _Pool:
    """One device's pool: a `graph_pool_handle` while a graph of it lives (PyTorch frees a pool with its last graph,
    and a handle must not be reused after that), and the side stream captures run on."""

    def __init__(self, device: torch.device):
        self.device = device
        self.handle = None
        self.live = 0
        self.stream: torch.cuda.Stream | None = None

    def released(self) -> None:
        self.live -= 1
        if self.live == 0:
            self.handle = None


class GraphPools:
    """The CUDA graph memory pools of one cache, one per device."""

    def __init__(self):
        self._pools: dict[torch.device, _Pool] = {}

    def capture(self, device: torch.device, fn):
        """Capture `fn()` (device work only: it must not read a value back to the host nor change host state) into a
        new CUDA graph on `device` -> `(graph, what fn returned)`. Nothing runs: replaying the graph does the work."""
        pool = self._pools.get(device)
        if pool is None:
            pool = self._pools[device] = _Pool(device)
        if pool.handle is None:
            pool.handle = torch.cuda.graph_pool_handle()
        if pool.stream is None:
            pool.stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        pool.stream.wait_stream(current)
        try:
            with torch.cuda.device(device), torch.cuda.stream(pool.stream):
                # thread_local: a CUDA call of another thread (a data loader, a tokenizer) does not break the capture
                graph.capture_begin(pool=pool.handle, capture_error_mode="thread_local")
                try:
                    out = fn()
                finally:
                    graph.capture_end()
        except BaseException:
            if pool.live == 0:  # the failed graph may have been the pool's only user: never reuse its handle
                pool.handle = None
            raise
        finally:
            current.wait_stream(pool.stream)
        pool.live += 1
        weakref.finalize(graph, pool.released)
        return graph, out


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


class DecodeGraph:
    """The CUDA-graphed decode step of one `QuantizedKVLayer` (`hf_kvcache.layer`), which keeps it as `layer.graph`.

    It owns the step's state: the buffers `inputs`, the graphs `captured` (by the step's shape), whether the layer's
    storage version can replay (`_replayable`), and the token `update` left for the graph (`hold`, `pending`). It sees
    the layer through a narrow surface: whether the layer allows graphs (`cuda_graphs`, `fused`, `offloaded`), its
    storage `version`, its read (`layer.reads.decode_read`, `rotate_query`), the codecs still observing a statistic
    (`layer.observing`), `store_token` (one token written at the length, which it advances: device work only),
    `capacity`, `device`, `policy` and `quantize_before_attention`.

    `update` of one token asks `takes`; when it can, the token waits (`hold`) and the attention calls `replay`, which
    stores it, advances the length and attends in one graph replay; any other read stores it first
    (`store_pending`)."""

    def __init__(self, layer, pools: GraphPools):
        self._layer = weakref.ref(layer)  # the layer owns its graph: a cycle would keep a deleted cache's memory
        self.pools = pools
        self.forget()

    @property
    def layer(self):
        return self._layer()

    def __deepcopy__(self, memo):
        """The graph of the copied layer (a deep copy of a cache, such as `warm_up`'s): its pools copied with the
        cache's, nothing captured or held (a CUDA graph cannot be copied)."""
        layer = memo.get(id(self.layer)) or copy.deepcopy(self.layer, memo)
        return DecodeGraph(layer, copy.deepcopy(self.pools, memo))

    def forget(self) -> None:
        """No step held, no buffers, no graphs (a new sequence)."""
        self.pending = False
        self._step_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self.inputs: _StepInputs | None = None
        self.captured: dict[tuple, _Graph] = {}
        self._replayable: tuple[int, bool] | None = None

    def drop_pending(self) -> None:
        """Forget a held step without storing it (`reset` of a pinned layer)."""
        self.pending, self._step_kv = False, None

    def release_inputs(self) -> None:
        """New input buffers at the next step (the old ones were made under inference mode): the graphs read the old
        ones, so they go too."""
        self.inputs = None
        self.captured = {}

    def takes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether this decode step can run as a CUDA graph: CUDA, the fused path and its kernels, no per-sequence
        statistic still to observe, nothing offloaded, and not inside someone else's capture."""
        layer = self.layer
        if not (layer.cuda_graphs and layer.fused and key_states.is_cuda and not layer.offloaded and enabled()
                and kernels.use_kernels(key_states.device)) or torch.cuda.is_current_stream_capturing():
            return False
        if self._replayable is None or self._replayable[0] != layer.version:
            ok = not layer.observing() and layer.reads.decode_read(key_states) is not None
            self._replayable = (layer.version, ok)
        if not self._replayable[1]:
            return False
        if self.inputs is None or self.inputs.k.shape != key_states.shape or self.inputs.v.shape != value_states.shape:
            self.inputs = _StepInputs(key_states, value_states)
            self.captured = {}  # a captured step reads the old buffers
        return True

    def hold(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep this step's token for `replay` (after `takes`) -> the buffers it will be copied into, which the
        attention's handles name as the step's new keys and values."""
        self._step_kv = (key_states, value_states)
        self.pending = True
        return self.inputs.k, self.inputs.v

    def _take_step_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        kv, self._step_kv = self._step_kv, None
        return kv

    def store_pending(self) -> None:
        """Store the held token eagerly (its attention did not come, or cannot be replayed)."""
        if not self.pending:
            return
        self.pending = False
        k, v = self.inputs.k, self.inputs.v
        torch._foreach_copy_([k, v], self._take_step_kv())
        rotation = self.layer.policy.key_rotation
        if rotation is not None:
            k.copy_(rotation.apply(k))  # in place: the handle's exact new keys are in the stored frame
        self.layer.store_token(k, v, start=self.layer.held_tokens - 1)

    def replay(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
               softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor | None:
        """The held decode step: store its token, advance the length and attend, from this layer's CUDA graph for
        these inputs (the first time: eagerly, then captured) -> `(B, 1, Hq, D)`, a buffer the next replay
        overwrites. None when the step cannot be a graph (a float mask): then it is stored eagerly."""
        layer = self.layer
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            self.store_pending()
            return None
        self.pending = False
        new_kv = self._take_step_kv()
        key = (float(scaling), softcap, None if s_aux is None else s_aux.data_ptr(), tuple(query.shape), query.dtype,
               None if attention_mask is None else tuple(attention_mask.shape[:3]), layer.quantize_before_attention)
        entry = self.captured.get(key)
        if entry is not None and entry.version == layer.version:
            if layer.device.index != torch.cuda.current_device():
                with torch.cuda.device(layer.device):
                    self._replay(entry, query, new_kv, attention_mask)
            else:
                self._replay(entry, query, new_kv, attention_mask)
            return entry.out
        # This storage version's first step of this shape: run it eagerly (it compiles the kernels), then capture it
        # for the next ones, over buffers of its own.
        mask = None
        if attention_mask is not None:
            mask = torch.zeros((*attention_mask.shape[:3], layer.capacity), dtype=torch.bool, device=layer.device)
            mask[..., : attention_mask.shape[-1]].copy_(attention_mask)
        torch._foreach_copy_([self.inputs.k, self.inputs.v], new_kv)
        entry = _Graph(layer.version, query.contiguous().clone(), mask)
        out = self._graph_step(entry, scaling, softcap, s_aux)
        try:
            entry.graph, entry.out = self.pools.capture(
                layer.device, lambda: self._graph_step(entry, scaling, softcap, s_aux))
        except RuntimeError as error:
            warnings.warn(f"hf_kvcache: a decode step could not be captured in a CUDA graph "
                          f"({str(error).splitlines()[0]}); this layer runs its steps eagerly from now on",
                          RuntimeWarning, stacklevel=2)
            layer.cuda_graphs = False
            return out
        self.captured = {k: v for k, v in self.captured.items() if v.version == layer.version}
        self.captured[key] = entry
        return out

    def _replay(self, entry: _Graph, query: torch.Tensor, new_kv: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None) -> None:
        # the query and the new K/V into the graph's buffers in one launch, not three (each launch costs host time)
        torch._foreach_copy_([entry.q, self.inputs.k, self.inputs.v], [query, *new_kv])
        if attention_mask is not None:
            entry.mask[..., : attention_mask.shape[-1]].copy_(attention_mask)
        entry.graph.replay()

    def _graph_step(self, entry: _Graph, scaling: float, softcap: float | None,
                    s_aux: torch.Tensor | None) -> torch.Tensor:
        """One decode step from `inputs` and `entry`'s buffers, device work only (what a CUDA graph records): store the
        token at the length, advance it, attend with the kernels (every length read from the device)."""
        layer, inputs = self.layer, self.inputs
        k = inputs.k
        if layer.policy.key_rotation is not None:
            k = layer.policy.key_rotation.apply(k)
        layer.store_token(k, inputs.v)
        return layer.reads.kernel_read().attend(layer.reads.rotate_query(entry.q), k, inputs.v, entry.mask, scaling, softcap, s_aux)
