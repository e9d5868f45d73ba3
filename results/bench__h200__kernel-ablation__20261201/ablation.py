"""Issue 19 body-kernel experiments (dev only, not shipped): conversions and group scales.

A stripped split-K body (decode, q_len 1, no mask/tail, Llama-3-8B heads), one program per (b*h, split), same loop
as `kernels/decode.py`. Each mode is a format and a way of computing it:
  bf16        bf16 K/V (our loop's ceiling against SDPA)
  i4-int      int4 one group per token (int4-g128), planes, codes into bf16 by Triton integer ops (the library today)
  i4-asm      = i4-int with the planes made by inline PTX, two codes per instruction (prmt + lop3, 0x4300 magic)
  g32-int     int4-g32, strided planes (plane P = channels P*D/2 ..), one 32-deep product per group, the group
              scales applied to the scores and to p; conversion by Triton integer ops
  g32-asm     = g32-int with the inline-PTX conversion
  i2g32-asm   int2-g32 the same way (4 planes, each one group at D = 128)
  fp8-lib     e4m3 through fp32 into bf16 (the library today)
  fp8-direct  e4m3 -> bf16 by Triton's own conversion
  fp8-asm     e4m3 bits shifted into bf16 and multiplied by 2^120 (bf16x2), two per instruction
  i8-lib      int8 one group per token, plane through fp32 (the library today)
  i8-magic    int8 through the fp32 magic number 2^23 (or + sub), then bf16
  i8-asm      int8 by prmt into the fp32 magic, sub, cvt.rn.bf16x2
"""
import math
import os
import sys

import torch
import triton
import triton.language as tl

MODES = ["bf16", "i4-int", "i4-asm", "g32-int", "g32-asm", "i2g32-asm", "fp8-lib", "fp8-direct", "fp8-asm",
         "i8-lib", "i8-magic", "i8-asm", "fp8-h", "fp8e5-h", "i8-h", "i8-h-asm", "i4-h-asm"]
# fp16 products for a bf16 model (modes *-h): q scaled by a power of two into fp16's range, p rounded to fp16,
# codes converted straight to fp16 (e4m3/e5m2 exactly; integer codes as 1024 + c by the 0x6400 magic)
ID = {m: i for i, m in enumerate(MODES)}

_ASM4 = """
{
.reg .b32 z, t0, t1, s0, s1;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
and.b32 $0, t0, 0x000F000F;
or.b32 $0, $0, 0x43004300;
and.b32 $1, t1, 0x000F000F;
or.b32 $1, $1, 0x43004300;
shr.u32 s0, t0, 4;
shr.u32 s1, t1, 4;
and.b32 $2, s0, 0x000F000F;
or.b32 $2, $2, 0x43004300;
and.b32 $3, s1, 0x000F000F;
or.b32 $3, $3, 0x43004300;
}
"""

_ASM2 = """
{
.reg .b32 z, t0, t1, s0, s1;
mov.b32 z, 0;
prmt.b32 t0, $8, z, 0x4140;
prmt.b32 t1, $8, z, 0x4342;
and.b32 $0, t0, 0x00030003;
or.b32 $0, $0, 0x43004300;
and.b32 $1, t1, 0x00030003;
or.b32 $1, $1, 0x43004300;
shr.u32 s0, t0, 2;
shr.u32 s1, t1, 2;
and.b32 $2, s0, 0x00030003;
or.b32 $2, $2, 0x43004300;
and.b32 $3, s1, 0x00030003;
or.b32 $3, $3, 0x43004300;
shr.u32 s0, t0, 4;
shr.u32 s1, t1, 4;
and.b32 $4, s0, 0x00030003;
or.b32 $4, $4, 0x43004300;
and.b32 $5, s1, 0x00030003;
or.b32 $5, $5, 0x43004300;
shr.u32 s0, t0, 6;
shr.u32 s1, t1, 6;
and.b32 $6, s0, 0x00030003;
or.b32 $6, $6, 0x43004300;
and.b32 $7, s1, 0x00030003;
or.b32 $7, $7, 0x43004300;
}
"""

