"""Fused attention over a quantized layer: one Triton kernel reads the sink, the packed codes and scales, the
residual and the exact new tokens, dequantizes in registers and runs an online fp32 softmax; a second small
kernel combines the split-K partial results (flash-decoding).

Work split, per (batch row, kv-head, tile of query rows):
- body programs (`n_splits` of them) each take a contiguous range of the *body*: whole tiles of `BLOCK_N` tokens
  where both keys and values are packed. Codes are read as contiguous bytes and split into codes in registers,
  dequantized in fp32 (`code * scale + zero` per group; per-channel keys fold the scale into q:
  q.k = (q * s) . c + q . z, one block of tokens per tile; fp8 keys and values take their per-head scale
  after the products) and fed to tensor cores in the model dtype, or in fp16 for a bf16 model whose codes are all
  exact in fp16 (fp8, and integer codes of one group per token row): then q enters the products rounded to fp16
  (times a power of two if it would overflow) and p is rounded to fp16 instead of bf16 (`decode_launch._product_dtype`).
  Integer codes read as bit planes (`planes`) are split on the GPU by inline PTX that writes two codes into the
  mantissas of a 16-bit float pair per instruction (`plane_asm`).
- tail programs (a separate launch of the same kernel, BODY=False, so that its many live tiles do not
  raise the body's register count) read everything else token by token: the sink, the packed tokens outside whole body
  tiles (KIVI's keys and values are split differently), the residual and the new tokens, each dequantized exactly as
  the reference codecs do (to the model dtype) before the dot. `n_tail` programs take the tail's tiles in turn (tile
  i to program i mod n_tail), each writing a partial result of its own after the body's: KIVI's 128-256 tokens past
  its body are 5-9 tiles, which one program walked in series after the body's launch (`kivi-2`, one layer at batch 1
  x 32k: 152.8 -> 75.0 us, 13% -> 27% of `fp8-e4m3`'s GB/s of its own bytes, H100, 2026-12-07; `launch._tail_split`
  sizes it).

Query rows are (query position, query head of the kv-head's group) pairs, so GQA/MQA read each K/V tile once for
all the query heads that share it, and q_len > 1 (chunked prefill, speculative verification) is the same code
with more rows. The launchers are `decode_launch.py`'s (`packed_attention`, `_combine`); `dispatch.decode_attention`
(`hf_kvcache.kernels.decode_attention`) picks them by format.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (dot, finish_scores, fp8_to, group_dequant, group_planes, mask_scores, place_tile,
                    plane_scores, planes, planes_dot, planes_into, q_plane, row_of, side, softmax_step, static_places)

FMT_FP8_E4M3 = 1
FMT_FP8_E5M2 = 2
FMT_UNIFORM = 3
FMT_EXACT = 4  # the model dtype itself (the `exact` preset): read like fp8 codes with a unit scale
# fp8 read by integer operations on the bits, for GPUs without fp8 conversions (before sm_89, `launch.fp8_native`)
FMT_FP8_E4M3_BITS = 5
FMT_FP8_E5M2_BITS = 6


# Integers that change from step to step (lengths, split counts, the mask's strides, which follow the length) are
# not specialized: Triton would otherwise compile a new variant whenever one of them turns 1 or a multiple of 16,
# which during generation means seconds of compiling between tokens. Strides of the places are specialized: their
# divisibility by 16 is what lets Triton prove the tile loads aligned, vectorize them and pipeline them
# (cp.async); the cache keeps its capacity a multiple of 16 rows so that they stay in one class as it grows.
_VARYING = (
    "sm_b", "sm_t", "sm_s", "Tq", "n_sink", "npk", "nrk", "npv", "nrv",
    "stop", "n_new", "n_body_tiles", "tiles_per_split", "n_splits", "n_tail", "m_tiles",
)


@triton.jit(do_not_specialize=_VARYING)
def _attn_fwd(
    Q, sq_b, sq_h, sq_t,
    KS, sks_b, sks_h, sks_t, KC, skc_b, skc_h, skc_t, KSC, sksc_b, sksc_h, sksc_t, sksc_c, KZ,
    KR, skr_b, skr_h, skr_t, KN, skn_b, skn_h, skn_t, KF8, skf_b, skf_h,
    VS, svs_b, svs_h, svs_t, VC, svc_b, svc_h, svc_t, VSC, svsc_b, svsc_h, svsc_t, svsc_c, VZ,
    VR, svr_b, svr_h, svr_t, VN, svn_b, svn_h, svn_t, VF8, svf_b, svf_h,
    MASK, sm_b, sm_t, sm_s,
    ACC, M_OUT, L_OUT, LENS, cap_len,
    Hkv, Tq, n_sink, npk, nrk, npv, nrv, stop, n_new, n_body_tiles, tiles_per_split, n_splits, n_tail, m_tiles,
    sm_scale, softcap,
    D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
    PDT: tl.constexpr, PREC: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BODY: tl.constexpr,
    CAUSAL_BODY: tl.constexpr, K_PLANES: tl.constexpr, V_PLANES: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_TOKG: tl.constexpr, K_CHG: tl.constexpr, K_SYM: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_CHG: tl.constexpr, V_SYM: tl.constexpr,
    MASK_ROW: tl.constexpr = False, MASK_AHEAD: tl.constexpr = True, STATIC: tl.constexpr = False,
    SINK_CAP: tl.constexpr = 0, K_RING: tl.constexpr = 0, V_RING: tl.constexpr = 0,
    K_WINDOW: tl.constexpr = False, V_WINDOW: tl.constexpr = False, K_ASM: tl.constexpr = "", V_ASM: tl.constexpr = "",
    K_GP: tl.constexpr = False, V_GP: tl.constexpr = False,  # grouped tiles in fp16 by plane (`group_planes`)
    B_COPY: tl.constexpr = False,  # the products' tiles and planes through `opaque`
    ROW_LENS: tl.constexpr = False,  # STATIC: `LENS` holds one length per batch row (packed pages), not one for all
):
    pid_bh = tl.program_id(0)
    k_off = 0
    v_off = 0
    if STATIC:
        # The storage's layout (`hf_kvcache.storage`): the launch is sized for the capacity and every length comes
        # from the device, so one captured graph serves every step; programs past the filled tiles find empty ranges.
        # tokens held after this step's update; never more than the storage (a compiled step past max_cache_len
        # stores nothing more, see `hf_kvcache.storage`)
        held = tl.minimum(tl.load(LENS + row_of(tl.program_id(0), Hkv, ROW_LENS)), cap_len).to(tl.int32)
        n_sink = tl.minimum(held, SINK_CAP)
        npk, nrk, k_off = static_places(held - n_sink, K_RING, K_WINDOW)
        npv, nrv, v_off = static_places(held - n_sink, V_RING, V_WINDOW)
        stop = held - n_new
        n_body_tiles = tl.maximum(tl.minimum(tl.minimum(npk, npv), stop - n_sink), 0) // BLOCK_N
        tiles_per_split = tl.cdiv(n_body_tiles, tl.maximum(n_splits, 1))
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)  # offsets of large caches pass 2^31
    h = (pid_bh % Hkv).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows (position t, head g of the group)
    row_ok = rows < Tq * G
    t = rows // G
    qoff = b * sq_b + (h * G + rows % G) * sq_h + t * sq_t  # (BLOCK_M,)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(Q + qoff[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)  # (BLOCK_M, D) model dtype
    qf = q.to(tl.float32)
    qd = q.to(DT)

    k_scale = 1.0
    v_scale = 1.0
    if K_FMT != 3:
        k_scale = tl.load(KF8 + b * skf_b + h * skf_h)
    if V_FMT != 3:
        v_scale = tl.load(VF8 + b * svf_b + h * svf_h)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    split = pid_s if BODY else n_splits + pid_s  # the tail's partial results go last
    part = (pid_bh.to(tl.int64) * (m_tiles * BLOCK_M) + rows) * (n_splits + n_tail) + split  # (BLOCK_M,)
    # this (batch row, kv-head)'s places: sink, packed codes / scales / zeros, residual, new tokens
    ks = KS + b * sks_b + h * sks_h
    kc = KC + b * skc_b + h * skc_h
    ksc = KSC + b * sksc_b + h * sksc_h
    kz = KZ + b * sksc_b + h * sksc_h
    kr = KR + b * skr_b + h * skr_h
    kn = KN + b * skn_b + h * skn_h
    vs = VS + b * svs_b + h * svs_h
    vc = VC + b * svc_b + h * svc_h
    vsc = VSC + b * svsc_b + h * svsc_h
    vz = VZ + b * svsc_b + h * svsc_h
    vr = VR + b * svr_b + h * svr_h
    vn = VN + b * svn_b + h * svn_h

    if BODY:
        # ------------------------------------------------------------------ body: whole packed tiles
        KPER: tl.constexpr = 8 // K_BITS if K_PLANES or K_GP else 1
        VPER: tl.constexpr = 8 // V_BITS if V_PLANES or V_GP else 1
        KQT: tl.constexpr = tl.float16 if K_GP else PDT  # the dtype of the query's planes
        jk = tl.arange(0, D // KPER)
        jv = tl.arange(0, D // VPER)
        # The products' operands are PDT: the model dtype, or fp16 for a bf16 model when every code converts to
        # fp16 exactly (fp8, integer codes as 1024 + c): one instruction per two codes instead of a trip through
        # fp32. The query then enters the products times q_pow2, a power of two that keeps it inside fp16's range
        # (1 unless some |q| >= 2^15), and the scores are divided by it again.
        q_pow2 = 1.0
        if PDT != DT or K_GP:
            q_max = tl.max(tl.max(tl.abs(qf), 1), 0)
            q_pow2 = tl.exp2(-tl.maximum(tl.ceil(tl.log2(tl.maximum(q_max, 1e-30) * (1.0 / 32768.0))), 0.0))
        qp = (qf * q_pow2).to(PDT)
        if K_PLANES or K_GP:
            # query planes, rounded as the products see them; their sums carry the zeros and the codes' centers
            q0 = (q_plane(Q, qoff, row_ok, jk, 0, KPER).to(tl.float32) * q_pow2).to(KQT)
            q1 = q0
            q2 = q0
            q3 = q0
            if KPER > 1:
                q1 = (q_plane(Q, qoff, row_ok, jk, 1, KPER).to(tl.float32) * q_pow2).to(KQT)
            if KPER > 2:
                q2 = (q_plane(Q, qoff, row_ok, jk, 2, KPER).to(tl.float32) * q_pow2).to(KQT)
                q3 = (q_plane(Q, qoff, row_ok, jk, 3, KPER).to(tl.float32) * q_pow2).to(KQT)
            q_sum = tl.sum(qp.to(tl.float32), 1) / q_pow2
        acc0 = tl.zeros((BLOCK_M, D // VPER), tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        # sum_n p_n (zero_n + V_CTR * scale_n) for asymmetric per-token values: the codes enter the products centered
        extra = tl.zeros((BLOCK_M,), tl.float32)
        K_CTR: tl.constexpr = 1 << (K_BITS - 1)  # the codes' centers (`plane`)
        V_CTR: tl.constexpr = 1 << (V_BITS - 1)
        lo = pid_s * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, n_body_tiles)
        # scales and zeros of the first tile; each iteration loads the next tile's (the last one reloads its own);
        # an empty range (a launch sized for the capacity) loads tile 0, which the storage always has
        first = tl.where(lo < hi, lo, 0)
        ka0, ka1, ka2, ka3, kzr = side(ksc, kz, first, sksc_t, sksc_c, BLOCK_N, D, K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM,
                                        K_PLANES)
        va0, va1, va2, va3, vzr = side(vsc, vz, first, svsc_t, svsc_c, BLOCK_N, D, V_FMT, V_BITS, 1, V_CHG, V_SYM,
                                        V_PLANES)
        # A decode step's mask row, one byte a token, is loaded a tile ahead too (MASK_AHEAD): the pipeliner does not
        # stage it (its stride is not specialized), and loaded in the tile that uses it, its latency stalled every tile
        mask_row = MASK + b * sm_b + n_sink * sm_s
        allowed_nx = tl.zeros((BLOCK_N,), tl.uint8)
        if HAS_MASK and MASK_ROW and MASK_AHEAD:
            allowed_nx = tl.load(mask_row + (first * BLOCK_N + n) * sm_s, mask=n < tl.where(lo < hi, BLOCK_N, 0),
                                 other=0)
        for tile in range(lo, hi):
            tok = tile * BLOCK_N + n  # packed token indices (BLOCK_N,)
            k0, k1, k2, k3, kz_t = ka0, ka1, ka2, ka3, kzr
            v0, vz_t = va0, vzr  # values use one scale per token row (or the group tile): a0 only
            nxt = tl.minimum(tile + 1, hi - 1)
            ka0, ka1, ka2, ka3, kzr = side(ksc, kz, nxt, sksc_t, sksc_c, BLOCK_N, D, K_FMT, K_BITS, K_TOKG, K_CHG,
                                            K_SYM, K_PLANES)
            va0, va1, va2, va3, vzr = side(vsc, vz, nxt, svsc_t, svsc_c, BLOCK_N, D, V_FMT, V_BITS, 1, V_CHG,
                                            V_SYM, V_PLANES)
            allowed = allowed_nx
            if HAS_MASK and MASK_ROW and MASK_AHEAD:
                allowed_nx = tl.load(mask_row + (nxt * BLOCK_N + n) * sm_s)
            # ---- scores (BLOCK_M, BLOCK_N)
            if K_FMT != 3:
                c = tl.load(kc + tok[:, None] * skc_t + d[None, :])
                s = dot(qp, tl.trans(fp8_to(c, K_FMT, PDT)), PREC, B_COPY) * (k_scale / q_pow2)
            elif K_PLANES and K_TOKG > 1:
                # one tile = one block of K_TOKG tokens with per-channel scales: q.k = (q * s) . c + q . z
                qs0 = (q0.to(tl.float32) * k0[None, :]).to(DT)
                qs1 = qs0
                qs2 = qs0
                qs3 = qs0
                if KPER > 1:
                    qs1 = (q1.to(tl.float32) * k1[None, :]).to(DT)
                if KPER > 2:
                    qs2 = (q2.to(tl.float32) * k2[None, :]).to(DT)
                    qs3 = (q3.to(tl.float32) * k3[None, :]).to(DT)
                s = plane_scores(kc, tok, skc_t, jk, qs0, qs1, qs2, qs3, PREC, K_BITS, PDT, K_OFF, K_CTR, K_ASM,
                                  B_COPY)
                if not K_SYM:  # q.k = (q * s) . (c - K_CTR) + q . (z + K_CTR * s), the latter from `side`
                    s += tl.sum(qf * kz_t[None, :], 1)[:, None]
            elif K_PLANES:
                # one group per token row: q.k = scale * (q . (c - K_CTR)) + (zero + K_CTR * scale) * sum(q)
                s = plane_scores(kc, tok, skc_t, jk, q0, q1, q2, q3, PREC, K_BITS, PDT, K_OFF, K_CTR, K_ASM,
                                  B_COPY) / q_pow2
                if K_SYM:
                    s = s * k0[None, :]
                else:
                    s = s * k0[None, :] + q_sum[:, None] * (kz_t + K_CTR * k0)[None, :]
            elif K_GP:
                # the fp16 planes of the dequantized tile, each times its query plane
                x0, x1, x2, x3 = group_planes(kc, tok, skc_t, k0, kz_t, BLOCK_N, D, K_BITS, K_CHG, K_SYM, K_ASM)
                s = planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, KPER, PREC, B_COPY) / q_pow2
            else:
                kt = group_dequant(kc, tok, skc_t, k0, kz_t, BLOCK_N, D, K_BITS, K_CHG, K_SYM)
                s = dot(qd, tl.trans(kt.to(DT)), PREC, B_COPY)
            s = finish_scores(s, sm_scale, softcap, HAS_SOFTCAP)
            if HAS_MASK and MASK_ROW:
                # one query position (decode): one row of the mask serves every query head
                if not MASK_AHEAD:
                    allowed = tl.load(mask_row + tok * sm_s)
                s = tl.where(allowed[None, :] != 0, s, float("-inf"))
            elif HAS_MASK:
                kpos = n_sink + tok
                allowed = tl.load(MASK + b * sm_b + t[:, None] * sm_t + kpos[None, :] * sm_s,
                                  mask=row_ok[:, None], other=0)
                s = tl.where(allowed != 0, s, float("-inf"))
            elif CAUSAL_BODY:
                # a chunk of queries whose own tokens are packed (quantize_before_attention) and no mask: causal
                s = tl.where((n_sink + tok)[None, :] <= (stop + n_new - Tq + t)[:, None], s, float("-inf"))
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            # ---- values
            if V_FMT != 3:
                c = tl.load(vc + tok[:, None] * svc_t + d[None, :])
                acc0 = acc0 * alpha[:, None] + dot(p.to(PDT), fp8_to(c, V_FMT, PDT), PREC, B_COPY)
            elif V_PLANES:
                # one group per token row: sum_n p_n v_n = (p * scale) . (c - V_CTR) + sum_n p_n (zero_n + V_CTR * scale_n);
                # p * scale is clamped to fp16's largest value when the products are fp16 (a scale past it is not a
                # real cache)
                ps = p * v0[None, :]
                if PDT != DT:
                    ps = tl.minimum(ps, 65504.0)
                ps = ps.to(PDT)
                if not V_SYM:
                    extra = extra * alpha + tl.sum(p * (vz_t + V_CTR * v0)[None, :], 1)
                x0, x1, x2, x3 = planes(tl.load(vc + tok[:, None] * svc_t + jv[None, :]), V_BITS, PDT, V_OFF, V_CTR,
                                         V_ASM)
                acc0, acc1, acc2, acc3 = planes_into(acc0, acc1, acc2, acc3, alpha, ps, x0, x1, x2, x3, VPER, PREC,
                                                      B_COPY)
            elif V_GP:
                # each fp16 plane of the dequantized tile into its own accumulator (output channels PER*j + P)
                x0, x1, x2, x3 = group_planes(vc, tok, svc_t, v0, vz_t, BLOCK_N, D, V_BITS, V_CHG, V_SYM, V_ASM)
                acc0, acc1, acc2, acc3 = planes_into(acc0, acc1, acc2, acc3, alpha, p.to(tl.float16), x0, x1, x2, x3,
                                                      VPER, PREC, B_COPY)
            else:
                vt = group_dequant(vc, tok, svc_t, v0, vz_t, BLOCK_N, D, V_BITS, V_CHG, V_SYM)
                acc0 = acc0 * alpha[:, None] + dot(p.to(DT), vt.to(DT), PREC, B_COPY)
        ptr = ACC + part[:, None] * D + (VPER * jv)[None, :]
        if V_FMT != 3:
            tl.store(ptr, acc0 * v_scale, mask=row_ok[:, None])
        else:
            tl.store(ptr, acc0 + extra[:, None], mask=row_ok[:, None])
            if VPER > 1:
                tl.store(ptr + 1, acc1 + extra[:, None], mask=row_ok[:, None])
            if VPER > 2:
                tl.store(ptr + 2, acc2 + extra[:, None], mask=row_ok[:, None])
                tl.store(ptr + 3, acc3 + extra[:, None], mask=row_ok[:, None])
    else:
        # ------------------------------------------------------------------ tail: every other token
        body_end = n_sink + n_body_tiles * BLOCK_N
        s_total = stop + n_new
        end = s_total
        if not HAS_MASK:
            # causal: no row of this tile attends past its last query position
            t_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, Tq - 1)
            end = tl.minimum(s_total, s_total - Tq + t_last + 1)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        n_first = tl.cdiv(n_sink, BLOCK_N)
        n_rest = tl.cdiv(tl.maximum(end - body_end, 0), BLOCK_N)
        for i in range(pid_s, n_first + n_rest, n_tail):
            start = tl.where(i < n_first, i * BLOCK_N, body_end + (i - n_first) * BLOCK_N)
            limit = tl.where(i < n_first, tl.minimum(n_sink, end), end)
            kpos = start + n  # (BLOCK_N,)
            ok = kpos < limit
            kt = place_tile(ks, kr, kn, kc, ksc, kz, sks_t, skr_t, skn_t, skc_t, sksc_t, sksc_c, k_scale,
                             kpos[:, None], d[None, :], ok[:, None], n_sink, npk, nrk, k_off, stop, n_new, DT,
                             K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM, K_RING)
            s = finish_scores(dot(qd, tl.trans(kt), PREC, B_COPY), sm_scale, softcap, HAS_SOFTCAP)
            s = mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK)
            m_i, alpha, p, l_i = softmax_step(s, m_i, l_i)
            vt = place_tile(vs, vr, vn, vc, vsc, vz, svs_t, svr_t, svn_t, svc_t, svsc_t, svsc_c, v_scale,
                             kpos[:, None], d[None, :], ok[:, None], n_sink, npv, nrv, v_off, stop, n_new, DT,
                             V_FMT, V_BITS, 1, V_CHG, V_SYM, V_RING)
            acc = acc * alpha[:, None] + dot(p.to(DT), vt, PREC, B_COPY)
        tl.store(ACC + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


@triton.jit(do_not_specialize=("so_b", "so_t", "so_h", "Tq", "n_parts", "n_framed", "rows_pad"))
def _combine(
    ACC, M_IN, L_IN, OUT, so_b, so_t, so_h, SAUX, FV, sfv_d, ORDER, sor_b, sor_h,
    Hkv, Tq, n_parts, n_framed, rows_pad,
    G: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, HAS_SAUX: tl.constexpr, FRAME: tl.constexpr = False,
    HAS_ORDER: tl.constexpr = False,
):
    """out[b, t, h*G + g] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the split-K partials, NP of them at
    a time (a fixed block: one kernel variant whatever the split count, which grows with the context) in one pass
    that rescales what it summed whenever the running max grows (each block's loads wait on the last's: a batch-1
    read of 32k tokens has over a hundred parts, and two passes of blocks of 16 took 11-19 us a layer there on an
    H100, 2026-12-07). FRAME (TurboQuant, `turbo.py`): the first `n_framed` parts (the body's) are in the values' frame
    F = P R (`layout.CodebookFormat`) and are summed, then rotated back by R^T (z_c = sum_j o'_j R[c, j]) and put back
    in the model's channel order (HAS_ORDER: channel `ORDER[b, h, c]` takes z_c); the others (the tail programs'), in
    the model's frame, are summed apart, each lane taking the channel it writes, and added after."""
    pid = tl.program_id(0)
    rows = Tq * G
    bh = (pid // rows).to(tl.int64)
    r = pid % rows
    b = bh // Hkv
    h = bh % Hkv
    d = tl.arange(0, D)
    base = (bh * rows_pad + r) * n_parts
    mx = tl.full((), float("-inf"), tl.float32)
    if HAS_SAUX:
        aux = tl.load(SAUX + h * G + r % G).to(tl.float32) * 1.4426950408889634
        mx = tl.maximum(mx, aux)
    total = tl.zeros((), tl.float32)
    out = tl.zeros((D,), tl.float32)
    tails = tl.zeros((D,), tl.float32)  # FRAME: the tail programs' sum, lane d at the channel it writes
    c = d  # the output channel of each lane
    if FRAME and HAS_ORDER:
        c = tl.load(ORDER + b * sor_b + h * sor_h + d).to(tl.int32)
    for s0 in range(0, n_parts, NP):
        sp = s0 + tl.arange(0, NP)
        ok = sp < n_parts
        m = tl.load(M_IN + base + sp, mask=ok, other=float("-inf"))
        grown = tl.maximum(mx, tl.max(m, 0))
        safe = tl.where(grown == float("-inf"), 0.0, grown)
        alpha = tl.exp2(mx - safe)  # 0 while nothing was summed (mx = -inf)
        w = tl.exp2(m - safe)
        total = total * alpha + tl.sum(w * tl.load(L_IN + base + sp, mask=ok, other=0.0), 0)
        if FRAME:
            tail = sp >= n_framed
            x = tl.load(ACC + (base + sp)[:, None] * D + tl.where(tail[:, None], c[None, :], d[None, :]),
                        mask=ok[:, None], other=0.0)
            out = out * alpha + tl.sum(x * tl.where(tail, 0.0, w)[:, None], 0)
            tails = tails * alpha + tl.sum(x * tl.where(tail, w, 0.0)[:, None], 0)
        else:
            out = out * alpha + tl.sum(tl.load(ACC + (base + sp)[:, None] * D + d[None, :], mask=ok[:, None],
                                               other=0.0) * w[:, None], 0)
        mx = grown
    if HAS_SAUX:
        total += tl.exp2(aux - tl.where(mx == float("-inf"), 0.0, mx))
    if FRAME:
        f = tl.load(FV + d[:, None] * sfv_d + d[None, :])  # R[c, j]
        out = tl.sum(f * out[None, :], 1) + tails
    out = tl.where(total > 0, out / tl.maximum(total, 1e-30), 0.0)
    t = r // G
    tl.store(OUT + b * so_b + t * so_t + (h * G + r % G) * so_h + c, out.to(OUT.dtype.element_ty))
