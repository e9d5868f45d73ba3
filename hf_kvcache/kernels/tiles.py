"""The Triton device functions that several kernels share (`decode.py`, `turbo.py`, `nuq.py`, `workspace.py`,
`pack.py`): products on tensor cores and the operands' copy, the online softmax's steps and masks, codes unpacked
from bytes or split into bit planes (by inline PTX), integer groups and fp8 dequantized, a stream's places in token
order (sink, packed, residual ring, new tokens), TurboQuant's codebook tiles and lengths, and fp16 rounding. Each
kernel module holds its kernels and what only they use; what two of them share lives here, under a public name.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl


@triton.jit
def opaque(x):
    """`x` (16-bit) unchanged, through a copy that Triton may not look through. Triton lays out a product's operands
    for the narrowest type its operands were loaded as, following elementwise operations, views and joins back to the
    loads (and halving the width again at a join): an operand built from byte codes, or joined from lookups, took the
    layout of 8-bit operands (kWidth 4), whose fragments ptxas copied into place before every mma, and whose tiles were
    read back from shared memory 64 bits at a time instead of by ldmatrix. Behind this copy the search stops at 16
    bits (`hf-kvcache bench --parts sass`, Triton 3.6: int4-g32 42.8 -> 32.7 instructions a held token, turboquant-3
    60.5 -> 48.1). Not pure, which is what stops the search; it moves nothing once compiled. The launchers take it
    where it measured faster (`launch.TUNING["operand_copy"]`)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2)


@triton.jit
def dot(a, b, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """Tensor-core product with fp32 accumulation; exact fp32 products when the operands are fp32. COPY: a 16-bit
    `b` through `opaque` first (on the GPU)."""
    if PREC == "ieee":
        out = tl.dot(a, b, input_precision="ieee")
    else:
        if COPY and b.dtype.primitive_bitwidth == 16:
            b = opaque(b)
        out = tl.dot(a, b)
    return out


@triton.jit
def dot_into(acc, a, b, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """`acc + a @ b` with the tensor cores' own accumulation (as `dot`)."""
    if PREC == "ieee":
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        if COPY and b.dtype.primitive_bitwidth == 16:
            b = opaque(b)
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def unpack(ptr, row_off, d, mask, BITS: tl.constexpr):
    """Unsigned codes at `ptr + row_off` for channels `d` (broadcastable offsets, any tokens), as int32."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(ptr + row_off + d // PER, mask=mask, other=0).to(tl.int32)
    if BITS == 8:
        c = byte
    else:
        c = (byte >> ((d % PER) * BITS)) & ((1 << BITS) - 1)
    return c


@triton.jit
def unpack_rows(ptr, row_off, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Codes of BLOCK_N whole rows (`row_off (BLOCK_N,)` byte offsets) -> int32 (BLOCK_N, D). The packed bytes are
    read contiguously (vector loads) and split in registers: byte i holds elements PER*i .. PER*i + PER-1."""
    PER: tl.constexpr = 8 // BITS
    j = tl.arange(0, D // PER)
    byte = tl.load(ptr + row_off[:, None] + j[None, :]).to(tl.int32)  # (BLOCK_N, D / PER)
    if BITS == 8:
        c = byte
    elif BITS == 4:
        c = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_N, D))
    else:
        # join(join(c0, c2), join(c1, c3)) flattens to c0, c1, c2, c3 (c_k = bits 2k..2k+1)
        c = tl.reshape(tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, byte >> 6)),
                       (BLOCK_N, D))
    return c


@triton.jit
def group_dequant(C, tok, sc_t, scale, zero, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   CHG: tl.constexpr, SYM: tl.constexpr):
    """Per-token groups of CHG < D channels, whole tiles: float32 (BLOCK_N, D) = code * scale + zero, from the
    tile's `scale`/`zero (BLOCK_N, D / CHG)` (Triton's integer operations: the interpreter, fp32 models). The group
    scales are broadcast by reshapes, which keeps the dequantized tile from being produced in the tensor-core operand
    layout: it goes through shared memory."""
    NG: tl.constexpr = D // CHG
    code3 = tl.reshape(unpack_rows(C, tok * sc_t, BLOCK_N, D, BITS).to(tl.float32), (BLOCK_N, NG, CHG))
    if SYM:
        x = (code3 - (1 << (BITS - 1))) * scale[:, :, None]
    else:
        x = code3 * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))


