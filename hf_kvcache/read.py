"""How one layer's tokens are read: `LayerReads`, the object a `QuantizedKVLayer` (`hf_kvcache.layer`) keeps as
`layer.reads`. Two paths: the dense one (its tokens dequantized to the model dtype, what `update()` returns to the
model's own attention, and the reference the fused read is held against) and the fused one, a `DecodeRead`: the
packed places as the kernels read them, their layout, and the one call of the kernels' dispatcher.

A read sees the layer through a narrow surface: its two streams (`streams`, `hf_kvcache.storage`), the counts
(`length` on the device, `held_tokens` on the host, `capacity`), `dtype`, `policy` (the key rotation) and
`quantize_before_attention`; it changes nothing but asks the layer to store a decode step's pending token first
(`write_pending`).
"""

from __future__ import annotations

import copy
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .kernels.layout import StaticLayout, StreamTensors


@dataclass(frozen=True)
class DecodeRead:
    """One layer's fused read: its keys and values as the kernels read them, how its places split the tokens, and
    whether the new tokens are read exactly (not from their stored copies)."""

    keys: StreamTensors
    values: StreamTensors
    layout: StaticLayout
    exact_new: bool

    def attend(self, query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float, softcap: float | None = None,
               s_aux: torch.Tensor | None = None) -> torch.Tensor:
        """`(B, Tq, Hq, D)`: `query (B, Hq, Tq, D)` (in the stored keys' frame) over every token held, eagerly through
        the launchers, under torch.compile through the operator (`kernels.dispatch.static_decode_attention`)."""
        from .kernels import ops

        return ops.static_decode_attention(query, self.keys, self.values, k_new, v_new, self.layout,
                                           exact_new=self.exact_new, attention_mask=attention_mask, scaling=scaling,
                                           softcap=softcap, s_aux=s_aux)


