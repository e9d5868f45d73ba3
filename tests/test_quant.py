"""Properties of the reference codecs in `hf_kvcache.quant`: packing, uniform integers, fp8, errors.

Random tensors are drawn from a seed that hypothesis chooses (fast, and a failure prints the seed); the
structure (shapes, axis, group size, bits, dtype, magnitude, kind of data) is drawn by hypothesis itself.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvcache.quant import (
    FP8_FORMATS,
    SCALE_DTYPE,
    UNIFORM_BITS,
    dequantize_fp8,
    dequantize_uniform,
    fp8_max,
    fp8_scale,
    pack_bits,
    packed_size,
    quantize_fp8,
    quantize_uniform,
    unpack_bits,
)

FAST = settings(max_examples=60, deadline=None)
THOROUGH = settings(max_examples=100, deadline=None)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Mantissa bits and smallest normal exponent of each fp8 format.
FP8_MANTISSA = {"e4m3": 3, "e5m2": 2}
FP8_MIN_NORMAL = {"e4m3": 2.0**-6, "e5m2": 2.0**-14}

seeds = st.integers(0, 2**31 - 1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------------------------------- packing


@st.composite
def packing_cases(draw):
    bits = draw(st.sampled_from(UNIFORM_BITS))
    leading = draw(st.lists(st.integers(1, 3), min_size=0, max_size=3))
    n = 8 * draw(st.integers(1, 6))
    fill = draw(st.sampled_from(["random", "zeros", "max"]))
    seed = draw(seeds)
    hi = 2**bits - 1
    shape = (*leading, n)
    if fill == "random":
        codes = torch.randint(0, hi + 1, shape, generator=_gen(seed), dtype=torch.int64).to(torch.uint8)
    else:
        codes = torch.full(shape, 0 if fill == "zeros" else hi, dtype=torch.uint8)
    return bits, codes


@THOROUGH
@given(packing_cases())
def test_pack_unpack_round_trip(case):
    bits, codes = case
    packed = pack_bits(codes, bits)
    n = codes.shape[-1]
    assert packed.dtype == torch.uint8
    assert packed.shape == (*codes.shape[:-1], packed_size(n, bits))
    assert packed_size(n, bits) == n * bits // 8
    unpacked = unpack_bits(packed, bits)
    assert unpacked.dtype == torch.uint8
    assert torch.equal(unpacked, codes)


@FAST
@given(packing_cases())
def test_pack_is_little_endian_runs_of_8(case):
    """Each run of 8 codes, read as the integer sum(c_j << j*bits), is `bits` little-endian bytes."""
    bits, codes = case
    packed = pack_bits(codes, bits).reshape(-1, bits).tolist()
    runs = codes.reshape(-1, 8).tolist()
    for run, stored in zip(runs, packed):
        word = sum(c << (j * bits) for j, c in enumerate(run))
        assert int.from_bytes(bytes(stored), "little") == word


def test_known_layouts():
    codes4 = torch.arange(16, dtype=torch.uint8)  # 0..15
    packed4 = pack_bits(codes4, 4)
    assert packed4.tolist() == [(codes4[2 * i] | (codes4[2 * i + 1] << 4)).item() for i in range(8)]
    assert packed4[0].item() == 0x10 and packed4[7].item() == 0xFE

    codes2 = torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8)
    packed2 = pack_bits(codes2, 2)
    # element 4i in the low bits: 1 | 2 << 2 | 3 << 4 | 0 << 6
    assert packed2.tolist() == [1 | 2 << 2 | 3 << 4, 0xFF]

    codes1 = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits(codes1, 1).tolist() == [0b1000_0001]

    codes8 = torch.tensor([0, 1, 254, 255, 7, 8, 9, 10], dtype=torch.uint8)
    assert torch.equal(pack_bits(codes8, 8), codes8)

    codes3 = torch.tensor([7, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert pack_bits(codes3, 3).tolist() == [7, 0, 0]


# ------------------------------------------------------------------------------------- uniform integers

CONSTANTS = (0.0, -0.0, 1.0, -3.14159, 1e-7, 1e-30, 6e4, -6e4, 65504.0, 12345.678)


@st.composite
def uniform_cases(draw):
    ndim = draw(st.sampled_from([3, 4]))
    axis = draw(st.sampled_from([0, 1, -1, -2]))
    group_size = draw(st.sampled_from([None, 1, 2, 4, 8, 16, 32]))
    if group_size is None:
        n = draw(st.integers(1, 48))
    else:
        n = group_size * draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    shape[axis] = n
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    symmetric = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    magnitude = draw(st.sampled_from([1e-4, 1.0, 30.0, 6e4]))
    kind = draw(st.sampled_from(["normal", "uniform", "outliers", "offset", "constant_groups", "constant"]))
    constant = draw(st.sampled_from(CONSTANTS))
    seed = draw(seeds)

    g = _gen(seed)
    if kind == "uniform":
        x = torch.rand(shape, generator=g) * 2 - 1
    elif kind == "constant":
        x = torch.full(shape, constant)
    else:
        x = torch.randn(shape, generator=g)
    if kind == "outliers":  # a few elements 50x the rest, as in key channels
        mask = torch.rand(shape, generator=g) < 0.05
        x = torch.where(mask, x * 50, x)
    if kind != "constant":
        x = x / x.abs().amax().clamp_min(1e-12) * magnitude  # max |x| is exactly `magnitude`
    if kind == "offset":  # a small spread far from zero: the zero point carries the value
        x = x * 1e-3 + math.copysign(magnitude, constant if constant != 0 else 1.0)
        x = x.clamp(-6e4, 6e4)
    if kind == "constant_groups":  # every other group constant (its first element repeated)
        xg = x.movedim(axis, -1)
        lead = xg.shape[:-1]
        gsz = n if group_size is None else group_size
        xg = xg.reshape(*lead, n // gsz, gsz).clone()
        xg[..., ::2, :] = xg[..., ::2, :1]
        x = xg.reshape(*lead, n).movedim(-1, axis)
    return x.to(dtype).contiguous(), bits, axis, group_size, symmetric


def _expand_groups(t: torch.Tensor, axis: int, group_size: int | None, n: int) -> torch.Tensor:
    """Per-group tensor (axis holds groups) -> per-element tensor (axis holds n elements)."""
    g = n if group_size is None else group_size
    return t.repeat_interleave(g, dim=axis)


def _check_uniform(x, bits, axis, group_size, symmetric):
    xf = x.float()
    n = x.shape[axis]
    q = quantize_uniform(x, bits, axis=axis, group_size=group_size, symmetric=symmetric)
    groups = n // (n if group_size is None else group_size)
    expected_param_shape = list(x.shape)
    expected_param_shape[axis] = groups

    assert q.codes.dtype == torch.uint8 and q.codes.shape == x.shape
    assert int(q.codes.max()) <= 2**bits - 1
    if symmetric:
        assert q.zero is None
        assert int(q.codes.min()) >= 1  # codes are offset by 2^(bits-1) and clamped to +-qmax
    else:
        assert q.zero is not None and q.zero.dtype == SCALE_DTYPE
        assert list(q.zero.shape) == expected_param_shape
        assert torch.isfinite(q.zero).all()
    assert q.scale.dtype == SCALE_DTYPE and list(q.scale.shape) == expected_param_shape
    assert torch.isfinite(q.scale).all() and (q.scale >= 0).all()

    xhat = dequantize_uniform(q.codes, q.scale, q.zero, bits, axis=axis, group_size=group_size)
    assert xhat.dtype == torch.float32 and xhat.shape == x.shape
    assert torch.isfinite(xhat).all()
    step = _expand_groups(q.scale.float(), axis, group_size, n)
    tol = 1e-6 * float(xf.abs().amax()) + torch.finfo(torch.float32).tiny
    err = (xhat - xf).abs()
    excess = err - (step / 2 + tol)
    assert (excess <= 0).all(), (
        f"error exceeds half a step by {float(excess.max()):.3g} "
        f"(max err {float(err.max()):.3g}, step at worst {float(step.flatten()[excess.argmax()]):.3g})"
    )
    return q, xhat


@THOROUGH
@given(uniform_cases())
def test_uniform_error_within_half_step(case):
    _check_uniform(*case)


@FAST
@given(
    st.sampled_from(CONSTANTS),
    st.sampled_from([2, 3, 4, 8]),
    st.booleans(),
    st.sampled_from(DTYPES),
    st.sampled_from([None, 8]),
)
def test_uniform_constant_groups(constant, bits, symmetric, dtype, group_size):
    x = torch.full((2, 3, 16), constant).to(dtype)
    q, xhat = _check_uniform(x, bits, -1, group_size, symmetric)
    xf = x.float()
    if float(xf.abs().amax()) == 0.0:
        assert (q.scale == 0).all()
        assert torch.equal(xhat, torch.zeros_like(xhat))
    exact_in_fp16 = float(torch.tensor(float(xf.flatten()[0])).half().float()) == float(xf.flatten()[0])
    if not symmetric and exact_in_fp16:
        # the zero point holds the constant exactly and the scale is 0: nothing is lost
        assert (q.scale == 0).all()
        assert torch.equal(xhat, xf)


@FAST
@given(uniform_cases())
def test_uniform_whole_axis_is_one_group(case):
    x, bits, axis, _, symmetric = case
    n = x.shape[axis]
    a = quantize_uniform(x, bits, axis=axis, group_size=None, symmetric=symmetric)
    b = quantize_uniform(x, bits, axis=axis, group_size=n, symmetric=symmetric)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale)
    assert (a.zero is None and b.zero is None) or torch.equal(a.zero, b.zero)


@FAST
@given(uniform_cases(), st.sampled_from(DTYPES))
def test_dequantize_dtype(case, out_dtype):
    x, bits, axis, group_size, symmetric = case
    q = quantize_uniform(x, bits, axis=axis, group_size=group_size, symmetric=symmetric)
    ref = dequantize_uniform(q.codes, q.scale, q.zero, bits, axis=axis, group_size=group_size)
    kwargs = dict(axis=axis, group_size=group_size)
    out = dequantize_uniform(q.codes, q.scale, q.zero, bits, **kwargs, dtype=out_dtype)
    assert out.dtype == out_dtype
    assert torch.equal(out, ref.to(out_dtype))


@FAST
@given(st.sampled_from(UNIFORM_BITS), seeds, st.sampled_from(DTYPES))
def test_uniform_every_bit_width(bits, seed, dtype):
    """1 to 8 bits, asymmetric, values up to 3e4 (a 1-bit step must fit in fp16: range <= 65504)."""
    x = (torch.randn(2, 4, 32, generator=_gen(seed)) * 1e4).clamp(-3e4, 3e4).to(dtype)
    _check_uniform(x, bits, -1, 16, False)
    if bits >= 2:
        _check_uniform(x, bits, 1, None, True)


@FAST
@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=8, max_size=8),
    st.sampled_from([1, 2, 4, 8]),
    st.booleans(),
)
def test_uniform_never_nan_or_inf(values, bits, symmetric):
    """Any finite float32 input, even past fp16's range (where the fp16 scale and zero cannot cover the group
    and the error bound no longer holds): scales, zeros and the reconstruction stay finite."""
    if symmetric and bits == 1:
        bits = 2
    x = torch.tensor(values, dtype=torch.float32).reshape(1, 8)
    q = quantize_uniform(x, bits, symmetric=symmetric)
    assert torch.isfinite(q.scale).all() and (q.zero is None or torch.isfinite(q.zero).all())
    assert torch.isfinite(dequantize_uniform(q.codes, q.scale, q.zero, bits)).all()


def test_uniform_extremes_of_range():
    """+-6e4 in one group: zero point and scale both sit near fp16's limit and still cover the group."""
    x = torch.tensor([-6e4, 6e4, 0.0, 1.0, -1.0, 3e4, -3e4, 59999.0]).reshape(1, 1, 8)
    for bits in (2, 3, 4, 8):
        for symmetric in (False, True):
            _check_uniform(x, bits, -1, None, symmetric)


