"""A lossless codec and cache: the core's bookkeeping (places, flushes, windows, batch ops, crop) tested on its
own. Any difference from transformers' DynamicCache with this cache is a bookkeeping bug, not quantization."""

from __future__ import annotations

import torch

from hf_kvcache.cache import Codec, LayerPolicy, QuantizedKVCache


class LosslessCodec(Codec):
    """Stores blocks of `block_size` tokens verbatim: field `x (B, H, T / block_size, block_size * D)`."""

    def __init__(self, block_size: int = 1):
        super().__init__()
        self.block_size = block_size

    def encode(self, x, valid=None):
        b, h, t, d = x.shape
        return {"x": x.reshape(b, h, t // self.block_size, self.block_size * d).clone()}

    def decode(self, fields, dtype):
        x = fields["x"]
        b, h, n, bd = x.shape
        return x.reshape(b, h, n * self.block_size, bd // self.block_size).to(dtype)


class LosslessCache(QuantizedKVCache):
    def __init__(
        self, config, *, key_block=1, value_block=1, sink_tokens=0, key_residual=0, value_residual=0, key_flush="fifo"
    ):
        def policy(layer_idx):
            return LayerPolicy(
                LosslessCodec(key_block),
                LosslessCodec(value_block),
                sink_tokens=sink_tokens,
                key_residual_length=key_residual,
                value_residual_length=value_residual,
                key_flush=key_flush,
            )

        super().__init__(config, policy)


# Layouts that put tokens in every place: sinks, per-token and per-block packing, FIFO and block-flushed residuals.
LAYOUTS = {
    "packed": {},
    "sink+fifo": dict(sink_tokens=3, key_residual=5, value_residual=5),
    "kivi-like": dict(key_block=4, value_block=1, key_residual=8, value_residual=8, key_flush="block", sink_tokens=2),
    "blocks": dict(key_block=4, value_block=2),
}
