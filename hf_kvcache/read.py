"""How a `QuantizedKVLayer` (`hf_kvcache.layer`) is read, one of its base classes: the dense path (its tokens
dequantized to the model dtype, what `update()` returns to the model's own attention, and the reference the fused read
is held against) and what the fused read takes (`kernel_views`, `static_layout`, the query in the stored keys' frame).
These methods read the layer's storage (`_streams`), length, capacity and policy; they change nothing but store a
decode step's pending token first (`write_pending`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from .kernels.layout import StaticLayout


class LayerReads:
    """The reads of a `QuantizedKVLayer`'s tokens (see the module's docstring)."""

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