# e4m3 s.eeee.mmm -> bf16 s.0000eeee.mmm0000, times 2^120 (exact, subnormals too)
_ASM_FP8 = """
{
.reg .b32 z, t0, t1, a0, a1, m0, m1;
mov.b32 z, 0;
prmt.b32 t0, $2, z, 0x1404;
prmt.b32 t1, $2, z, 0x3424;
shr.u32 a0, t0, 4;
shr.u32 a1, t1, 4;
and.b32 a0, a0, 0x07F007F0;
and.b32 a1, a1, 0x07F007F0;
and.b32 m0, t0, 0x80008000;
and.b32 m1, t1, 0x80008000;
or.b32 a0, a0, m0;
or.b32 a1, a1, m1;
mov.b32 z, 0x7B807B80;
mul.rn.bf16x2 $0, a0, z;
mul.rn.bf16x2 $1, a1, z;
}
"""

# int8 byte -> fp32 2^23 + c (prmt into the magic's low byte), minus 2^23, two rounded into bf16x2
_ASM_I8H = """
{
.reg .b32 m;
mov.b32 m, 0x64646464;
prmt.b32 $0, $2, m, 0x4140;
prmt.b32 $1, $2, m, 0x4342;
}
"""

_ASM_I8 = """
{
.reg .b32 m, f0, f1, f2, f3;
mov.b32 m, 0x4B000000;
prmt.b32 f0, $2, m, 0x7650;
prmt.b32 f1, $2, m, 0x7651;
prmt.b32 f2, $2, m, 0x7652;
prmt.b32 f3, $2, m, 0x7653;
sub.f32 f0, f0, 0f4B000000;
sub.f32 f1, f1, 0f4B000000;
sub.f32 f2, f2, 0f4B000000;
sub.f32 f3, f3, 0f4B000000;
cvt.rn.bf16x2.f32 $0, f1, f0;
cvt.rn.bf16x2.f32 $1, f3, f2;
}
"""

K_ASM4 = tl.constexpr(_ASM4)
K_ASM2 = tl.constexpr(_ASM2)
K_ASM_FP8 = tl.constexpr(_ASM_FP8)
K_ASM_I8 = tl.constexpr(_ASM_I8)
K_ASM_I8H = tl.constexpr(_ASM_I8H)
K_ASM4H = tl.constexpr(_ASM4.replace("0x43004300", "0x64006400"))


