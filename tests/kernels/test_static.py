"""The storage's kernels (lengths read from the device, places of fixed capacity, the ring window) and the
operators torch.compile calls, under Triton's interpreter on CPU: greedy tokens through the kernels, eager and
traced (`fullgraph=True`, dynamo's eager backend, so the operators run as Inductor would call them), equal the
plain-PyTorch reference's; and incomplete KIVI blocks are skipped by the pack kernel."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.configuration_utils import CompileConfig

from hf_kvcache import _compat, kernels, make_cache
from tests.helpers.methods import STATIC_METHODS as METHODS, TURBOQUANT_KERNEL
from tests.helpers.tiny_models import left_padded_batch, tiny_model

# Each kernel and operator once: FP8 (sinks + a FIFO ring), KIVI (the block flush and its pack flag, per-token INT
# values in a ring, sinks), KVQuant's NUQ kernel (pre-RoPE keys, outlier slots, a sink), RotatedCache (the
# Hadamard operator in front of per-token INT groups) and TurboQuant's kernels (`TURBOQUANT_KERNEL`). `exact`
# shares FP8's path; on CUDA every method runs.
CASES = [m for m in METHODS if m[0] in ("fp8-e4m3", "kivi-2", "kvquant-3", "rotated-4")] + [TURBOQUANT_KERNEL]


@pytest.mark.parametrize("spec,easy,hard", CASES, ids=[c[0] for c in CASES])
def test_static_kernels_eager_and_traced_equal_the_reference(spec, easy, hard):
    if not kernels.interpreting():
        pytest.skip("the interpreter run; on CUDA, tests/test_pinned_capacity.py compares compiled and eager")
    model = tiny_model("llama", "hf_kvcache")
    # 33 tokens, then 5 steps: KIVI's first window (3 sinks + 32) closes at a decode step, through the pack flag
    ids, mask = left_padded_batch(model, lengths=(33, 7))

    def greedy(backend: str, **kwargs):
        with kernels.use_backend(backend):
            cache = make_cache(spec, model, **hard, max_cache_len=88)
            return model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **kwargs,
                                  **_compat.cache_kwargs(cache))

    reference = greedy("torch", disable_compile=True)
    assert torch.equal(greedy("triton", disable_compile=True), reference)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    assert torch.equal(greedy("triton", compile_config=config), reference)


def test_pack_kernel_skips_incomplete_blocks():
    if not kernels.interpreting():
        pytest.skip("interpreter only")
    from hf_kvcache.methods.kivi import PerChannelKeyCodec

    codec = PerChannelKeyCodec(2, 16, range_search=(0.0, 0.05, 0.1, 0.15, 0.2))
    x = torch.randn(1, 2, 48, 64)
    with kernels.use_backend("triton"):
        full = codec.encode(x)
        part = codec.encode(x, complete=torch.tensor([True, False, True]))
    for name in full:
        assert torch.equal(part[name][:, :, [0, 2]], full[name][:, :, [0, 2]])
        assert not part[name][:, :, 1].float().abs().sum()


# (spec, its overrides, the prompt: FP8's scale and TurboQuant's channel split come from a first write past the sinks)
_PLACES = [("kivi-2", {"residual_length": 32, "sink_tokens": 2}, 1),
           ("fp8-e4m3", {"sink_tokens": 2, "residual_length": 3}, 3), ("int4-g32", {"sink_tokens": 1}, 1)]


@pytest.mark.parametrize("spec,kwargs,prompt", _PLACES, ids=["kivi-2-blocks", "fp8-window", "int4-plain"])
def test_a_graphed_step_places_its_token_in_one_launch(spec, kwargs, prompt):
    """A decode step captured in a layer's CUDA graph writes its token with the index arithmetic of one launch
    (`storage.StreamStorage._write_token`, `pack._token_places`): token by token from the sinks on, through KIVI's
    block flush (a block completed), FIFO windows and plain packing, every place of the pinned storage holds what
    `write`'s PyTorch operations (`_write`) put there, byte for byte."""
    from tests.kernels.test_decode import _Model

    if not kernels.interpreting():
        pytest.skip("the interpreter run; on CUDA every graphed decode step takes it")
    gen = torch.Generator().manual_seed(0)
    tokens = [(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen)) for _ in range(40)]
    layers = []
    for one_launch in (True, False):
        layer = make_cache(spec, _Model(4, 2, 64), **kwargs, max_cache_len=48).layers[0]
        with kernels.use_backend("triton"):
            layer.update(*(torch.cat(x, dim=2) for x in zip(*tokens[:prompt])))
            for k, v in tokens[prompt:]:
                if one_launch:
                    layer.store_token(k, v)
                    continue
                p = layer.length + torch.arange(1)
                for name, x in (("keys", k), ("values", v)):
                    layer.streams[name]._write(x, p, None, 0, None)
                layer.length.add_(1)
        layers.append(layer)
    for name in ("keys", "values"):
        one, ops = (layer.streams[name] for layer in layers)
        places = {"sink": (one.sink, ops.sink), "ring": (one.ring, ops.ring),
                  "ring_index": (one.ring_index, ops.ring_index),
                  **{k: (one.packed[k], ops.packed[k]) for k in one.packed}}
        for place, (got, want) in places.items():
            assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), f"{name} {place}"


