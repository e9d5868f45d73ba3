"""A packed history dequantized into a workspace, for prefill over it (`hf_kvcache.prefill`): a chunk of many query
tokens then reads each dequantized token once through flash attention, instead of the decode kernel dequantizing the
whole history again for every tile of query rows.

Each program writes BLOCK_T consecutive tokens of one (batch row, kv-head) to `(B, Hkv, n, D)` workspaces, both
streams at once, every count derived on the device from the storage's length (`hf_kvcache.storage`, as the attention
kernels do with STATIC):
- `_gather_places` (the formats `decode.py` reads: fp8, integer groups, KIVI's per-channel key blocks, exact): the
  history tokens `start .. start + n` in order, from whichever place holds each (sink, packed, residual ring),
  dequantized exactly as the reference codecs do, rounded to the model dtype (`tiles.place_tile`);
- `_gather_codebook` (TurboQuant): the packed body's tokens in the codec's frame, `norm * codebook[code]` per part
  (`turbo.py`: F is orthogonal, so the attention reads the frame with the query rotated in and its output rotated
  back), or with EXACT its exact tokens (sinks, the residual before this chunk) in the model's frame.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import centroids, exact_tile, norms, place_tile, static_places


_VARYING = ("start", "n_tok", "n_new")


@triton.jit(do_not_specialize=_VARYING)
def _gather_places(
    KS, sks_b, sks_h, sks_t, KC, skc_b, skc_h, skc_t, KSC, sksc_b, sksc_h, sksc_t, sksc_c, KZ,
    KR, skr_b, skr_h, skr_t, KN, skn_b, skn_h, skn_t, KF8, skf_b, skf_h,
    VS, svs_b, svs_h, svs_t, VC, svc_b, svc_h, svc_t, VSC, svsc_b, svsc_h, svsc_t, svsc_c, VZ,
    VR, svr_b, svr_h, svr_t, VN, svn_b, svn_h, svn_t, VF8, svf_b, svf_h,
    WK, WV, sw_b, sw_h, sw_t, LENS, cap_len, Hkv, start, n_tok, n_new,
    D: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_TOKG: tl.constexpr, K_CHG: tl.constexpr, K_SYM: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_CHG: tl.constexpr, V_SYM: tl.constexpr,
    SINK_CAP: tl.constexpr, K_RING: tl.constexpr, V_RING: tl.constexpr, K_WINDOW: tl.constexpr,
    V_WINDOW: tl.constexpr,
):
    """Tokens `start + i` (i < n_tok) of the held history, keys into WK and values into WV at row i (the places'
    pointer and stride arguments as `decode._attn_fwd` takes them; the new tokens, `n_new` of them, are never read)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    held = tl.minimum(tl.load(LENS), cap_len).to(tl.int32)
    n_sink = tl.minimum(held, SINK_CAP)
    npk, nrk, k_off = static_places(held - n_sink, K_RING, K_WINDOW)
    npv, nrv, v_off = static_places(held - n_sink, V_RING, V_WINDOW)
    stop = held - n_new
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < n_tok
    kpos = (start + i)[:, None]
    d = tl.arange(0, D)[None, :]
    k_scale = 1.0
    v_scale = 1.0
    if K_FMT != 3:
        k_scale = tl.load(KF8 + b * skf_b + h * skf_h)
    if V_FMT != 3:
        v_scale = tl.load(VF8 + b * svf_b + h * svf_h)
    kt = place_tile(KS + b * sks_b + h * sks_h, KR + b * skr_b + h * skr_h, KN + b * skn_b + h * skn_h,
                     KC + b * skc_b + h * skc_h, KSC + b * sksc_b + h * sksc_h, KZ + b * sksc_b + h * sksc_h,
                     sks_t, skr_t, skn_t, skc_t, sksc_t, sksc_c, k_scale, kpos, d, ok[:, None], n_sink, npk, nrk,
                     k_off, stop, n_new, DT, K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM, K_RING)
    vt = place_tile(VS + b * svs_b + h * svs_h, VR + b * svr_b + h * svr_h, VN + b * svn_b + h * svn_h,
                     VC + b * svc_b + h * svc_h, VSC + b * svsc_b + h * svsc_h, VZ + b * svsc_b + h * svsc_h,
                     svs_t, svr_t, svn_t, svc_t, svsc_t, svsc_c, v_scale, kpos, d, ok[:, None], n_sink, npv, nrv,
                     v_off, stop, n_new, DT, V_FMT, V_BITS, 1, V_CHG, V_SYM, V_RING)
    row = b * sw_b + h * sw_h + i[:, None] * sw_t + d
    tl.store(WK + row, kt, mask=ok[:, None])
    tl.store(WV + row, vt, mask=ok[:, None])


