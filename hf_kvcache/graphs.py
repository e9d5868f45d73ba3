"""CUDA graphs of eager decode steps (DESIGN.md, "The layer and its storage").

A cache layer's decode step on CUDA (pack the new token, advance the length, attend, combine) reads every length from
the device, so its launches do not change from step to step: the layer runs it eagerly once, captures it in a CUDA
graph, and from then on replays the graph, one launch instead of five to eight with their Python (measured on an
H200: 32-63 us of host time a layer step instead of 590-2000 us, BENCHMARKS.md 2026-12-02). `GraphPools` holds the
memory pool the graphs of one cache share on each device: a layer's graph keeps only its output between replays,
and layers run one after another, so their temporaries can share memory.
"""

from __future__ import annotations

import os
import weakref

import torch


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
