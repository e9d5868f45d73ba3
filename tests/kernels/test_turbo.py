"""TurboQuant's kernel (`kernels/turbo.py`) against the reference attention over the same stored codes, every part
layout (one width, two widths under one length, the energy split's two halves with a per-sequence frame), sinks and a
residual window, a chunk with a padding mask, the paper protocol; on CUDA also the register lookup of bf16 models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvcache import kernels
from hf_kvcache.kernels import ops
from hf_kvcache.kernels.layout import CodebookPart
from hf_kvcache.methods.turboquant import lloyd_max_codebook, pack_codes, signed_order, unpack_codes
from tests.kernels.test_decode import DEVICE, _compare, _filled_layer, decode_padding_mask

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)

# the presets' layouts: 4 / 4, 4 / 3 (the 3-bit planes), 3.5 / 2.5 split in halves (4+3 and 3+2 bits, two lengths and
# a frame per sequence and head), 3.5 in two widths under one length (split=0), with sinks and a residual window
CASES = [
    ("turboquant-4", {}),
    ("turboquant-3.5", {"sink_tokens": 3, "residual_length": 5}),
    ("turboquant-3", {}),
    ("turboquant-2.5", {"sink_tokens": 2, "residual_length": 7, "rotation": "hadamard"}),
    ("turboquant-3.5", {"key_bits": 3.5, "value_bits": 2.5, "split": 0}),
]
IDS = ["4", "3.5-sink-residual", "3-split", "2.5-hadamard", "split0"]


@pytest.mark.parametrize("spec,kwargs", CASES, ids=IDS)
def test_decode_step_matches_reference(spec, kwargs):
    _compare(spec, kwargs, steps=(70, 1))


def test_the_tail_dealt_to_several_programs(monkeypatch):
    """The exact tokens dealt to two tail programs (`launch._tail_split`, forced: on the interpreter one program), each
    a partial result in the model's frame, which the combine adds after rotating the body's back (the energy split's
    channel order, sinks, a window)."""
    from hf_kvcache.kernels import turbo_launch

    dealt = []

    def two(query, n_tiles, programs):
        dealt.append(n_tiles)
        return 2

    monkeypatch.setattr(turbo_launch, "_tail_split", two)
    _compare("turboquant-3", {"sink_tokens": 3, "residual_length": 30}, steps=(70, 1))
    assert max(dealt) >= 3, f"the tail had {dealt} tiles: too few to deal out"


def test_chunk_of_queries_with_padding_mask():
    steps = (100, 9)
    s = sum(steps)
    mask = torch.ones(2, 1, 9, s, dtype=torch.bool).tril(diagonal=s - 9)
    mask[0, :, :, :13] = False
    _compare("turboquant-3", {"sink_tokens": 1}, steps=steps, mask=mask)


def test_decode_step_with_a_padding_mask():
    _compare("turboquant-3", {"sink_tokens": 1}, steps=(200, 1), mask=decode_padding_mask(201))


def test_bfloat16_mqa_and_softcap():
    _compare("turboquant-3", {}, heads=8, kv_heads=1, steps=(130, 1), dtype=torch.bfloat16, softcap=20.0)


def test_paper_protocol_chunk_without_a_mask_stays_causal():
    _compare("turboquant-4", {}, steps=(150, 100), quantize_before=True)


def test_qjl_keys_and_static_windows_of_two_lengths_go_to_the_reference():
    cache, (kh, vh) = _filled_layer("turboquant-3", {"key_qjl": True, "scale": "norm"}, batch=1, heads=4, kv_heads=2,
                                    head_dim=64, steps=(20, 1), dtype=torch.float32)
    assert kh.layer.key_stream.kernel_view() is None
    values = vh.layer.value_stream.kernel_view()  # the plain codebook: read by the kernel, both streams so
    q = torch.zeros(1, 4, 1, 64, device=DEVICE)
    assert ops.supports(values, values, q) is None
    assert ops.supports(values, values, q, static=True) is None
    ring = dataclasses.replace(values, residual=torch.zeros(1, 2, 5, 64, device=DEVICE))
    assert "residual windows of two lengths" in ops.supports(values, ring, q, static=True)


@pytest.mark.parametrize("planes", [True, False], ids=["planes", "tile"])
def test_4_and_3_bit_streams_read_by_planes(planes, monkeypatch):
    """head_dim 128, one part of 4 bits, or of 3 bits for the keys: the stream's products by plane (channels 4j + i,
    `turbo._half_planes`; 8j + i, `turbo._eighth_planes`) or as one tile, against the reference, decode steps and
    chunks of queries; 3-bit values and streams of two parts are never read by planes."""
    from hf_kvcache.kernels import turbo, turbo_launch

    monkeypatch.setitem(ops.TUNING, "turbo_planes", planes)
    launched = []
    run = turbo._turbo_attn.run
    monkeypatch.setattr(turbo._turbo_attn, "run", lambda *a, **kw: launched.append(kw) or run(*a, **kw))
    for spec, want in (("turboquant-4", (4, 4)), ("turboquant-3.5", (4, 0)), ("turboquant-2.75", (8, 0))):
        launched.clear()
        _compare(spec, {}, batch=1, heads=4, kv_heads=1, head_dim=128, steps=(300, 1))
        _compare(spec, {}, batch=1, heads=2, kv_heads=1, head_dim=128, steps=(290, 9))
        body = [kw for kw in launched if kw["BODY"]]
        assert body and all((kw["K_PLANES"], kw["V_PLANES"]) == (want if planes else (0, 0)) for kw in body), spec
    monkeypatch.setitem(ops.TUNING, "turbo_planes", True)
    cache, _ = _filled_layer("turboquant-3", {}, batch=1, heads=2, kv_heads=1, head_dim=128, steps=(2, 1),
                             dtype=torch.float32)
    layer = cache.layers[0]
    assert turbo_launch._planes_of(layer.key_stream.kernel_view().fmt, 128, keys=True) == 0  # 3.5 bits: two parts
    assert turbo_launch._planes_of(layer.value_stream.kernel_view().fmt, 128, keys=False) == 0  # 2.5 bits


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_code_layouts_round_trip(bits):
    codes = torch.randint(0, 2**bits, (3, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 64 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits), codes)


@pytest.mark.skipif(DEVICE != "cuda", reason="the register lookup is PTX: fp16 products on the GPU")
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_register_lookup_is_the_codebook(bits):
    """Every code of a random row decodes through the PTX to the fp16 centroid, exactly."""
    from hf_kvcache.kernels import turbo

    book = signed_order(lloyd_max_codebook(32, bits))
    codes = torch.randint(0, 2**bits, (64, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_codes(codes, bits).cuda()
    out = torch.empty(64, 32, device="cuda", dtype=torch.float16)
    part = CodebookPart("codes", "norm", bits, 0, 32, book)
    table, asm = ops._codebook_table(part, torch.device("cuda"), torch.float16)
    turbo._lookup_probe[(1,)](packed, out, table, packed.stride(0), W=32, BITS=bits, ASM=asm, N=64)
    assert torch.equal(out.cpu(), book[codes.long()].half())


@pytest.mark.skipif(DEVICE != "cuda", reason="fp16 products are the GPU path of bf16 models (the interpreter: fp32)")
@pytest.mark.parametrize("lookup", ["registers", "load"])
@pytest.mark.parametrize("q_scale", [1.0, 4e4], ids=["q", "q-past-fp16-range"])
@pytest.mark.parametrize("spec,kwargs", CASES[:4], ids=IDS[:4])
def test_bfloat16_model(spec, kwargs, q_scale, lookup, monkeypatch):
    monkeypatch.setitem(ops.TUNING, "turbo_lookup", lookup)
    _compare(spec, kwargs, heads=8, kv_heads=2, steps=(300, 1), dtype=torch.bfloat16, q_scale=q_scale)