@pytest.mark.parametrize("spec,easy,hard", CASES[:2] + CASES[-1:], ids=[c[0] for c in CASES[:2] + CASES[-1:]])
def test_one_launch_reads_rows_of_their_own_lengths(spec, easy, hard):
    """Packed pages (`hf_kvcache.paged`) read requests of different lengths in one launch: `LENS` with a length per
    batch row. Each row's output equals its own storage's read at its own length (sinks, rings, KIVI's block flush,
    per-sequence codec state stacked)."""
    from hf_kvcache.kernels import ops
    from hf_kvcache.kernels.layout import StaticLayout, StreamTensors
    from tests.kernels.test_decode import _Model

    if not kernels.interpreting():
        pytest.skip("the interpreter run; on CUDA, tests/test_paged.py reads packed pages through it")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 64, generator=gen)
    layers, reads, outs, news = [], [], [], []
    for held in (5, 38, 71):  # a row still in its sinks and window, one past a KIVI block, one past the window
        cache = make_cache(spec, _Model(4, 2, 64), **hard, max_cache_len=80)
        layer = cache.layers[0]
        layer.fused = True
        with kernels.use_backend("torch"):
            layer.update(torch.randn(1, 2, held - 1, 64, generator=gen), torch.randn(1, 2, held - 1, 64, generator=gen))
            kh, vh = layer.update(torch.randn(1, 2, 1, 64, generator=gen), torch.randn(1, 2, 1, 64, generator=gen))
            layer.write_pending()
        with kernels.use_backend("triton"):
            read = layer.reads.decode_read(q)
            assert read is not None
            outs.append(read.attend(layer.reads.rotate_query(q), kh.new, vh.new, None, 0.125))
        layers.append(layer)
        reads.append(read)
        news.append((kh.new, vh.new))

    def stacked(name):
        streams = [layer.streams[name] for layer in layers]
        codec = streams[0].codec
        codec.state = {k: torch.cat([s.codec.state[k] for s in streams]) for k in streams[0].codec.state}
        codec.__dict__.pop("_format", None)
        cat = (lambda ts: None if ts[0] is None else torch.cat(ts))
        view = streams[0].kernel_view()
        return StreamTensors(sink=cat([s.sink for s in streams]), fmt=codec.packed_format(), n_packed=view.n_packed,
                             fields={k: torch.cat([s.packed[k] for s in streams]) for k in streams[0].packed},
                             residual=cat([s.ring for s in streams]))

    one = reads[0].layout
    layout = StaticLayout(length=torch.stack([layer.length for layer in layers]), capacity=one.capacity,
                          sink_tokens=one.sink_tokens, key_ring=one.key_ring, value_ring=one.value_ring,
                          key_window=one.key_window, value_window=one.value_window)
    keys, values = stacked("keys"), stacked("values")
    with kernels.use_backend("triton"):
        got = ops.static_decode_attention(layers[0].reads.rotate_query(q).expand(3, -1, -1, -1), keys, values,
                                          torch.cat([k for k, _ in news]), torch.cat([v for _, v in news]), layout,
                                          exact_new=reads[0].exact_new, attention_mask=None, scaling=0.125)
    for row, want in enumerate(outs):
        torch.testing.assert_close(got[row : row + 1], want, rtol=1e-5, atol=1e-5)
