"""KVQuant's kernels (`kernels/nuq.py`) against the reference codecs of `methods/kvquant.py`: the pack kernel writes
the same fields, the fused attention (NUQ lookup, outlier slots, RoPE at the stored positions) matches the reference
attention over the same cache. CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import _compat, kernels, make_cache
from hf_kvcache.attention import fused_attention, reference_attention
from hf_kvcache.kernels import nuq, ops
from hf_kvcache.quant import pack_bits
from tests.helpers.tiny_models import left_padded_batch, tiny_model
from tests.kernels.test_decode import DEVICE

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _cache(name, bits=3, **kwargs):
    model = tiny_model(name).to(DEVICE)
    return model, make_cache(f"kvquant-{bits}", model, **kwargs)


def _kv(model, batch, length, seed=0, dtype=torch.float32):
    """Keys with the scale of the model's own keys (and a channel far outside its calibrated range)."""
    gen = torch.Generator().manual_seed(seed)
    _, kv, d = model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim
    k = torch.randn(batch, kv, length, d, generator=gen) * 2
    v = torch.randn(batch, kv, length, d, generator=gen)
    k[..., 5] *= 6
    return k.to(DEVICE, dtype), v.to(DEVICE, dtype)


@pytest.mark.parametrize("name,bits", [("llama", 3), ("qwen3", 4), ("gemma", 2)])
def test_pack_kernel_writes_the_reference_fields(name, bits):
    """Same codes, slots, positions and value ranges as the reference encode. Keys are un-rotated with the
    kernel's own cos/sin, so a code on a decision boundary may differ: at most 0.5% of them, by one centroid."""
    model, cache = _cache(name, bits, outlier_fraction=0.05)
    layer = cache.layers[0]
    k, v = _kv(model, batch=2, length=37)
    positions = torch.arange(3, 40, device=DEVICE)[None].expand(2, 37)
    for codec, x, extra in ((layer.key_stream.codec, k, {"positions": positions}),
                            (layer.value_stream.codec, v, {})):
        with kernels.use_backend("torch"):
            want = codec.encode(x, None, **extra)
        got = {name: torch.zeros_like(t) for name, t in want.items()}
        with kernels.use_backend("triton"):
            codec.encode_into(x, None, got, **extra)
        assert codec.packed_format() is not None
        for field in set(want) - {"codes"}:
            both_nan = got[field].isnan() & want[field].isnan() if got[field].is_floating_point() else False
            same = (got[field] == want[field]) | both_nan
            assert same.float().mean() > 0.995, f"{field}: {(~same).sum()} differ"
        a = codec.decode(got, torch.float32)
        b = codec.decode(want, torch.float32)
        close = (a - b).abs() <= 1e-4 * b.abs().amax()
        assert close.float().mean() > 0.995, f"{(~close).sum()} of {close.numel()} decoded elements differ"


def _compare(name, *, bits=3, steps=(150, 1, 1), batch=2, mask=None, dtype=torch.float32, **kwargs):
    model, cache = _cache(name, bits, **kwargs)
    layer = cache.layers[1]
    layer.fused = True
    for i, n in enumerate(steps):
        kh, vh = layer.update(*_kv(model, batch, n, seed=i, dtype=dtype))
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(batch, model.config.num_attention_heads, steps[-1], model.config.head_dim, generator=gen)
    q = q.to(DEVICE, dtype)
    d = q.shape[-1]
    mask = None if mask is None else mask.to(DEVICE)
    with kernels.use_backend("triton"):
        views = layer.key_stream.kernel_view(), layer.value_stream.kernel_view()
        assert ops.supports(*views, q) is None
        got = fused_attention(q, kh, vh, mask, d**-0.5)
    assert got is not None
    want = reference_attention(q, kh, vh, mask, d**-0.5).transpose(1, 2)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("name,bits,kwargs", [
    ("llama", 3, {}),
    ("qwen3", 4, {"sink_tokens": 3}),
    ("mqa", 2, {"outlier_fraction": 0.05, "sink_tokens": 0}),
    ("llama", 3, {"pre_rope": False}),
])
def test_decode_step_matches_reference(name, bits, kwargs):
    _compare(name, bits=bits, **kwargs)


