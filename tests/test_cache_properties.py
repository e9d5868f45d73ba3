"""Stateful property test of `QuantizedKVLayer`'s bookkeeping against a trivially correct model.

Hypothesis drives one layer (no model) through random sequences of `update`, `crop`, `reorder_cache`,
`batch_select_indices`, `batch_repeat_interleave` and `reset`, on random layouts (block sizes, sinks, residual
lengths, FIFO or block flushes, sliding windows), with a capacity that grows or a pinned one. The codec is
lossless, so the reference is simply every token ever stored, keys and values as `(B, H, S, D)` tensors, and every
comparison is exact.

Channel 0 of every token holds its serial number (the same in every batch row and head), so the test can tell
which tokens the codec encoded: a per-token stream without a window encodes each token once, as it arrives.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hf_kvcache.layer as layer_module
from hf_kvcache.cache import KVHandle, LayerPolicy, QuantizedKVLayer
from tests.helpers.lossless import LosslessCodec

D = 8
MAX_BATCH = 6  # batch_repeat_interleave may grow the batch up to this
CAPACITY = 400  # a pinned layer's max_cache_len: 30 steps of at most 12 tokens fit
STREAMS = ("keys", "values")


@st.composite
def layouts(draw) -> dict:
    """A layer layout: block sizes, sinks, residual lengths, flush rules and sliding window."""

    def stream(prefix: str) -> dict:
        block = draw(st.sampled_from([1, 2, 4]), label=f"{prefix}_block")
        # A FIFO window packs one token at a time as it leaves: per-token codecs only (`storage.check_flush`).
        flush = draw(st.sampled_from(["fifo", "block"]), label=f"{prefix}_flush")
        if flush == "block":  # a positive multiple of the block size
            residual = block * draw(st.integers(1, 9 // block), label=f"{prefix}_residual_blocks")
        elif block == 1:
            residual = draw(st.integers(0, 9), label=f"{prefix}_residual")
        else:
            residual = 0  # blocks without a window
        return {f"{prefix}_block": block, f"{prefix}_flush": flush, f"{prefix}_residual": residual}

    return {
        **stream("key"),
        **stream("value"),
        "sink_tokens": draw(st.integers(0, 3), label="sink_tokens"),
        "sliding_window": draw(st.one_of(st.none(), st.integers(5, 20)), label="sliding_window"),
    }


def _places(held: int, sink_tokens: int, residual_length: int, block: int, flush: str) -> tuple[int, int, int]:
    """`(sinks, packed, residual)` tokens of `held` (the storage's spec): a FIFO window keeps its last R tokens exact, a
    block flush the ones past its last whole window (a block codec without a window: its incomplete block)."""
    n_sink = min(held, sink_tokens)
    after = held - n_sink
    if flush == "fifo" and block > 1 and not residual_length:
        flush, residual_length = "block", block
    if not residual_length:
        return n_sink, after, 0
    packed = max(after - residual_length, 0) if flush == "fifo" else (after // residual_length) * residual_length
    return n_sink, packed, after - packed


class LayerMachine(RuleBasedStateMachine):
    """One `QuantizedKVLayer` with lossless codecs, and `self.model`: every token ever stored, per stream."""

    # ------------------------------------------------------------------ setup
    @initialize(
        layout=layouts(),
        batch=st.integers(2, 3),
        heads=st.integers(1, 2),
        seed=st.integers(0, 2**16),
        # The sliding layer trims in bulk once it holds a margin's worth beyond its window (64 in the library);
        # small margins make windows trim (and crops reach their limit) within a 30-step sequence.
        margin=st.sampled_from([1, 2, 3, 8, layer_module._SLIDING_CROP_MARGIN]),
        quantize_before_attention=st.booleans(),
        pinned=st.booleans(),
    )
    def build(self, layout, batch, heads, seed, margin, quantize_before_attention, pinned):
        self.saved_margin = layer_module._SLIDING_CROP_MARGIN
        layer_module._SLIDING_CROP_MARGIN = margin
        self.layout = layout
        self.pinned = pinned
        # A pinned capacity keeps every token of a sliding layer (its mask applies the window): no window to track.
        self.window = None if pinned else layout["sliding_window"]
        self.codecs = {"keys": LosslessCodec(layout["key_block"]), "values": LosslessCodec(layout["value_block"])}
        self.encoded = {name: Counter() for name in STREAMS}  # serial -> times encoded
        for name, codec in self.codecs.items():
            original = codec.encode

            def counting(x, valid=None, original=original, counter=self.encoded[name]):
                counter.update(int(s) for s in x[0, 0, :, 0].tolist())
                return original(x, valid)

            codec.encode = counting
        policy = LayerPolicy(
            self.codecs["keys"],
            self.codecs["values"],
            sink_tokens=layout["sink_tokens"],
            key_residual_length=layout["key_residual"],
            value_residual_length=layout["value_residual"],
            key_flush=layout["key_flush"],
            value_flush=layout["value_flush"],
        )
        self.layer = QuantizedKVLayer(policy, sliding_window=layout["sliding_window"],
                                      max_cache_len=CAPACITY if pinned else None)
        self.quantize_before_attention = quantize_before_attention
        self.layer.quantize_before_attention = quantize_before_attention
        self.heads = heads
        self.gen = torch.Generator().manual_seed(seed)
        self.serial = 0
        self._clear(batch)

    def teardown(self):
        if hasattr(self, "saved_margin"):
            layer_module._SLIDING_CROP_MARGIN = self.saved_margin

    def _clear(self, batch: int) -> None:
        self.ops_since_reset = 0
        self.model = {name: torch.zeros(batch, self.heads, 0, D) for name in STREAMS}  # (B, H, S, D)

    # ------------------------------------------------------------------ helpers
    @property
    def batch(self) -> int:
        return self.model["keys"].shape[0]

    @property
    def total(self) -> int:
        return self.model["keys"].shape[2]

    def _stream(self, name: str):
        return self.layer.key_stream if name == "keys" else self.layer.value_stream

    def _spec(self, name: str) -> tuple[int, int, str]:
        p = "key" if name == "keys" else "value"
        return self.layout[f"{p}_residual"], self.layout[f"{p}_block"], self.layout[f"{p}_flush"]

    def _new_tokens(self, t: int) -> torch.Tensor:
        x = torch.randn(self.batch, self.heads, t, D, generator=self.gen)
        x[..., 0] = torch.arange(self.serial, self.serial + t, dtype=torch.float32)
        return x

    def _serials(self, lo: int, hi: int) -> list[int]:
        """Serial numbers of held tokens [lo, hi) (0 = the oldest held)."""
        start = self.total - self.layer.held_tokens
        return [int(s) for s in self.model["keys"][0, 0, start + lo : start + hi, 0].tolist()]

    # ------------------------------------------------------------------ operations
    @precondition(lambda self: self.total + 12 <= CAPACITY)
    @rule(t=st.integers(1, 12), fused=st.booleans(), chunk=st.integers(1, 7))
    def update(self, t, fused, chunk):
        self._update(t, fused, chunk)

    @precondition(lambda self: self.total + 1 <= CAPACITY)
    @rule(fused=st.booleans(), chunk=st.integers(1, 7))
    def decode(self, fused, chunk):
        """One token, generation's common case (a second update rule also makes long sequences likelier)."""
        self._update(1, fused, chunk)

    def _update(self, t: int, fused: bool, chunk: int) -> None:
        self.ops_since_reset += 1
        layer = self.layer
        held_before = layer.held_tokens
        kv_len, offset = layer.get_mask_sizes(t)  # what transformers sizes this step's mask from
        k_new = self._new_tokens(t)
        v_new = -self._new_tokens(t)
        v_new[..., 0] = k_new[..., 0]  # the same serials in both streams
        self.serial += t
        layer.fused = fused
        out = layer.update(k_new, v_new)
        layer.fused = False
        if layer.held_tokens < held_before + t:
            event("update: the window let tokens go")
        for name, x in zip(STREAMS, (k_new, v_new)):
            self.model[name] = torch.cat([self.model[name], x], dim=2)

        if self.pinned:
            assert (kv_len, offset) == (CAPACITY, 0)
            kv_len, offset = self.total, 0
        assert offset + kv_len == self.total, (kv_len, offset, self.total)
        if not self.window:
            assert (kv_len, offset) == (held_before + t, 0)
        expected = [self.model[name][:, :, offset : offset + kv_len] for name in STREAMS]
        if fused:
            for handle, name, new in zip(out, STREAMS, (k_new, v_new)):
                assert isinstance(handle, KVHandle) and handle.stream == name and handle.new is new
                assert handle.shape == (self.batch, self.heads, kv_len, D)
            chunks = list(layer.reads.iter_kv_chunks(k_new, v_new, chunk_tokens=chunk))
            for k, v in chunks:
                assert k.shape[2] == v.shape[2] > 0, [(k.shape, v.shape) for k, v in chunks]
            got = [torch.cat([c[i] for c in chunks], dim=2) for i in (0, 1)]
        else:
            got = list(out)
            if self.pinned:  # the whole capacity, the rows past the length hidden by the mask
                got = [g[:, :, : self.total] for g in got]
        for g, e, name in zip(got, expected, STREAMS):
            assert g.shape == e.shape, (name, g.shape, e.shape)
            assert torch.equal(g, e), name

    @precondition(lambda self: self.total > 0)
    @rule(data=st.data(), as_length=st.booleans())
    def crop(self, data, as_length):
        self.ops_since_reset += 1
        layer = self.layer
        n = data.draw(st.integers(1, min(self.total, 12)), label="n")
        held, total = layer.held_tokens, self.total
        # A rollback is possible while what remains still covers the window of the next query.
        possible = not self.window or held - n >= min(total - n, self.window - 1)
        # As a length only when positive: 0 is transformers 5.24's `crop(-0)`, "remove nothing" (the layer's crop).
        arg = total - n if as_length and total > n else -n
        if not possible:
            event("crop: refused")
            with pytest.raises(RuntimeError):
                layer.crop(arg)
            return
        layer.crop(arg)
        for name in STREAMS:
            self.model[name] = self.model[name][:, :, : total - n]

    @rule(kind=st.sampled_from(["reorder", "select", "repeat"]), data=st.data())
    def batch_op(self, kind, data):
        """Beam search's reorder, and the batch selection / expansion of contrastive search and generate()."""
        self.ops_since_reset += 1
        b = self.batch
        if kind == "reorder":
            idx = data.draw(st.lists(st.integers(0, b - 1), min_size=b, max_size=b), label="beam_idx")
            self.layer.reorder_cache(torch.tensor(idx))
        elif kind == "select":
            idx = data.draw(st.lists(st.integers(0, b - 1), min_size=1, max_size=b), label="indices")
            self.layer.batch_select_indices(torch.tensor(idx))
        else:
            repeats = data.draw(st.integers(1, max(MAX_BATCH // b, 1)), label="repeats")
            self.layer.batch_repeat_interleave(repeats)
        for name in STREAMS:
            x = self.model[name]
            self.model[name] = x.repeat_interleave(repeats, dim=0) if kind == "repeat" else x[idx]

    # A sequence runs a few operations before it may be reset: windows need some tokens before they trim.
    @precondition(lambda self: self.ops_since_reset >= 8)
    @rule(batch=st.integers(2, 3))
    def reset(self, batch):
        self.layer.reset()
        # A pinned storage stays allocated for its batch (a compiled step's CUDA graph replays over it).
        self._clear(self.batch if self.pinned and self.layer.is_initialized else batch)
        # Resetting forgets the sequence, not how the layer reads it.
        assert self.layer.quantize_before_attention == self.quantize_before_attention

    # ------------------------------------------------------------------ invariants
    @invariant()
    def lengths_and_window(self):
        layer, total = self.layer, self.total
        assert int(layer.get_seq_length()) == total
        held = layer.held_tokens
        assert held <= total
        if self.window:
            assert held >= min(total, self.window - 1), (held, total, self.window)
            assert layer.key_stream.sink_tokens == 0  # sinks are dead weight on a sliding layer
        else:
            assert held == total

    @invariant()
    def mask_sizes(self):
        layer, total, held = self.layer, self.total, self.layer.held_tokens
        for q in (1, 5):
            kv_len, offset = layer.get_mask_sizes(q)
            if self.pinned:
                assert (kv_len, offset) == (CAPACITY, 0)
            elif not self.window:
                assert (kv_len, offset) == (held + q, total - held)
            else:
                # A sliding layer may let its oldest tokens go before the next append: the mask covers what the
                # next update() will return, never less than the window.
                assert kv_len - q + offset == total, (kv_len, offset, total)
                assert min(total, self.window - 1) <= kv_len - q <= held, (kv_len, held, total)

    @invariant()
    def stored_tokens_are_exact(self):
        held = self.layer.held_tokens
        if held == 0:
            return
        for name in STREAMS:
            got = self._stream(name).dense(torch.float32, held)
            expected = self.model[name][:, :, self.total - held :]
            assert got.shape == expected.shape, (name, got.shape, expected.shape)
            assert torch.equal(got, expected), name

    @invariant()
    def places(self):
        held = self.layer.held_tokens
        if not self.layer.is_initialized:
            return
        sinks = 0 if self.layout["sliding_window"] else self.layout["sink_tokens"]
        for name in STREAMS:
            residual, block, flush = self._spec(name)
            got = self._stream(name).split(held)[:3]
            assert got == _places(held, sinks, residual, block, flush), (name, got)

    @invariant()
    def per_token_codes_are_encoded_once(self):
        """A stream of one-token codes without a window encodes each token as it arrives, never again (a crop or a
        sliding window only lets tokens go)."""
        held = self.layer.held_tokens
        for name in STREAMS:
            residual, block, _ = self._spec(name)
            if block != 1 or residual:
                continue
            s = self._stream(name).split(held)[0]
            encoded = self.encoded[name]
            assert all(encoded[serial] == 0 for serial in self._serials(0, s)), (name, "sink")
            assert all(encoded[serial] == 1 for serial in self._serials(s, held)), (name, "packed")
            assert all(c <= 1 for c in encoded.values()), name

    @invariant()
    def nbytes_count_held_tokens(self):
        """The packed tokens, and the sinks and the window at their full size (`StreamStorage.nbytes`)."""
        per_token = self.batch * self.heads * D * 4  # float32
        held = self.layer.held_tokens
        sinks = 0 if self.layout["sliding_window"] else self.layout["sink_tokens"]
        expected = 0
        for name in STREAMS:
            residual, block, flush = self._spec(name)
            ring = residual or (block if block > 1 else 0)  # blocks without a window: a ring of one block
            expected += per_token * (sinks + ring + _places(held, sinks, residual, block, flush)[1]) if held else 0
        assert self.layer.nbytes() == expected
        assert self.layer.allocated_nbytes() >= self.layer.nbytes()


LayerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestQuantizedKVLayer = LayerMachine.TestCase


def test_a_trim_after_a_crop_reads_the_cropped_window_back():
    """The sequence the machine above once found (it draws at random, so it is kept here): a sliding layer (window
    5) whose keys are block-flushed through a window of 4, 11 tokens held, 3 cropped, then one more token, whose
    write trims the front. The trim realigns the block flush's window, which then reads from the ring tokens that
    were packed; the crop had left the later, cropped tokens in their ring rows (keys read token 10 where token 6
    was). Values (a FIFO window) and every other place stay exact."""
    saved, layer_module._SLIDING_CROP_MARGIN = layer_module._SLIDING_CROP_MARGIN, 1
    try:
        policy = LayerPolicy(LosslessCodec(1), LosslessCodec(2), key_residual_length=4, value_residual_length=0,
                             key_flush="block", value_flush="fifo")
        layer = QuantizedKVLayer(policy, sliding_window=5)
        gen = torch.Generator().manual_seed(0)
        held = []

        def write(serials):
            k = torch.randn(2, 1, len(serials), D, generator=gen)
            k[..., 0] = torch.tensor(serials, dtype=torch.float32)
            held.extend(k.unbind(2))
            return layer.update(k, -k)

        write([0])
        write(list(range(1, 11)))
        layer.crop(-3)
        del held[-3:]
        kv_len, offset = layer.get_mask_sizes(1)
        keys, values = write([11])
        want = torch.stack(held, 2)[:, :, offset : offset + kv_len]
        assert keys[0, 0, :, 0].tolist() == [2, 3, 4, 5, 6, 7, 11]
        assert torch.equal(keys, want) and torch.equal(values, -want)
    finally:
        layer_module._SLIDING_CROP_MARGIN = saved
