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
  Integer codes read as bit planes (`_planes`) are split on the GPU by inline PTX that writes two codes into the
  mantissas of a 16-bit float pair per instruction (`plane_asm`).
- one tail program (a separate launch of the same kernel, BODY=False, so that its many live tiles do not
  raise the body's register count) reads everything else token by token: the sink, the packed tokens outside whole body tiles
  (KIVI's keys and values are split differently), the residual and the new tokens, each dequantized exactly as
  the reference codecs do (to the model dtype) before the dot.

Query rows are (query position, query head of the kv-head's group) pairs, so GQA/MQA read each K/V tile once for
all the query heads that share it, and q_len > 1 (chunked prefill, speculative verification) is the same code
with more rows. The launchers are `decode_launch.py`'s (`packed_attention`, `_combine`); `dispatch.decode_attention`
(`hf_kvcache.kernels.decode_attention`) picks them by format.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

FMT_FP8_E4M3 = 1
FMT_FP8_E5M2 = 2
FMT_UNIFORM = 3
FMT_EXACT = 4  # the model dtype itself (the `exact` preset): read like fp8 codes with a unit scale
# fp8 read by integer operations on the bits, for GPUs without fp8 conversions (before sm_89, `launch.fp8_native`)
FMT_FP8_E4M3_BITS = 5
FMT_FP8_E5M2_BITS = 6


@triton.jit
def _opaque(x):
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
def _dot(a, b, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """Tensor-core product with fp32 accumulation; exact fp32 products when the operands are fp32. COPY: a 16-bit
    `b` through `_opaque` first (on the GPU)."""
    if PREC == "ieee":
        out = tl.dot(a, b, input_precision="ieee")
    else:
        if COPY and b.dtype.primitive_bitwidth == 16:
            b = _opaque(b)
        out = tl.dot(a, b)
    return out


@triton.jit
def _dot_into(acc, a, b, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """`acc + a @ b` with the tensor cores' own accumulation (as `_dot`)."""
    if PREC == "ieee":
        out = tl.dot(a, b, acc, input_precision="ieee")
    else:
        if COPY and b.dtype.primitive_bitwidth == 16:
            b = _opaque(b)
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _unpack(ptr, row_off, d, mask, BITS: tl.constexpr):
    """Unsigned codes at `ptr + row_off` for channels `d` (broadcastable offsets, any tokens), as int32."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(ptr + row_off + d // PER, mask=mask, other=0).to(tl.int32)
    if BITS == 8:
        c = byte
    else:
        c = (byte >> ((d % PER) * BITS)) & ((1 << BITS) - 1)
    return c


@triton.jit
def _unpack_rows(ptr, row_off, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
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
def _group_dequant(C, tok, sc_t, scale, zero, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                   CHG: tl.constexpr, SYM: tl.constexpr):
    """Per-token groups of CHG < D channels, whole tiles: float32 (BLOCK_N, D) = code * scale + zero, from the
    tile's `scale`/`zero (BLOCK_N, D / CHG)` (Triton's integer operations: the interpreter, fp32 models). The group
    scales are broadcast by reshapes, which keeps the dequantized tile from being produced in the tensor-core operand
    layout: it goes through shared memory."""
    NG: tl.constexpr = D // CHG
    code3 = tl.reshape(_unpack_rows(C, tok * sc_t, BLOCK_N, D, BITS).to(tl.float32), (BLOCK_N, NG, CHG))
    if SYM:
        x = (code3 - (1 << (BITS - 1))) * scale[:, :, None]
    else:
        x = code3 * scale[:, :, None] + zero[:, :, None]
    return tl.reshape(x, (BLOCK_N, D))


@triton.jit
def _group_plane(c, scale, zero, BITS: tl.constexpr, SYM: tl.constexpr):
    """One plane of `_group_planes`: the exact fp16 codes -> code * scale + zero (asymmetric) or
    (code - 2^(BITS-1)) * scale, two elements an instruction, rounded once to fp16."""
    if SYM:
        x = (c - (1 << (BITS - 1))) * scale
    else:
        x = tl.fma(c, scale, zero)
    return x


@triton.jit
def _group_planes(C, tok, sc_t, scale, zero, BLOCK_N: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                  CHG: tl.constexpr, SYM: tl.constexpr, ASM: tl.constexpr):
    """Per-token groups of CHG < D channels of a 16-bit model, whole tiles: the bit planes of `_planes` (x0..x3,
    plane P = channels PER*j + P, (BLOCK_N, D / PER)), their codes exact in fp16 (1024 + code, less 1024),
    dequantized in fp16 from the tile's `scale`/`zero (BLOCK_N, D / CHG)`. Each plane is an operand of its own
    product, so no tile is joined back into channel order through shared memory. Every value lies between the
    group's fp16 zero and zero + (2^BITS - 1) * scale, inside fp16's range, and is rounded to fp16 (11 bits, where a
    bf16 tile kept 8)."""
    PER: tl.constexpr = 8 // BITS
    byte = tl.load(C + (tok * sc_t)[:, None] + tl.arange(0, D // PER)[None, :])
    c0, c1, c2, c3 = _planes(byte, BITS, tl.float16, 1024, 0, ASM)
    shape3: tl.constexpr = (BLOCK_N, D // CHG, CHG // PER)
    sg = tl.reshape(tl.broadcast_to(scale.to(tl.float16)[:, :, None], shape3), (BLOCK_N, D // PER))
    zg = sg
    if not SYM:
        zg = tl.reshape(tl.broadcast_to(zero.to(tl.float16)[:, :, None], shape3), (BLOCK_N, D // PER))
    x0 = _group_plane(c0, sg, zg, BITS, SYM)
    x1 = x0
    x2 = x0
    x3 = x0
    if PER > 1:
        x1 = _group_plane(c1, sg, zg, BITS, SYM)
    if PER > 2:
        x2 = _group_plane(c2, sg, zg, BITS, SYM)
        x3 = _group_plane(c3, sg, zg, BITS, SYM)
    return x0, x1, x2, x3


@triton.jit
def _side(SC, Z, tile, ss_t, ss_c, BLOCK_N: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
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
def _plane(byte, P: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr, CENTER: tl.constexpr):
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
def _q_plane(Q, qoff, row_ok, j, P: tl.constexpr, PER: tl.constexpr):
    """Query elements PER*j + P: (BLOCK_M, D / PER) in the query's dtype."""
    return tl.load(Q + qoff[:, None] + (PER * j + P)[None, :], mask=row_ok[:, None], other=0.0)


@triton.jit
def _planes_ptx(byte, ASM: tl.constexpr, PER: tl.constexpr, OUT: tl.constexpr):
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
def _planes(byte, BITS: tl.constexpr, DT: tl.constexpr, OFF: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr):
    """Every plane of packed bytes `byte` (uint8), as `_plane` gives them: (x0, x1, x2, x3), the ones past 8 / BITS
    repeating x0. ASM (`plane_asm(BITS, OFF)`, the GPU): inline PTX on four bytes a register writes OFF + code of
    two elements into each 32-bit register, then OFF + CENTER is subtracted here: about 1.5 instructions a code, where
    `_plane`'s integer operations on one element at a time take about 2.75."""
    PER: tl.constexpr = 8 // BITS
    if ASM != "":
        o0, o1, o2, o3 = _planes_ptx(byte, ASM, PER, DT)
        x0 = o0 - (OFF + CENTER)
        x1 = o1 - (OFF + CENTER)
        x2 = o2 - (OFF + CENTER)
        x3 = o3 - (OFF + CENTER)
    else:
        b32 = byte.to(tl.int32)
        x0 = _plane(b32, 0, BITS, DT, OFF, CENTER)
        x1 = x0
        x2 = x0
        x3 = x0
        if PER > 1:
            x1 = _plane(b32, 1, BITS, DT, OFF, CENTER)
        if PER > 2:
            x2 = _plane(b32, 2, BITS, DT, OFF, CENTER)
            x3 = _plane(b32, 3, BITS, DT, OFF, CENTER)
    return x0, x1, x2, x3


@triton.jit
def _plane_scores(kc, tok, skc_t, jk, q0, q1, q2, q3, PREC: tl.constexpr, BITS: tl.constexpr, DT: tl.constexpr,
                  OFF: tl.constexpr, CENTER: tl.constexpr, ASM: tl.constexpr, COPY: tl.constexpr = False):
    """sum over planes of q_P . (code_P - CENTER): raw scores (BLOCK_M, BLOCK_N) of whole packed rows of keys, in
    one accumulator."""
    byte = tl.load(kc + tok[:, None] * skc_t + jk[None, :])
    x0, x1, x2, x3 = _planes(byte, BITS, DT, OFF, CENTER, ASM)
    return _planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, 8 // BITS, PREC, COPY)


@triton.jit
def _planes_into(acc0, acc1, acc2, acc3, alpha, p, x0, x1, x2, x3, PER: tl.constexpr, PREC: tl.constexpr,
                 COPY: tl.constexpr = False):
    """The running weighted sums of the PER planes (accumulator P: output channels PER*j + P), each rescaled by the
    softmax step's `alpha` and added p . x_P; the accumulators past PER are returned as given."""
    acc0 = _dot_into(acc0 * alpha[:, None], p, x0, PREC, COPY)
    if PER > 1:
        acc1 = _dot_into(acc1 * alpha[:, None], p, x1, PREC, COPY)
    if PER > 2:
        acc2 = _dot_into(acc2 * alpha[:, None], p, x2, PREC, COPY)
        acc3 = _dot_into(acc3 * alpha[:, None], p, x3, PREC, COPY)
    return acc0, acc1, acc2, acc3


@triton.jit
def _planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, PER: tl.constexpr, PREC: tl.constexpr, COPY: tl.constexpr = False):
    """sum over the PER planes of q_P . x_P^T: raw scores (BLOCK_M, BLOCK_N) in one accumulator."""
    s = _dot(q0, tl.trans(x0), PREC, COPY)
    if PER > 1:
        s = _dot_into(s, q1, tl.trans(x1), PREC, COPY)
    if PER > 2:
        s = _dot_into(s, q2, tl.trans(x2), PREC, COPY)
        s = _dot_into(s, q3, tl.trans(x3), PREC, COPY)
    return s


@functools.lru_cache(maxsize=None)
def plane_asm(bits: int, off: int) -> str:
    """The PTX of `_planes` for `bits`-bit codes and OFF `off` (1024: fp16, 128: bf16 for codes below 128): input `$n`
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
def _fp8_bits_to_f16(c, E4M3: tl.constexpr):
    """fp8 bytes as fp16 by their bits, exactly (`pack._fp8_bits` backwards): E5M2 is fp16's top byte; E4M3's sign,
    exponent and mantissa moved into an fp16 whose exponent bias is 8 more, times 2^8 (subnormals included)."""
    u = c.to(tl.uint8).to(tl.uint16)
    if E4M3:
        x = (((u & 0x80) << 8) | ((u & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0
    else:
        x = (u << 8).to(tl.float16, bitcast=True)
    return x


@triton.jit
def _fp8_to_float(c, FMT: tl.constexpr):
    if FMT == 4:
        x = c.to(tl.float32)
    elif FMT == 1:
        x = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    elif FMT == 2:
        x = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        x = _fp8_bits_to_f16(c, FMT == 5).to(tl.float32)
    return x


@triton.jit
def _fp8_to(c, FMT: tl.constexpr, PDT: tl.constexpr):
    """fp8 codes as the products' dtype: straight to fp16 (exact, one conversion per two codes) when PDT is fp16,
    else through fp32 (bf16 has no direct conversion from fp8 on Hopper)."""
    if PDT == tl.float16 and FMT != 4:
        if FMT == 1:
            x = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        elif FMT == 2:
            x = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float16)
        else:
            x = _fp8_bits_to_f16(c, FMT == 5)
    else:
        x = _fp8_to_float(c, FMT).to(PDT)
    return x


@triton.jit
def _dequant(C, SC, Z, tok, d, mask, sc_t, ss_t, ss_c, fp8_scale,
             FMT: tl.constexpr, BITS: tl.constexpr, TOKG: tl.constexpr, CHG: tl.constexpr, SYM: tl.constexpr):
    """Element-domain dequantization of packed tokens `tok (N, 1)` x channels `d (1, D)` -> float32 (N, D)."""
    if FMT == 3:
        code = _unpack(C, tok * sc_t, d, mask, BITS).to(tl.float32)
        soff = (tok // TOKG) * ss_t + (d // CHG) * ss_c
        scale = tl.load(SC + soff, mask=mask, other=0.0).to(tl.float32)
        if SYM:
            x = (code - (1 << (BITS - 1))) * scale
        else:
            x = code * scale + tl.load(Z + soff, mask=mask, other=0.0).to(tl.float32)
    else:
        code = tl.load(C + tok * sc_t + d, mask=mask, other=0)
        x = _fp8_to_float(code, FMT) * fp8_scale
    return x


@triton.jit
def _place_tile(S_, Rs, N_, C, SC, Z, ss_t, sr_t, sn_t, sc_t, ssc_t, ssc_c, fp8_scale,
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
    x += _dequant(C, SC, Z, pk, d, in_packed, sc_t, ssc_t, ssc_c, fp8_scale, FMT, BITS, TOKG, CHG, SYM)
    if RING > 0:
        rk = (rk + r_off) % RING
    x += tl.load(Rs + rk * sr_t + d, mask=in_res, other=0.0).to(tl.float32)
    x += tl.load(N_ + nk * sn_t + d, mask=in_new, other=0.0).to(tl.float32)
    return x.to(DT)


@triton.jit
def _softmax_step(s, m_i, l_i):
    """Online softmax in base 2: new running max, the rescale factor of the old sums, and the tile's weights."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, alpha, p, l_i


@triton.jit
def _mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK: tl.constexpr):
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
def _finish_scores(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k -> base-2 logits: times the softmax scale, optional tanh soft-capping (Gemma 2), times log2(e)."""
    s = s * scale
    if HAS_SOFTCAP:
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
    return s * 1.4426950408889634


@triton.jit
def _static_places(after, RING: tl.constexpr, WINDOW: tl.constexpr):
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


# Integers that change from step to step (lengths, split counts, the mask's strides, which follow the length) are
# not specialized: Triton would otherwise compile a new variant whenever one of them turns 1 or a multiple of 16,
# which during generation means seconds of compiling between tokens. Strides of the places are specialized: their
# divisibility by 16 is what lets Triton prove the tile loads aligned, vectorize them and pipeline them
# (cp.async); the cache keeps its capacity a multiple of 16 rows so that they stay in one class as it grows.
_VARYING = (
    "sm_b", "sm_t", "sm_s", "Tq", "n_sink", "npk", "nrk", "npv", "nrv",
    "stop", "n_new", "n_body_tiles", "tiles_per_split", "n_splits", "m_tiles",
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
    Hkv, Tq, n_sink, npk, nrk, npv, nrv, stop, n_new, n_body_tiles, tiles_per_split, n_splits, m_tiles,
    sm_scale, softcap,
    D: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DT: tl.constexpr,
    PDT: tl.constexpr, PREC: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BODY: tl.constexpr,
    CAUSAL_BODY: tl.constexpr, K_PLANES: tl.constexpr, V_PLANES: tl.constexpr, K_OFF: tl.constexpr, V_OFF: tl.constexpr,
    K_FMT: tl.constexpr, K_BITS: tl.constexpr, K_TOKG: tl.constexpr, K_CHG: tl.constexpr, K_SYM: tl.constexpr,
    V_FMT: tl.constexpr, V_BITS: tl.constexpr, V_CHG: tl.constexpr, V_SYM: tl.constexpr,
    MASK_ROW: tl.constexpr = False, MASK_AHEAD: tl.constexpr = True, STATIC: tl.constexpr = False,
    SINK_CAP: tl.constexpr = 0, K_RING: tl.constexpr = 0, V_RING: tl.constexpr = 0,
    K_WINDOW: tl.constexpr = False, V_WINDOW: tl.constexpr = False, K_ASM: tl.constexpr = "", V_ASM: tl.constexpr = "",
    K_GP: tl.constexpr = False, V_GP: tl.constexpr = False,  # grouped tiles in fp16 by plane (`_group_planes`)
    B_COPY: tl.constexpr = False,  # the products' tiles and planes through `_opaque`
):
    pid_bh = tl.program_id(0)
    k_off = 0
    v_off = 0
    if STATIC:
        # The storage's layout (`hf_kvcache.storage`): the launch is sized for the capacity and every length comes
        # from the device, so one captured graph serves every step; programs past the filled tiles find empty ranges.
        # tokens held after this step's update; never more than the storage (a compiled step past max_cache_len
        # stores nothing more, see `hf_kvcache.storage`)
        held = tl.minimum(tl.load(LENS), cap_len).to(tl.int32)
        n_sink = tl.minimum(held, SINK_CAP)
        npk, nrk, k_off = _static_places(held - n_sink, K_RING, K_WINDOW)
        npv, nrv, v_off = _static_places(held - n_sink, V_RING, V_WINDOW)
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
    split = pid_s if BODY else n_splits  # the tail's partial result goes last
    part = (pid_bh.to(tl.int64) * (m_tiles * BLOCK_M) + rows) * (n_splits + 1) + split  # (BLOCK_M,)
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
            q0 = (_q_plane(Q, qoff, row_ok, jk, 0, KPER).to(tl.float32) * q_pow2).to(KQT)
            q1 = q0
            q2 = q0
            q3 = q0
            if KPER > 1:
                q1 = (_q_plane(Q, qoff, row_ok, jk, 1, KPER).to(tl.float32) * q_pow2).to(KQT)
            if KPER > 2:
                q2 = (_q_plane(Q, qoff, row_ok, jk, 2, KPER).to(tl.float32) * q_pow2).to(KQT)
                q3 = (_q_plane(Q, qoff, row_ok, jk, 3, KPER).to(tl.float32) * q_pow2).to(KQT)
            q_sum = tl.sum(qp.to(tl.float32), 1) / q_pow2
        acc0 = tl.zeros((BLOCK_M, D // VPER), tl.float32)
        acc1 = acc0
        acc2 = acc0
        acc3 = acc0
        # sum_n p_n (zero_n + V_CTR * scale_n) for asymmetric per-token values: the codes enter the products centered
        extra = tl.zeros((BLOCK_M,), tl.float32)
        K_CTR: tl.constexpr = 1 << (K_BITS - 1)  # the codes' centers (`_plane`)
        V_CTR: tl.constexpr = 1 << (V_BITS - 1)
        lo = pid_s * tiles_per_split
        hi = tl.minimum(lo + tiles_per_split, n_body_tiles)
        # scales and zeros of the first tile; each iteration loads the next tile's (the last one reloads its own);
        # an empty range (a launch sized for the capacity) loads tile 0, which the storage always has
        first = tl.where(lo < hi, lo, 0)
        ka0, ka1, ka2, ka3, kzr = _side(ksc, kz, first, sksc_t, sksc_c, BLOCK_N, D, K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM,
                                        K_PLANES)
        va0, va1, va2, va3, vzr = _side(vsc, vz, first, svsc_t, svsc_c, BLOCK_N, D, V_FMT, V_BITS, 1, V_CHG, V_SYM,
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
            ka0, ka1, ka2, ka3, kzr = _side(ksc, kz, nxt, sksc_t, sksc_c, BLOCK_N, D, K_FMT, K_BITS, K_TOKG, K_CHG,
                                            K_SYM, K_PLANES)
            va0, va1, va2, va3, vzr = _side(vsc, vz, nxt, svsc_t, svsc_c, BLOCK_N, D, V_FMT, V_BITS, 1, V_CHG,
                                            V_SYM, V_PLANES)
            allowed = allowed_nx
            if HAS_MASK and MASK_ROW and MASK_AHEAD:
                allowed_nx = tl.load(mask_row + (nxt * BLOCK_N + n) * sm_s)
            # ---- scores (BLOCK_M, BLOCK_N)
            if K_FMT != 3:
                c = tl.load(kc + tok[:, None] * skc_t + d[None, :])
                s = _dot(qp, tl.trans(_fp8_to(c, K_FMT, PDT)), PREC, B_COPY) * (k_scale / q_pow2)
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
                s = _plane_scores(kc, tok, skc_t, jk, qs0, qs1, qs2, qs3, PREC, K_BITS, PDT, K_OFF, K_CTR, K_ASM,
                                  B_COPY)
                if not K_SYM:  # q.k = (q * s) . (c - K_CTR) + q . (z + K_CTR * s), the latter from `_side`
                    s += tl.sum(qf * kz_t[None, :], 1)[:, None]
            elif K_PLANES:
                # one group per token row: q.k = scale * (q . (c - K_CTR)) + (zero + K_CTR * scale) * sum(q)
                s = _plane_scores(kc, tok, skc_t, jk, q0, q1, q2, q3, PREC, K_BITS, PDT, K_OFF, K_CTR, K_ASM,
                                  B_COPY) / q_pow2
                if K_SYM:
                    s = s * k0[None, :]
                else:
                    s = s * k0[None, :] + q_sum[:, None] * (kz_t + K_CTR * k0)[None, :]
            elif K_GP:
                # the fp16 planes of the dequantized tile, each times its query plane
                x0, x1, x2, x3 = _group_planes(kc, tok, skc_t, k0, kz_t, BLOCK_N, D, K_BITS, K_CHG, K_SYM, K_ASM)
                s = _planes_dot(q0, q1, q2, q3, x0, x1, x2, x3, KPER, PREC, B_COPY) / q_pow2
            else:
                kt = _group_dequant(kc, tok, skc_t, k0, kz_t, BLOCK_N, D, K_BITS, K_CHG, K_SYM)
                s = _dot(qd, tl.trans(kt.to(DT)), PREC, B_COPY)
            s = _finish_scores(s, sm_scale, softcap, HAS_SOFTCAP)
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
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i)
            # ---- values
            if V_FMT != 3:
                c = tl.load(vc + tok[:, None] * svc_t + d[None, :])
                acc0 = acc0 * alpha[:, None] + _dot(p.to(PDT), _fp8_to(c, V_FMT, PDT), PREC, B_COPY)
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
                x0, x1, x2, x3 = _planes(tl.load(vc + tok[:, None] * svc_t + jv[None, :]), V_BITS, PDT, V_OFF, V_CTR,
                                         V_ASM)
                acc0, acc1, acc2, acc3 = _planes_into(acc0, acc1, acc2, acc3, alpha, ps, x0, x1, x2, x3, VPER, PREC,
                                                      B_COPY)
            elif V_GP:
                # each fp16 plane of the dequantized tile into its own accumulator (output channels PER*j + P)
                x0, x1, x2, x3 = _group_planes(vc, tok, svc_t, v0, vz_t, BLOCK_N, D, V_BITS, V_CHG, V_SYM, V_ASM)
                acc0, acc1, acc2, acc3 = _planes_into(acc0, acc1, acc2, acc3, alpha, p.to(tl.float16), x0, x1, x2, x3,
                                                      VPER, PREC, B_COPY)
            else:
                vt = _group_dequant(vc, tok, svc_t, v0, vz_t, BLOCK_N, D, V_BITS, V_CHG, V_SYM)
                acc0 = acc0 * alpha[:, None] + _dot(p.to(DT), vt.to(DT), PREC, B_COPY)
        ptr = ACC + part[:, None] * D + (VPER * jv)[None, :]
        if V_FMT != 3:
            tl.store(ptr, acc0 * v_scale)
        else:
            tl.store(ptr, acc0 + extra[:, None])
            if VPER > 1:
                tl.store(ptr + 1, acc1 + extra[:, None])
            if VPER > 2:
                tl.store(ptr + 2, acc2 + extra[:, None])
                tl.store(ptr + 3, acc3 + extra[:, None])
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
        for i in range(0, n_first + n_rest):
            start = tl.where(i < n_first, i * BLOCK_N, body_end + (i - n_first) * BLOCK_N)
            limit = tl.where(i < n_first, tl.minimum(n_sink, end), end)
            kpos = start + n  # (BLOCK_N,)
            ok = kpos < limit
            kt = _place_tile(ks, kr, kn, kc, ksc, kz, sks_t, skr_t, skn_t, skc_t, sksc_t, sksc_c, k_scale,
                             kpos[:, None], d[None, :], ok[:, None], n_sink, npk, nrk, k_off, stop, n_new, DT,
                             K_FMT, K_BITS, K_TOKG, K_CHG, K_SYM, K_RING)
            s = _finish_scores(_dot(qd, tl.trans(kt), PREC, B_COPY), sm_scale, softcap, HAS_SOFTCAP)
            s = _mask_scores(s, MASK, b, t, kpos, ok, row_ok, sm_b, sm_t, sm_s, s_total, Tq, HAS_MASK)
            m_i, alpha, p, l_i = _softmax_step(s, m_i, l_i)
            vt = _place_tile(vs, vr, vn, vc, vsc, vz, svs_t, svr_t, svn_t, svc_t, svsc_t, svsc_c, v_scale,
                             kpos[:, None], d[None, :], ok[:, None], n_sink, npv, nrv, v_off, stop, n_new, DT,
                             V_FMT, V_BITS, 1, V_CHG, V_SYM, V_RING)
            acc = acc * alpha[:, None] + _dot(p.to(DT), vt, PREC, B_COPY)
        tl.store(ACC + part[:, None] * D + d[None, :], acc)
    tl.store(M_OUT + part, m_i)
    tl.store(L_OUT + part, l_i)


@triton.jit(do_not_specialize=("so_b", "so_t", "so_h", "Tq", "n_parts", "rows_pad"))
def _combine(
    ACC, M_IN, L_IN, OUT, so_b, so_t, so_h, SAUX, FV, sfv_d, ORDER, sor_b, sor_h,
    Hkv, Tq, n_parts, rows_pad,
    G: tl.constexpr, D: tl.constexpr, NP: tl.constexpr, HAS_SAUX: tl.constexpr, FRAME: tl.constexpr = False,
    HAS_ORDER: tl.constexpr = False,
):
    """out[b, t, h*G + g] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the split-K partials, NP of them at
    a time (a fixed block: one kernel variant whatever the split count, which grows with the context). FRAME
    (TurboQuant, `turbo.py`): every part but the last (the tail's) is in the values' frame F = P R
    (`layout.CodebookFormat`) and is summed, then rotated back by R^T (z_c = sum_j o'_j R[c, j]) and put back in
    the model's channel order (HAS_ORDER: channel `ORDER[b, h, c]` takes z_c) before the tail's part is added."""
    pid = tl.program_id(0)
    rows = Tq * G
    bh = (pid // rows).to(tl.int64)
    r = pid % rows
    b = bh // Hkv
    h = bh % Hkv
    d = tl.arange(0, D)
    base = (bh * rows_pad + r) * n_parts
    mx = tl.full((), float("-inf"), tl.float32)
    for s0 in range(0, n_parts, NP):  # the largest running max first
        sp = s0 + tl.arange(0, NP)
        mx = tl.maximum(mx, tl.max(tl.load(M_IN + base + sp, mask=sp < n_parts, other=float("-inf")), 0))
    if HAS_SAUX:
        aux = tl.load(SAUX + h * G + r % G).to(tl.float32) * 1.4426950408889634
        mx = tl.maximum(mx, aux)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.zeros((), tl.float32)
    out = tl.zeros((D,), tl.float32)
    for s0 in range(0, n_parts, NP):
        sp = s0 + tl.arange(0, NP)
        ok = sp < n_parts
        w = tl.exp2(tl.load(M_IN + base + sp, mask=ok, other=float("-inf")) - mx_safe)
        total += tl.sum(w * tl.load(L_IN + base + sp, mask=ok, other=0.0), 0)
        if FRAME:
            w = tl.where(sp == n_parts - 1, 0.0, w)  # (the tail's part is added below, in the model's frame)
        out += tl.sum(tl.load(ACC + (base + sp)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                      * w[:, None], 0)
    if HAS_SAUX:
        total += tl.exp2(aux - mx_safe)
    c = d  # the output channel of each lane
    if FRAME:
        if HAS_ORDER:
            c = tl.load(ORDER + b * sor_b + h * sor_h + d).to(tl.int32)
        f = tl.load(FV + d[:, None] * sfv_d + d[None, :])  # R[c, j]
        tail_acc = tl.load(ACC + (base + n_parts - 1) * D + c)  # the tail's, in the model's channel order
        tail_w = tl.exp2(tl.load(M_IN + base + n_parts - 1) - mx_safe)
        out = tl.sum(f * out[None, :], 1) + tail_acc * tail_w
    out = tl.where(total > 0, out / tl.maximum(total, 1e-30), 0.0)
    t = r // G
    tl.store(OUT + b * so_b + t * so_t + (h * G + r % G) * so_h + c, out.to(OUT.dtype.element_ty))