@triton.jit
def group_plane(c, scale, zero, BITS: tl.constexpr, SYM: tl.constexpr):
    """One plane of `group_planes`: the exact fp16 codes -> code * scale + zero (asymmetric) or
    (code - 2^(BITS-1)) * scale, two elements an instruction, rounded once to fp16."""
    if SYM:
        x = (c - (1 << (BITS - 1))) * scale
    else:
        x = tl.fma(c, scale, zero)
    return x


@triton.jit
def group_planes(C, tok, sc_t, scale, zero, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  CHG: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr):
    """Per-token groups of CHG < D channels of a 16-bit model, whole tiles: the bit planes of `planes` (x0..x3,
    plane P = channels PER*j + P, (BLOCK_N, D / PER)), their codes exact in fp16 (1024 + code, less 1024),
    dequantized in fp16 from the tile's `scale`/`zero (BLOCK_N, D / CHG)`. Each plane is an operand of its own
    product, so no tile is joined back into channel order through shared memory. Every value lies between the
    group's fp16 zero and zero + (2^BITS - 1) * scale, inside fp16's range, and is rounded to fp16 (11 bits, where a
    bf16 tile kept 8)."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(C + (tok * sc_t)[:, None] + tl.arange(0, D // PER)[None, :])
    c0, c1, c2, c3 = planes(byte, BITS, tl.float16, 1024, 0, ASM)
    shape3: tl.constexpr = (BLOCK_N, D // CHG, CHG // PER)
    sg = tl.reshape(tl.broadcast_to(scale.to(tl.float16)[:, :, None], shape3), (BLOCK_N, D // PER))
    zg = sg
    if not SYM:
        zg = tl.reshape(tl.broadcast_to(zero.to(tl.float16)[:, :, None], shape3), (BLOCK_N, D // PER))
    x0 = group_plane(c0, sg, zg, BITS, SYM)
    x1 = x0
    x2 = x0
    x3 = x0
    if PER > 1:
        x1 = group_plane(c1, sg, zg, BITS, SYM)
    if PER > 2:
        x2 = group_plane(c2, sg, zg, BITS, SYM)
        x3 = group_plane(c3, sg, zg, BITS, SYM)
    return x0, x1, x2, x3


@triton.jit
def side(SC, Z, tile, ss_t, ss_c, BLOCK_N: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
          BITS: tl.constexpr, TOKG: tl.constexpr, CHG: tl.constexpr, SYM: tl.constexpr, PLANES: tl.constexpr):
    """The scales and zeros one body tile needs, as float32 (a0, a1, a2, a3, z): per-channel key blocks: the
    scales of each bit plane's channels (D / PER,) and, asymmetric, zero + 2^(BITS-1) * scale (D,), what the
    centered codes leave out of q.k; one group per token: (BLOCK_N,) scales and
    zeros; smaller groups: (BLOCK_N, D / CHG) tiles; fp8: placeholders. The body loads them one tile ahead, so
    that their latency overlaps the current tile's work (Triton's pipeliner only prefetches the code tiles)."""
    n = tl.arange(0, BLOCK_N)
    tok = tile * BLOCK_N + n
    if FMT != 3:
        a0 = tl.zeros((BLOCK_N,), tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        z = a0
    elif TOKG > 1:
        PER: tl.constexpr = 8 // BITS
        j = tl.arange(0, D // PER)
        base = SC + tile * ss_t
        a0 = tl.load(base + (PER * j) * ss_c).to(tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        if PER > 1:
            a1 = tl.load(base + (PER * j + 1) * ss_c).to(tl.float32)
        if PER > 2:
            a2 = tl.load(base + (PER * j + 2) * ss_c).to(tl.float32)
            a3 = tl.load(base + (PER * j + 3) * ss_c).to(tl.float32)
        z = a0
        if not SYM:  # the zeros plus the codes' center times the scales, in channel order
            d = tl.arange(0, D)
            z = (tl.load(Z + tile * ss_t + d * ss_c).to(tl.float32)
                 + (1 << (BITS - 1)) * tl.load(base + d * ss_c).to(tl.float32))
    elif PLANES:
        a0 = tl.load(SC + tok * ss_t).to(tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        z = a0
        if not SYM:
            z = tl.load(Z + tok * ss_t).to(tl.float32)
    else:
        g = tl.arange(0, D // CHG)
        off = tok[:, None] * ss_t + g[None, :] * ss_c
        a0 = tl.load(SC + off).to(tl.float32)
        a1 = a0
        a2 = a0
        a3 = a0
        z = a0
        if not SYM:
            z = tl.load(Z + off).to(tl.float32)
    return a0, a1, a2, a3, z


@triton.jit
def plane(byte, P: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr, CENTER: tl.constexpr):
    """Plane P of packed bytes `byte` (int32): the codes of elements PER*j + P, centered, as exact DT values
    `code - CENTER`. OFF > 0 first writes the code into the mantissa of OFF (128 in bf16 for codes < 128, 1024 in
    fp16: two integer operations and a reinterpretation instead of an int-to-float conversion), then subtracts
    OFF + CENTER in DT, which is exact. Centering matters: an operand of OFF + code carried a constant 100-1000x the
    code into every product and into the split's running sum, from which OFF * sum(p) was taken only at the end, so
    the code's part kept only the accumulator's precision and the error grew with the tiles a split sums (3-11% for
    int8 and 5-155% for whole-row int4 at batch 1-64 x 32k; centered, 0.34% at 16 x 32k: H200, BENCHMARKS.md,
    2026-12-02)."""
    if BITS == 8:
        c = byte
    else:
        c = (byte >> (P * BITS)) & ((1 << BITS) - 1)
    if OFF == 128:
        x = (c | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True) - (128.0 + CENTER)
    elif OFF == 1024:
        x = (c | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - (1024.0 + CENTER)
    else:
        x = (c - CENTER).to(tl.float32).to(DT)
    return x


@triton.jit
def q_plane(Q, qoff, row_ok, j, P: tl.constexpr, PER: tl.constexpr):
    """Query elements PER*j + P: (BLOCK_M, D / PER) in the query's dtype."""
    return tl.load(Q + qoff[:, None] + (PER * j + P)[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def planes_ptx(byte, ASM: tl.constexpr, PER: tl.constexpr, OUT: tl.constexpr):
    """`plane_asm`'s outputs, OFF + code in OUT (fp16 or bf16) of each of the PER planes; the rest repeat plane 0."""
    if PER == 1:
        o0 = tl.inline_asm_elementwise(ASM, "=r,=r,r", [byte], dtype=OUT.value, is_pure=True, pack=4)
        o1 = o0
        o2 = o0
        o3 = o0
    elif PER == 2:
        o = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [byte], dtype=(OUT.value, OUT.value), is_pure=True,
                                      pack=4)
        o0 = o[0]
        o1 = o[1]
        o2 = o0
        o3 = o0
    else:
        o = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                      dtype=(OUT.value, OUT.value, OUT.value, OUT.value), is_pure=True, pack=4)
        o0 = o[0]
        o1 = o[1]
        o2 = o[2]
        o3 = o[3]
    return o0, o1, o2, o3


