"""TurboQuantCache: the Lloyd-Max codebooks against the law they come from and the paper's bounds, the codec
against a plain-PyTorch reference of the paper's two algorithms (written from the paper, dense matrices, one
vector at a time), QJL's unbiased inner products, the bytes it holds, and its errors."""

from __future__ import annotations

import math

import pytest
import torch

from hf_kvcache import make_cache
from hf_kvcache.methods.turboquant import (
    RandomRotation,
    SplitTurboCodec,
    TurboCodec,
    TurboQuantCache,
    codebook_distortion,
    coordinate_law,
    lloyd_max_codebook,
)
from tests.helpers.tiny_models import TINY_CONFIGS

# The paper's D_mse of its b-bit quantizer (its Theorem 1 discussion: 0.36, 0.117, 0.03, 0.009) and its bounds:
# no quantizer does better than 4^-b, and TurboQuant stays under sqrt(3) pi / 2 * 4^-b.
PAPER_MSE = {1: 0.36, 2: 0.117, 3: 0.03, 4: 0.009}


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_reaches_the_papers_distortion_within_its_bounds(d, bits):
    book = lloyd_max_codebook(d, bits)
    assert book.shape == (2**bits,) and bool((book[1:] > book[:-1]).all())
    torch.testing.assert_close(book, -book.flip(0), atol=0, rtol=0)  # the law is symmetric
    mse = codebook_distortion(d, bits)
    assert 4.0**-bits < mse < math.sqrt(3) * math.pi / 2 * 4.0**-bits
    assert mse == pytest.approx(PAPER_MSE[bits], rel=0.15)  # the paper rounds (0.03 for 0.034)


def test_codebook_is_a_fixed_point_of_lloyds_conditions():
    """Every centroid is the mean of the law over its cell (cells bounded by midpoints): Lloyd-Max optimality."""
    t, w = coordinate_law(64)
    book = lloyd_max_codebook(64, 3).double()
    cell = torch.bucketize(t, (book[1:] + book[:-1]) / 2)
    means = torch.zeros(8, dtype=torch.float64).index_add_(0, cell, w * t) / torch.zeros(
        8, dtype=torch.float64).index_add_(0, cell, w)
    torch.testing.assert_close(means, book, atol=1e-6, rtol=0)


def test_rotated_unit_vectors_meet_the_computed_distortion():
    """Monte Carlo: any fixed vectors, randomly rotated and coded, lose what the law predicts."""
    d, gen = 64, torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 4000, d, generator=gen) * torch.linspace(0.05, 8.0, d)  # anisotropic, outlier channels
    for bits in (2, 3, 4):
        errors = {}
        for scale in ("norm", "lsq"):
            codec = TurboCodec(d, bits, seed=1, scale=scale)
            xh = codec.decode(codec.encode(x), torch.float32)
            errors[scale] = ((x - xh).norm(dim=-1) ** 2 / x.norm(dim=-1) ** 2).mean().item()
        assert errors["norm"] == pytest.approx(codebook_distortion(d, bits), rel=0.1)  # the paper's quantizer
        assert errors["lsq"] < errors["norm"]  # the least-squares length fits the coded direction better


def _rotation_matrix(rot: RandomRotation, d: int) -> torch.Tensor:
    """Pi (D, D) with y = Pi x: the rotation as the paper writes it, read off the codec's transform."""
    return rot.apply(torch.eye(d)).T


def _paper_mse(x: torch.Tensor, pi: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """The paper's Algorithm 1 (TurboQuant_mse) on one vector x (norm kept apart): y = Pi x / |x|, idx_j the nearest
    centroid of y_j, x_hat = |x| Pi^T c[idx]."""
    n = x.norm()
    y = pi @ (x / n)
    idx = (y[:, None] - book[None, :]).abs().argmin(1)
    return n * (pi.T @ book[idx])


@pytest.mark.parametrize("rotation", ["dense", "hadamard", "hadamard2"])
@pytest.mark.parametrize("d", [64, 48])  # 48: no Sylvester matrix, the exact Paley-Hadamard construction
def test_codec_matches_the_papers_mse_quantizer(d, rotation):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 30, d, generator=gen) * 3
    codec = TurboCodec(d, 3, seed=5, rotation=rotation, scale="norm")
    pi = _rotation_matrix(codec.rotation, d)
    torch.testing.assert_close(pi @ pi.T, torch.eye(d), atol=1e-5, rtol=0)
    got = codec.decode(codec.encode(x), torch.float32)
    book = lloyd_max_codebook(d, 3)
    ref = torch.stack([_paper_mse(v, pi, book) for v in x.reshape(-1, d)]).reshape(x.shape)
    # the same codes; the fp16 norm is the only rounding
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=2e-3)


