"""The register lookups' inline PTX (`turbo.lookup_asm`, `nuq.lookup_asm`), which only a GPU runs, read on the CPU by
`tests.helpers.ptx`: every code of random words decodes to its codebook entry's fp16 bits, in the channel order the
kernels rebuild."""

from __future__ import annotations

import pytest
import torch

from hf_kvcache.kernels import nuq, turbo
from hf_kvcache.methods.turboquant import lloyd_max_codebook, pack_codes, signed_order
from tests.helpers import ptx


def _halves(values: torch.Tensor) -> list[int]:
    return [int(v) & 0xFFFF for v in values.to(torch.float16).view(torch.int16).tolist()]


def _word(data: bytes, at: int, size: int = 4) -> int:
    return int.from_bytes(data[at:at + size], "little")


def test_the_reading_knows_prmt_and_lop3():
    """The two instructions that carry the lookups, on cases worked by hand from the PTX manual."""
    assert ptx.prmt(0x33221100, 0x77665544, 0x3210) == 0x33221100
    assert ptx.prmt(0x33221100, 0x77665544, 0x7654) == 0x77665544
    assert ptx.prmt(0x33221100, 0x77665544, 0x5140) == 0x55114400
    assert ptx.prmt(0x00008011, 0, 0x4449) == 0xFF  # bit 3: byte 1 (0x80) has its sign set
    assert ptx.lop3(0xF0F0, 0xCCCC, 0xAAAA, 0xD2) == (0xF0F0 ^ (~0xCCCC & 0xAAAA)) & 0xFFFFFFFF
    with pytest.raises(NotImplementedError):
        ptx.run("{ add.u32 $0, $1, $2; }", 1, [1, 2])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_turbo_lookup_decodes_every_code(bits):
    width = 64
    book = signed_order(lloyd_max_codebook(width, bits))
    halves = _halves(book)
    asm = turbo.lookup_asm(bits, halves)
    codes = torch.randint(0, 2**bits, (16, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    for row in range(codes.shape[0]):
        data = pack_codes(codes[row], bits).numpy().tobytes()
        got = []
        if bits == 4:  # a word: channels 8j .. 8j + 7
            for j in range(width // 8):
                got += ptx.run(asm, 8, [_word(data, 4 * j)])
        else:  # a word of the 2-bit plane and, for 3 bits, the 16 top bits of its channels: 16j .. 16j + 15
            for j in range(width // 16):
                top = _word(data, width // 4 + 2 * j, 2) if bits == 3 else _word(data, 4 * j)
                got += ptx.run(asm, 16, [_word(data, 4 * j), top])
        assert got == [halves[c] for c in codes[row].tolist()], f"row {row}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_the_kvquant_lookup_decodes_every_code(bits):
    gen = torch.Generator().manual_seed(10 + bits)
    book = torch.randn(2**bits, generator=gen).sort().values
    h = _halves(book) + [0] * (16 - 2**bits)
    tables = [sum((h[4 * k + i] >> (8 * high) & 0xFF) << (8 * i) for i in range(4)) for high in (0, 1)
              for k in range(4)]  # `nuq._tables`: low bytes of entries 0-3, 4-7, 8-11, 12-15, then the high bytes
    asm = nuq.lookup_asm(bits)
    for _ in range(64):
        codes = torch.randint(0, 2**bits, (8,), generator=gen).tolist()
        word = sum(c << (bits * i) for i, c in enumerate(codes))
        assert ptx.run(asm, 8, [word, *tables]) == [h[c] for c in codes]


@pytest.mark.parametrize("bits,off", [(2, 1024), (4, 1024), (8, 1024), (2, 128), (4, 128)])
def test_the_plane_split_writes_each_code_into_its_offset(bits, off):
    """`tiles.plane_asm`: four packed bytes -> each plane's OFF + code of bytes 0, 1 and 2, 3 as 16-bit float pairs
    (fp16 1024 = 0x6400, bf16 128 = 0x4300: the code lands in the mantissa's last bits)."""
    from hf_kvcache.kernels import tiles

    per, mask, base = 8 // bits, (1 << bits) - 1, {1024: 0x6400, 128: 0x4300}[off]
    asm = tiles.plane_asm(bits, off)
    gen = torch.Generator().manual_seed(bits)
    for _ in range(64):
        data = torch.randint(0, 256, (4,), generator=gen).tolist()
        got = ptx.run(asm, 2 * per, [sum(b << (8 * i) for i, b in enumerate(data))])
        for p in range(per):
            half = [base | ((b >> (p * bits)) & mask) for b in data]
            assert got[2 * p:2 * p + 2] == [half[0] | half[1] << 16, half[2] | half[3] << 16], (p, data)
    with pytest.raises(ValueError, match="no plane PTX"):
        tiles.plane_asm(8, 128)  # bf16 holds codes below 128 only


def test_the_turbo_half_lookup_decodes_every_code():
    """`turbo.lookup_asm_halves`: two 16-bit halves of 4-bit codes -> each plane k's centroids of both halves, the
    first half's in the low 16 bits."""
    book = signed_order(lloyd_max_codebook(128, 4))
    halves = _halves(book)
    asm = turbo.lookup_asm_halves(halves)
    gen = torch.Generator().manual_seed(4)
    for _ in range(256):
        codes = torch.randint(0, 16, (2, 4), generator=gen).tolist()  # two halves, channels 4j + k
        word = sum(c << (4 * k + 16 * h) for h in range(2) for k, c in enumerate(codes[h]))
        got = ptx.run(asm, 4, [word])
        assert got == [halves[codes[0][k]] | halves[codes[1][k]] << 16 for k in range(4)], codes
    with pytest.raises(ValueError, match="sign-magnitude"):
        turbo.lookup_asm_halves(_halves(lloyd_max_codebook(128, 4)))  # ascending order: negative magnitudes


def test_each_integer_format_gets_its_plane_ptx(monkeypatch):
    """Which PTX `tiles.planes` / `tiles.group_planes` receive (`decode_launch._plane_asm`): planes in the products'
    dtype, grouped tiles of a 16-bit model at 1024 (dequantized in fp16), none for an fp32 model's grouped tiles
    (Triton's fp32 path), for fp8, for 8-bit codes in bf16, on the interpreter or when off."""
    from hf_kvcache.kernels import decode_launch, ops, tiles
    from hf_kvcache.kernels.layout import PackedFormat

    monkeypatch.setattr(decode_launch.backend, "interpreting", lambda: False)
    pick = decode_launch._plane_asm
    int4_g32 = PackedFormat("uniform", bits=4, channel_group=32)
    kivi_keys = PackedFormat("uniform", bits=2, token_group=32, channel_group=1)
    int8 = PackedFormat("uniform", bits=8)
    assert pick(int4_g32, torch.bfloat16, 128, planes=False) == tiles.plane_asm(4, 1024)
    assert pick(int4_g32, torch.float16, 128, planes=False) == tiles.plane_asm(4, 1024)
    assert pick(int4_g32, torch.float32, 128, planes=False) == ""
    int2_g8 = PackedFormat("uniform", bits=2, channel_group=8)
    assert pick(int2_g8, torch.bfloat16, 64, planes=False) == tiles.plane_asm(2, 1024)
    assert pick(int2_g8, torch.bfloat16, 32, planes=False) == ""  # planes 8 wide: too narrow for a product
    assert pick(kivi_keys, torch.bfloat16, 128, planes=True) == tiles.plane_asm(2, 128)
    assert pick(kivi_keys, torch.bfloat16, 128, planes=False) == ""  # per-channel blocks are read by planes only
    assert pick(int8, torch.float16, 128, planes=True) == tiles.plane_asm(8, 1024)
    assert pick(int8, torch.bfloat16, 128, planes=True) == ""  # 8-bit codes pass bf16's 128
    assert pick(PackedFormat("fp8-e4m3"), torch.float16, 128, planes=False) == ""
    monkeypatch.setitem(ops.TUNING, "plane_asm", False)
    assert pick(int4_g32, torch.bfloat16, 128, planes=False) == ""
    monkeypatch.setattr(decode_launch.backend, "interpreting", lambda: True)
    monkeypatch.setitem(ops.TUNING, "plane_asm", True)
    assert pick(int4_g32, torch.bfloat16, 128, planes=False) == ""


def test_the_operand_copy_goes_where_it_measured_faster(monkeypatch):
    """`launch.operand_copy`: by default only for the formats where `tiles.opaque` measured faster, nowhere with
    "0", everywhere with "all" (to measure the rest); any other setting is refused, naming the allowed ones."""
    from hf_kvcache.kernels import launch

    for mode, faster, other in (("1", True, False), ("0", False, False), ("all", True, True)):
        monkeypatch.setitem(launch.TUNING, "operand_copy", mode)
        assert (launch.operand_copy(True), launch.operand_copy(False)) == (faster, other), mode
    monkeypatch.setitem(launch.TUNING, "operand_copy", "yes")
    with pytest.raises(ValueError, match="0, 1 or all"):
        launch.operand_copy(True)


def test_the_turbo_eighth_lookup_decodes_every_code():
    """`turbo.lookup_asm_eighths`: two 16-bit halves of a 3-bit part's 2-bit plane and their top-bit bytes -> each
    plane k's centroids (channels 8j + k) of both halves, the first half's in the low 16 bits."""
    book = lloyd_max_codebook(128, 3)
    halves = _halves(book)
    asm = turbo.lookup_asm_eighths(halves)
    gen = torch.Generator().manual_seed(3)
    for _ in range(256):
        codes = torch.randint(0, 8, (16,), dtype=torch.uint8, generator=gen)  # two halves, channels 8j + k
        data = pack_codes(codes, 3).numpy().tobytes()  # the 2-bit plane (4 bytes), then the top bits (2 bytes)
        got = ptx.run(asm, 8, [_word(data, 0), data[4] | data[5] << 16])
        codes = codes.view(2, 8).tolist()
        assert got == [halves[codes[0][k]] | halves[codes[1][k]] << 16 for k in range(8)], codes
    with pytest.raises(ValueError, match="8 entries"):
        turbo.lookup_asm_eighths(halves[:4])