@triton.jit
def _codebook_tile(W, row, C, N_, CB, tok, ok, sc_t, sn_t, BLOCK_T: tl.constexpr, C0: tl.constexpr,
                   WID: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr):
    """One part's channels C0 .. C0 + WID of packed tokens `tok`: norm * codebook[code] (float32 table) into W."""
    x = centroids(C, CB, tok, ok, sc_t, BLOCK_T, WID, BITS, 1, "", tl.float32) * norms(N_, tok, ok, sn_t)[:, None]
    tl.store(W + row + C0 + tl.arange(0, WID)[None, :], x.to(DT), mask=ok[:, None])


@triton.jit(do_not_specialize=_VARYING)
def _gather_codebook(
    KCA, skca_b, skca_h, skca_t, KNA, skna_b, skna_h, skna_t, KBA,
    KCB, skcb_b, skcb_h, skcb_t, KNB, sknb_b, sknb_h, sknb_t, KBB,
    VCA, svca_b, svca_h, svca_t, VNA, svna_b, svna_h, svna_t, VBA,
    VCB, svcb_b, svcb_h, svcb_t, VNB, svnb_b, svnb_h, svnb_t, VBB,
    KS, sks_b, sks_h, sks_t, KR, skr_b, skr_h, skr_t, KN, skn_b, skn_h, skn_t,
    VS, svs_b, svs_h, svs_t, VR, svr_b, svr_h, svr_t, VN, svn_b, svn_h, svn_t,
    WK, WV, sw_b, sw_h, sw_t, LENS, cap_len, Hkv, start, n_tok, n_new,
    D: tl.constexpr, BLOCK_T: tl.constexpr, DT: tl.constexpr, EXACT: tl.constexpr,
    K_TWO: tl.constexpr, K_WA: tl.constexpr, K_BA: tl.constexpr, K_BB: tl.constexpr,
    V_TWO: tl.constexpr, V_WA: tl.constexpr, V_BA: tl.constexpr, V_BB: tl.constexpr,
    SINK_CAP: tl.constexpr, RING: tl.constexpr, WINDOW: tl.constexpr,
):
    """Rows i < n_tok of the workspaces: packed body tokens `start + i` in the frame (per part, codes + lengths +
    float32 codebook, as `turbo._turbo_attn` takes them), or (EXACT) the i-th exact token of the history, sinks first
    then the residual up to this chunk, as stored (model frame)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    held = tl.minimum(tl.load(LENS), cap_len).to(tl.int32)
    n_sink = tl.minimum(held, SINK_CAP)
    n_packed, _, r_off = static_places(held - n_sink, RING, WINDOW)
    stop = held - n_new
    n_body = tl.maximum(tl.minimum(n_packed, stop - n_sink), 0)
    i = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < n_tok
    d = tl.arange(0, D)[None, :]
    row = b * sw_b + h * sw_h + i[:, None] * sw_t
    if EXACT:
        kpos = tl.where(i < n_sink, i, i + n_body)[:, None]
        kt = exact_tile(KS + b * sks_b + h * sks_h, KR + b * skr_b + h * skr_h, KN + b * skn_b + h * skn_h,
                         sks_t, skr_t, skn_t, kpos, d, ok[:, None], n_sink, n_sink + n_body, stop, r_off, DT, RING)
        vt = exact_tile(VS + b * svs_b + h * svs_h, VR + b * svr_b + h * svr_h, VN + b * svn_b + h * svn_h,
                         svs_t, svr_t, svn_t, kpos, d, ok[:, None], n_sink, n_sink + n_body, stop, r_off, DT, RING)
        tl.store(WK + row + d, kt, mask=ok[:, None])
        tl.store(WV + row + d, vt, mask=ok[:, None])
    else:
        tok = start + i
        ok = ok & (tok < n_body)
        _codebook_tile(WK, row, KCA + b * skca_b + h * skca_h, KNA + b * skna_b + h * skna_h, KBA, tok, ok, skca_t,
                       skna_t, BLOCK_T, 0, K_WA, K_BA, DT)
        if K_TWO:
            _codebook_tile(WK, row, KCB + b * skcb_b + h * skcb_h, KNB + b * sknb_b + h * sknb_h, KBB, tok, ok,
                           skcb_t, sknb_t, BLOCK_T, K_WA, D - K_WA, K_BB, DT)
        _codebook_tile(WV, row, VCA + b * svca_b + h * svca_h, VNA + b * svna_b + h * svna_h, VBA, tok, ok, svca_t,
                       svna_t, BLOCK_T, 0, V_WA, V_BA, DT)
        if V_TWO:
            _codebook_tile(WV, row, VCB + b * svcb_b + h * svcb_h, VNB + b * svnb_b + h * svnb_h, VBB, tok, ok,
                           svcb_t, svnb_t, BLOCK_T, V_WA, D - V_WA, V_BB, DT)