@triton.jit
def _planes4(byte, ASM: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as bf16 128 + code."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(K_ASM4, "=r,=r,=r,=r,r", [byte], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=4)
    else:
        b = byte.to(tl.int32)
        lo = ((b & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = ((b >> 4) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return lo, hi


@triton.jit
def _planes2(byte):
    p0, p1, p2, p3 = tl.inline_asm_elementwise(K_ASM2, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                               dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
                                               is_pure=True, pack=4)
    return p0, p1, p2, p3


@triton.jit
def _fp8(byte, HOW: tl.constexpr):
    """HOW 0: via fp32; 1: Triton's direct conversion; 2: inline PTX (exact value)."""
    if HOW == 0:
        x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
    elif HOW == 1:
        x = byte.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    else:
        x = tl.inline_asm_elementwise(K_ASM_FP8, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True, pack=4)
    return x


@triton.jit
def _int8(byte, HOW: tl.constexpr):
    if HOW == 0:
        x = byte.to(tl.float32).to(tl.bfloat16)
    elif HOW == 1:
        x = ((byte.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(tl.bfloat16)
    else:
        x = tl.inline_asm_elementwise(K_ASM_I8, "=r,=r,r", [byte], dtype=tl.bfloat16, is_pure=True, pack=4)
    return x


@triton.jit
def _to_h(byte, HOW: tl.constexpr):
    """bytes -> fp16 for the *-h modes: 12 e4m3, 13 e5m2, 14 int8 (1024 + c) by integer ops, 15 the same by prmt."""
    if HOW == 12:
        x = byte.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    elif HOW == 13:
        x = byte.to(tl.float8e5, bitcast=True).to(tl.float16)
    elif HOW == 14:
        x = (byte.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        x = tl.inline_asm_elementwise(K_ASM_I8H, "=r,=r,r", [byte], dtype=tl.float16, is_pure=True, pack=4)
    return x


@triton.jit
def _softmax(s, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _cols4(x, BN: tl.constexpr):
    """(BN, 4) -> its four columns (BN,) by register splits."""
    a, b = tl.split(tl.reshape(x, (BN, 2, 2)))  # a: columns 0, 2; b: columns 1, 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


_SUB128 = """
sub.rn.bf16x2 $0, $0, k128;
sub.rn.bf16x2 $1, $1, k128;
sub.rn.bf16x2 $2, $2, k128;
sub.rn.bf16x2 $3, $3, k128;
"""

_K128 = ".reg .b32 k128;\nmov.b32 k128, 0x43004300;\n"
ASM4X = tl.constexpr(_ASM4.replace("}", "") + _K128 + _SUB128 + "}")
ASM2X = tl.constexpr(_ASM2.replace("}", "") + _K128 + _SUB128 + _SUB128.replace("$3", "$7").replace("$2", "$6")
                     .replace("$1", "$5").replace("$0", "$4") + "}")


@triton.jit
def _planes4x(byte, ASM: tl.constexpr):
    """uint8 bytes -> (low nibbles, high nibbles) as exact bf16 codes."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(ASM4X, "=r,=r,=r,=r,r", [byte],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        b = byte.to(tl.int32)
        lo = (b & 15).to(tl.float32).to(tl.bfloat16)
        hi = (b >> 4).to(tl.float32).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _planes2x(byte):
    p0, p1, p2, p3 = tl.inline_asm_elementwise(
        ASM2X, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return p0, p1, p2, p3


@triton.jit
def _body(Q, K, V, KS, KZ, VS, VZ, ACC, M_OUT, L_OUT, S, tiles_per_split, n_splits, sm_scale,
          D: tl.constexpr, G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr,
          NG: tl.constexpr, DT: tl.constexpr):
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    rows = tl.arange(0, BM)
    row_ok = rows < G
    n = tl.arange(0, BN)
    d = tl.arange(0, D)
    qbase = Q + pid_bh * G * D + rows * D
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    lo = pid_s * tiles_per_split
    hi = tl.minimum(lo + tiles_per_split, S // BN)
    LOG2E: tl.constexpr = 1.4426950408889634
    part = (pid_bh * n_splits + pid_s) * BM + rows
    if MODE == 0 or MODE == 6 or MODE == 7 or MODE == 8:
        q = tl.load(qbase[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        acc = tl.zeros((BM, D), tl.float32)
        kbase = K + pid_bh * S * D
        vbase = V + pid_bh * S * D
        for tile in range(lo, hi):
            tok = tile * BN + n
            if MODE == 0:
                k = tl.load(kbase + tok[:, None] * D + d[None, :])
            else:
                k = _fp8(tl.load(kbase + tok[:, None] * D + d[None, :]), MODE - 6)
            s = tl.dot(q, tl.trans(k.to(DT))) * (sm_scale * LOG2E)
            m_i, alpha, p, l_i = _softmax(s, m_i, l_i)
            if MODE == 0:
                v = tl.load(vbase + tok[:, None] * D + d[None, :])
            else:
                v = _fp8(tl.load(vbase + tok[:, None] * D + d[None, :]), MODE - 6)
            acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT))
        tl.store(ACC + part[:, None] * D + d[None, :], acc)
    elif MODE >= 12:
        qf = tl.load(qbase[:, None] + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        amax = tl.max(tl.max(tl.abs(qf), 1), 0)
        qe = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1e-30) / 16384.0)), 0.0)
        qscale = tl.exp2(-qe)  # a power of two: q * qscale is exact, and below 2^14 in magnitude
        if MODE <= 13:
            q = (qf * qscale).to(tl.float16)
            acc = tl.zeros((BM, D), tl.float32)
            kbase = K + pid_bh * S * D
            vbase = V + pid_bh * S * D
            for tile in range(lo, hi):
                tok = tile * BN + n
                k = _to_h(tl.load(kbase + tok[:, None] * D + d[None, :]), MODE)
                s = tl.dot(q, tl.trans(k)) * (sm_scale * LOG2E / qscale)
                m_i, alpha, p, l_i = _softmax(s, m_i, l_i)
                v = _to_h(tl.load(vbase + tok[:, None] * D + d[None, :]), MODE)
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
            tl.store(ACC + part[:, None] * D + d[None, :], acc)
        else:
            PER: tl.constexpr = 2 if MODE == 16 else 1
            W: tl.constexpr = D // PER
            j = tl.arange(0, W)
            q0 = tl.load(qbase[:, None] + PER * j[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
            q0 = (q0 * qscale).to(tl.float16)
            q1 = q0
            qsum = tl.sum(q0.to(tl.float32), 1)
            if PER == 2:
                q1 = tl.load(qbase[:, None] + PER * j[None, :] + 1, mask=row_ok[:, None], other=0.0).to(tl.float32)
                q1 = (q1 * qscale).to(tl.float16)
                qsum += tl.sum(q1.to(tl.float32), 1)
            qsum = qsum / qscale
            OFF: tl.constexpr = 1024.0
            acc0 = tl.zeros((BM, W), tl.float32)
            acc1 = acc0
            extra = tl.zeros((BM,), tl.float32)
            kbase = K + pid_bh * S * W
            vbase = V + pid_bh * S * W
            sbase = pid_bh * S
            for tile in range(lo, hi):
                tok = tile * BN + n
                kb = tl.load(kbase + tok[:, None] * W + j[None, :])
                ksc = tl.load(KS + sbase + tok).to(tl.float32)
                kzr = tl.load(KZ + sbase + tok).to(tl.float32)
                if PER == 2:
                    c0, c1 = tl.inline_asm_elementwise(K_ASM4H, "=r,=r,=r,=r,r", [kb],
                                                       dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
                    s = tl.dot(q0, tl.trans(c0)) + tl.dot(q1, tl.trans(c1))
                else:
                    s = tl.dot(q0, tl.trans(_to_h(kb, MODE)))
                s = (s / qscale - OFF * qsum[:, None]) * ksc[None, :] + qsum[:, None] * kzr[None, :]
                m_i, alpha, p, l_i = _softmax(s * (sm_scale * LOG2E), m_i, l_i)
                vb = tl.load(vbase + tok[:, None] * W + j[None, :])
                vsc = tl.load(VS + sbase + tok).to(tl.float32)
                vzr = tl.load(VZ + sbase + tok).to(tl.float32)
                ps = tl.minimum(p * vsc[None, :], 65504.0).to(tl.float16)
                extra = extra * alpha + tl.sum(p * vzr[None, :] - OFF * ps.to(tl.float32), 1)
                if PER == 2:
                    c0, c1 = tl.inline_asm_elementwise(K_ASM4H, "=r,=r,=r,=r,r", [vb],
                                                       dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
                    acc0 = acc0 * alpha[:, None] + tl.dot(ps, c0)
                    acc1 = acc1 * alpha[:, None] + tl.dot(ps, c1)
                else:
                    acc0 = acc0 * alpha[:, None] + tl.dot(ps, _to_h(vb, MODE))
            tl.store(ACC + part[:, None] * D + PER * j[None, :], acc0 + extra[:, None])
            if PER == 2:
                tl.store(ACC + part[:, None] * D + PER * j[None, :] + 1, acc1 + extra[:, None])
    elif MODE == 1 or MODE == 2 or MODE >= 9:
        # one scale + zero per token, interleaved planes (library layout): element 2j low nibble, 2j+1 high
        PER: tl.constexpr = 2 if MODE <= 2 else 1
        W: tl.constexpr = D // PER
        j = tl.arange(0, W)
        q0 = tl.load(qbase[:, None] + PER * j[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        q1 = q0
        qsum = tl.sum(q0.to(tl.float32), 1)
        if PER == 2:
            q1 = tl.load(qbase[:, None] + PER * j[None, :] + 1, mask=row_ok[:, None], other=0.0).to(DT)
            qsum += tl.sum(q1.to(tl.float32), 1)
        OFF: tl.constexpr = 128.0 if PER == 2 else 0.0
        acc0 = tl.zeros((BM, W), tl.float32)
        acc1 = acc0
        extra = tl.zeros((BM,), tl.float32)
        kbase = K + pid_bh * S * W
        vbase = V + pid_bh * S * W
        sbase = pid_bh * S
        for tile in range(lo, hi):
            tok = tile * BN + n
            kb = tl.load(kbase + tok[:, None] * W + j[None, :])
            ksc = tl.load(KS + sbase + tok).to(tl.float32)
            kzr = tl.load(KZ + sbase + tok).to(tl.float32)
            if PER == 2:
                c0, c1 = _planes4(kb, MODE == 2)
                s = tl.dot(q0, tl.trans(c0.to(DT))) + tl.dot(q1, tl.trans(c1.to(DT)))
            else:
                s = tl.dot(q0, tl.trans(_int8(kb, MODE - 9).to(DT)))
            s = (s - OFF * qsum[:, None]) * ksc[None, :] + qsum[:, None] * kzr[None, :]
            m_i, alpha, p, l_i = _softmax(s * (sm_scale * LOG2E), m_i, l_i)
            vb = tl.load(vbase + tok[:, None] * W + j[None, :])
            vsc = tl.load(VS + sbase + tok).to(tl.float32)
            vzr = tl.load(VZ + sbase + tok).to(tl.float32)
            ps = (p * vsc[None, :]).to(DT)
            extra = extra * alpha + tl.sum(p * vzr[None, :] - OFF * ps.to(tl.float32), 1)
            if PER == 2:
                c0, c1 = _planes4(vb, MODE == 2)
                acc0 = acc0 * alpha[:, None] + tl.dot(ps, c0.to(DT))
                acc1 = acc1 * alpha[:, None] + tl.dot(ps, c1.to(DT))
            else:
                acc0 = acc0 * alpha[:, None] + tl.dot(ps, _int8(vb, MODE - 9).to(DT))
        tl.store(ACC + part[:, None] * D + PER * j[None, :], acc0 + extra[:, None])
        if PER == 2:
            tl.store(ACC + part[:, None] * D + PER * j[None, :] + 1, acc1 + extra[:, None])
    else:
        # strided planes: byte j of a row holds channel j + P * D / PER in bits P*BITS. At D = 128 with groups of
        # 32 every plane of a 32-byte chunk is one whole group: int4: chunk c, plane P = group 2P + c; int2: one
        # chunk, plane P = group P. One 32-deep product per group; scales on the scores and on p, zeros through
        # a small tf32 product; codes exact (128 + c - 128 in bf16).
        PER: tl.constexpr = 2 if MODE <= 4 else 4
        ROW: tl.constexpr = D // PER
        W: tl.constexpr = 32
        jw = tl.arange(0, W)
        ASM: tl.constexpr = MODE != 3
        q0 = tl.load(qbase[:, None] + jw[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        q1 = tl.load(qbase[:, None] + W + jw[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        q2 = tl.load(qbase[:, None] + 2 * W + jw[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        q3 = tl.load(qbase[:, None] + 3 * W + jw[None, :], mask=row_ok[:, None], other=0.0).to(DT)
        g16 = tl.arange(0, 16)
        s0 = tl.sum(q0.to(tl.float32), 1)[:, None]
        s1 = tl.sum(q1.to(tl.float32), 1)[:, None]
        s2 = tl.sum(q2.to(tl.float32), 1)[:, None]
        s3 = tl.sum(q3.to(tl.float32), 1)[:, None]
        qsums = (tl.where(g16[None, :] == 0, s0, 0.0) + tl.where(g16[None, :] == 1, s1, 0.0)
                 + tl.where(g16[None, :] == 2, s2, 0.0) + tl.where(g16[None, :] == 3, s3, 0.0))  # (BM, 16)
        a0 = tl.zeros((BM, W), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        extra = tl.zeros((BM, 16), tl.float32)
        g4 = tl.arange(0, 4)
        kbase = K + pid_bh * S * ROW
        vbase = V + pid_bh * S * ROW
        sbase = pid_bh * S * NG
        for tile in range(lo, hi):
            tok = tile * BN + n
            soff = sbase + tok[:, None] * NG
            kz16 = tl.load(KZ + soff + g16[None, :], mask=g16[None, :] < NG, other=0.0).to(tl.float32)
            ks0, ks1, ks2, ks3 = _cols4(tl.load(KS + soff + g4[None, :]).to(tl.float32), BN)
            vs0, vs1, vs2, vs3 = _cols4(tl.load(VS + soff + g4[None, :]).to(tl.float32), BN)
            vz16 = tl.load(VZ + soff + g16[None, :], mask=g16[None, :] < NG, other=0.0).to(tl.float32)
            if PER == 2:
                c0, c2 = _planes4x(tl.load(kbase + tok[:, None] * ROW + jw[None, :]), ASM)
                c1, c3 = _planes4x(tl.load(kbase + tok[:, None] * ROW + W + jw[None, :]), ASM)
            else:
                c0, c1, c2, c3 = _planes2x(tl.load(kbase + tok[:, None] * ROW + jw[None, :]))
            s = tl.dot(q0, tl.trans(c0.to(DT))) * ks0[None, :]
            s += tl.dot(q1, tl.trans(c1.to(DT))) * ks1[None, :]
            s += tl.dot(q2, tl.trans(c2.to(DT))) * ks2[None, :]
            s += tl.dot(q3, tl.trans(c3.to(DT))) * ks3[None, :]
            s += tl.dot(qsums, tl.trans(kz16), input_precision="tf32")
            m_i, alpha, p, l_i = _softmax(s * (sm_scale * LOG2E), m_i, l_i)
            if PER == 2:
                v0, v2 = _planes4x(tl.load(vbase + tok[:, None] * ROW + jw[None, :]), ASM)
                v1, v3 = _planes4x(tl.load(vbase + tok[:, None] * ROW + W + jw[None, :]), ASM)
            else:
                v0, v1, v2, v3 = _planes2x(tl.load(vbase + tok[:, None] * ROW + jw[None, :]))
            a0 = a0 * alpha[:, None] + tl.dot((p * vs0[None, :]).to(DT), v0.to(DT))
            a1 = a1 * alpha[:, None] + tl.dot((p * vs1[None, :]).to(DT), v1.to(DT))
            a2 = a2 * alpha[:, None] + tl.dot((p * vs2[None, :]).to(DT), v2.to(DT))
            a3 = a3 * alpha[:, None] + tl.dot((p * vs3[None, :]).to(DT), v3.to(DT))
            extra = extra * alpha[:, None] + tl.dot(p, vz16, input_precision="tf32")
        e0 = tl.sum(tl.where(g16[None, :] == 0, extra, 0.0), 1)[:, None]
        e1 = tl.sum(tl.where(g16[None, :] == 1, extra, 0.0), 1)[:, None]
        e2 = tl.sum(tl.where(g16[None, :] == 2, extra, 0.0), 1)[:, None]
        e3 = tl.sum(tl.where(g16[None, :] == 3, extra, 0.0), 1)[:, None]
        tl.store(ACC + part[:, None] * D + jw[None, :], a0 + e0)
        tl.store(ACC + part[:, None] * D + W + jw[None, :], a1 + e1)
        tl.store(ACC + part[:, None] * D + 2 * W + jw[None, :], a2 + e2)
        tl.store(ACC + part[:, None] * D + 3 * W + jw[None, :], a3 + e3)
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


# ---------------------------------------------------------------------------------------------------- host side
def pack_data(mode, B, H, S, D, dev):
    """Packed K and V for a mode plus the dequantized bf16 reference tensors."""
    g = torch.Generator(device=dev).manual_seed(0)
    out = {}
    for name in ("k", "v"):
        x = torch.randn(B, H, S, D, generator=g, device=dev)
        if name == "k":
            x[..., 3] *= 8  # a key outlier channel
        if mode in ("bf16",):
            out[name] = (x.to(torch.bfloat16).contiguous(), None, None)
            out[name + "_ref"] = x.to(torch.bfloat16)
        elif mode.startswith("fp8"):
            c = x.clamp(-448, 448).to(torch.float8_e5m2 if "e5" in mode else torch.float8_e4m3fn)
            out[name] = (c.view(torch.uint8).contiguous(), None, None)
            out[name + "_ref"] = c.to(torch.bfloat16)
        else:
            bits = 8 if mode.startswith("i8") else (2 if mode.startswith("i2") else 4)
            chg = 32 if "g32" in mode else D
            qmax = (1 << bits) - 1
            xg = x.view(B, H, S, D // chg, chg)
            mn, mx = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
            sc = ((mx - mn) / qmax).clamp_min(1e-6).half()
            zr = mn.half()
            c = ((xg - zr.float()) / sc.float()).round().clamp(0, qmax).to(torch.uint8)
            deq = (c.float() * sc.float() + zr.float()).view(B, H, S, D)
            c = c.view(B, H, S, D)
            per = 8 // bits
            if per == 1:
                packed = c
            elif "g32" in mode:  # strided: byte j holds channel j + P * D / per
                row = D // per
                packed = torch.zeros(B, H, S, row, dtype=torch.int32, device=dev)
                for P in range(per):
                    packed |= c[..., P * row:(P + 1) * row].int() << (P * bits)
                packed = packed.to(torch.uint8)
            else:  # interleaved (library): byte j holds channels per*j .. per*j + per - 1
                packed = (c[..., 0::2] | (c[..., 1::2] << 4))
            out[name] = (packed.contiguous(), sc.view(B, H, S, D // chg).contiguous(),
                         zr.view(B, H, S, D // chg).contiguous())
            out[name + "_ref"] = deq.to(torch.bfloat16)
    return out


def launch(mode, q, data, B, H, G, S, D, bn, warps, stages, splits):
    BM = 16
    tiles = S // bn
    tps = math.ceil(tiles / splits)
    splits = math.ceil(tiles / tps)
    acc = torch.empty(B * H * splits * BM, D, device=q.device)
    m = torch.empty(B * H * splits * BM, device=q.device)
    lsum = torch.empty_like(m)
    K, KS, KZ = data["k"]
    V, VS, VZ = data["v"]
    KS = KS if KS is not None else m
    KZ = KZ if KZ is not None else m
    VS = VS if VS is not None else m
    VZ = VZ if VZ is not None else m
    ng = 1 if data["k"][1] is None else data["k"][1].shape[-1]

    def go():
        _body[(B * H, splits)](q, K, V, KS, KZ, VS, VZ, acc, m, lsum, S, tps, splits, 1 / math.sqrt(D),
                               D=D, G=G, BM=BM, BN=bn, MODE=ID[mode], NG=ng,
                               DT=tl.float32 if os.environ.get('TRITON_INTERPRET') == '1' else tl.bfloat16, num_warps=warps, num_stages=stages)

    def result():
        a = acc.view(B, H, splits, BM, D)[:, :, :, :G]
        mm = m.view(B, H, splits, BM)[:, :, :, :G]
        ll = lsum.view(B, H, splits, BM)[:, :, :, :G]
        w = torch.exp2(mm - mm.amax(2, keepdim=True))
        return ((a * w[..., None]).sum(2) / (ll * w).sum(2)[..., None]).reshape(B, H * G, D)

    return go, result


def reference(q, data, B, H, G, S, D):
    k, v = data["k_ref"].float(), data["v_ref"].float()
    qq = q.view(B, H, G, D).float()
    s = torch.einsum("bhgd,bhsd->bhgs", qq, k) / math.sqrt(D)
    return torch.einsum("bhgs,bhsd->bhgd", s.softmax(-1), v).reshape(B, H * G, D)


def main():
    B, H, G, S, D = 16, 8, 4, 32768, 128
    dev = "cuda"
    q = torch.randn(B, H * G, D, device=dev).to(torch.bfloat16)
    kb = torch.randn(B, H, S, D, device=dev).to(torch.bfloat16)
    vb = torch.randn(B, H, S, D, device=dev).to(torch.bfloat16)
    qs = q.view(B, H * G, 1, D)
    torch.backends.cuda.enable_cudnn_sdp(False)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, kb, vb, enable_gqa=True)
    base = triton.testing.do_bench(sdpa, warmup=50, rep=300)
    src = torch.empty(2 * 1024 ** 3, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    bw = 2 * src.numel() / copy / 1e6
    del src, dst
    print(f"sdpa bf16: {base * 1e3:.1f} us; copy bandwidth {bw:.0f} GB/s", flush=True)
    once = os.environ.get("ONCE")
    if once:  # one mode, two launches (for ncu)
        data = pack_data(once, B, H, S, D, dev)
        go, _ = launch(once, q, data, B, H, G, S, D, 64, 4, 3, 8)
        go()
        go()
        torch.cuda.synchronize()
        return
    modes = os.environ.get("MODES", ",".join(MODES)).split(",")
    configs = [tuple(int(v) for v in c.split("/")) for c in os.environ.get("CONFIGS", "64/4/3/8,64/4/2/8").split(",")]
    results = []
    for mode in modes:
        data = pack_data(mode, B, H, S, D, dev)
        nbytes = sum(t.numel() * t.element_size() for name in ("k", "v") for t in data[name] if t is not None)
        ref = reference(q, data, B, H, G, S, D)
        best = None
        for bn, warps, stages, splits in configs:
            try:
                go, res = launch(mode, q, data, B, H, G, S, D, bn, warps, stages, splits)
                go()
                err = (res() - ref).abs().max().item()
                t = triton.testing.do_bench(go, warmup=20, rep=200)
                line = (f"{mode:11s} bn {bn} w {warps} st {stages} splits {splits}: {t * 1e3:7.1f} us x{base / t:.2f} "
                        f"{nbytes / t / 1e6:5.0f} GB/s ({nbytes / t / 1e6 / bw:.0%} of copy) "
                        f"limit x{2 * B * H * S * D * 2 / nbytes:.2f} err {err:.2e}")
                print(line, flush=True)
                if best is None or t < best[0]:
                    best = (t, line)
            except Exception as e:  # noqa: BLE001
                print(f"{mode} bn {bn} w {warps} st {stages}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        if best:
            results.append(best[1])
        del data
        torch.cuda.empty_cache()
    print("\nBEST PER MODE (sdpa %.1f us)" % (base * 1e3))
    for line in results:
        print(line)


if __name__ == "__main__":
    sys.exit(main())
