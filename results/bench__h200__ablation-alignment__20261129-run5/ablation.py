"""Body-kernel experiments: where does the time of the packed decode attention go? (dev only, not shipped)

Simplified split-K body (decode, q_len 1, no mask/tail), one program per (b*h, split). Modes:
 0 bf16 K/V                     (structure of our loop vs SDPA)
 1 fp8 e4m3 K/V -> bf16 direct
 2 int4 g32, current library method (join/reshape unpack, 3D reshape scale broadcast, fp32)
 3 int4 g32, split planes (no join/reshape), q/acc split even/odd, magic-number int->float, gather scales
 4 = 3 without scales (codes only; wrong numbers, timing only)
 5 int4 g32, split planes, scales broadcast by reshape of (N, NG, CHG/2)
 6 int4 g32, split planes, keys: scores by per-group 2D dots with scale after; values as 5
 7 = 5 with I2F conversion instead of magic numbers
"""
import math
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _i2f(c, MAGIC: tl.constexpr):
    if MAGIC:
        x = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        x = c.to(tl.float32)
    return x


@triton.jit
def _sc_gather(SC, tok, NG: tl.constexpr, W: tl.constexpr, PERG: tl.constexpr):
    j = tl.arange(0, W)
    return tl.load(SC + tok[:, None] * NG + (j // PERG)[None, :]).to(tl.float32)


@triton.jit
def _sc_reshape(x, SC, tok, BN: tl.constexpr, NG: tl.constexpr, W: tl.constexpr, PERG: tl.constexpr):
    g = tl.arange(0, NG)
    s = tl.load(SC + tok[:, None] * NG + g[None, :]).to(tl.float32)
    x3 = tl.reshape(x, (BN, NG, PERG))
    return x3, s[:, :, None]


@triton.jit
def _body(Q, K, V, KS, KZ, VS, VZ, ACC, M_OUT, L_OUT, Hkv, S, tiles_per_split, n_splits, sm_scale,
          D: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
          CHG: tl.constexpr, DT: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < G
    n = tl.arange(0, BN)
    d = tl.arange(0, D)
    NG: tl.constexpr = D // CHG
    qbase = Q + pid_bh * G * D + rows * D
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    lo = pid_s * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, S // BN)
    if MODE <= 2:
        q = tl.load(qbase[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        acc = tl.zeros((BM, D), tl.float32)
        for tile in range(lo, hi):
            tok = tile * BN + n
            if MODE == 0:
                k = tl.load(K + pid_bh * S * D + tok[:, None] * D + d[None, :]).to(DT)
            elif MODE == 1:
                k = tl.load(K + pid_bh * S * D + tok[:, None] * D + d[None, :]).to(tl.float8e4nv, bitcast=True)
                k = k.to(DT)
            else:
                j = tl.arange(0, D // 2)
                byte = tl.load(K + pid_bh * S * (D // 2) + tok[:, None] * (D // 2) + j[None, :]).to(tl.int32)
                c = tl.reshape(tl.join(byte & 15, byte >> 4), (BN, D)).to(tl.float32)
                g = tl.arange(0, NG)
                soff = pid_bh * S * NG + tok[:, None] * NG + g[None, :]
                c3 = tl.reshape(c, (BN, NG, CHG))
                x = c3 * tl.load(KS + soff).to(tl.float32)[:, :, None] + tl.load(KZ + soff).to(tl.float32)[:, :, None]
                k = tl.reshape(x, (BN, D)).to(DT)
            s = tl.dot(q, tl.trans(k)) * (sm_scale * 1.4426950408889634)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            if MODE == 0:
                v = tl.load(V + pid_bh * S * D + tok[:, None] * D + d[None, :]).to(DT)
            elif MODE == 1:
                v = tl.load(V + pid_bh * S * D + tok[:, None] * D + d[None, :]).to(tl.float8e4nv, bitcast=True)
                v = v.to(DT)
            else:
                j = tl.arange(0, D // 2)
                byte = tl.load(V + pid_bh * S * (D // 2) + tok[:, None] * (D // 2) + j[None, :]).to(tl.int32)
                c = tl.reshape(tl.join(byte & 15, byte >> 4), (BN, D)).to(tl.float32)
                g = tl.arange(0, NG)
                soff = pid_bh * S * NG + tok[:, None] * NG + g[None, :]
                c3 = tl.reshape(c, (BN, NG, CHG))
                x = c3 * tl.load(VS + soff).to(tl.float32)[:, :, None] + tl.load(VZ + soff).to(tl.float32)[:, :, None]
                v = tl.reshape(x, (BN, D)).to(DT)
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), v)
        part = (pid_bh * n_splits + pid_s) * BM + rows
        tl.store(ACC + part[:, None] * D + d[None, :], acc)
    else:
        # split planes: element 2j is the low nibble of byte j, 2j+1 the high one
        W: tl.constexpr = D // 2
        PERG: tl.constexpr = CHG // 2
        j = tl.arange(0, W)
        q0 = tl.load(qbase[:, None] + 2 * j[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        q1 = tl.load(qbase[:, None] + 2 * j[None, :] + 1, mask=row_ok[:, None], other=0.0).to(DT)
        acc0 = tl.zeros((BM, W), tl.float32)
        acc1 = tl.zeros((BM, W), tl.float32)
        for tile in range(lo, hi):
            tok = tile * BN + n
            byte = tl.load(K + pid_bh * S * W + tok[:, None] * W + j[None, :]).to(tl.int32)
            sbase = pid_bh * S * NG
            if MODE == 6:
                s = tl.zeros((BM, BN), tl.float32)
                for gg in tl.static_range(NG):
                    jg = tl.arange(0, PERG)
                    bg = tl.load(K + pid_bh * S * W + tok[:, None] * W + gg * PERG + jg[None, :]).to(tl.int32)
                    qa = tl.load(qbase[:, None] + gg * CHG + 2 * jg[None, :], mask=row_ok[:, None], other=0.0).to(DT)
                    qb = tl.load(qbase[:, None] + gg * CHG + 2 * jg[None, :] + 1, mask=row_ok[:, None], other=0.0).to(DT)
                    ca = _i2f(bg & 15, True).to(DT)
                    cb = _i2f(bg >> 4, True).to(DT)
                    part = tl.dot(qa, tl.trans(ca)) + tl.dot(qb, tl.trans(cb))
                    sg = tl.load(KS + sbase + tok * NG + gg).to(tl.float32)
                    zg = tl.load(KZ + sbase + tok * NG + gg).to(tl.float32)
                    qsum = tl.sum(qa.to(tl.float32), 1) + tl.sum(qb.to(tl.float32), 1)
                    s += part * sg[None, :] + qsum[:, None] * zg[None, :]
            elif MODE == 3 or MODE == 4:
                k0 = _i2f(byte & 15, True)
                k1 = _i2f(byte >> 4, True)
                if MODE == 3:
                    sc = _sc_gather(KS + sbase, tok, NG, W, PERG)
                    zr = _sc_gather(KZ + sbase, tok, NG, W, PERG)
                    k0 = k0 * sc + zr
                    k1 = k1 * sc + zr
                s = tl.dot(q0, tl.trans(k0.to(DT))) + tl.dot(q1, tl.trans(k1.to(DT)))
            else:
                k0 = _i2f(byte & 15, MODE != 7)
                k1 = _i2f(byte >> 4, MODE != 7)
                k03, sc = _sc_reshape(k0, KS + sbase, tok, BN, NG, W, PERG)
                k13, zr = _sc_reshape(k1, KZ + sbase, tok, BN, NG, W, PERG)
                k0 = tl.reshape(k03 * sc + zr, (BN, W))
                k1 = tl.reshape(k13 * sc + zr, (BN, W))
                s = tl.dot(q0, tl.trans(k0.to(DT))) + tl.dot(q1, tl.trans(k1.to(DT)))
            s = s * (sm_scale * 1.4426950408889634)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            byte = tl.load(V + pid_bh * S * W + tok[:, None] * W + j[None, :]).to(tl.int32)
            v0 = _i2f(byte & 15, MODE != 7)
            v1 = _i2f(byte >> 4, MODE != 7)
            if MODE == 3:
                sc = _sc_gather(VS + sbase, tok, NG, W, PERG)
                zr = _sc_gather(VZ + sbase, tok, NG, W, PERG)
                v0 = v0 * sc + zr
                v1 = v1 * sc + zr
            elif MODE != 4:
                v03, sc = _sc_reshape(v0, VS + sbase, tok, BN, NG, W, PERG)
                v13, zr = _sc_reshape(v1, VZ + sbase, tok, BN, NG, W, PERG)
                v0 = tl.reshape(v03 * sc + zr, (BN, W))
                v1 = tl.reshape(v13 * sc + zr, (BN, W))
            pb = p.to(DT)
            acc0 = acc0 * alpha[:, None] + tl.dot(pb, v0.to(DT))
            acc1 = acc1 * alpha[:, None] + tl.dot(pb, v1.to(DT))
        part = (pid_bh * n_splits + pid_s) * BM + rows
        tl.store(ACC + part[:, None] * D + 2 * j[None, :], acc0)
        tl.store(ACC + part[:, None] * D + 2 * j[None, :] + 1, acc1)
    part = (pid_bh * n_splits + pid_s) * BM + rows
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


_body_unaligned = triton.jit(do_not_specialize=["S"])(_body.fn)  # the library kernel before strides were specialized


def make(B, H, G, S, D, CHG, dev):
    torch.manual_seed(0)
    q = torch.randn(B, H * G, D, device=dev).to(torch.bfloat16)
    k = torch.randn(B, H, S, D, device=dev)
    v = torch.randn(B, H, S, D, device=dev)
    packs = {}
    for name, x in (("k", k), ("v", v)):
        xg = x.view(B, H, S, D // CHG, CHG)
        mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
        sc = ((mx - mn) / 15).clamp_min(1e-6).half()
        c = ((xg - mn) / sc.float()).round().clamp(0, 15).to(torch.uint8).view(B, H, S, D)
        packs[name] = (
            (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous(),
            sc.view(B, H, S, D // CHG).contiguous(),
            mn.half().view(B, H, S, D // CHG).contiguous(),
        )
        deq = (c.view(B, H, S, D // CHG, CHG).float() * sc.float() + mn.half().float()).view(B, H, S, D)
        packs[name + "_deq"] = deq.to(torch.bfloat16)
        packs[name + "_bf16"] = x.to(torch.bfloat16)
        packs[name + "_fp8"] = x.to(torch.float8_e4m3fn).view(torch.uint8)
    return q, packs


def run(mode, q, packs, B, H, G, S, D, CHG, bn, warps, stages, splits, kernel=None):
    kernel = kernel or _body
    BM = 16
    dev = q.device
    if mode == 0:
        K, V = packs["k_bf16"], packs["v_bf16"]
    elif mode == 1:
        K, V = packs["k_fp8"], packs["v_fp8"]
    else:
        K, V = packs["k"][0], packs["v"][0]
    tiles = S // bn
    tps = math.ceil(tiles / splits)
    splits = math.ceil(tiles / tps)
    acc = torch.empty(B * H * splits * BM, D, device=dev)
    m = torch.empty(B * H * splits * BM, device=dev)
    lsum = torch.empty_like(m)

    def go():
        kernel[(B * H, splits)](q, K, V, packs["k"][1], packs["k"][2], packs["v"][1], packs["v"][2], acc, m, lsum,
                                H, S, tps, splits, 1 / math.sqrt(D), D=D, G=G, BM=BM, BN=bn, MODE=mode, CHG=CHG,
                                DT=tl.float32 if os.environ.get('TRITON_INTERPRET') == '1' else tl.bfloat16,
                                num_warps=warps, num_stages=stages)

    def result():
        a = acc.view(B, H, splits, BM, D)[:, :, :, :G]
        mm = m.view(B, H, splits, BM)[:, :, :, :G]
        ll = lsum.view(B, H, splits, BM)[:, :, :, :G]
        w = torch.exp2(mm - mm.amax(2, keepdim=True))
        return ((a * w[..., None]).sum(2) / (ll * w).sum(2)[..., None]).reshape(B, H * G, D)

    return go, result


def reference(mode, q, packs, B, H, G, S, D):
    if mode == 0:
        k, v = packs["k_bf16"], packs["v_bf16"]
    elif mode == 1:
        k = packs["k_fp8"].view(torch.float8_e4m3fn).to(torch.bfloat16)
        v = packs["v_fp8"].view(torch.float8_e4m3fn).to(torch.bfloat16)
    else:
        k, v = packs["k_deq"], packs["v_deq"]
    qq = q.view(B, H, G, D).float()
    s = torch.einsum("bhgd,bhsd->bhgs", qq, k.float()) / math.sqrt(D)
    return torch.einsum("bhgs,bhsd->bhgd", s.softmax(-1), v.float()).reshape(B, H * G, D)


def main():
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        B, H, G, S, D, CHG = 1, 2, 4, 128, 64, 32
        q, packs = make(B, H, G, S, D, CHG, dev)
        for mode in (0, 2, 3, 5, 6, 7):
            go, res = run(mode, q, packs, B, H, G, S, D, CHG, 32, 4, 1, 2)
            go()
            err = (res() - reference(mode, q, packs, B, H, G, S, D)).abs().max().item()
            print("mode", mode, "max err", err)
        return
    B, H, G, S, D, CHG = 16, 8, 4, 32768, 128, 32
    q, packs = make(B, H, G, S, D, CHG, dev)
    k, v = packs["k_bf16"], packs["v_bf16"]
    qs = q.view(B, H * G, 1, D)
    base = triton.testing.do_bench(
        lambda: torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True), warmup=50, rep=300)
    bytes_bf16 = k.numel() * 2 * 2
    print(f"sdpa bf16: {base*1e3:.1f} us, {bytes_bf16/base/1e6:.0f} GB/s", flush=True)
    for mode in (1, 2):
        go, _ = run(mode, q, packs, B, H, G, S, D, CHG, 32, 4, 2, 4, kernel=_body_unaligned)
        go()
        t = triton.testing.do_bench(go, warmup=20, rep=200)
        print(f"UNALIGNED mode {mode} bn 32 w 4 st 2 splits 4: {t*1e3:.1f} us x{base/t:.2f}", flush=True)
    modes = [int(x) for x in os.environ.get("MODES", "0,1,2,3,4,5,6,7").split(",")]
    for mode in modes:
        nbytes = bytes_bf16 if mode == 0 else (bytes_bf16 // 2 if mode == 1 else
                                                 bytes_bf16 // 4 + 4 * packs["k"][1].numel() * 2)
        errs = None
        for bn, warps, stages in ((32, 4, 2), (64, 4, 2), (32, 4, 3), (64, 4, 3)):
            for splits in (4, 8):
                try:
                    go, res = run(mode, q, packs, B, H, G, S, D, CHG, bn, warps, stages, splits)
                    go()
                    if errs is None:
                        errs = (res() - reference(mode, q, packs, B, H, G, S, D)).abs().max().item()
                    t = triton.testing.do_bench(go, warmup=20, rep=200)
                    print(f"mode {mode} bn {bn} w {warps} st {stages} splits {splits}: {t*1e3:.1f} us "
                          f"x{base/t:.2f} {nbytes/t/1e6:.0f} GB/s err {errs:.2e}", flush=True)
                except Exception as e:  # noqa: BLE001
                    print(f"mode {mode} bn {bn} w {warps} st {stages}: FAILED {type(e).__name__}: {str(e)[:200]}",
                          flush=True)


if __name__ == "__main__":
    sys.exit(main())
