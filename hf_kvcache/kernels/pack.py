"""Quantize/pack kernels: one pass from model-dtype K/V to codes and scales, written in place into the cache's
preallocated storage. Each reproduces a reference of `hf_kvcache.quant` bit for bit (same fp16 outward rounding
of scales and zeros, round-half-to-even codes, IEEE division), so a kernel-written cache decodes exactly like a
reference-written one. TurboQuant's (`_pack_turbo`) sums a vector's squares, whose order PyTorch's CUDA reduction
need not share: its lengths can round to the neighbouring fp16 value, and a coordinate within a float32 step of a
cell edge take the other cell (`tests/kernels/test_pack.py`; under the interpreter the bytes are the same).
Launchers: `pack_launch.py` (KVQuant's pack kernel and its launcher: `nuq.py`, `nuq_launch.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import fp16_outward, rint

_FP16_MAX = 65504.0


@triton.jit
def _pack_rows(q, BLOCK: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes `(BLOCK, D)` int32 -> bytes `(BLOCK, D * BITS / 8)`, little-endian within each byte."""
    PER: tl.constexpr = 8 // BITS
    if PER == 1:
        out = q
    else:
        q3 = tl.reshape(q, (BLOCK, D // PER, PER))
        shifts = tl.arange(0, PER) * BITS
        out = tl.sum(q3 << shifts[None, None, :], 2)
    return out.to(tl.uint8)


# Only token counts (which change every step) are left unspecialized: the strides keep their divisibility by 16,
# which lets Triton vectorize the stores (see `decode._VARYING`). So is the alignment of the scales and zeros (a few
# bytes a token, so a write's first row decides it): decode steps compiled a second variant for it.
@triton.jit(do_not_specialize=("T",), do_not_specialize_on_alignment=("SC", "Z"))
def _pack_per_token(
    X, sx_b, sx_h, sx_t, C, sc_b, sc_h, sc_t, SC, ss_b, ss_h, ss_t, Z, T, H, clip,
    D: tl.constexpr, CHG: tl.constexpr, BITS: tl.constexpr, SYM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Uniform codes in per-token groups of CHG channels (`quant.quantize_uniform(axis=-1, group_size=CHG,
    clip_ratio=clip)`)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)  # offsets of large caches pass 2^31
    h = (pid_bh % H).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok < T
    NG: tl.constexpr = D // CHG
    j = tl.arange(0, NG)
    e = tl.arange(0, CHG)
    ch = j[None, :, None] * CHG + e[None, None, :]  # (1, NG, CHG)
    x = tl.load(X + b * sx_b + h * sx_h + tok[:, None, None] * sx_t + ch, mask=ok[:, None, None], other=0.0)
    x = x.to(tl.float32)  # (BLOCK_T, NG, CHG)
    if SYM:
        qmax = (1 << (BITS - 1)) - 1
        scale = fp16_outward(tl.math.div_rn(tl.max(tl.abs(x), 2), qmax * 1.0), True)  # (BLOCK_T, NG)
        safe = tl.where(scale > 0, scale, 1.0)
        q = rint(tl.math.div_rn(x, safe[:, :, None]))
        q = tl.minimum(tl.maximum(q, -qmax * 1.0), qmax * 1.0) + (1 << (BITS - 1))
    else:
        qmax = (1 << BITS) - 1
        zero = fp16_outward(tl.min(x, 2) * clip, False)
        scale = fp16_outward(tl.math.div_rn(tl.max(x, 2) * clip - zero, qmax * 1.0), True)
        safe = tl.where(scale > 0, scale, 1.0)
        q = rint(tl.math.div_rn(x - zero[:, :, None], safe[:, :, None]))
        q = tl.minimum(tl.maximum(q, 0.0), qmax * 1.0)
        tl.store(Z + b * ss_b + h * ss_h + tok[:, None] * ss_t + j[None, :], zero.to(tl.float16), mask=ok[:, None])
    tl.store(SC + b * ss_b + h * ss_h + tok[:, None] * ss_t + j[None, :], scale.to(tl.float16), mask=ok[:, None])
    PER: tl.constexpr = 8 // BITS
    packed = _pack_rows(tl.reshape(q.to(tl.int32), (BLOCK_T, D)), BLOCK_T, D, BITS)
    nb = tl.arange(0, D // PER)
    tl.store(C + b * sc_b + h * sc_h + tok[:, None] * sc_t + nb[None, :], packed, mask=ok[:, None])


@triton.jit(do_not_specialize=("sv_b",))
def _pack_per_channel(
    X, sx_b, sx_h, sx_t, VALID, sv_b, sv_t, C, sc_b, sc_h, sc_n, SC, ss_b, ss_h, ss_n, Z, KEEP,
    H, r0, r1, r2, r3, r4,
    D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, HAS_VALID: tl.constexpr, SEARCH: tl.constexpr,
    HAS_KEEP: tl.constexpr = False,
):
    """KIVI keys: each channel of a block of G tokens is one asymmetric group (`PerChannelKeyCodec.encode`),
    optionally with the least-squares range search over the grid (r0..r4, each < 0.5) of
    `quantize_uniform(range_search=)`. HAS_KEEP: blocks whose `KEEP` flag is 0 (the incomplete block of a graphed
    or compiled step, never read) are written as zeros without the search."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)  # offsets of large caches pass 2^31
    h = (pid_bh % H).to(tl.int64)
    blk = tl.program_id(1)
    tok = tl.arange(0, G)
    d = tl.arange(0, D)
    PER: tl.constexpr = 8 // BITS
    nb = tl.arange(0, D // PER)
    keep = True
    if HAS_KEEP:
        keep = tl.load(KEEP + blk) != 0
    if keep:
        packed, scale, zero = _per_channel_block(X, sx_b, sx_h, sx_t, VALID, sv_b, sv_t, b, h, blk, tok, d,
                                                 r0, r1, r2, r3, r4, D, G, BITS, HAS_VALID, SEARCH)
    else:
        packed = tl.zeros((G, D // PER), tl.uint8)
        scale = tl.zeros((D,), tl.float32)
        zero = tl.zeros((D,), tl.float32)
    base = C + b * sc_b + h * sc_h + blk * sc_n
    tl.store(base + tok[:, None] * (D // PER) + nb[None, :], packed)
    tl.store(SC + b * ss_b + h * ss_h + blk * ss_n + d, scale.to(tl.float16))
    tl.store(Z + b * ss_b + h * ss_h + blk * ss_n + d, zero.to(tl.float16))


@triton.jit
def _per_channel_block(X, sx_b, sx_h, sx_t, VALID, sv_b, sv_t, b, h, blk, tok, d, r0, r1, r2, r3, r4,
                       D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr, HAS_VALID: tl.constexpr,
                       SEARCH: tl.constexpr):
    """One block of `_pack_per_channel`: (packed codes (G, D * BITS / 8) uint8, scale (D,), zero (D,) float32)."""
    x = tl.load(X + b * sx_b + h * sx_h + (blk * G + tok)[:, None] * sx_t + d[None, :]).to(tl.float32)  # (G, D)
    if HAS_VALID:
        # Left padding takes the value of the block's first valid token (a block with none: of its first token).
        valid = tl.load(VALID + b * sv_b + (blk * G + tok) * sv_t) != 0
        first = tl.min(tl.where(valid, tok, G), 0)
        first = tl.where(first == G, 0, first)
        first_row = tl.sum(tl.where((tok == first)[:, None], x, 0.0), 0)  # (D,)
        x = tl.where(valid[:, None], x, first_row[None, :])
    qmax = (1 << BITS) - 1
    lo = tl.min(x, 0)
    hi = tl.max(x, 0)
    zero = fp16_outward(lo, False)
    scale = fp16_outward(tl.math.div_rn(hi - zero, qmax * 1.0), True)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.minimum(tl.maximum(rint(tl.math.div_rn(x - zero[None, :], safe[None, :])), 0.0), qmax * 1.0)
    if SEARCH:
        dq = q * scale[None, :] + zero[None, :] - x
        best = tl.sum(dq * dq, 0)
        width = hi - lo
        # Runtime loops, not unrolled: the 24 candidates unrolled made this kernel most of a KIVI cache's first-call
        # compiles (10.9 -> 5.6 s for sm_90 with Triton 3.6, `hf-kvcache bench --parts compiles`, BENCHMARKS.md
        # 2026-12-05); the order, and so the winner among equal errors, is the same.
        for ia in range(5):
            for ib in range(5):
                if ia + ib > 0:
                    a = tl.where(ia == 0, r0, tl.where(ia == 1, r1, tl.where(ia == 2, r2, tl.where(ia == 3, r3, r4))))
                    bb = tl.where(ib == 0, r0, tl.where(ib == 1, r1, tl.where(ib == 2, r2, tl.where(ib == 3, r3, r4))))
                    cz = fp16_outward(lo + a * width, False)
                    cs = fp16_outward(tl.math.div_rn(hi - bb * width - cz, qmax * 1.0), True)
                    csafe = tl.where(cs > 0, cs, 1.0)
                    cq = rint(tl.math.div_rn(x - cz[None, :], csafe[None, :]))
                    cq = tl.minimum(tl.maximum(cq, 0.0), qmax * 1.0)
                    e = cq * cs[None, :] + cz[None, :] - x
                    err = tl.sum(e * e, 0)
                    better = err < best
                    q = tl.where(better[None, :], cq, q)
                    scale = tl.where(better, cs, scale)
                    zero = tl.where(better, cz, zero)
                    best = tl.minimum(err, best)
    return _pack_rows(q.to(tl.int32), G, D, BITS), scale, zero


@triton.jit
def _fp8_grid(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """`y` (finite, within the format's range) rounded half-to-even to the nearest value of an fp8 format with
    MANT mantissa bits and smallest normal exponent EMIN: the step is 2^(max(exponent of y, EMIN) - MANT)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    p = tl.maximum(e, EMIN) - MANT
    step = ((p + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - p) << 23).to(tl.float32, bitcast=True)  # powers of two: both products are exact
    return rint(y * inv) * step


@triton.jit
def _fp8_bits(y, E5M2: tl.constexpr):
    """The fp8 byte of `y` (float32 on the format's grid, within its range) from the bits of an fp16 that holds it
    exactly, for GPUs without fp8 conversions (before sm_89). E5M2 is fp16's top byte. E4M3 scaled by 2^-8 is an fp16
    whose 5-bit exponent field is E4M3's 4-bit one (bias 15 = 7 + 8) and whose mantissa's top 3 bits are E4M3's,
    subnormals included: the byte is the sign and the 7 bits below fp16's top bit, one place down."""
    if E5M2:
        u = y.to(tl.float16).to(tl.uint16, bitcast=True)
        c = u >> 8
    else:
        u = (y * 0.00390625).to(tl.float16).to(tl.uint16, bitcast=True)  # y * 2^-8, exact
        c = ((u >> 8) & 0x80) | ((u >> 7) & 0x7F)
    return c.to(tl.uint8)


@triton.jit(do_not_specialize=("T",))
def _pack_fp8(
    X, sx_b, sx_h, sx_t, C, sc_b, sc_h, sc_t, S, ss_b, ss_h, T, H, fmax,
    D: tl.constexpr, E5M2: tl.constexpr, BLOCK_T: tl.constexpr, NATIVE: tl.constexpr = True,
):
    """FP8 bytes of `clamp(x / scale)` (`quant.quantize_fp8`), one scale per (batch row, kv-head)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)  # offsets of large caches pass 2^31
    h = (pid_bh % H).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok[:, None] < T
    d = tl.arange(0, D)
    x = tl.load(X + b * sx_b + h * sx_h + tok[:, None] * sx_t + d[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(S + b * ss_b + h * ss_h)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -fmax), fmax)
    # Round to the format's grid first (round half to even), so the cast below only converts exact values:
    # Triton's interpreter mis-rounds fp8 casts that carry into the exponent.
    # NATIVE: the hardware's conversion (sm_89 on); else the bits (`_fp8_bits`): the same bytes.
    y = _fp8_grid(y, 2, -14) if E5M2 else _fp8_grid(y, 3, -6)
    if not NATIVE:
        c = _fp8_bits(y, E5M2)
    elif E5M2:
        c = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        c = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(C + b * sc_b + h * sc_h + tok[:, None] * sc_t + d[None, :], c, mask=ok)


@triton.jit
def _cells(u, MID, CB, BITS: tl.constexpr):
    """TurboQuant's coding of unit-vector coordinates `u` (the reference's `torch.bucketize` against the ascending
    codebook's midpoints `MID (2^b - 1,)`, then `turboquant._to_code`): (codes int32 in sign-magnitude order, their
    centroids `CB[code]`)."""
    idx = tl.zeros(u.shape, tl.int32)
    for i in tl.static_range((1 << BITS) - 1):
        idx += (tl.load(MID + i) < u).to(tl.int32)  # bucketize: the midpoints strictly below
    half: tl.constexpr = 1 << (BITS - 1)
    code = tl.where(idx < half, half - 1 - idx, idx)
    return code, tl.load(CB + code)


@triton.jit
def _store_codes(C, rows, ok, code, BLOCK: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """Codes `(BLOCK, W)` of one part at byte rows `C + rows` in `turboquant.pack_codes`' layout (3 bits: the low two
    bits' plane, then the top bit's)."""
    if BITS == 3:
        lo = _pack_rows(code & 3, BLOCK, W, 2)
        tl.store(C + rows[:, None] + tl.arange(0, W // 4)[None, :], lo, mask=ok[:, None])
        top = _pack_rows(code >> 2, BLOCK, W, 1)
        tl.store(C + rows[:, None] + W // 4 + tl.arange(0, W // 8)[None, :], top, mask=ok[:, None])
    else:
        tl.store(C + rows[:, None] + tl.arange(0, W * BITS // 8)[None, :], _pack_rows(code, BLOCK, W, BITS),
                 mask=ok[:, None])


@triton.jit(do_not_specialize=("T",))
def _pack_turbo(
    Y, sy_b, sy_h, sy_t, CA, sca_b, sca_h, sca_t, CB_, scb_b, scb_h, scb_t, NRM, sn_b, sn_h, sn_t,
    MIDA, BOOKA, MIDB, BOOKB, T, H,
    WA: tl.constexpr, WB: tl.constexpr, BA: tl.constexpr, BB: tl.constexpr, TWO: tl.constexpr, LSQ: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """TurboQuant's codes of rotated vectors `Y (B, H, T, WA + WB)` float32 under one length
    (`turboquant.TurboCodec.encode` after its rotation): part A (channels 0..WA, BA bits) and, when TWO, part B (the
    WB after it, BB bits); the length `NRM (B, H, T, 1)` fp16 is the norm or (LSQ) the least-squares length of the
    coded direction, clamped to fp16's range."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok < T
    y_row = Y + b * sy_b + h * sy_h + tok[:, None] * sy_t
    ya = tl.load(y_row + tl.arange(0, WA)[None, :], mask=ok[:, None], other=0.0)
    yy = tl.sum(ya * ya, 1)
    if TWO:
        yb = tl.load(y_row + WA + tl.arange(0, WB)[None, :], mask=ok[:, None], other=0.0)
        yy += tl.sum(yb * yb, 1)
    norm = tl.math.sqrt_rn(yy)
    safe = tl.maximum(norm, 1.1754943508222875e-38)[:, None]  # a zero vector stays zero: no division by zero
    ua = tl.math.div_rn(ya, safe)
    code, ca = _cells(ua, MIDA, BOOKA, BA)
    _store_codes(CA + b * sca_b + h * sca_h, tok * sca_t, ok, code, BLOCK_T, WA, BA)
    uc = tl.sum(ua * ca, 1)
    cc = tl.sum(ca * ca, 1)
    if TWO:
        ub = tl.math.div_rn(yb, safe)
        code, cb = _cells(ub, MIDB, BOOKB, BB)
        _store_codes(CB_ + b * scb_b + h * scb_h, tok * scb_t, ok, code, BLOCK_T, WB, BB)
        uc += tl.sum(ub * cb, 1)
        cc += tl.sum(cb * cb, 1)
    if LSQ:
        norm = tl.math.div_rn(norm * uc, tl.maximum(cc, 1e-30))
    norm = tl.minimum(norm, 65504.0)  # (fp16's largest value)
    tl.store(NRM + b * sn_b + h * sn_h + tok * sn_t, norm.to(tl.float16), mask=ok)


PLACE_PLAIN = 0  # every token packed (no ring)
PLACE_WINDOW = 1  # a FIFO window: the token leaving it is packed
PLACE_BLOCK = 2  # a window flushed in blocks (KIVI's keys): the block the token falls in is packed


@triton.jit(do_not_specialize=("rows", "capacity"))
def _token_places(P, OUT, rows, capacity, S: tl.constexpr, R: tl.constexpr, G: tl.constexpr, MODE: tl.constexpr,
                  GP: tl.constexpr):
    """Where one new token of a stream goes, from its held index `P[0]` (a device int64): the index arithmetic of
    `storage.StreamStorage.write` for one token, in one launch, as int64 into `OUT`: [0] the sink row (S: the spare
    row), [1] the packed row written (`rows`: the spare one), [2] the ring row (R: the spare one; also past
    `capacity`), [3] the index past the sinks, [4] whether the packed block is complete (PLACE_BLOCK), then GP ring
    rows to gather the packed tokens from, then their GP held indices (the first G of each used; PLACE_PLAIN: the
    token itself, from no ring)."""
    p = tl.load(P)
    i = p - S
    k = tl.arange(0, GP)
    complete = p * 0
    if MODE == 2:  # PLACE_BLOCK (a jitted function reads no module global)
        blk = tl.maximum(i, 0) // G
        idx = blk * G + k  # the block's tokens (the new one is in its ring row before they are gathered)
        src = idx % R
        row = tl.where(blk < rows, blk, rows)
        complete = ((blk + 1) * G <= i + 1).to(tl.int64)
        held = idx + S
    elif MODE == 1:  # PLACE_WINDOW
        j = i - R  # the token leaving the window (none while j < 0: its row is the spare one)
        src = (j % R + R) % R + k * 0
        row = tl.where((j >= 0) & (j < rows), j, rows)
        held = j + S + k * 0
    else:
        src = k * 0
        row = tl.where((i >= 0) & (i < rows), i, rows)
        held = p + k * 0
    ring = R + p * 0
    if R > 0:
        ring = tl.where((i >= 0) & (p < capacity), i % R, R)
    tl.store(OUT, tl.minimum(p, S))
    tl.store(OUT + 1, row)
    tl.store(OUT + 2, ring)
    tl.store(OUT + 3, i)
    tl.store(OUT + 4, complete)
    tl.store(OUT + 8 + k, src)
    tl.store(OUT + 8 + GP + k, held)