# --------------------------------------------------------------------------------------------------- fp8


def _fp8_bound(x: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """Round-to-nearest error bound: half an ulp in the normal range, half the subnormal step below."""
    m = FP8_MANTISSA[fmt]
    rel = 2.0 ** -(m + 1)
    half_subnormal = FP8_MIN_NORMAL[fmt] * 2.0 ** -(m + 1)
    s = torch.as_tensor(scale, dtype=torch.float32)
    bound = torch.maximum(x.float().abs() * rel, half_subnormal * s)
    return bound * (1 + 1e-6) + torch.finfo(torch.float32).tiny


@st.composite
def fp8_normal_cases(draw):
    fmt = draw(st.sampled_from(sorted(FP8_FORMATS)))
    scale = draw(st.sampled_from([1.0, 0.5, 3.7, 1e-3, 250.0]))
    seed = draw(seeds)
    dtype = draw(st.sampled_from(DTYPES))
    g = _gen(seed)
    lo, hi = math.log2(FP8_MIN_NORMAL[fmt]), math.log2(fp8_max(fmt))
    exps = torch.rand(4, 3, 17, generator=g) * (hi - lo) + lo
    signs = torch.where(torch.rand(4, 3, 17, generator=g) < 0.5, -1.0, 1.0)
    x = (signs * torch.exp2(exps) * scale).to(dtype)
    return fmt, scale, x


@THOROUGH
@given(fp8_normal_cases())
def test_fp8_relative_error_in_normal_range(case):
    fmt, scale, x = case
    codes = quantize_fp8(x, fmt, scale)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    xhat = dequantize_fp8(codes, fmt, scale)
    assert torch.isfinite(xhat).all()
    xf = x.float()
    inside = (xf / scale).abs() <= fp8_max(fmt)  # bf16/fp16 rounding may push a few just past the maximum
    err = (xhat - xf).abs()
    bound = _fp8_bound(xf, fmt, scale)
    assert (err[inside] <= bound[inside]).all(), float((err - bound)[inside].max())
    assert ((xhat.abs() - fp8_max(fmt) * scale)[~inside] <= 1e-3 * scale).all()


@FAST
@given(
    st.sampled_from(sorted(FP8_FORMATS)),
    st.lists(st.floats(allow_nan=False, width=32), min_size=1, max_size=40),
    st.floats(min_value=1e-3, max_value=1e3),
)
def test_fp8_never_nan_or_inf(fmt, values, scale):
    """Any finite or infinite input, frozen scale: the stored value is finite and saturates at the maximum."""
    x = torch.tensor(values, dtype=torch.float32)
    xhat = dequantize_fp8(quantize_fp8(x, fmt, scale), fmt, scale)
    assert torch.isfinite(xhat).all()
    fmax = fp8_max(fmt)
    assert (xhat.abs() <= fmax * scale * (1 + 1e-6)).all()
    big = (x / scale).abs() >= fmax
    assert torch.equal(xhat[big], torch.sign(x[big]) * torch.tensor(fmax) * scale)
    small = ~big
    assert (xhat[small] - x[small]).abs().le(_fp8_bound(x[small], fmt, scale)).all()


@pytest.mark.parametrize("fmt, fmax", [("e4m3", 448.0), ("e5m2", 57344.0)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_far_beyond_frozen_scale_clamps(fmt, fmax, dtype):
    assert fp8_max(fmt) == fmax
    x = torch.tensor([1e6, -1e6, 6e4, -6e4, float("inf"), -float("inf"), fmax, -fmax]).to(dtype)
    xhat = dequantize_fp8(quantize_fp8(x, fmt, 1.0), fmt, 1.0)
    assert torch.isfinite(xhat).all()
    assert xhat.tolist() == [fmax, -fmax] * 4


@st.composite
def fp8_dynamic_cases(draw):
    fmt = draw(st.sampled_from(sorted(FP8_FORMATS)))
    granularity = draw(st.sampled_from(["tensor", "head", "token"]))
    B, H, S = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 9))
    shape = (B, H, S, draw(st.sampled_from([8, 64])))  # (B, H, S, D)
    magnitude = draw(st.sampled_from([1e-3, 1.0, 100.0, 6e4]))
    headroom = draw(st.sampled_from([1.0, 1.5]))
    dtype = draw(st.sampled_from(DTYPES))
    zero_head = draw(st.booleans())
    seed = draw(seeds)
    x = torch.randn(shape, generator=_gen(seed))
    x = (x / x.abs().amax() * magnitude).clamp(-6e4, 6e4)
    if zero_head:  # an all-zero head: its per-head / per-token scales must be 1, not 0
        x[:, 0] = 0
    return fmt, granularity, x.to(dtype), headroom


@THOROUGH
@given(fp8_dynamic_cases())
def test_fp8_dynamic_scale_shapes_and_error(case):
    fmt, granularity, x, headroom = case
    B, H, S, D = x.shape
    dims, expected_shape = {
        "tensor": (None, ()),
        "head": ((0, 2, 3), (1, H, 1, 1)),
        "token": ((-1,), (B, H, S, 1)),
    }[granularity]
    scale = fp8_scale(x, fmt, dims=dims, headroom=headroom)
    assert scale.dtype == torch.float32 and tuple(scale.shape) == expected_shape
    assert torch.isfinite(scale).all() and (scale > 0).all()
    xf = x.float()
    amax = xf.abs().amax() if dims is None else xf.abs().amax(dim=dims, keepdim=True)
    expected = torch.where(amax > 0, amax * headroom / fp8_max(fmt), torch.ones_like(amax))
    assert torch.equal(scale, expected)

    xhat = dequantize_fp8(quantize_fp8(x, fmt, scale), fmt, scale)
    assert xhat.shape == x.shape and torch.isfinite(xhat).all()
    assert ((xhat - xf).abs() <= _fp8_bound(xf, fmt, scale.expand_as(xf))).all()
    assert torch.equal(xhat[xf == 0], xf[xf == 0])


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
@pytest.mark.parametrize("dims", [None, (0, 2, 3), (-1,)])
def test_fp8_zero_input(fmt, dims):
    x = torch.zeros(2, 3, 5, 8)
    scale = fp8_scale(x, fmt, dims=dims)
    assert (scale == 1).all()
    codes = quantize_fp8(x, fmt, scale)
    assert (codes == 0).all()
    assert torch.equal(dequantize_fp8(codes, fmt, scale), x)


@pytest.mark.parametrize("fmt", sorted(FP8_FORMATS))
def test_fp8_dequantize_dtype(fmt):
    x = torch.linspace(-3, 3, 16)
    codes = quantize_fp8(x, fmt, 0.5)
    for dtype in DTYPES:
        out = dequantize_fp8(codes, fmt, 0.5, dtype=dtype)
        assert out.dtype == dtype
        assert torch.equal(out, dequantize_fp8(codes, fmt, 0.5).to(dtype))


# --------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("bits", [0, 9, 16, -1, 2.5])
def test_bad_bits_raise(bits):
    codes = torch.zeros(2, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(codes, bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(codes, bits)
    with pytest.raises(ValueError, match="bits"):
        quantize_uniform(torch.randn(2, 8), bits)


def test_symmetric_one_bit_raises():
    with pytest.raises(ValueError, match="bits"):
        quantize_uniform(torch.randn(2, 8), 1, symmetric=True)


def test_pack_length_not_multiple_raises():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_bits(torch.zeros(2, 12, dtype=torch.uint8), 4)
    with pytest.raises(ValueError, match="multiple of 3"):
        unpack_bits(torch.zeros(2, 4, dtype=torch.uint8), 3)


@pytest.mark.parametrize("group_size", [3, 5, 0, -8, 64])
@pytest.mark.parametrize("axis", [0, -1])
def test_group_size_not_dividing_axis_raises(group_size, axis):
    x = torch.randn(32, 4, 32)
    with pytest.raises(ValueError, match="group_size"):
        quantize_uniform(x, 4, axis=axis, group_size=group_size)
    codes = torch.zeros(32, 4, 32, dtype=torch.uint8)
    scale = torch.ones(1, 4, 1, dtype=SCALE_DTYPE)
    with pytest.raises(ValueError, match="group_size"):
        dequantize_uniform(codes, scale, None, 4, axis=axis, group_size=group_size)


@pytest.mark.parametrize("fmt", ["e3m4", "E4M3", "fp8", "int8", ""])
def test_unknown_fp8_format_raises(fmt):
    x = torch.randn(4, 8)
    for call in (
        lambda: fp8_max(fmt),
        lambda: fp8_scale(x, fmt),
        lambda: quantize_fp8(x, fmt),
        lambda: dequantize_fp8(torch.zeros(4, 8, dtype=torch.uint8), fmt),
    ):
        with pytest.raises(ValueError, match="format"):
            call()


def test_range_search_never_loses_to_min_max_and_can_win():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    x[:, 0] *= 8  # one outlier per group: min/max wastes most levels on it
    plain = quantize_uniform(x, 2, axis=-1)
    searched = quantize_uniform(x, 2, axis=-1, range_search=(0.0, 0.05, 0.1, 0.15, 0.2))
    err_plain = (dequantize_uniform(plain.codes, plain.scale, plain.zero, 2) - x).pow(2).sum(-1)
    err_search = (dequantize_uniform(searched.codes, searched.scale, searched.zero, 2) - x).pow(2).sum(-1)
    assert (err_search <= err_plain + 1e-6).all()
    assert err_search.sum() < 0.9 * err_plain.sum()
    only_zero = quantize_uniform(x, 2, axis=-1, range_search=(0.0,))
    assert torch.equal(only_zero.codes, plain.codes) and torch.equal(only_zero.scale, plain.scale)
    with pytest.raises(ValueError, match="asymmetric"):
        quantize_uniform(x, 4, symmetric=True, range_search=(0.0, 0.1))
