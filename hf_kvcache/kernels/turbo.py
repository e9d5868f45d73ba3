"""TurboQuant's layout in Triton (`layout.CodebookFormat`): decode attention straight from the codebook codes.

A stored vector is `x F` (F orthogonal: the codec's rotation, and for the energy split a per-sequence channel order),
its channels coded part by part against fixed codebooks with one length per token and part. Attention does not
see F: `q . k = (q F) . (k F)` and `sum_t p_t v_t = (sum_t p_t v_t F) F^T`. So the launcher
(`turbo_launch.turbo_attention`) rotates the query into the keys' frame once per step, and the body programs compute,
in the frame, with `n_{p,t}` the length and `c_p` the codebook of part p,

    s_t = sum_p n_{p,t} (q'_p . c_p[code_{p,t}]),      o'_p = sum_t softmax(s)_t n_{p,t} c_p[code_{p,t}]

the lengths applied to the scores and to the softmax weights, outside the products, which take the bare centroids.
Work split as in `decode.py`: split-K body programs over tiles of packed tokens (a last partial tile masked), tail
programs over the exact tokens (sinks, residual, new tokens, read where they lie) in the model's own frame, and
the combine kernel (`decode._combine` with FRAME) that rotates the body's sum back by F^T before adding the tails'.
The storage's layout (STATIC, `hf_kvcache.storage`) takes every count from the device's length, as `decode.py` does,
so that one CUDA graph serves every step (`torch.ops.hf_kvcache.static_turbo_attention` under torch.compile). No
product with F runs inside a program: an exact fp32 one there (Triton's FMA path) cost ~60 us a program on the H200
(BENCHMARKS.md).

Codebook lookup (`LOOKUP`):
- 2, in registers (fp16 products, not the interpreter): inline PTX on 32-bit words of codes. `prmt` picks bytes out
  of 8 held in two registers by 3-bit selectors, four at a time, so the low and the high bytes of the fp16 centroids
  are two tables of immediates: a 2- or 3-bit codebook whole, a 4-bit one's 8 magnitudes, its sign from the code's
  top bit (sign-magnitude order). About 1.5 (2 bits) to 2.5 (4 bits) instructions a code.
- 1, a load of `codebook[code]` per code (the table stays in L1): fp32 models and the interpreter.

A stream of one 4-bit part (`turboquant-4`'s keys and values, `turboquant-3.5`'s keys; head_dim 128 or 256) is
multiplied by plane (K_PLANES, V_PLANES, `TUNING["turbo_planes"]`): its codes are read as 16-bit halves, the register
lookup (`lookup_asm_halves`) turns two halves into plane i's centroids of both (channels 4j + i), and each plane is
the operand of its own product (the query's channels 4j + i; the weighted sums stored to them), in the layout the codes
were read in: Triton then reads the codes from shared memory straight into the products' layout, with no tile joined
from the lookup's outputs and sent through shared memory again (51.9 -> 38.5 warp instructions a held token of
`turboquant-4` for sm_90, `hf-kvcache bench --parts sass`, BENCHMARKS.md 2026-12-05). A key stream of one 3-bit part
(`turboquant-2.75`) goes by 8 planes (channels 8j + i, `lookup_asm_eighths`: the 2-bit plane's 16-bit halves beside
their top-bit bytes; 57.9 -> 51.6); 3-bit values stay one tile, as their eight products 16 wide were copied on every
warp and spilled.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (centroids, codes_3bit, dot, dot_into, exact_tile, finish_scores, mask_scores, norms,
                    planes_into, q_plane, row_of, softmax_step, static_places, unpack)


LOOKUP_LOAD = 1
LOOKUP_REGISTERS = 2


@triton.jit
def _half_planes(C, CB, tok, ok, s_t, W: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr, PDT: tl.constexpr):
    """codebook[code] of a 4-bit part as 4 planes of 16-bit halves: plane i (BLOCK_N, W / 4) holds channels 4j + i,
    straight from the lookup (`lookup_asm_halves`: two halves a register, so that each output register holds a pair
    of neighbours along j, as a product's operand does)."""
    if LOOKUP == 2:
        ptr = C.to(tl.pointer_type(tl.int16))
        h = tl.load(ptr + (tok * (s_t // 2))[:, None] + tl.arange(0, W // 4)[None, :], mask=ok[:, None], other=0)
        o = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [h], dtype=(tl.float16, tl.float16, tl.float16,
                                                                        tl.float16), is_pure=True, pack=2)
        x0, x1, x2, x3 = o[0], o[1], o[2], o[3]
    else:
        ch = 4 * tl.arange(0, W // 4)[None, :]
        row = (tok * s_t)[:, None]
        x0 = tl.load(CB + unpack(C, row, ch, ok[:, None], 4)).to(PDT)
        x1 = tl.load(CB + unpack(C, row, ch + 1, ok[:, None], 4)).to(PDT)
        x2 = tl.load(CB + unpack(C, row, ch + 2, ok[:, None], 4)).to(PDT)
        x3 = tl.load(CB + unpack(C, row, ch + 3, ok[:, None], 4)).to(PDT)
    return x0, x1, x2, x3


@triton.jit
def _eighth_planes(C, CB, tok, ok, s_t, W: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr,
                   PDT: tl.constexpr):
    """codebook[code] of a 3-bit part as 8 planes: plane k (BLOCK_N, W / 8) holds channels 8j + k, straight from the
    lookup (`lookup_asm_eighths`: the 2-bit plane read as 16-bit halves, 8 channels each, beside their top-bit bytes,
    two of each a lookup, so that each output register holds a pair of neighbours along j, as a product's operand
    does)."""
    jj = tl.arange(0, W // 8)
    if LOOKUP == 2:
        ptr = C.to(tl.pointer_type(tl.int16))
        h = tl.load(ptr + (tok * (s_t // 2))[:, None] + jj[None, :], mask=ok[:, None], other=0)
        top = tl.load(C + W // 4 + (tok * s_t)[:, None] + jj[None, :], mask=ok[:, None], other=0).to(tl.int16)
        o = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [h, top],
                                      dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                                             tl.float16, tl.float16), is_pure=True, pack=2)
        x0, x1, x2, x3, x4, x5, x6, x7 = o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]
    else:
        ch = 8 * jj[None, :]
        row = (tok * s_t)[:, None]
        x0 = tl.load(CB + codes_3bit(C, row, ch, ok[:, None], W)).to(PDT)
        x1 = tl.load(CB + codes_3bit(C, row, ch + 1, ok[:, None], W)).to(PDT)
        x2 = tl.load(CB + codes_3bit(C, row, ch + 2, ok[:, None], W)).to(PDT)
        x3 = tl.load(CB + codes_3bit(C, row, ch + 3, ok[:, None], W)).to(PDT)
        x4 = tl.load(CB + codes_3bit(C, row, ch + 4, ok[:, None], W)).to(PDT)
        x5 = tl.load(CB + codes_3bit(C, row, ch + 5, ok[:, None], W)).to(PDT)
        x6 = tl.load(CB + codes_3bit(C, row, ch + 6, ok[:, None], W)).to(PDT)
        x7 = tl.load(CB + codes_3bit(C, row, ch + 7, ok[:, None], W)).to(PDT)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _lengths(kna, knb, vna, vnb, tok, ok, skna_t, sknb_t, svna_t, svnb_t, K_TWO: tl.constexpr, V_TWO: tl.constexpr):
    """The lengths of the four parts (keys A, B, values A, B) for tokens `tok`; a single part's B repeats its A."""
    ka = norms(kna, tok, ok, skna_t)
    kb = ka
    if K_TWO:
        kb = norms(knb, tok, ok, sknb_t)
    va = norms(vna, tok, ok, svna_t)
    vb = va
    if V_TWO:
        vb = norms(vnb, tok, ok, svnb_t)
    return ka, kb, va, vb


# as `decode._VARYING`: integers that change from step to step are not specialized (no recompiles between tokens)
_VARYING = ("sm_b", "sm_t", "sm_s", "Tq", "n_sink", "n_body", "stop", "n_new", "tiles_per_split", "n_splits",
            "n_tail", "m_tiles")


@triton.jit(do_not_specialize=_VARYING)
def _turbo_attn(
    Q, sq_b, sq_h, sq_t, QR, sqr_b, sqr_h, sqr_t,
    KCA, skca_b, skca_h, skca_t, KNA, skna_b, skna_h, skna_t, KBA,
    KCB, skcb_b, skcb_h, skcb_t, KNB, sknb_b, sknb_h, sknb_t, KBB,
    VCA, svca_b, svca_h, svca_t, VNA, svna_b, svna_h, svna_t, VBA,
    VCB, svcb_b, svcb_h, svcb_t, VNB, svnb_b, svnb_h, svnb_t, VBB,
    KS, sks_b, sks_h, sks_t, KR, skr_b, skr_h, skr_t, KN, skn_b, skn_h, skn_t,
    VS, svs_b, svs_h, svs_t, VR, svr_b, svr_h, svr_t, VN, svn_b, svn_h, svn_t,
    MASK, sm_b, sm_t, sm_s,
    ACC, M_OUT, L_OUT, LENS, cap_len,
    Hkv, Tq, n_sink, n_body, stop, n_new, tiles_per_split, n_splits, n_tail, m_tiles,
    sm_scale, softcap,
    D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
    DT: tl.constexpr, PDT: tl.constexpr, PREC: tl.constexpr, HAS_MASK: tl.constexpr, MASK_ROW: tl.constexpr,
    MASK_AHEAD: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, CAUSAL_BODY: tl.constexpr, BODY: tl.constexpr, LOOKUP: tl.constexpr,
    K_TWO: tl.constexpr, K_WA: tl.constexpr, K_BA: tl.constexpr, K_BB: tl.constexpr,
    V_TWO: tl.constexpr, V_WA: tl.constexpr, V_BA: tl.constexpr, V_BB: tl.constexpr,
    K_ASM_A: tl.constexpr, K_ASM_B: tl.constexpr, V_ASM_A: tl.constexpr, V_ASM_B: tl.constexpr,
    STATIC: tl.constexpr = False, SINK_CAP: tl.constexpr = 0, RING: tl.constexpr = 0, WINDOW: tl.constexpr = False,
    K_PLANES: tl.constexpr = 0, V_PLANES: tl.constexpr = 0, K_ASM_H: tl.constexpr = "",
    V_ASM_H: tl.constexpr = "", B_COPY: tl.constexpr = False,  # the lookups' tiles through `tiles.opaque`
    ROW_LENS: tl.constexpr = False,  # STATIC: `LENS` holds one length per batch row (packed pages), not one for all
):
    """Partial softmax results of one (batch row x kv-head, split, tile of query rows), the body's in the values'
    frame, the tail's in the model's: `Q` the query in the keys' frame (B, Hq, Tq, D) float32 (the body's), `QR` the
    query as the model gives it (the tail's); per stream up to two parts (A: channels 0..WA, B: WA..D), codes +
    lengths + codebook; the exact places as stored, per stream: sinks `S`, residual `R` (its first row the oldest),
    this step's `n_new` tokens `N`. Token order: n_sink sinks, n_body packed, the residual up to `stop` (the held
    tokens before the new ones), n_new new.

    STATIC (the storage's layout, `hf_kvcache.storage`): the counts come from the device (`LENS`: the tokens held, at
    most `cap_len`), the residual is a ring of RING rows (`tiles.static_places`), the launch is sized for the capacity
    and programs past the filled tiles find empty ranges, as in `decode._attn_fwd`."""
    if STATIC:
        held = tl.minimum(tl.load(LENS + row_of(tl.program_id(0), Hkv, ROW_LENS)), cap_len).to(tl.int32)
        n_sink = tl.minimum(held, SINK_CAP)
        n_packed, _, r_off = static_places(held - n_sink, RING, WINDOW)
        stop = held - n_new
        n_body = tl.maximum(tl.minimum(n_packed, stop - n_sink), 0)
        tiles_per_split = tl.cdiv(tl.cdiv(n_body, BLOCK_N), tl.maximum(n_splits, 1))
    else:
        r_off = 0
    s_total = stop + n_new
    n_tiles = tl.cdiv(n_body, BLOCK_N)
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Tq * G
    t = rows // G
    qoff = b * sq_b + (h * G + rows % G) * sq_h + t * sq_t
    d = tl.arange(0, D)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    split = pid_s if BODY else n_splits + pid_s  # the tail programs' partial results go last
    part = (pid_bh.to(tl.int64) * (m_tiles * BLOCK_M) + rows) * (n_splits + n_tail) + split
    if BODY:
        K_WB: tl.constexpr = D - K_WA if K_TWO else K_WA  # (a single part: B is never read)
        V_WB: tl.constexpr = D - V_WA if V_TWO else V_WA
        # (the query comes rotated: an exact fp32 product with F here cost ~60 us a program, BENCHMARKS.md runs 5-8)
        qa = tl.load(Q + qoff[:, None] + tl.arange(0, K_WA)[None, :], mask=row_ok[:, None], other=0.0)
        qb = qa
        if K_TWO:
            qb = tl.load(Q + qoff[:, None] + K_WA + tl.arange(0, K_WB)[None, :], mask=row_ok[:, None], other=0.0)
        q_pow2 = 1.0
        if PDT == tl.float16:  # a power of two that keeps the query inside fp16's range (1 unless |q| >= 2^15)
            q_max = tl.max(tl.max(tl.abs(qa), 1), 0)
            if K_TWO:
                q_max = tl.maximum(q_max, tl.max(tl.max(tl.abs(qb), 1), 0))
            q_pow2 = tl.exp2(-tl.maximum(tl.ceil(tl.log2(tl.maximum(q_max, 1e-30) * (1.0 / 32768.0))), 0.0))
        qa = (qa * q_pow2).to(PDT)
        qb = (qb * q_pow2).to(PDT)
        # one factor a token multiplies the raw scores: its length, the query's power of two, the softmax scale
        # and log2(e) at once (the soft cap needs the scaled score first)
        if HAS_SOFTCAP:
            unit = 1.0 / q_pow2
        else:
            unit = sm_scale * 1.4426950408889634 / q_pow2
        kca = KCA + b * skca_b + h * skca_h
        kna = KNA + b * skna_b + h * skna_h
        kcb = KCB + b * skcb_b + h * skcb_h
        knb = KNB + b * sknb_b + h * sknb_h
        vca = VCA + b * svca_b + h * svca_h
        vna = VNA + b * svna_b + h * svna_h
        vcb = VCB + b * svcb_b + h * svcb_h
        vnb = VNB + b * svnb_b + h * svnb_h
        acc_a = tl.zeros((BLOCK_M, V_WA), tl.float32)
        acc_b = tl.zeros((BLOCK_M, V_WB), tl.float32)
        if V_PLANES:  # one 4-bit part: the weighted sums by plane of halves (channels 4j + i), see `_half_planes`
            a0 = tl.zeros((BLOCK_M, D // 4), tl.float32)
            a1 = a0
            a2 = a0
            a3 = a0
        if K_PLANES:  # one 4- or 3-bit part: the query by plane (channels K_PLANES * j + i)
            jq = tl.arange(0, D // K_PLANES)
            q0 = (q_plane(Q, qoff, row_ok, jq, 0, K_PLANES) * q_pow2).to(PDT)
            q1 = (q_plane(Q, qoff, row_ok, jq, 1, K_PLANES) * q_pow2).to(PDT)
            q2 = (q_plane(Q, qoff, row_ok, jq, 2, K_PLANES) * q_pow2).to(PDT)
            q3 = (q_plane(Q, qoff, row_ok, jq, 3, K_PLANES) * q_pow2).to(PDT)
            q4 = q0
            q5 = q0
            q6 = q0
            q7 = q0
            if K_PLANES == 8:
                q4 = (q_plane(Q, qoff, row_ok, jq, 4, 8) * q_pow2).to(PDT)
                q5 = (q_plane(Q, qoff, row_ok, jq, 5, 8) * q_pow2).to(PDT)
                q6 = (q_plane(Q, qoff, row_ok, jq, 6, 8) * q_pow2).to(PDT)
                q7 = (q_plane(Q, qoff, row_ok, jq, 7, 8) * q_pow2).to(PDT)
        lo = pid_s * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, n_tiles)
        # The lengths are loaded one tile ahead (as `tiles.side` loads scales), so that their latency overlaps a
        # tile's work; an empty range loads tile 0's, masked.
        n = tl.arange(0, BLOCK_N)
        first = tl.where(lo < hi, lo, 0) * BLOCK_N + n
        nka, nkb, nva, nvb = _lengths(kna, knb, vna, vnb, first, first < n_body, skna_t, sknb_t, svna_t, svnb_t,
                                      K_TWO, V_TWO)
        # a decode step's mask row a tile ahead as well (`decode._attn_fwd`, MASK_AHEAD)
        mask_row = MASK + b * sm_b + n_sink * sm_s
        allowed_nx = tl.zeros((BLOCK_N,), tl.uint8)
        if HAS_MASK and MASK_ROW and MASK_AHEAD:
            allowed_nx = tl.load(mask_row + first * sm_s, mask=first < tl.where(lo < hi, n_body, 0), other=0)
        for tile in range(lo, hi):
            tok = tile * BLOCK_N + n
            ok = tok < n_body
            ka_len, kb_len, va_len, vb_len = nka, nkb, nva, nvb
            nxt = tl.minimum(tile + 1, hi - 1) * BLOCK_N + n
            nka, nkb, nva, nvb = _lengths(kna, knb, vna, vnb, nxt, nxt < n_body, skna_t, sknb_t, svna_t, svnb_t,
                                          K_TWO, V_TWO)
            allowed = allowed_nx
            if HAS_MASK and MASK_ROW and MASK_AHEAD:
                allowed_nx = tl.load(mask_row + nxt * sm_s, mask=nxt < n_body, other=0)
            # ---- scores: per part, the bare centroids' products times the part's lengths
            if K_PLANES == 4:
                # one accumulator through the four products (the tensor cores add them)
                k0, k1, k2, k3 = _half_planes(kca, KBA, tok, ok, skca_t, D, LOOKUP, K_ASM_H, PDT)
                s = dot(q0, tl.trans(k0), PREC)
                s = dot_into(s, q1, tl.trans(k1), PREC)
                s = dot_into(s, q2, tl.trans(k2), PREC)
                s = dot_into(s, q3, tl.trans(k3), PREC)
                s = s * (ka_len * unit)[None, :]
            elif K_PLANES == 8:
                k0, k1, k2, k3, k4, k5, k6, k7 = _eighth_planes(kca, KBA, tok, ok, skca_t, D, LOOKUP, K_ASM_H, PDT)
                s = dot(q0, tl.trans(k0), PREC)
                s = dot_into(s, q1, tl.trans(k1), PREC)
                s = dot_into(s, q2, tl.trans(k2), PREC)
                s = dot_into(s, q3, tl.trans(k3), PREC)
                s = dot_into(s, q4, tl.trans(k4), PREC)
                s = dot_into(s, q5, tl.trans(k5), PREC)
                s = dot_into(s, q6, tl.trans(k6), PREC)
                s = dot_into(s, q7, tl.trans(k7), PREC)
                s = s * (ka_len * unit)[None, :]
            else:
                kt = centroids(kca, KBA, tok, ok, skca_t, BLOCK_N, K_WA, K_BA, LOOKUP, K_ASM_A, PDT, B_COPY)
                s = dot(qa, tl.trans(kt), PREC) * (ka_len * unit)[None, :]
            if K_TWO:
                kt = centroids(kcb, KBB, tok, ok, skcb_t, BLOCK_N, K_WB, K_BB, LOOKUP, K_ASM_B, PDT, B_COPY)
                s += dot(qb, tl.trans(kt), PREC) * (kb_len * unit)[None, :]
            if HAS_SOFTCAP:
                s = finish_scores(s, sm_scale, softcap, HAS_SOFTCAP)
            kpos = n_sink + tok
            s = tl.where(ok[None, :], s, float("-inf"))
            if HAS_MASK and MASK_ROW:
                if not MASK_AHEAD:
                    allowed = tl.load(mask_row + tok * sm_s, mask=ok, other=0)
                s = tl.where(allowed[None, :] != 0, s, float("-inf"))
            elif HAS_MASK:
                allowed = tl.load(MASK + b * sm_b + t[:, None] * sm_t + kpos[None, :] * sm_s,
                                  mask=row_ok[:, None] & ok[None, :], other=0)
                s = tl.where(allowed != 0, s, float("-inf"))
            elif CAUSAL_BODY:
                s = tl.where(kpos[None, :] <= (s_total - Tq + t)[:, None], s, float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            # ---- values: the weights times each part's lengths (p <= 1 and an fp16 length: inside fp16's
            # range), then the bare centroids
            if V_PLANES:
                pv = (p * va_len[None, :]).to(PDT)
                v0, v1, v2, v3 = _half_planes(vca, VBA, tok, ok, svca_t, D, LOOKUP, V_ASM_H, PDT)
                a0, a1, a2, a3 = planes_into(a0, a1, a2, a3, alpha, pv, v0, v1, v2, v3, 4, PREC)
            else:
                vt = centroids(vca, VBA, tok, ok, svca_t, BLOCK_N, V_WA, V_BA, LOOKUP, V_ASM_A, PDT, B_COPY)
                acc_a = acc_a * alpha[:, None] + dot((p * va_len[None, :]).to(PDT), vt, PREC)
            if V_TWO:
                vt = centroids(vcb, VBB, tok, ok, svcb_t, BLOCK_N, V_WB, V_BB, LOOKUP, V_ASM_B, PDT, B_COPY)
                acc_b = acc_b * alpha[:, None] + dot((p * vb_len[None, :]).to(PDT), vt, PREC)
        ptr = ACC + part[:, None] * D
        if V_PLANES:
            jh = 4 * tl.arange(0, D // 4)
            tl.store(ptr + jh[None, :], a0, mask=row_ok[:, None])
            tl.store(ptr + (jh + 1)[None, :], a1, mask=row_ok[:, None])
            tl.store(ptr + (jh + 2)[None, :], a2, mask=row_ok[:, None])
            tl.store(ptr + (jh + 3)[None, :], a3, mask=row_ok[:, None])
        else:
            tl.store(ptr + tl.arange(0, V_WA)[None, :], acc_a, mask=row_ok[:, None])
        if V_TWO:
            tl.store(ptr + V_WA + tl.arange(0, V_WB)[None, :], acc_b, mask=row_ok[:, None])
    else:
        # ---- tail: the exact tokens as stored, in the model's frame (q . k is the same in both), in the model
        # dtype like `decode.py`'s; its weighted sum stays in the model's frame (`decode._combine` adds it after
        # rotating the body's)
        n = tl.arange(0, TAIL_N)
        qroff = b * sqr_b + (h * G + rows % G) * sqr_h + t * sqr_t
        qd = tl.load(QR + qroff[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        ks = KS + b * sks_b + h * sks_h
        kr = KR + b * skr_b + h * skr_h
        kn = KN + b * skn_b + h * skn_h
        vs = VS + b * svs_b + h * svs_h
        vr = VR + b * svr_b + h * svr_h
        vn = VN + b * svn_b + h * svn_h
        body_end = n_sink + n_body
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for i in range(pid_s, tl.cdiv(s_total - n_body, TAIL_N), n_tail):  # tile i to program i mod n_tail
            e = i * TAIL_N + n  # the i-th exact token: sinks, then past the body
            ok = e < s_total - n_body
            kpos = tl.where(e < n_sink, e, e + n_body)
            kt = exact_tile(ks, kr, kn, sks_t, skr_t, skn_t, kpos[:, None], d[None, :], ok[:, None], n_sink,
                             body_end, stop, r_off, DT, RING)
            s = finish_scores(dot(qd, tl.trans(kt), PREC), sm_scale, softcap, HAS_SOFTCAP)
            s = mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK)
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            vt = exact_tile(vs, vr, vn, svs_t, svr_t, svn_t, kpos[:, None], d[None, :], ok[:, None], n_sink,
                             body_end, stop, r_off, DT, RING)
            acc = acc * alpha[:, None] + dot(p.to(DT), vt, PREC)
        tl.store(ACC + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


@triton.jit
def _lookup_probe(C, OUT, CB, s_t, W: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr, N: tl.constexpr):
    """The register lookup alone (tests): `OUT (N, W) fp16` = codebook[code] of N rows of one part's codes."""
    tok = tl.arange(0, N)
    x = centroids(C, CB, tok, tok < N, s_t, N, W, BITS, 2, ASM, tl.float16)
    tl.store(OUT + tok[:, None] * W + tl.arange(0, W)[None, :], x)


# --------------------------------------------------------------------------- the lookup's PTX, built per codebook

def _table_words(halves: list[int]) -> tuple[int, int, int, int]:
    """fp16 bit patterns of up to 8 entries -> (low bytes of 0-3, of 4-7, high bytes of 0-3, of 4-7) as words."""
    halves = list(halves) + [0] * (8 - len(halves))

    def word(bs):
        return sum(v << (8 * i) for i, v in enumerate(bs))

    lo = [v & 0xFF for v in halves]
    hi = [v >> 8 for v in halves]
    return word(lo[:4]), word(lo[4:]), word(hi[:4]), word(hi[4:])


def lookup_asm_halves(halves: list[int]) -> str:
    """The PTX of `_half_planes` for a 4-bit codebook (`halves`: its 16 entries as fp16 bit patterns, sign-magnitude
    order): input `$4` two 16-bit halves of codes (channels 4j .. 4j + 3 and 4j' .. 4j' + 3, code k in nibble k),
    outputs `$0`..`$3` plane k's centroids of both halves (j's in the low 16 bits). For each pair of planes, a `prmt`
    gathers their four codes onto one selector; the magnitude tables give low and high bytes, two more `prmt` pair
    them, and the sign (bit 3, 1 = positive) is flipped in by a `prmt` of the selector and a `lop3`."""
    mags = halves[8:]
    if len(halves) != 16 or any(v >> 15 for v in mags) or any(halves[c] != mags[c] | 0x8000 for c in range(8)):
        raise ValueError("a 4-bit codebook read in registers must have 16 entries in sign-magnitude order (code c "
                         "below 8 the negative of code 8 + c)")
    lo0, lo1, hi0, hi1 = _table_words(mags)
    lines = [
        "{", ".reg .b32 r_s, r_m, r_w4, r_l, r_h, r_p, r_g, r_tl0, r_tl1, r_th0, r_th1, r_sgn;",
        f"mov.b32 r_tl0, {lo0:#x}; mov.b32 r_tl1, {lo1:#x}; mov.b32 r_th0, {hi0:#x}; mov.b32 r_th1, {hi1:#x};",
        "mov.b32 r_sgn, 0x80008000;",
    ]
    for k, gather in ((0, "0x4420"), (2, "0x4431")):  # planes 0, 1: bytes 0 and 2 of the input; 2, 3: bytes 1, 3
        lines += [
            f"prmt.b32 r_s, $4, 0, {gather}; and.b32 r_m, r_s, 0x7777;",  # nibbles: k of j, k + 1 of j, k of j', ...
            "prmt.b32 r_l, r_tl0, r_tl1, r_m; prmt.b32 r_h, r_th0, r_th1, r_m; shl.b32 r_w4, r_s, 4;",
            f"prmt.b32 r_p, r_l, r_h, 0x6240; prmt.b32 r_g, r_w4, 0, 0x1404; lop3.b32 ${k}, r_p, r_g, r_sgn, 0xD2;",
            f"prmt.b32 r_p, r_l, r_h, 0x7351; prmt.b32 r_g, r_s, 0, 0x1404; lop3.b32 ${k + 1}, r_p, r_g, r_sgn, 0xD2;",
        ]
    return "\n".join(lines + ["}"])


def lookup_asm_eighths(halves: list[int]) -> str:
    """The PTX of `_eighth_planes` for a 3-bit codebook (`halves`: its 8 entries as fp16 bit patterns, code order):
    inputs `$8` two 16-bit halves of the 2-bit plane (channels 8j .. 8j + 7 and 8j' .. 8j' + 7, code bits 2c..2c+1 of
    channel c) and `$9` their two top-bit bytes as 16-bit halves (bit c: channel c's third bit), outputs `$0`..`$7`
    plane k's centroids of both (j's in the low 16 bits). For each pair of planes (k, k + 2) a `prmt` gathers their
    four 2-bit codes onto one selector, a `lop3` ors in their top bits (shifted onto bit 2 of each nibble), and the
    8-entry tables of low and high bytes give the centroids, which two more `prmt` pair."""
    if len(halves) != 8:
        raise ValueError("a 3-bit codebook has 8 entries")
    lo0, lo1, hi0, hi1 = _table_words(halves)
    lines = [
        "{", ".reg .b32 r_a, r_b, r_t, r_s, r_y, r_l, r_h, r_tl0, r_tl1, r_th0, r_th1;",
        ".reg .b32 r_u1, r_u2, r_u3, r_u4, r_d1, r_d2, r_d3;",
        f"mov.b32 r_tl0, {lo0:#x}; mov.b32 r_tl1, {lo1:#x}; mov.b32 r_th0, {hi0:#x}; mov.b32 r_th1, {hi1:#x};",
        # byte k of a: channels 4k (low nibble) and 4k + 2 (high nibble); of b: 4k + 1 and 4k + 3
        "and.b32 r_a, $8, 0x33333333; shr.b32 r_b, $8, 2; and.b32 r_b, r_b, 0x33333333;",
        # the top bits of both halves in bits 0-7 (j) and 8-15 (j'), and each shift that lands one on a nibble's bit 2
        "prmt.b32 r_t, $9, 0, 0x4420;",
        "shl.b32 r_u1, r_t, 1; shl.b32 r_u2, r_t, 2; shl.b32 r_u3, r_t, 3; shl.b32 r_u4, r_t, 4;",
        "shr.b32 r_d1, r_t, 1; shr.b32 r_d2, r_t, 2; shr.b32 r_d3, r_t, 3;",
    ]
    # (planes k, k + 2; codes from; bytes gathered; the top bits' shifts for nibbles 0, 2 (j's, j''s plane k) and 1, 3)
    for k, src, gather, even, odd in ((0, "r_a", "0x4420", "r_u2", "r_u4"), (4, "r_a", "0x4431", "r_d2", "r_t"),
                                      (1, "r_b", "0x4420", "r_u1", "r_u3"), (5, "r_b", "0x4431", "r_d3", "r_d1")):
        lines += [
            f"prmt.b32 r_s, {src}, 0, {gather}; lop3.b32 r_y, {even}, {odd}, 0x0F0F, 0xE4;",
            "lop3.b32 r_s, r_s, r_y, 0x4444, 0xF8;",  # selector nibbles: k of j, k + 2 of j, k of j', k + 2 of j'
            "prmt.b32 r_l, r_tl0, r_tl1, r_s; prmt.b32 r_h, r_th0, r_th1, r_s;",
            f"prmt.b32 ${k}, r_l, r_h, 0x6240; prmt.b32 ${k + 2}, r_l, r_h, 0x7351;",
        ]
    return "\n".join(lines + ["}"])


def lookup_asm(bits: int, halves: list[int]) -> str:
    """The PTX of `centroids`' register lookup for one codebook: `halves`, its 2^bits entries in code order as fp16
    bit patterns. 4 bits: input one word of 8 codes, outputs the 8 fp16 centroids; 2 and 3 bits: inputs one word of
    the 2-bit plane (16 channels) and, for 3 bits, those channels' 16 top bits; outputs 16 centroids."""
    if bits == 4:
        mags = halves[8:]
        if any(v >> 15 for v in mags):
            raise ValueError("a 4-bit codebook read in registers must be in sign-magnitude order")
        lo0, lo1, hi0, hi1 = _table_words(mags)
        lines = [
            "{", ".reg .b32 r_m, r_mh, r_l0, r_h0, r_l1, r_h1, r_w4, r_p, r_g, r_tl0, r_tl1, r_th0, r_th1, r_sgn;",
            f"mov.b32 r_tl0, {lo0:#x}; mov.b32 r_tl1, {lo1:#x}; mov.b32 r_th0, {hi0:#x}; mov.b32 r_th1, {hi1:#x};",
            "mov.b32 r_sgn, 0x80008000;",
            "and.b32 r_m, $8, 0x77777777; shr.b32 r_mh, r_m, 16;",  # magnitudes: selectors of channels 0-3, 4-7
            "prmt.b32 r_l0, r_tl0, r_tl1, r_m; prmt.b32 r_h0, r_th0, r_th1, r_m;",
            "prmt.b32 r_l1, r_tl0, r_tl1, r_mh; prmt.b32 r_h1, r_th0, r_th1, r_mh;",
            "shl.b32 r_w4, $8, 4;",
        ]
        # pairs (0,1), (2,3) from l0/h0 and (4,5), (6,7) from l1/h1; the signs (bit 3 of each code, 1 = positive)
        # moved onto bits 15 and 31 by a byte permutation of the word and of the word shifted by 4, flipped where 0
        for k, (pair, sign) in enumerate([("0x5140", "0x4000"), ("0x7362", "0x5010"), ("0x5140", "0x6020"),
                                           ("0x7362", "0x7030")]):
            src = "r_l0, r_h0" if k < 2 else "r_l1, r_h1"
            lines += [f"prmt.b32 r_p, {src}, {pair}; prmt.b32 r_g, r_w4, $8, {sign};",
                      "lop3.b32 r_p, r_p, r_g, r_sgn, 0xD2;", f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, r_p;"]
        return "\n".join(lines + ["}"])
    lo0, lo1, hi0, hi1 = _table_words(halves)
    if bits == 2:
        lo1, hi1 = lo0, hi0
    lines = [
        "{", ".reg .b32 r_a, r_b, r_x, r_y, r_s, r_l, r_h, r_p, r_tl0, r_tl1, r_th0, r_th1, r_m4, r_m40, r_0;",
        f"mov.b32 r_tl0, {lo0:#x}; mov.b32 r_tl1, {lo1:#x}; mov.b32 r_th0, {hi0:#x}; mov.b32 r_th1, {hi1:#x};",
        # the word's 2-bit codes: a holds channels 4k (low nibble of byte k) and 4k + 2, b channels 4k + 1, 4k + 3
        "and.b32 r_a, $16, 0x33333333; shr.b32 r_b, $16, 2; and.b32 r_b, r_b, 0x33333333;",
    ]
    if bits == 3:
        # the top bits of channels 4k..4k+3 into byte k (x), then onto bit 2 of each selector nibble
        lines += [
            "mov.b32 r_m4, 0x04040404; mov.b32 r_m40, 0x40404040; mov.b32 r_0, 0;",
            "prmt.b32 r_x, $17, r_0, 0x4140; shl.b32 r_y, r_x, 4; or.b32 r_x, r_x, r_y; and.b32 r_x, r_x, 0x0F0F0F0F;",
            "shl.b32 r_y, r_x, 2; lop3.b32 r_a, r_y, r_m4, r_a, 0xEA;",
            "shl.b32 r_y, r_x, 4; lop3.b32 r_a, r_y, r_m40, r_a, 0xEA;",
            "shl.b32 r_y, r_x, 1; lop3.b32 r_b, r_y, r_m4, r_b, 0xEA;",
            "shl.b32 r_y, r_x, 3; lop3.b32 r_b, r_y, r_m40, r_b, 0xEA;",
        ]
    # selectors: a (channels 0,2,4,6), a >> 16 (8,10,12,14), b (1,3,5,7), b >> 16 (9,11,13,15)
    for src, shift, chans in (("r_a", 0, (0, 2, 4, 6)), ("r_a", 16, (8, 10, 12, 14)), ("r_b", 0, (1, 3, 5, 7)),
                              ("r_b", 16, (9, 11, 13, 15))):
        lines += [f"shr.b32 r_s, {src}, {shift};",
                  "prmt.b32 r_l, r_tl0, r_tl1, r_s; prmt.b32 r_h, r_th0, r_th1, r_s;",
                  f"prmt.b32 r_p, r_l, r_h, 0x5140; mov.b32 {{${chans[0]}, ${chans[1]}}}, r_p;",
                  f"prmt.b32 r_p, r_l, r_h, 0x7362; mov.b32 {{${chans[2]}, ${chans[3]}}}, r_p;"]
    return "\n".join(lines + ["}"])