@triton.jit
def planes(byte, BITS: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr):
    """Every plane of packed bytes `byte` (uint8), as `plane` gives them: (x0, x1, x2, x3), the ones past 8 / BITS
    repeating x0. ASM (`plane_asm(BITS, OFF)`, the GPU): inline PTX on four bytes a register writes OFF + code of
    two elements into each 32-bit register, then OFF + CENTER is subtracted here: about 1.5 instructions a code, where
    `plane`'s integer operations on one element at a time take about 2.75."""
    PER: tl.constexpr = 8 // BITS
    if ASM != "":
        o0, o1, o2, o3 = planes_ptx(byte, ASM, PER, DT)
        x0 = o0 - (OFF + CENTER)
        x1 = o1 - (OFF + CENTER)
        x2 = o2 - (OFF + CENTER)
        x3 = o3 - (OFF + CENTER)
    else:
        b32 = byte.to(tl.int32)
        x0 = plane(b32, 0, BITS, DT, OFF, CENTER)
        x1 = x0
        x2 = x0
        x3 = x0
        if PER > 1:
            x1 = plane(b32, 1, BITS, DT, OFF, CENTER)
        if PER > 2:
            x2 = plane(b32, 2, BITS, DT, OFF, CENTER)
            x3 = plane(b32, 3, BITS, DT, OFF, CENTER)
    return x0, x1, x2, x3