def test_codebook_gather_variant_matches_reference(monkeypatch):
    """The ablation's lookup (a gather load instead of selects over the centroids) stays correct."""
    monkeypatch.setitem(ops.TUNING, "nuq_lookup", "load")
    _compare("llama", steps=(70, 1))


@pytest.mark.skipif(DEVICE != "cuda", reason="the register lookup is PTX: bf16 and fp16 models on the GPU")
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_register_lookup_is_the_fp16_codebook(bits):
    """Every code of random rows decodes through the PTX to its centroid rounded to fp16, exactly."""
    gen = torch.Generator().manual_seed(bits)
    book = torch.randn(2**bits, generator=gen).sort().values
    codes = torch.randint(0, 2**bits, (32, 128), dtype=torch.uint8, generator=gen)
    packed = pack_bits(codes, bits).cuda()
    out = torch.empty(32, 128, device="cuda", dtype=torch.float16)
    nuq._lookup_probe[(1,)](packed, out, book.cuda(), packed.stride(0), D=128, BITS=bits, ASM=nuq.lookup_asm(bits),
                            N=32)
    assert torch.equal(out.cpu(), book[codes.long()].half())


@pytest.mark.skipif(DEVICE != "cuda", reason="the packed slot write is PTX (CUDA only)")
def test_packed_slot_write_replaces_one_channel_a_row():
    """`_put16`: the row's value lands at its channel, bit for bit, every other element stays; -1 writes nothing."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 64, generator=gen).half()
    idx = torch.randint(0, 64, (16,), generator=gen, dtype=torch.int32)
    idx[3] = -1
    val = torch.randn(16, generator=gen).half() * 100
    out = torch.empty_like(x).cuda()
    nuq._put16_probe[(1,)](x.cuda(), idx.cuda(), val.cuda(), out, N=16, D=64)
    want = x.clone()
    rows = (idx >= 0).nonzero().flatten()
    want[rows, idx[rows].long()] = val[rows]
    assert torch.equal(out.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.skipif(DEVICE != "cuda", reason="bf16 products: the interpreter's are not trustworthy (CUDA only)")
@pytest.mark.parametrize("lookup,fp16", [("registers", True), ("registers", False), ("selects", False)])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_bfloat16_lookups_match_reference(bits, lookup, fp16, monkeypatch):
    """Each lookup, and the register lookup's fp16 dequantization on and off (`TUNING["nuq_fp16"]`)."""
    monkeypatch.setitem(ops.TUNING, "nuq_lookup", lookup)
    monkeypatch.setitem(ops.TUNING, "nuq_fp16", fp16)
    _compare("llama", bits=bits, steps=(300, 1), dtype=torch.bfloat16, outlier_fraction=0.02)


def test_chunk_of_queries_with_padding_mask():
    steps = (100, 7)
    s = sum(steps)
    mask = torch.ones(2, 1, 7, s, dtype=torch.bool).tril(diagonal=s - 7)
    mask[0, :, :, :11] = False
    _compare("llama", steps=steps, mask=mask.to(DEVICE))


@pytest.mark.skipif(DEVICE == "cpu", reason="bf16 products: the interpreter's are not trustworthy (CUDA only)")
def test_bfloat16_on_the_gpu():
    _compare("qwen3", steps=(700, 1), dtype=torch.bfloat16)


def test_greedy_generation_through_the_kernels_equals_the_dense_path():
    """Left-padded batch: RoPE positions of padded rows, the sink, packed tokens past several tiles."""
    outs = {}
    for attn, backend in (("sdpa", "torch"), ("hf_kvcache", "triton")):
        model = tiny_model("llama", attn_implementation=attn).to(DEVICE)
        ids, mask = left_padded_batch(model, lengths=(40, 15))
        cache = make_cache("kvquant-3", model)
        with kernels.use_backend(backend):
            outs[attn] = model.generate(ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=12,
                                        do_sample=False, **_compat.cache_kwargs(cache))
    assert torch.equal(outs["sdpa"], outs["hf_kvcache"])