def test_codec_matches_the_papers_inner_product_quantizer():
    """Algorithm 2 (TurboQuant_prod): the (b-1)-bit MSE code, the residual r = x - x_mse, its QJL sketch
    sign(S' r) with S' Gaussian, and x_hat = x_mse + sqrt(pi/2) / d |r| S'^T sign(S' r). The codec draws S in the
    rotated frame; S' = S Pi is the same draw in the original one."""
    d, gen = 64, torch.Generator().manual_seed(3)
    x = torch.randn(1, 1, 20, d, generator=gen)
    codec = TurboCodec(d, 3, seed=7, qjl=True, scale="norm")
    pi = _rotation_matrix(codec.rotation, d)
    s = codec.sketch @ pi
    book = lloyd_max_codebook(d, 2)
    refs = []
    for v in x.reshape(-1, d):
        n = v.norm()
        x_mse = _paper_mse(v / n, pi, book)
        r = v / n - x_mse
        refs.append(n * (x_mse + math.sqrt(math.pi / 2) / d * r.norm() * (s.T @ torch.sign(s @ r))))
    got = codec.decode(codec.encode(x), torch.float32)
    torch.testing.assert_close(got, torch.stack(refs).reshape(x.shape), atol=2e-3, rtol=2e-3)


def test_qjl_inner_products_are_unbiased_and_the_mse_ones_shrink():
    d, gen = 64, torch.Generator().manual_seed(4)
    x = torch.randn(1, 1, 3000, d, generator=gen)
    q = x[0, 0, :, :].roll(1, 0)  # queries correlated with nothing in particular, one per key
    true = (x[0, 0] * q).sum(-1)
    for qjl, biased in ((True, False), (False, True)):
        codec = TurboCodec(d, 2, seed=9, qjl=qjl, scale="norm")
        xh = codec.decode(codec.encode(x), torch.float32)[0, 0]
        # the slope of the estimate against the truth: 1 when unbiased, the codebook's shrinkage (1 - D_mse) if not
        slope = ((xh * q).sum(-1) * true).sum() / (true * true).sum()
        if biased:
            assert slope.item() == pytest.approx(1 - codebook_distortion(d, 2), abs=0.03)
        else:
            assert slope.item() == pytest.approx(1.0, abs=0.03)


def test_zero_and_constant_vectors_stay_finite():
    codec = TurboCodec(64, 4, seed=0)
    x = torch.zeros(1, 1, 2, 64)
    x[0, 0, 1] = 5.0
    xh = codec.decode(codec.encode(x), torch.float32)
    assert torch.isfinite(xh).all() and torch.equal(xh[0, 0, 0], torch.zeros(64))
    assert ((xh[0, 0, 1] - 5).norm() / x[0, 0, 1].norm()).item() < 0.15  # 4 bits: sqrt(0.009) ~ 0.1 expected