@triton.jit
def plane_scores(kc, tok, skc_t, jk, q0, q1, q2, q3, PREC: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
                  OFF: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr, COPY: tl.constexpr = False):
    """sum over planes of q_P . (code_P - CENTER): raw scores (BLOCK_M, BLOCK_N) of whole packed rows of keys, in
    one accumulator."""
    byte = tl.load(kc + tok[:, None] * skc_t + jk[None, :])
    x0, x1, x2, x3 = planes(byte, BITS, DT, OFF, CENTER, ASM)
    return planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, 8 // BITS, PREC, COPY)


@triton.jit
def planes_into(acc0, acc1, acc2, acc3, alpha, p, x0, x1, x2, x3, PER: tl.constexpr, PREC: tl.constexpr,
                 COPY: tl.constexpr = False):
    """The running weighted sums of the PER planes (accumulator P: output channels PER*j + P), each rescaled by the
    softmax step's `alpha` and added p . x_P; the accumulators past PER are returned as given."""
    acc0 = dot_into(acc0 * alpha[:, None], p, x0, PREC, COPY)
    if PER > 1:
        acc1 = dot_into(acc1 * alpha[:, None], p, x1, PREC, COPY)
    if PER > 2:
        acc2 = dot_into(acc2 * alpha[:, None], p, x2, PREC, COPY)
        acc3 = dot_into(acc3 * alpha[:, None], p, x3, PREC, COPY)
    return acc0, acc1, acc2, acc3


@triton.jit
def planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, PER: tl.constexpr, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """sum over the PER planes of q_P . x_P^T: raw scores (BLOCK_M, BLOCK_N) in one accumulator."""
    s = dot(q0, tl.trans(x0), PREC, COPY)
    if PER > 1:
        s = dot_into(s, q1, tl.trans(x1), PREC, COPY)
    if PER > 2:
        s = dot_into(s, q2, tl.trans(x2), PREC, COPY)
        s = dot_into(s, q3, tl.trans(x3), PREC, COPY)
    return s


@functools.lru_cache(maxsize=None)
def plane_asm(bits: int, off: int) -> str:
    """The PTX of `planes` for `bits`-bit codes and OFF `off` (1024: fp16, 128: bf16 for codes below 128): input `$n`
    four packed bytes (n = 2 * 8 / bits), outputs `$2P`, `$2P + 1` plane P's OFF + code of bytes 0, 1 and of bytes 2,
    3, as two 16-bit floats each. `prmt` spreads bytes 0, 1 (and 2, 3) onto the low bytes of two 16-bit halves; each
    plane is then a shift and one `lop3` that masks its code and ors in OFF's bits (fp16 1024 = 0x6400, bf16 128 =
    0x4300), whose last mantissa bits the code becomes. 8-bit codes (fp16) take OFF's high byte in the same `prmt`."""
    if (bits, off) not in ((2, 1024), (4, 1024), (8, 1024), (2, 128), (4, 128)):
        raise ValueError(f"no plane PTX for {bits}-bit codes at OFF {off}")
    per = 8 // bits
    src = f"${2 * per}"
    high = {1024: 0x64, 128: 0x43}[off]
    if bits == 8:
        return "\n".join(["{", ".reg .b32 r_m;", f"mov.b32 r_m, {high * 0x01010101:#x};",
                           f"prmt.b32 $0, {src}, r_m, 0x4140; prmt.b32 $1, {src}, r_m, 0x4342;", "}"])
    mask = ((1 << bits) - 1) * 0x00010001
    lines = ["{", ".reg .b32 r_a, r_b, r_s, r_t;",
             f"prmt.b32 r_a, {src}, 0, 0x4140; prmt.b32 r_b, {src}, 0, 0x4342;"]
    for p in range(per):
        a, b = ("r_a", "r_b") if p == 0 else ("r_s", "r_t")
        if p:
            lines.append(f"shr.b32 r_s, r_a, {p * bits}; shr.b32 r_t, r_b, {p * bits};")
        lines.append(f"lop3.b32 ${2 * p}, {a}, {mask:#x}, {high * 0x01000100:#x}, 0xEA; "
                     f"lop3.b32 ${2 * p + 1}, {b}, {mask:#x}, {high * 0x01000100:#x}, 0xEA;")
    return "\n".join(lines + ["}"])


