"""KIVICache against a fake-quantization reference of Algorithm 1 over many step patterns, with left padding;
bookkeeping; crop; errors."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.methods.kivi import KIVICache
from tests.helpers.kivi_reference import kivi_reference
from tests.helpers.references import outlier_keys, sqnr_db
from tests.helpers.tiny_models import TINY_CONFIGS

LLAMA = TINY_CONFIGS["llama"]()  # head_dim 64, 2 kv heads

PATTERNS = {
    "prefill R-1 then tokens": [63] + [1] * 70,
    "prefill R then tokens": [64] + [1] * 66,
    "prefill R+1 then chunks": [65, 7, 1, 30, 64, 1],
    "prefill 2R+5 then tokens": [133] + [1] * 61,
    "token by token": [1] * 140,
    "chunks straddling R": [40, 40, 40, 1, 1, 100],
}


def _positions(pads: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Position ids as generate() makes them for left-padded rows (padding at position 0)."""
    pos = torch.arange(start, start + n).unsqueeze(0) - pads.unsqueeze(1)
    return pos.clamp(min=0)


@pytest.mark.parametrize("sink", [0, 3])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_matches_algorithm_1(pattern, bits, sink):
    g, r = 32, 64
    cache = KIVICache(LLAMA, bits=bits, group_size=g, residual_length=r, sink_tokens=sink)
    cache.quantize_before_attention = True  # compare everything held, the new tokens included
    layer = cache.layers[0]
    total = sum(PATTERNS[pattern])
    k, v = outlier_keys(b=2, h=2, s=total, d=64), torch.randn(2, 2, total, 64, generator=torch.Generator().manual_seed(1))
    pads = torch.tensor([0, 37])  # row 1 is left-padded by 37 tokens
    k[1, :, :37] = 50.0  # padding with a huge value: it would wreck any key group whose range it entered
    pos = 0
    for n in PATTERNS[pattern]:
        kwargs = {"kwargs": {"position_ids": _positions(pads, pos, n)}}
        keys, values = layer.update(k[:, :, pos : pos + n], v[:, :, pos : pos + n], **kwargs)
        pos += n
        want_k, want_v = kivi_reference(k[:, :, :pos], v[:, :, :pos], bits, g, r, sink, pad_lengths=pads)
        real = torch.arange(pos) >= pads.view(2, 1, 1)  # (B, 1, S): compare the text, not the padding
        real = real.unsqueeze(-1).expand_as(keys)
        torch.testing.assert_close(keys[real], want_k[real])
        torch.testing.assert_close(values, want_v)
        (k_sink, _, k_res, _), (v_sink, _, v_res, _) = (s.split(layer.held_tokens)
                                                        for s in (layer.key_stream, layer.value_stream))
        body = max(pos - sink, 0)
        assert k_res == body % r < r
        assert v_res == min(body, r)
        assert k_sink == v_sink == min(pos, sink)


def test_padding_never_enters_a_key_group():
    """A row left-padded with huge values keeps key groups as tight as its text alone would."""
    cache = KIVICache(LLAMA, bits=2)
    cache.quantize_before_attention = True
    text = outlier_keys(b=2, h=2, s=200, d=64)
    batch = text.clone()
    batch[1, :, :20] = 30.0  # row 1: 20 padding tokens, then text
    positions = torch.stack([torch.arange(200), (torch.arange(200) - 20).clamp(min=0)])
    got, _ = cache.layers[0].update(batch, batch, kwargs={"position_ids": positions})
    # Row 1's first packed key block holds 20 pads and 12 text tokens; without the padding rule its range
    # would span [min, 30] and 2 bits could not resolve the text.
    # Measured: ~9.7 dB with the rule, 0.1 dB without it, 8.0 dB for the unpadded row's first block.
    padded, unpadded = sqnr_db(text[1, :, 20:32], got[1, :, 20:32]), sqnr_db(text[0, :, :32], got[0, :, :32])
    assert padded > unpadded - 3, f"padded row {padded:.1f} dB vs unpadded {unpadded:.1f} dB"


def test_bytes_per_token_at_8k_is_within_budget():
    cache = KIVICache(LLAMA, bits=2, group_size=32, residual_length=128)
    layer = cache.layers[0]
    x = torch.randn(1, 2, 8192, 64, dtype=torch.bfloat16)
    layer.update(x, x)
    sixteen_bit = 2 * 2 * 2 * 64 * 8192  # bytes * (K, V) * heads * head_dim * tokens
    ratio = layer.nbytes() / sixteen_bit
    # Keys: 8192 is a multiple of R, all packed, and the window's 128 rows, empty after the flush but the sequence's
    # as it fills again; values: the last 128 exact (bf16), the rest packed.
    keys = (8192 * 0.1875 + 128 * 1.0) / 8192
    values = (8064 * 0.1875 + 128 * 1.0) / 8192
    assert ratio == pytest.approx((keys + values) / 2, abs=1e-4)
    assert ratio <= 0.21


def test_crop_inside_a_packed_key_block_keeps_earlier_values():
    """A crop back into the last whole window: its keys are read from the window again, the ones whose rows later
    keys took back from their packed blocks (dequantized), the others as they came."""
    cache = KIVICache(LLAMA, bits=2, group_size=32, residual_length=64)
    layer = cache.layers[0]
    k, v = torch.randn(1, 2, 150, 64), torch.randn(1, 2, 150, 64)
    layer.update(k, v)  # keys: 128 packed, 22 in the window (rows 0-21)
    assert layer.key_stream.split(150)[:3] == (0, 128, 22)

    def held(stream):
        return stream.dense(torch.float32, layer.held_tokens)

    before = (held(layer.key_stream), held(layer.value_stream))
    layer.crop(-40)  # into the second window of keys
    assert layer.get_seq_length() == 110 and layer.key_stream.split(110)[:3] == (0, 64, 46)
    keys = held(layer.key_stream)
    torch.testing.assert_close(keys[:, :, :86], before[0][:, :, :86])  # packed, or taken back from packed blocks
    torch.testing.assert_close(keys[:, :, 86:], k[:, :, 86:110])  # still in their window rows: exact
    torch.testing.assert_close(held(layer.value_stream), before[1][:, :, :110])
    layer.update(k[:, :, 110:], v[:, :, 110:])  # refills to 150: the window flushes again
    assert layer.get_seq_length() == 150 and layer.key_stream.split(150)[:3] == (0, 128, 22)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=1), "bits=1"),
        (dict(group_size=16), "group_size=16"),
        (dict(residual_length=48), "multiple of group_size=32"),
        (dict(residual_length=0), "positive multiple"),
        (dict(sink_tokens=-2), "sink_tokens"),
    ],
)
def test_bad_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KIVICache(LLAMA, **kwargs)


def test_key_range_search_lowers_key_error_at_two_bits():
    k = outlier_keys(b=2, h=2, s=256, d=64)
    errors = {}
    for search in (False, True):
        cache = KIVICache(LLAMA, bits=2, residual_length=128, key_range_search=search)
        cache.quantize_before_attention = True
        keys, _ = cache.layers[0].update(k, k)
        errors[search] = sqnr_db(k, keys)
    assert errors[True] > errors[False] + 0.5, errors