class LayerReads:
    """The reads of one layer's tokens (see the module's docstring)."""

    def __init__(self, layer):
        self._layer = weakref.ref(layer)  # the layer owns its reads: a cycle would keep a deleted cache's memory
        # Triton 3.6 failed to compile TurboQuant-3's kernel for a 2048-token prefill chunk on the H200 (a pass of its
        # own pipeline, "PassManager::run failed", 2026-12-02, BENCHMARKS.md): such a chunk then attends by the
        # reference, and so does every later chunk of this layer (`attend_chunk`).
        self.chunk_kernel_failed = False

    @property
    def layer(self):
        return self._layer()

    def __deepcopy__(self, memo):
        """The reads of the copied layer (a deep copy of a cache, such as `warm_up`'s)."""
        layer = memo.get(id(self.layer)) or copy.deepcopy(self.layer, memo)
        copied = copy.copy(self)
        copied._layer = weakref.ref(layer)
        return copied

    # ------------------------------------------------------------------ the fused read
    def decode_read(self, query: torch.Tensor) -> DecodeRead | None:
        """The fused read of this layer for `query (B, Hq, Tq, D)` (a decode step's new key serves too: only its
        dtype and head_dim are read), or None when no kernel reads its formats (a codec without a kernel, or a
        layout the kernels do not take): the one place that decides whether a kernel serves a layer."""
        from .kernels import ops

        read = self.kernel_read()
        if read is None or ops.supports(read.keys, read.values, query, static=True) is not None:
            return None
        return read

    def kernel_read(self) -> DecodeRead | None:
        """The fused read as it stands, unchecked (None for a codec without a kernel): a captured decode step's,
        whose layer `decode_read` accepted when the step was held."""
        keys, values = self.kernel_views()
        if keys is None or values is None:
            return None
        return DecodeRead(keys, values, self.static_layout(), not self.layer.quantize_before_attention)

    def attend_chunk(self, read: DecodeRead, query: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float, softcap: float | None,
                     s_aux: torch.Tensor | None) -> torch.Tensor | None:
        """`read.attend` for a chunk of several query tokens, or None where the kernel failed to compile for such a
        chunk (`chunk_kernel_failed`): the caller attends by the reference. Nothing else is caught. Unmasked chunks of
        more than `prefill.PREFILL`'s rows read a workspace instead; what still comes here (a few rows, a padded
        chunk) has not run on a GPU since that failure, so the catch stays until a GPU run shows whether it is
        needed."""
        if self.chunk_kernel_failed:
            return None
        try:
            return read.attend(query, k_new, v_new, attention_mask, scaling, softcap, s_aux)
        except RuntimeError as error:
            if "PassManager::run failed" not in str(error):
                raise
            warnings.warn(f"hf_kvcache: the fused kernel for this layout failed to compile for {query.shape[2]} "
                          "query tokens; prefill chunks of this cache attend by the PyTorch reference",
                          RuntimeWarning, stacklevel=3)
            self.chunk_kernel_failed = True
            return None

    def kernel_views(self):
        """`(keys, values)` as the fused kernels read them (`StreamTensors`, None for a codec without a kernel)."""
        layer = self.layer
        return layer.key_stream.kernel_view(), layer.value_stream.kernel_view()

    def static_layout(self) -> StaticLayout:
        layer = self.layer
        k, v = layer.streams["keys"], layer.streams["values"]
        return StaticLayout(length=layer.length, capacity=layer.capacity, sink_tokens=k.sink_tokens,
                            key_ring=k.ring_length, value_ring=v.ring_length, key_window=k.window,
                            value_window=v.window)

    def rotate_query(self, query: torch.Tensor) -> torch.Tensor:
        """The query in the frame the stored keys are in (`LayerPolicy.key_rotation`): `(B, Hq, Tq, D)`."""
        rotation = self.layer.policy.key_rotation
        return query if rotation is None else rotation.apply(query)

    # ------------------------------------------------------------------ the dense read
    def held_dense(self, name: str, new: torch.Tensor) -> torch.Tensor:
        """`(B, Hkv, held, D)` of one stream dequantized, the new tokens exact unless `quantize_before_attention`, keys
        rotated back (RotatedCache): the dense read of a growing layer."""
        layer = self.layer
        x = layer.streams[name].dense(layer.dtype, layer.held_tokens)
        if not layer.quantize_before_attention:
            # Prefill and decode attend to the exact new tokens, to the stored past (as KIVI, KVQuant, vLLM).
            x[:, :, x.shape[2] - new.shape[2] :] = new
        if name == "keys" and layer.policy.key_rotation is not None:
            x = layer.policy.key_rotation.apply(x, inverse=True)
        return x

    def _stored_dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`(B, Hkv, capacity, D)` of one stream in the stored frame (keys rotated for RotatedCache), the new tokens at
        held indices `p` exact unless `quantize_before_attention`."""
        layer = self.layer
        x = layer.streams[name].capacity_dense(layer.dtype, layer.length)
        if not layer.quantize_before_attention:
            x.index_copy_(2, p.clamp(max=layer.capacity - 1), new)
        return x

    def capacity_dense(self, name: str, new: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """The dense read of a pinned layer: the whole capacity (the mask, sized for it, hides what is not held), keys
        rotated back."""
        x = self._stored_dense(name, new, p)
        if name == "keys" and self.layer.policy.key_rotation is not None:
            x = self.layer.policy.key_rotation.apply(x, inverse=True)
        return x

    def dense_kv(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values as `_stored_dense` gives them: the traced fused read's reference for a pinned layer."""
        p = self.layer.length - k_new.shape[2] + torch.arange(k_new.shape[2], device=k_new.device)
        return self._stored_dense("keys", k_new, p), self._stored_dense("values", v_new, p)

    def iter_kv_chunks(
        self, k_new: torch.Tensor, v_new: torch.Tensor, chunk_tokens: int = 256
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The held tokens as `(k (B, Hkv, c, D), v (B, Hkv, c, D))` chunks in order, the new ones exact unless
        `quantize_before_attention`: the fused read path's reference, used by the CPU attention."""
        layer = self.layer
        layer.write_pending()
        held = layer.held_tokens
        n_new = k_new.shape[2]
        stop = held if layer.quantize_before_attention else held - n_new
        ks = layer.streams["keys"].iter_chunks(layer.dtype, chunk_tokens, stop, held)
        vs = layer.streams["values"].iter_chunks(layer.dtype, chunk_tokens, stop, held)
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
        if not layer.quantize_before_attention:
            for i in range(0, n_new, chunk_tokens):  # a long chunk of new tokens, in pieces too
                yield k_new[:, :, i : i + chunk_tokens], v_new[:, :, i : i + chunk_tokens]