@triton.jit
def fp8_bits_to_f16(c, E4M3: tl.constexpr):
    """fp8 bytes as fp16 by their bits, exactly (`pack._fp8_bits` backwards): E5M2 is fp16's top byte; E4M3's sign,
    exponent and mantissa moved into an fp16 whose exponent bias is 8 more, times 2^8 (subnormals included)."""
    u = c.to(tl.uint8).to(tl.uint16)
    if E4M3:
        x = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    else:
        x = (u << 8).to(tl.float16, bitcast=True)
    return x


@triton.jit
def fp8_to_float(c, FMT: tl.constexpr):
    if FMT == 4:
        x = c.to(tl.float32)
    elif FMT == 1:
        x = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FMT == 2:
        x = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        x = fp8_bits_to_f16(c, FMT == 5).to(tl.float32)
    return x


@triton.jit
def fp8_to(c, FMT: tl.constexpr, PDT: tl.constexpr):
    """fp8 codes as the products' dtype: straight to fp16 (exact, one conversion per two codes) when PDT is fp16,
    else through fp32 (bf16 has no direct conversion from fp8 on Hopper)."""
    if PDT == tl.float16 and FMT != 4:
        if FMT == 1:
            x = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        elif FMT == 2:
            x = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            x = fp8_bits_to_f16(c, FMT == 5)
    else:
        x = fp8_to_float(c, FMT).to(PDT)
    return x


