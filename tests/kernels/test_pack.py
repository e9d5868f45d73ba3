"""Quantize/pack kernels against the reference codecs: the same bytes (codes, fp16 scales and zeros), written in
place into the cache's storage. CPU: Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache import kernels
from hf_kvcache.methods.fp8 import FP8Codec
from hf_kvcache.methods.int import IntCodec
from hf_kvcache.methods.kivi import KEY_RANGE_GRID, PerChannelKeyCodec
from hf_kvcache.methods.turboquant import SplitTurboCodec, TurboCodec
from tests.kernels.test_decode import DEVICE, _filled_layer

pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and not kernels.interpreting(), reason="needs CUDA or TRITON_INTERPRET=1"
)


def _x(shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen)
    x[..., 5] *= 12  # an outlier channel
    x[0, 0, 0] = 0.25  # a constant vector: a zero range never divides by zero
    return x.to(DEVICE, dtype)


def _both(codec, x, valid=None):
    with kernels.use_backend("torch"):
        want = codec.encode(x, valid)
    with kernels.use_backend("triton"):
        got = codec.encode(x, valid)
    return got, want


def _assert_same_bytes(got, want):
    """The same bytes, on CPU and CUDA alike (the reference divides as the kernels do: `quant._ieee_div`)."""
    for name in want:
        bad = got[name] != want[name]
        assert not bad.any(), f"{name}: {int(bad.sum())} differ, e.g. {got[name][bad][:4]} vs {want[name][bad][:4]}"


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (4, 32, False), (2, 32, False), (4, 64, False),
                                                  (2, None, False), (4, 32, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_codes_are_the_reference_bytes(bits, group, symmetric, dtype):
    codec = IntCodec(bits, group, symmetric)
    got, want = _both(codec, _x((2, 3, 21, 64), dtype))
    assert got.keys() == want.keys()
    _assert_same_bytes(got, want)


@pytest.mark.parametrize("bits", [2, 4])
def test_per_channel_key_blocks_with_padding(bits):
    x = _x((2, 2, 64, 64))
    valid = torch.ones(2, 64, dtype=torch.bool, device=DEVICE)
    valid[0, :40] = False  # row 0: the first block is all padding, the second half padding
    codec = PerChannelKeyCodec(bits, 32)
    got, want = _both(codec, x, valid)
    _assert_same_bytes(got, want)


def test_per_channel_range_search_picks_an_equally_good_range():
    """Candidates whose squared errors tie to float rounding may be chosen differently (summation order); the
    kernel's reconstruction error must match the reference's."""
    codec = PerChannelKeyCodec(2, 32, KEY_RANGE_GRID)
    x = _x((1, 2, 64, 64))
    got, want = _both(codec, x)
    err = {k: (codec.decode(f, torch.float32) - x.float()).pow(2).sum().item() for k, f in (("got", got), ("want", want))}
    assert err["got"] == pytest.approx(err["want"], rel=1e-5), err
    same = (got["codes"] == want["codes"]).float().mean().item()
    assert same > 0.99, f"only {same:.3f} of the code bytes agree"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_bytes_clamp_like_the_reference(fmt):
    x = _x((2, 2, 19, 64)) * 50  # far beyond the scale's range: both must clamp, never NaN
    for mode, scale in (("none", None), ("calibrated", torch.tensor([0.02, 0.5]))):
        got, want = _both(FP8Codec(fmt, mode, scale), x)
        assert torch.equal(got["codes"], want["codes"]), mode


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_bytes_by_their_bits_are_the_hardware_conversions(monkeypatch, fmt):
    """Before sm_89 the pack kernel converts to fp8 by integer operations on an fp16's bits (`pack._fp8_bits`): every
    byte equals the hardware conversion's (`cvt`, here the interpreter's), across every binade, subnormals, halfway
    cases, both zeros and the clamp; and the reference's cast but for a zero's sign (the kernels round a negative
    zero to +0, either way)."""
    gen = torch.Generator().manual_seed(1)
    mags = torch.logspace(-12, 18, 64 * 19 * 2, base=2.0, dtype=torch.float64).float()  # every binade and past fmax
    signs = torch.where(torch.rand(mags.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (mags * signs)[torch.randperm(mags.numel(), generator=gen)].view(1, 2, 19, 64)
    x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 2.0 ** -10 * 1.5, -(2.0 ** -17) * 3])  # zeros, halfway subnormals
    codec = FP8Codec(fmt, "none", None)
    native, want = _both(codec, x.to(DEVICE))
    monkeypatch.setitem(kernels.launch.TUNING, "fp8_convert", "bits")
    bits, _ = _both(codec, x.to(DEVICE))
    _assert_same_bytes(bits, native)
    zero = want["codes"] == 0x80
    assert zero.sum() >= 1 and (bits["codes"][zero] == 0).all()
    _assert_same_bytes({"codes": bits["codes"][~zero]}, {"codes": want["codes"][~zero]})


@pytest.mark.parametrize("spec,kwargs", [("int4-g32", {"residual_length": 16}), ("kivi-2", {"residual_length": 32}),
                                         ("fp8-e4m3", {}), ("int8", {"sink_tokens": 3})])
def test_cache_storage_written_in_place_equals_the_reference(spec, kwargs):
    """Prefill plus decode steps through the cache: storage grown and appended in place by the kernels holds
    exactly what the reference writes."""
    caches = {}
    for backend in ("torch", "triton"):
        with kernels.use_backend(backend):
            caches[backend], _ = _filled_layer(spec, kwargs, batch=2, heads=4, kv_heads=2, head_dim=64,
                                               steps=(70,) + (1,) * 40, dtype=torch.float32)
    for name in ("key_stream", "value_stream"):
        layers = [caches[k].layers[0] for k in ("torch", "triton")]
        a, b = (getattr(layer, name) for layer in layers)
        n_packed = a.split(layers[0].held_tokens)[1]
        assert n_packed == b.split(layers[1].held_tokens)[1] > 0
        rows = -(-n_packed // a.codec.block_size)
        for field, value in a.packed.items():
            assert torch.equal(value[:, :, :rows], b.packed[field][:, :, :rows]), (name, field)


TURBO = {
    "4": lambda: TurboCodec(64, 4, 1),
    "3-planes": lambda: TurboCodec(64, 3, 2),
    "2": lambda: TurboCodec(64, 2, 3, scale="norm"),
    "3.5-two-widths": lambda: TurboCodec(64, 3.5, 4),
    "2.5-hadamard": lambda: TurboCodec(64, 2.5, 5, rotation="hadamard"),
    "3.5-split": lambda: SplitTurboCodec(64, 3.5, 6),
}


@pytest.mark.parametrize("name", list(TURBO))
def test_turboquant_codes_and_lengths_are_the_reference(name):
    """TurboQuant's pack kernel (after the codec's own rotation): the reference's codes, in every layout (4 bits, the
    3-bit planes, two widths under one length, the energy split), zero vectors and lengths past fp16's range
    clamped. The kernel sums squares in its own order, which PyTorch's CUDA reduction need not share: a length may
    round to the neighbouring fp16 value and, once in a while, a coordinate within that of a cell edge take the
    neighbouring cell (the interpreter gives the same bytes)."""
    codec = TURBO[name]()
    x = _x((2, 3, 37, 64), seed=len(name))
    x[1, 2, 3] = 0.0
    x[1, 1, 4] = 1e6  # a length past fp16's range
    got, want = _both(codec, x)
    assert got.keys() == want.keys()
    for field in want:
        if want[field].dtype == torch.uint8:
            equal = (got[field] == want[field]).float().mean().item()
            assert equal >= 0.999, f"{field}: {1 - equal:.2%} of the code bytes differ"
        else:
            def bits(t):  # (+ 0.0: a zero length is zero whatever its sign, which the two sums may give apart)
                return (t.float() + 0.0).half().view(torch.int16).int()

            steps = (bits(got[field]) - bits(want[field])).abs()
            assert steps.max() <= 1, f"{field}: lengths {int(steps.max())} fp16 steps apart"
            assert torch.isfinite(got[field].float()).all()
    if DEVICE == "cpu":
        _assert_same_bytes(got, want)
