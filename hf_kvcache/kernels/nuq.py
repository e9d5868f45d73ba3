"""KVQuant's layout in Triton: a pack kernel (keys un-rotated to their pre-RoPE values, per-channel normalization,
nearest-centroid codes, sparse outlier slots; values per token) and a fused decode attention that reads the NUQ
codes, looks up the codebook, writes the outlier slots over the tile, applies RoPE to the dequantized keys at
each token's stored position and runs the same online softmax as `decode.py`.

The body is bound by instructions. fp16 and bf16 models on the GPU look the codebook up in registers
(`lookup_asm`: byte permutes over the centroids rounded to fp16, whose rounding is below that of the products'
operands) and, where the format's values fit fp16 (`H16`, `NUQFormat.fp16`), dequantize, rotate and multiply in
fp16 on pairs of channels, the outlier slots written by a packed compare (`_put16`); fp32 models and the
interpreter take a chain of 2^bits selects over the float32 centroids and float32 arithmetic.

The layout and the math are `hf_kvcache.methods.kvquant`'s (the reference codecs); the launchers are
`nuq_launch.nuq_attention` and `nuq_launch.pack_nuq`.

RoPE (rotate-half convention): with the pre-RoPE key split in halves k1, k2 and angles pos * inv_freq,
k1' = k1 cos - k2 sin, k2' = k2 cos + k1 sin (times the rotary module's attention scaling, which the attention
kernel multiplies into the query instead). The attention kernel works on the two halves as separate tiles, so the
rotation needs no permutation of channels, and the score is q1 . k1' + q2 . k2'.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from .tiles import dot, finish_scores, fp16_outward, mask_scores, softmax_step



@triton.jit
def _words(C, row_off, ok, C0: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr):
    """The packed bits of channels C0 .. C0 + W - 1 of the rows at byte offsets `row_off (N, 1)`: int32 (N, W / 8),
    one word per 8 channels. Codes are a little-endian bit stream (`quant.pack_bits`): every 8 channels are BITS
    bytes, one aligned 32-bit load at 4 bits, 16-bit at 2; at 3 bits group j starts at bit 24 j, read as a funnel
    shift of the aligned 32-bit word holding that bit and, for groups that cross into it, the next (the bits above a
    group's 24 are not read); 16 channels are three byte planes. The launcher checks the alignment."""
    if BITS == 4:
        j = (C0 // 8 + tl.arange(0, W // 8))[None, :]
        word = tl.load(C.to(tl.pointer_type(tl.int32)) + row_off // 4 + j, mask=ok, other=0)
    elif BITS == 2:
        j = (C0 // 8 + tl.arange(0, W // 8))[None, :]
        word = tl.load(C.to(tl.pointer_type(tl.int16)) + row_off // 2 + j, mask=ok, other=0).to(tl.int32) & 0xFFFF
    elif W % 32:  # 16 channels (head_dim 32's halves): byte planes, one load per byte
        base = C + row_off + (C0 // 8 + tl.arange(0, W // 8))[None, :] * 3
        word = tl.load(base, mask=ok, other=0).to(tl.int32)
        for i in tl.static_range(1, 3):
            word = word | (tl.load(base + i, mask=ok, other=0).to(tl.int32) << (8 * i))
    else:
        j = (C0 // 8 + tl.arange(0, W // 8))[None, :]
        w = C.to(tl.pointer_type(tl.int32)) + row_off // 4 + (3 * j) // 4  # the word holding group j's first bit
        sh = (24 * j) % 32
        lo = tl.load(w, mask=ok, other=0).to(tl.int64) & 0xFFFFFFFF
        hi = tl.load(w + 1, mask=ok & (sh >= 16), other=0).to(tl.int64)  # only groups that cross a word
        word = ((lo | (hi << 32)) >> sh).to(tl.int32)
    return word


@triton.jit
def _split8(word, BITS: tl.constexpr):
    """Words (N, W / 8) -> the 8 codes of each, int32 (N, W) in channel order."""
    M: tl.constexpr = (1 << BITS) - 1
    # join(join(join(c0, c4), join(c2, c6)), join(join(c1, c5), join(c3, c7))) flattens to c0, c1, ..., c7
    lo = tl.join(tl.join(word & M, (word >> (4 * BITS)) & M), tl.join((word >> (2 * BITS)) & M, (word >> (6 * BITS)) & M))
    hi = tl.join(tl.join((word >> BITS) & M, (word >> (5 * BITS)) & M),
                 tl.join((word >> (3 * BITS)) & M, (word >> (7 * BITS)) & M))
    return tl.reshape(tl.join(lo, hi), (word.shape[0], word.shape[1] * 8))


LOOKUP_SELECTS = 0
LOOKUP_LOAD = 1
LOOKUP_REGISTERS = 2


@triton.jit
def _lookup(CB, code, BITS: tl.constexpr, LOOKUP: tl.constexpr):
    """codebook[code] as float32: a chain of selects over the 2^BITS centroids (no dependent load), or a gather."""
    if LOOKUP == 0:
        x = tl.zeros(code.shape, tl.float32) + tl.load(CB)
        for j in tl.static_range(1, 1 << BITS):
            x = tl.where(code == j, tl.load(CB + j), x)
    else:
        x = tl.load(CB + code)
    return x


@triton.jit
def _table_word(h, j, K: tl.constexpr, HIGH: tl.constexpr):
    """Byte HIGH of the fp16 patterns `h (16,)` of entries 4K .. 4K + 3, as one int32 word (entry 4K in byte 0)."""
    b = (h >> (8 * HIGH)) & 0xFF
    return tl.sum(tl.where(j // 4 == K, b << (8 * (j % 4)), 0), 0)


@triton.jit
def _tables(CB, BITS: tl.constexpr):
    """The codebook `CB (2^BITS,) float32` rounded to fp16, as the eight words `_lookup_registers` reads: the low
    bytes of entries 0-3, 4-7, 8-11, 12-15, then their high bytes (entries past 2^BITS are 0). Once a program."""
    j = tl.arange(0, 16)
    h = tl.load(CB + j, mask=j < (1 << BITS), other=0.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    h = h & 0xFFFF
    return (_table_word(h, j, 0, 0), _table_word(h, j, 1, 0), _table_word(h, j, 2, 0), _table_word(h, j, 3, 0),
            _table_word(h, j, 0, 1), _table_word(h, j, 1, 1), _table_word(h, j, 2, 1), _table_word(h, j, 3, 1))


@triton.jit
def _lookup_registers(word, t0, t1, t2, t3, t4, t5, t6, t7, ASM: tl.constexpr):
    """codebook[code] of the 8 codes of each word `(N, M)` as fp16 (N, 8M) in channel order, looked up in registers
    by `lookup_asm(BITS)` against the byte tables of `_tables` (GPU only: inline PTX)."""
    o = tl.inline_asm_elementwise(
        ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r,r,r,r,r,r,r,r", [word, t0, t1, t2, t3, t4, t5, t6, t7],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16),
        is_pure=True, pack=1)
    x = tl.join(tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6])), tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7])))
    return tl.reshape(x, (word.shape[0], word.shape[1] * 8))


@triton.jit
def _slots(OI, OV, row_off, ok, S: tl.constexpr, SP: tl.constexpr):
    """Outlier slots of the rows at `row_off (N, 1)`: channel indices int32 and values float32, (N, SP), SP =
    S rounded up to a power of two (the extra columns unused)."""
    sp = tl.arange(0, SP)[None, :]
    m = ok & (sp < S)
    idx = tl.load(OI + row_off + sp, mask=m, other=0).to(tl.int32)
    return idx, tl.load(OV + row_off + sp, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _dequant(word, idx, val, CB, C0: tl.constexpr, mid, half, BITS: tl.constexpr, S: tl.constexpr,
             SP: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr, t0, t1, t2, t3, t4, t5, t6, t7,
             H16: tl.constexpr):
    """Dequantized values of channels C0 .. from their words (N, W / 8): (N, W) = codebook[code] * half + mid,
    then the outlier slots `idx`/`val (N, SP)` (NaN value = empty) written over. LOOKUP_REGISTERS reads the byte
    tables t0..t7 (`_tables`); the other lookups read CB. H16 (with the register lookup): fp16 arithmetic on pairs
    of channels, `mid`/`half` fp16, the result fp16; float32 otherwise."""
    if H16:
        x = _lookup_registers(word, t0, t1, t2, t3, t4, t5, t6, t7, ASM) * half + mid
    elif LOOKUP == 2:
        x = _lookup_registers(word, t0, t1, t2, t3, t4, t5, t6, t7, ASM).to(tl.float32) * half + mid
    else:
        x = _lookup(CB, _split8(word, BITS), BITS, LOOKUP) * half + mid
    ch = C0 + tl.arange(0, x.shape[1])[None, :]
    sp = tl.arange(0, SP)[None, :]
    for s in tl.static_range(S):
        v_s = tl.sum(tl.where(sp == s, val, 0.0), 1)
        i_s = tl.where(v_s == v_s, tl.sum(tl.where(sp == s, idx, 0), 1), -1)  # an empty slot: no channel
        v_s = v_s[:, None]
        i_s = i_s[:, None]
        if H16:
            x = _put16(x, tl.broadcast_to(ch.to(tl.float16), x.shape), tl.broadcast_to(i_s.to(tl.float16), x.shape),
                       tl.broadcast_to(v_s.to(tl.float16), x.shape))
        else:
            x = tl.where(ch == i_s, v_s, x)
    return x


@triton.jit
def _put16(x, ch, i, v):
    """fp16 `x` with `v` where channel `ch` equals `i` (fp16 tensors of one shape; channel numbers are exact in
    fp16, an empty slot's -1 matches none): per pair of elements, one packed compare that sets each half's bits to
    all ones or zeros, and one bitwise select (PTX), against a compare and a select per element."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 m; set.eq.u32.f16x2 m, $2, $3; lop3.b32 $0, $4, $1, m, 0xE4; }", "=r,r,r,r,r",
        [x, ch, i, v], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _fetch(kc, koi, kov, kp, vc, voi, vov, vlo, vhi, tile, n_body, skc_t, sko_t, skp_t, svc_t, svo_t, svl_t,
           BLOCK_N: tl.constexpr, D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_S: tl.constexpr,
           V_S: tl.constexpr, K_SP: tl.constexpr, V_SP: tl.constexpr, ROPE: tl.constexpr):
    """Every load of one tile of packed tokens (raw: code words, slots, positions, value ranges). The body issues
    them one tile ahead, so that their latency overlaps the current tile's work (Triton's pipeliner only prefetches
    loads that feed the products directly; these go through the dequantization first)."""
    tok = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = tok < n_body
    row = tok[:, None]
    okr = ok[:, None]
    kw1 = _words(kc, row * skc_t, okr, 0, D // 2, K_BITS)
    kw2 = _words(kc, row * skc_t, okr, D // 2, D // 2, K_BITS)
    vw = _words(vc, row * svc_t, okr, 0, D, V_BITS)
    ki, kv = _slots(koi, kov, row * sko_t, okr, K_S, K_SP)
    vi, vv = _slots(voi, vov, row * svo_t, okr, V_S, V_SP)
    if ROPE:
        pos = tl.load(kp + tok * skp_t, mask=ok, other=0).to(tl.float32)
    else:
        pos = tok.to(tl.float32)
    v_lo = tl.load(vlo + tok * svl_t, mask=ok, other=0.0).to(tl.float32)
    v_hi = tl.load(vhi + tok * svl_t, mask=ok, other=0.0).to(tl.float32)
    return kw1, kw2, vw, ki, kv, vi, vv, pos, v_lo, v_hi


@triton.jit
def _cos_sin(angle, FAST: tl.constexpr):
    """cos and sin of float32 angles. FAST (compiled on the GPU): the angle is reduced to [-pi, pi] against a
    two-part 2 pi (exact products through FMA) and the hardware's approximate functions take it from there
    (absolute error ~1e-6, against ~40 instructions a call for the accurate library functions)."""
    if FAST:
        k = tl.floor(angle * 0.15915494309189535 + 0.5)
        r = angle - k * 6.2831854820251465  # float32(2 pi), a little above 2 pi ...
        r = r + k * 1.7484555314695172e-07  # ... by this much
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    return c, s


@triton.jit
def _dense_tile(S_, R_, N_, ss_t, sr_t, sn_t, kpos, d, ok, n_sink, npk, n_res, stop, n_new):
    """Tokens `kpos (N, 1)` held exactly (sink, residual, this step's new tokens): float32 (N, D)."""
    stored = ok & (kpos < stop)
    rk = kpos - n_sink - npk
    nk = kpos - stop
    x = tl.load(S_ + kpos * ss_t + d, mask=stored & (kpos < n_sink), other=0.0).to(tl.float32)
    x += tl.load(R_ + rk * sr_t + d, mask=stored & (rk >= 0) & (rk < n_res), other=0.0).to(tl.float32)
    x += tl.load(N_ + nk * sn_t + d, mask=ok & (nk >= 0) & (nk < n_new), other=0.0).to(tl.float32)
    return x


# As in `decode._VARYING`: lengths and split counts change every step and are not specialized; the strides of
# the storage are, so that their divisibility by 16 stays known.
_VARYING = ("sm_b", "sm_t", "sm_s", "Tq", "n_sink", "n_body", "npk", "n_res", "stop", "n_new", "tiles_per_split",
            "n_splits", "m_tiles")


@triton.jit(do_not_specialize=_VARYING)
def _nuq_attn(
    Q, sq_b, sq_h, sq_t,
    KS, sks_b, sks_h, sks_t, KR, skr_b, skr_h, skr_t, KN, skn_b, skn_h, skn_t,
    VS, svs_b, svs_h, svs_t, VR, svr_b, svr_h, svr_t, VN, svn_b, svn_h, svn_t,
    KC, skc_b, skc_h, skc_t, KOI, KOV, sko_b, sko_h, sko_t, KP, skp_b, skp_t, KMID, KHALF, KCB, INVF,
    VC, svc_b, svc_h, svc_t, VOI, VOV, svo_b, svo_h, svo_t, VLO, VHI, svl_b, svl_h, svl_t, VCB,
    MASK, sm_b, sm_t, sm_s,
    ACC, M_OUT, L_OUT, LENS, cap_len,
    Hkv, Tq, n_sink, n_body, npk, n_res, stop, n_new, tiles_per_split, n_splits, m_tiles,
    sm_scale, softcap, rope_scale,
    D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
    PREC: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, ROPE: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, K_S: tl.constexpr, V_S: tl.constexpr, K_SP: tl.constexpr,
    V_SP: tl.constexpr, FAST_TRIG: tl.constexpr, LOOKUP: tl.constexpr, K_ASM: tl.constexpr,
    V_ASM: tl.constexpr,
    STATIC: tl.constexpr = False, SINK_CAP: tl.constexpr = 0, H16: tl.constexpr = False,
    B_COPY: tl.constexpr = False,  # the products' tiles through `tiles.opaque`
):
    """Programs (batch row x kv-head, split, tile of query rows). Splits below `n_splits` take ranges of the
    packed tokens `[0, n_body)` (the last tile masked); split `n_splits` takes the exact tokens (sink, residual,
    new). Partial results go to ACC/M_OUT/L_OUT for `decode._combine`. STATIC: the lengths come from the device
    (`LENS`: tokens held; the first SINK_CAP are sinks, every later one is packed), as in `decode._attn_fwd`."""
    if STATIC:
        held = tl.minimum(tl.load(LENS), cap_len).to(tl.int32)  # as `decode._attn_fwd`
        n_sink = tl.minimum(held, SINK_CAP)
        npk = held - n_sink
        n_res = 0
        stop = held - n_new
        n_body = tl.maximum(tl.minimum(npk, stop - n_sink), 0)
        tiles_per_split = tl.cdiv(tl.cdiv(n_body, BLOCK_N), tl.maximum(n_splits, 1))
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    HALF: tl.constexpr = D // 2

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows (position t, head g of the group)
    row_ok = rows < Tq * G
    t = rows // G
    qoff = b * sq_b + (h * G + rows % G) * sq_h + t * sq_t
    d = tl.arange(0, D)
    e = tl.arange(0, HALF)
    n = tl.arange(0, BLOCK_N)
    s_total = stop + n_new
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    part = (pid_bh.to(tl.int64) * (m_tiles * BLOCK_M) + rows) * (n_splits + 1) + pid_s

    if pid_s < n_splits:
        # ------------------------------------------------------------------ packed tokens
        QT: tl.constexpr = tl.float16 if H16 else DT
        q1 = tl.load(Q + qoff[:, None] + e[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        q2 = tl.load(Q + qoff[:, None] + HALF + e[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        if ROPE:  # the rotary module's scaling, on the query once instead of on every key
            q1 = q1 * rope_scale
            q2 = q2 * rope_scale
        if H16:
            q1 = tl.minimum(tl.maximum(q1, -65504.0), 65504.0)
            q2 = tl.minimum(tl.maximum(q2, -65504.0), 65504.0)
        q1 = q1.to(QT)
        q2 = q2.to(QT)
        kc = KC + b * skc_b + h * skc_h
        koi = KOI + b * sko_b + h * sko_h
        kov = KOV + b * sko_b + h * sko_h
        kp = KP + b * skp_b
        vc = VC + b * svc_b + h * svc_h
        voi = VOI + b * svo_b + h * svo_h
        vov = VOV + b * svo_b + h * svo_h
        vlo = VLO + b * svl_b + h * svl_h
        vhi = VHI + b * svl_b + h * svl_h
        AT: tl.constexpr = tl.float16 if H16 else tl.float32  # the dequantization's arithmetic
        mid1 = tl.load(KMID + h * D + e)[None, :].to(AT)
        mid2 = tl.load(KMID + h * D + HALF + e)[None, :].to(AT)
        half1 = tl.load(KHALF + h * D + e)[None, :].to(AT)
        half2 = tl.load(KHALF + h * D + HALF + e)[None, :].to(AT)
        inv_freq = tl.load(INVF + e) if ROPE else e.to(tl.float32)
        kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7 = _tables(KCB, K_BITS)  # (dead code for the other lookups)
        vt0, vt1, vt2, vt3, vt4, vt5, vt6, vt7 = _tables(VCB, V_BITS)
        lo = pid_s * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, tl.cdiv(n_body, BLOCK_N))
        kw1n, kw2n, vwn, kin, kvn, vin, vvn, posn, v_lon, v_hin = _fetch(
            kc, koi, kov, kp, vc, voi, vov, vlo, vhi, lo, n_body, skc_t, sko_t, skp_t, svc_t, svo_t, svl_t,
            BLOCK_N, D, K_BITS, V_BITS, K_S, V_S, K_SP, V_SP, ROPE)
        for tile in range(lo, hi):
            tok = tile * BLOCK_N + n
            ok = tok < n_body
            kw1, kw2, vw, ki, kv, vi, vv, pos, v_lo, v_hi = kw1n, kw2n, vwn, kin, kvn, vin, vvn, posn, v_lon, v_hin
            kw1n, kw2n, vwn, kin, kvn, vin, vvn, posn, v_lon, v_hin = _fetch(
                kc, koi, kov, kp, vc, voi, vov, vlo, vhi, tl.minimum(tile + 1, hi - 1), n_body, skc_t, sko_t, skp_t,
                svc_t, svo_t, svl_t, BLOCK_N, D, K_BITS, V_BITS, K_S, V_S, K_SP, V_SP, ROPE)
            k1 = _dequant(kw1, ki, kv, KCB, 0, mid1, half1, K_BITS, K_S, K_SP, LOOKUP, K_ASM,
                          kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7, H16)
            k2 = _dequant(kw2, ki, kv, KCB, HALF, mid2, half2, K_BITS, K_S, K_SP, LOOKUP, K_ASM,
                          kt0, kt1, kt2, kt3, kt4, kt5, kt6, kt7, H16)
            if ROPE:
                cos, sin = _cos_sin(pos[:, None] * inv_freq[None, :], FAST_TRIG)
                cos = cos.to(k1.dtype)
                sin = sin.to(k1.dtype)
                r1 = k1 * cos - k2 * sin
                k2 = k2 * cos + k1 * sin
                k1 = r1
            s = dot(q1, tl.trans(k1.to(QT)), PREC, B_COPY) + dot(q2, tl.trans(k2.to(QT)), PREC, B_COPY)
            s = finish_scores(s, sm_scale, softcap, HAS_SOFTCAP)
            s = mask_scores(s, MASK, b, t, n_sink + tok, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK)
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            v_mid = ((v_hi + v_lo) / 2)[:, None].to(AT)
            v_half = ((v_hi - v_lo) / 2)[:, None].to(AT)
            vt = _dequant(vw, vi, vv, VCB, 0, v_mid, v_half, V_BITS, V_S, V_SP, LOOKUP, V_ASM,
                          vt0, vt1, vt2, vt3, vt4, vt5, vt6, vt7, H16)
            acc = acc * alpha[:, None] + dot(p.to(QT), vt.to(QT), PREC, B_COPY)
    else:
        # ------------------------------------------------------------------ exact tokens
        q = tl.load(Q + qoff[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        ks = KS + b * sks_b + h * sks_h
        kr = KR + b * skr_b + h * skr_h
        kn = KN + b * skn_b + h * skn_h
        vs = VS + b * svs_b + h * svs_h
        vr = VR + b * svr_b + h * svr_h
        vn = VN + b * svn_b + h * svn_h
        body_end = n_sink + n_body
        end = s_total
        if not HAS_MASK:
            t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
            end = tl.minimum(s_total, s_total - Tq + t_last + 1)
        n_first = tl.cdiv(n_sink, BLOCK_N)
        n_rest = tl.cdiv(tl.maximum(end - body_end, 0), BLOCK_N)
        for i in range(0, n_first + n_rest):
            start = tl.where(i < n_first, i * BLOCK_N, body_end + (i - n_first) * BLOCK_N)
            limit = tl.where(i < n_first, tl.minimum(n_sink, end), end)
            kpos = start + n
            ok = kpos < limit
            kt = _dense_tile(ks, kr, kn, sks_t, skr_t, skn_t, kpos[:, None], d[None, :], ok[:, None], n_sink,
                             npk, n_res, stop, n_new)
            s = finish_scores(dot(q, tl.trans(kt.to(DT)), PREC, B_COPY), sm_scale, softcap, HAS_SOFTCAP)
            s = mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK)
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            vt = _dense_tile(vs, vr, vn, svs_t, svr_t, svn_t, kpos[:, None], d[None, :], ok[:, None], n_sink,
                             npk, n_res, stop, n_new)
            acc = acc * alpha[:, None] + dot(p.to(DT), vt.to(DT), PREC, B_COPY)
    tl.store(ACC + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


@triton.jit
def _store_codes(C, row_off, x, MIDS, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, ok):
    """Nearest-centroid codes of normalized `x (BLOCK_T, D)` (the number of codebook midpoints below each value:
    `torch.bucketize(right=False)`, ties to the lower centroid), packed as a little-endian bit stream: every 8
    codes are BITS bytes."""
    code = tl.zeros((BLOCK_T, D), tl.int64)
    for j in tl.static_range((1 << BITS) - 1):
        code += (x > tl.load(MIDS + j)).to(tl.int64)
    word = tl.sum(tl.reshape(code, (BLOCK_T, D // 8, 8)) << (tl.arange(0, 8) * BITS)[None, None, :], 2)
    grp = tl.arange(0, D // 8)
    for i in tl.static_range(BITS):
        tl.store(C + row_off + (grp * BITS + i)[None, :], ((word >> (8 * i)) & 255).to(tl.uint8), mask=ok)


@triton.jit
def _top_slots(score, x, d, OI, OV, row_off, ok, S: tl.constexpr, NAN_IF_ZERO: tl.constexpr, D: tl.constexpr):
    """The S channels of largest `score (N, D)` per row (the lowest index among equals), stored as slots
    (uint8 channel, fp16 value of `x`); with NAN_IF_ZERO, a slot whose score is not positive is empty (NaN).
    Returns the mask of the chosen channels."""
    chosen = tl.zeros(score.shape, tl.int32) != 0
    for s in tl.static_range(S):
        best = tl.max(score, 1)
        idx = tl.min(tl.where(score == best[:, None], d, D), 1)
        hit = d == idx[:, None]
        val = tl.sum(tl.where(hit, x, 0.0), 1)
        if NAN_IF_ZERO:
            val = tl.where(best > 0, val, float("nan"))
        tl.store(OI + row_off + s, idx.to(tl.uint8), mask=ok)
        tl.store(OV + row_off + s, val.to(tl.float16), mask=ok)
        chosen = chosen | hit
        score = tl.where(hit, float("-inf"), score)
    return chosen


# Besides the token count, the positions' batch stride (the write's length) and the alignment of the per-token side
# fields (outlier slots, value ranges: a few bytes a token, so a write's first row decides it) are not specialized:
# each class compiled its own variant, 9 for a first `generate` (`hf-kvcache bench --parts compiles`), and a later
# prompt of another length compiled more. Their stores are a few bytes a token; vector stores gain nothing there.
@triton.jit(do_not_specialize=("T", "sp_b"), do_not_specialize_on_alignment=("OI", "OV", "VLO", "VHI"))
def _pack_nuq(
    X, sx_b, sx_h, sx_t, P, sp_b, sp_t, INVF, rope_scale, LO, HI, MID, HALF_, MIDS,
    C, sc_b, sc_h, sc_t, OI, OV, so_b, so_h, so_t, VLO, VHI, sv_b, sv_h, sv_t, T, H,
    D: tl.constexpr, BITS: tl.constexpr, S: tl.constexpr, KEYS: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Keys (`KVQuantKeyCodec.encode`): un-rotate RoPE at each token's position, normalize each channel by its
    calibrated range (MID/HALF_ (H, D)), code; slots take the channels farthest outside [LO, HI]. Values
    (`KVQuantValueCodec.encode`): slots take the largest magnitudes, the rest set each token's fp16 range
    (VLO/VHI, rounded outward), code."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    tok = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = tok[:, None] < T
    d = tl.arange(0, D)
    HALF: tl.constexpr = D // 2
    xrow = X + b * sx_b + h * sx_h + tok[:, None] * sx_t
    x = tl.load(xrow + d[None, :], mask=ok, other=0.0).to(tl.float32)  # (BLOCK_T, D)
    so = b * so_b + h * so_h + tok * so_t  # (BLOCK_T,)
    if KEYS:
        if ROPE:
            # the rotate-half partner of each channel, and the inverse rotation x cos -/+ partner sin
            partner = tl.load(xrow + ((d + HALF) % D)[None, :], mask=ok, other=0.0).to(tl.float32)
            pos = tl.load(P + b * sp_b + tok * sp_t, mask=tok < T, other=0).to(tl.float32)
            angle = pos[:, None] * tl.load(INVF + d % HALF)[None, :]
            sign = tl.where(d < HALF, 1.0, -1.0)[None, :]
            x = x * (tl.cos(angle) * rope_scale) + sign * partner * (tl.sin(angle) * rope_scale)
        lo = tl.load(LO + h * D + d)[None, :]
        hi = tl.load(HI + h * D + d)[None, :]
        distance = tl.maximum(x - hi, 0.0) + tl.maximum(lo - x, 0.0)
        _top_slots(distance, x, d[None, :], OI, OV, so, tok < T, S, True, D)
        nrm = tl.math.div_rn(x - tl.load(MID + h * D + d)[None, :], tl.load(HALF_ + h * D + d)[None, :])
    else:
        chosen = _top_slots(tl.abs(x), x, d[None, :], OI, OV, so, tok < T, S, False, D)
        v_lo = fp16_outward(tl.min(tl.where(chosen, float("inf"), x), 1), False)
        v_hi = fp16_outward(tl.max(tl.where(chosen, float("-inf"), x), 1), True)
        sv = b * sv_b + h * sv_h + tok * sv_t
        tl.store(VLO + sv, v_lo.to(tl.float16), mask=tok < T)
        tl.store(VHI + sv, v_hi.to(tl.float16), mask=tok < T)
        mid = (v_hi + v_lo) / 2
        half = tl.maximum((v_hi - v_lo) / 2, 1e-30)
        nrm = tl.math.div_rn(x - mid[:, None], half[:, None])
    nrm = tl.minimum(tl.maximum(nrm, -1.0), 1.0)
    _store_codes(C + b * sc_b + h * sc_h, tok[:, None] * sc_t, nrm, MIDS, BLOCK_T, D, BITS, ok)


@triton.jit
def _lookup_probe(C, OUT, CB, s_t, D: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, N: tl.constexpr):
    """The register lookup alone (tests): `OUT (N, D) fp16` = fp16(codebook)[code] of N rows of D channels' codes."""
    tok = tl.arange(0, N)[:, None]
    t0, t1, t2, t3, t4, t5, t6, t7 = _tables(CB, BITS)
    word = _words(C, tok * s_t, tok < N, 0, D, BITS)
    x = _lookup_registers(word, t0, t1, t2, t3, t4, t5, t6, t7, ASM)
    tl.store(OUT + tok * D + tl.arange(0, D)[None, :], x)


@triton.jit
def _put16_probe(X, I, V, OUT, N: tl.constexpr, D: tl.constexpr):
    """`_put16` alone (tests): `OUT (N, D) fp16` = X with V[row] at channel I[row] (int32, -1 = none)."""
    tok = tl.arange(0, N)[:, None]
    ch = tl.arange(0, D)[None, :]
    x = tl.load(X + tok * D + ch)
    i = tl.broadcast_to(tl.load(I + tok).to(tl.float16), x.shape)
    v = tl.broadcast_to(tl.load(V + tok), x.shape)
    tl.store(OUT + tok * D + ch, _put16(x, tl.broadcast_to(ch.to(tl.float16), x.shape), i, v))


# --------------------------------------------------------------------------- the register lookup's PTX

@functools.lru_cache(maxsize=None)
def lookup_asm(bits: int) -> str:
    """The PTX of `_lookup_registers` for `bits`-bit codes: input `$8` one word of 8 codes (the bit stream's 8 * bits
    bits, code 0 lowest) and `$9`..`$16` the byte tables of `_tables`; outputs `$0`..`$7` the 8 fp16 centroids.

    `prmt` picks four bytes out of the eight of two registers by four 3-bit selectors (the low 16 bits of its third
    operand, a nibble each). Codes of 2 and 3 bits are spread onto nibbles and select the low and the high bytes of
    their (up to 8) centroids in one `prmt` each; a 4-bit code's low 3 bits select in entries 0-7 and in 8-15, and
    its top bit picks one of the two (a third `prmt` whose selector is `i + 4 * top` for byte i). Two more `prmt`
    interleave the low and high bytes into fp16 pairs: about 3 instructions a code, against 2^bits compares and
    selects for the chain of `_lookup`."""
    if bits not in (2, 3, 4):
        raise ValueError(f"the register lookup reads 2, 3 or 4-bit codes, got {bits}")
    lines = ["{", ".reg .b32 r_s, r_c, r_x, r_y, r_la, r_lb, r_ha, r_hb, r_l, r_h, r_p;"]
    if bits == 4:
        lines += ["and.b32 r_s, $8, 0x77777777;",
                  "shr.b32 r_c, $8, 1; and.b32 r_c, r_c, 0x44444444; or.b32 r_c, r_c, 0x32103210;"]
    else:
        lines += ["mov.b32 r_x, $8;"]
    for half in range(2):
        if bits == 4:
            lines += ["prmt.b32 r_la, $9, $10, r_s; prmt.b32 r_lb, $11, $12, r_s;",
                      "prmt.b32 r_ha, $13, $14, r_s; prmt.b32 r_hb, $15, $16, r_s;",
                      "prmt.b32 r_l, r_la, r_lb, r_c; prmt.b32 r_h, r_ha, r_hb, r_c;"]
        else:
            mask = (1 << bits) - 1
            lines += [f"and.b32 r_s, r_x, {mask:#x};"]
            for k in range(1, 4):  # code k of the four onto nibble k
                lines += [f"shl.b32 r_y, r_x, {k * (4 - bits)}; and.b32 r_y, r_y, {mask << (4 * k):#x};",
                          "or.b32 r_s, r_s, r_y;"]
            lines += ["prmt.b32 r_l, $9, $10, r_s; prmt.b32 r_h, $13, $14, r_s;"]
        o = 4 * half
        lines += [f"prmt.b32 r_p, r_l, r_h, 0x5140; mov.b32 {{${o}, ${o + 1}}}, r_p;",
                  f"prmt.b32 r_p, r_l, r_h, 0x7362; mov.b32 {{${o + 2}, ${o + 3}}}, r_p;"]
        if half == 0:
            lines += (["shr.b32 r_s, r_s, 16; shr.b32 r_c, r_c, 16;"] if bits == 4
                      else [f"shr.b32 r_x, r_x, {4 * bits};"])
    return "\n".join(lines + ["}"])