@triton.jit
def dequant(C, SC, Z, tok, d, mask, sc_t, ss_t, ss_c, fp8_scale,
             FMT: tl.constexpr, BITS: tl.constexpr, TOKG: tl.constexpr, CHG: tl.constexpr, SYM: tl.constexpr):
    """Element-domain dequantization of packed tokens `tok (N, 1)` x channels `d (1, D)` -> float32 (N, D)."""
    if FMT == 3:
        code = unpack(C, tok * sc_t, d, mask, BITS).to(tl.float32)
        soff = (tok // TOKG) * ss_t + (d // CHG) * ss_c
        scale = tl.load(SC + soff, mask=mask, other=0.0).to(tl.float32)
        if SYM:
            x = (code - (1 << (BITS - 1))) * scale
        else:
            x = code * scale + tl.load(Z + soff, mask=mask, other=0.0).to(tl.float32)
    else:
        code = tl.load(C + tok * sc_t + d, mask=mask, other=0)
        x = fp8_to_float(code, FMT) * fp8_scale
    return x


@triton.jit
def place_tile(S_, Rs, N_, C, SC, Z, ss_t, sr_t, sn_t, sc_t, ssc_t, ssc_c, fp8_scale,
                kpos, d, ok, n_sink, n_packed, n_res, r_off, stop, n_new, DT: tl.constexpr,
                FMT: tl.constexpr, BITS: tl.constexpr, TOKG: tl.constexpr, CHG: tl.constexpr, SYM: tl.constexpr,
                RING: tl.constexpr):
    """Keys or values of tokens `kpos (N, 1)` (pointers already offset to this batch row and kv-head) from
    whichever place holds them, rounded to the model dtype as the reference decode does: (N, D). RING > 0: the
    residual is a ring of RING rows whose oldest token sits in row `r_off` (`hf_kvcache.storage`)."""
    stored = ok & (kpos < stop)
    in_sink = stored & (kpos < n_sink)
    pk = kpos - n_sink
    in_packed = stored & (pk >= 0) & (pk < n_packed)
    rk = pk - n_packed
    in_res = stored & (rk >= 0) & (rk < n_res)
    nk = kpos - stop
    in_new = ok & (nk >= 0) & (nk < n_new)
    x = tl.load(S_ + kpos * ss_t + d, mask=in_sink, other=0.0).to(tl.float32)
    x += dequant(C, SC, Z, pk, d, in_packed, sc_t, ssc_t, ssc_c, fp8_scale, FMT, BITS, TOKG, CHG, SYM)
    if RING > 0:
        rk = (rk + r_off) % RING
    x += tl.load(Rs + rk * sr_t + d, mask=in_res, other=0.0).to(tl.float32)
    x += tl.load(N_ + nk * sn_t + d, mask=in_new, other=0.0).to(tl.float32)
    return x.to(DT)


@triton.jit
def softmax_step(s, m_i, l_i):
    """Online softmax in base 2: new running max, the rescale factor of the old sums, and the tile's weights."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, alpha, p, l_i


@triton.jit
def mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK: tl.constexpr):
    """Scores `s (BLOCK_M, BLOCK_N)` of query rows at positions `t` against tokens `kpos (BLOCK_N,)` (`ok`: real
    tokens): -inf where the boolean mask forbids (HAS_MASK), else where the token is past the row's causal limit
    (the row attends to the first `s_total - Tq + t + 1` tokens)."""
    if HAS_MASK:
        allowed = tl.load(MASK + b * sm_b + t[:, None] * sm_t + kpos[None, :] * sm_s,
                          mask=row_ok[:, None] & ok[None, :], other=0)
        s = tl.where(allowed != 0, s, float("-inf"))
    else:
        s = tl.where(ok[None, :] & (kpos[None, :] <= (s_total - Tq + t)[:, None]), s, float("-inf"))
    return s


@triton.jit
def finish_scores(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k -> base-2 logits: times the softmax scale, optional tanh soft-capping (Gemma 2), times log2(e)."""
    s = s * scale
    if HAS_SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * 1.4426950408889634


@triton.jit
def row_of(pid_bh, Hkv, ROW_LENS: tl.constexpr):
    """Which entry of a STATIC launch's `LENS` holds this program's length: its batch row's where every row has its own
    (`ROW_LENS`, packed pages: requests of different lengths in one launch), else the one length of the batch."""
    return (pid_bh // Hkv).to(tl.int64) * ROW_LENS  # one return type either way (the compiler checks both)


@triton.jit
def static_places(after, RING: tl.constexpr, WINDOW: tl.constexpr):
    """The storage's split of the `after` tokens held past the sinks: (packed tokens read, residual tokens,
    ring row of the oldest residual token). RING = 0: every token is packed. WINDOW (a FIFO window, every token
    also packed): the last min(after, RING) tokens are read from the ring. Otherwise (block flush, KIVI's keys):
    whole windows of RING tokens are packed and the rest waits in the ring from row 0."""
    if RING == 0:
        packed = after
    elif WINDOW:
        packed = tl.maximum(after - RING, 0)
    else:
        packed = (after // RING) * RING
    off = 0
    if RING > 0:
        off = packed % RING
    return packed, after - packed, off


@triton.jit
def tree8(a0, a1, a2, a3, a4, a5, a6, a7):
    """Eight (N, M) tensors -> (N, M, 2, 2, 2) whose reshape to (N, 8M) runs a0..a7 for each of the M columns."""
    return tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7)))