@pytest.mark.parametrize("bits,split,per_token", [
    (4, None, 64 * 4 // 8 + 2), (3, None, 64 * 3 // 8 + 2),
    (3.5, 0, 32 * 4 // 8 + 32 * 3 // 8 + 2), (2.5, 0, 32 * 3 // 8 + 32 * 2 // 8 + 2),
    (3.5, None, 32 * 4 // 8 + 32 * 3 // 8 + 4), (2.5, None, 32 * 3 // 8 + 32 * 2 // 8 + 4),  # split: two lengths
])
def test_bytes_per_token_are_codes_and_lengths(bits, split, per_token):
    config = TINY_CONFIGS["llama"]()  # head_dim 64
    cache = TurboQuantCache(config, bits=bits, split=split)
    hkv = config.num_key_value_heads
    k = torch.randn(2, hkv, 40, 64)
    cache.update(k, k, 0)
    order = 2 * 2 * hkv * 64 if cache.key_split else 0  # keys and values: one byte a channel per sequence and head
    assert cache.layers[0].nbytes() == 2 * 2 * hkv * 40 * per_token + order  # keys and values, batch 2


@pytest.mark.parametrize("spec,key_token,value_token,split_streams", [
    ("turboquant-3.5", 64 * 4 // 8 + 2, 64 * 3 // 8 + 2, 0),  # 4-bit keys, 3-bit values: whole widths, no split
    ("turboquant-3", 32 * 4 // 8 + 32 * 3 // 8 + 4, 32 * 3 // 8 + 32 * 2 // 8 + 4, 2),  # 3.5 / 2.5: both split
])
def test_presets_give_the_keys_half_a_bit_more(spec, key_token, value_token, split_streams):
    """Both presets also keep the first token exact (a sink): float32 here, 64 channels, keys and values (their
    window of exact tokens off, so that all 39 others are coded)."""
    config = TINY_CONFIGS["llama"]()
    cache = make_cache(spec, config, residual_length=0)
    hkv = config.num_key_value_heads
    k = torch.randn(2, hkv, 40, 64)
    cache.update(k, k, 0)
    assert (cache.key_bits + cache.value_bits) / 2 == cache.bits
    orders = split_streams * 2 * hkv * 64  # a split stream keeps one byte a channel per sequence and head
    assert cache.layers[0].nbytes() == 2 * hkv * (39 * (key_token + value_token) + 2 * 64 * 4) + orders


@pytest.mark.parametrize("split", [0, None], ids=["one-rotation", "split"])
def test_allocated_bytes_count_the_rotations_it_keeps(split):
    """`allocated_nbytes()` counts the rotations (parameters and F, and a split's block-diagonal R) and codebook tables
    a codec moved to the device it coded on: memory the cache holds beside its tokens (2.0 MB for the default model's
    30 layers, which `tests/test_long_context.py` saw on the H100); `nbytes()`, the held tokens', does not."""
    config = TINY_CONFIGS["llama"]()
    cache = TurboQuantCache(config, bits=3.5, split=split)
    k = torch.randn(1, config.num_key_value_heads, 40, 64)
    cache.update(k, k, 0)
    stream = cache.layers[0].key_stream
    buffers = sum(t.numel() * t.element_size() for t in stream.buffers())
    state = sum(t.numel() * t.element_size() for t in stream.codec.state.values())
    codecs = stream.codec.halves.values() if split is None else [stream.codec]
    rotations = sum(2 * c.head_dim**2 * 4 for c in codecs) + (64 * 64 * 4 if split is None else 0)
    constants = stream.codec.constants_nbytes()
    assert rotations <= constants < rotations + 1024  # the rest: the codebooks and their midpoints
    assert stream.allocated_nbytes() == buffers + state + constants


def test_the_energy_split_spares_the_small_channels():
    """Two channels 10-12x the others (this model family's keys): with the split the other 62 channels are coded
    against their own length, and lose less than with one rotation over all 64."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 300, 64, generator=gen)
    x[..., 5] *= 12
    x[..., 37] *= 10
    small = [i for i in range(64) if i not in (5, 37)]
    err = {}
    for split in (0, 32):
        codec = SplitTurboCodec(64, 2.5, seed=1, high=32) if split else TurboCodec(64, 2.5, seed=1)
        xh = codec.decode(codec.encode(x), torch.float32)
        err[split] = ((x - xh)[..., small].norm() / x[..., small].norm()).item()
    assert err[32] < 0.8 * err[0]
    assert set(codec.state["perm"][0, 0, :32].tolist()) >= {5, 37}  # the outliers are in the high half


def test_presets_and_errors():
    config = TINY_CONFIGS["llama"]()
    assert make_cache("turboquant-3.5", config).bits == 3.5
    assert make_cache("turboquant-3:key_qjl=true,scale=norm", config).key_qjl
    with pytest.raises(ValueError, match="bits=5"):
        TurboQuantCache(config, bits=5)
    with pytest.raises(ValueError, match="value_bits=1.5"):
        TurboQuantCache(config, value_bits=1.5)
    with pytest.raises(ValueError, match="rotation='givens'"):
        TurboQuantCache(config, rotation="givens")
    with pytest.raises(ValueError, match="scale='lsq'"):
        TurboQuantCache(config, key_qjl=True)
    with pytest.raises(ValueError, match="split=16"):
        TurboQuantCache(config, bits=3.5, split=16)  # a fractional width's extra bit goes to half the channels
    with pytest.raises(ValueError, match="value_qjl"):
        TurboQuantCache(config, value_qjl=True)
    config.head_dim = 40
    with pytest.raises(ValueError, match="head_dim=40"):
        TurboQuantCache(config)
