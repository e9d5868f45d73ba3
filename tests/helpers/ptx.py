"""A reading of the few PTX integer instructions the kernels' register lookups are written in, on Python integers, so
that the CPU suite checks the inline PTX that only a GPU runs (`turbo.lookup_asm`, `nuq.lookup_asm`).

Covered: `.reg` declarations; `mov.b32` of a register, an immediate, or to / from a `{lo, hi}` pair of 16-bit halves;
`and`, `or`, `xor`, `shl`, `shr` (`.b32`/`.u32`, logical); `prmt.b32` in its default mode (a selector nibble's bit 3
replicates the chosen byte's sign bit); `lop3.b32` with its 8-bit truth table (a = 0xF0, b = 0xCC, c = 0xAA). Any other
instruction raises, so a lookup that starts using one fails here until this reading learns it.
"""

from __future__ import annotations

import re

MASK32 = 0xFFFFFFFF


def _split_operands(text: str) -> list[str]:
    """`a, {b, c}, 0x1` -> ["a", "{b, c}", "0x1"]."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "{"
        depth -= ch == "}"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def prmt(a: int, b: int, selector: int) -> int:
    """PTX `prmt.b32 d, a, b, c` (default mode): byte i of d is byte (c's nibble i & 7) of the pair {b, a}; a nibble
    with bit 3 set gives that byte's sign bit copied to all 8 bits."""
    pool = (a & MASK32) | ((b & MASK32) << 32)
    out = 0
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX `lop3.b32`: each bit of d is bit (4a + 2b + c) of `lut`."""
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def run(asm: str, outputs: int, inputs: list[int]) -> list[int]:
    """The values of `$0 .. $(outputs - 1)` after `asm`, with `$outputs ..` holding `inputs` (32-bit unsigned)."""
    regs: dict[str, int] = {f"${outputs + i}": v & MASK32 for i, v in enumerate(inputs)}

    def value(op: str) -> int:
        if op in regs:
            return regs[op]
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", op):
            return int(op, 0) & MASK32
        raise KeyError(f"PTX operand {op!r} read before it is written")

    body = asm.strip()
    for stmt in (s.strip() for s in body.replace("{\n", "\n").replace("\n}", "\n").split(";")):
        stmt = stmt.strip("{} \n")
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        ops = _split_operands(rest)
        name = op.split(".")[0]
        if name == "mov":
            dst, src = ops
            if dst.startswith("{"):
                lo, hi = (x.strip() for x in dst.strip("{}").split(","))
                v = value(src)
                regs[lo], regs[hi] = v & 0xFFFF, v >> 16
            elif src.startswith("{"):
                lo, hi = (x.strip() for x in src.strip("{}").split(","))
                regs[dst] = (value(lo) & 0xFFFF) | ((value(hi) & 0xFFFF) << 16)
            else:
                regs[dst] = value(src)
        elif name in ("and", "or", "xor", "shl", "shr"):
            dst, a, b = ops
            x, y = value(a), value(b)
            regs[dst] = {"and": x & y, "or": x | y, "xor": x ^ y, "shl": (x << y) & MASK32 if y < 32 else 0,
                         "shr": x >> y if y < 32 else 0}[name]
        elif name == "prmt" and op == "prmt.b32":
            dst, a, b, c = ops
            regs[dst] = prmt(value(a), value(b), value(c))
        elif name == "lop3":
            dst, a, b, c, lut = ops
            regs[dst] = lop3(value(a), value(b), value(c), value(lut))
        else:
            raise NotImplementedError(f"this PTX reading does not cover {op!r}")
    return [regs[f"${i}"] for i in range(outputs)]