@triton.jit
def code_words(C, tok, ok, s_t, OFF: tl.constexpr, NW: tl.constexpr, WIDE: tl.constexpr):
    """NW words per row from byte OFF of the rows of tokens `tok (N,)`: int32 words (WIDE) or int16 halves, as int32."""
    if WIDE:
        ptr = (C + OFF).to(tl.pointer_type(tl.int32))
        w = tl.load(ptr + (tok * (s_t // 4))[:, None] + tl.arange(0, NW)[None, :], mask=ok[:, None], other=0)
    else:
        ptr = (C + OFF).to(tl.pointer_type(tl.int16))
        w = tl.load(ptr + (tok * (s_t // 2))[:, None] + tl.arange(0, NW)[None, :], mask=ok[:, None], other=0)
        w = w.to(tl.int32) & 0xFFFF
    return w


@triton.jit
def centroids(C, CB, tok, ok, s_t, BLOCK_N: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr,
               LOOKUP: tl.constexpr, ASM: tl.constexpr, PDT: tl.constexpr, COPY: tl.constexpr = False):
    """codebook[code] of the W channels of one part for tokens `tok (BLOCK_N,)`: (BLOCK_N, W) in PDT (rows not `ok`
    read code 0: their lengths, loaded as 0, cancel them). COPY: the register lookup's tile, joined from its outputs,
    through `tiles.opaque` (a product's 16-bit operand layout)."""
    if LOOKUP == 2:
        if BITS == 4:  # a word: 8 channels
            w = code_words(C, tok, ok, s_t, 0, W // 8, True)
            o = tl.inline_asm_elementwise(
                ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [w],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16), is_pure=True, pack=1)
            x = tl.reshape(tree8(o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7]), (BLOCK_N, W))
        else:  # a word of the 2-bit plane (and the 16 top bits of its channels): 16 channels
            w = code_words(C, tok, ok, s_t, 0, W // 16, True)
            if BITS == 3:
                top = code_words(C, tok, ok, s_t, W // 4, W // 16, False)
            else:
                top = w
            o = tl.inline_asm_elementwise(
                ASM, "=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, top],
                dtype=(tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16, tl.float16,
                       tl.float16, tl.float16), is_pure=True, pack=1)
            x = tl.reshape(tl.join(tree8(o[0], o[2], o[4], o[6], o[8], o[10], o[12], o[14]),
                                   tree8(o[1], o[3], o[5], o[7], o[9], o[11], o[13], o[15])), (BLOCK_N, W))
        if COPY:
            x = opaque(x)
    else:
        ch = tl.arange(0, W)[None, :]
        row = (tok * s_t)[:, None]
        if BITS == 3:
            code = codes_3bit(C, row, ch, ok[:, None], W)
        else:
            code = unpack(C, row, ch, ok[:, None], BITS)
        x = tl.load(CB + code).to(PDT)
    return x


@triton.jit
def codes_3bit(C, row, ch, ok, W: tl.constexpr):
    """3-bit codes of channels `ch` (the 2-bit plane, then the top bits W / 4 bytes on), as int32."""
    return unpack(C, row, ch, ok, 2) | (unpack(C + W // 4, row, ch, ok, 1) << 2)


@triton.jit
def norms(N_, tok, ok, sn_t):
    """The fp16 lengths of tokens `tok (N,)` as float32, 0 where not `ok`."""
    return tl.load(N_ + tok * sn_t, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def exact_tile(S_, R_, N_, ss_t, sr_t, sn_t, kpos, d, ok, n_sink, body_end, stop, r_off, DT: tl.constexpr,
                RING: tl.constexpr):
    """The exact tokens at positions `kpos (N, 1)` (pointers offset to this batch row and kv-head): sinks below
    `n_sink`, the residual from `body_end` to `stop` (RING > 0: a ring of RING rows whose oldest token is row
    `r_off`, the storage's layout), this step's new tokens from `stop`: (N, D) in DT."""
    stored = ok & (kpos < stop)
    rk = kpos - body_end
    if RING > 0:
        rk = (rk + r_off) % RING
    nk = kpos - stop
    x = tl.load(S_ + kpos * ss_t + d, mask=stored & (kpos < n_sink), other=0.0).to(DT)
    x += tl.load(R_ + rk * sr_t + d, mask=stored & (kpos >= body_end), other=0.0).to(DT)
    x += tl.load(N_ + nk * sn_t + d, mask=ok & (nk >= 0), other=0.0).to(DT)
    return x


@triton.jit
def rint(x):
    """Round half to even (torch.round) for |x| < 2^22: adding and removing 1.5 * 2^23 leaves no fraction bits."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def fp16_outward(x, UP: tl.constexpr):
    """The fp16 value nearest to float32 `x` that is >= x (UP) or <= x, as float32 (`quant.round_fp16`)."""
    x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    h = x.to(tl.float16)
    hf = h.to(tl.float32)
    bits = h.to(tl.uint16, bitcast=True).to(tl.int32)
    negative = (bits & 0x8000) != 0
    if UP:
        step = tl.where(negative, bits - 1, bits + 1)
        out = tl.where(hf < x, step, bits)
    else:
        step = tl.where(bits == 0, 0x8001, tl.where(negative, bits + 1, bits - 1))
        out = tl.where(hf > x, step, bits)
    return out.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
