"""A simulator for the straight-line 32-bit PTX the GGUF int8 kernel's inline asm uses (and, shr,
mul.lo on .b32 / .u32 registers and immediates), so that CPU
tests can run each asm body on chosen registers and compare it with the kernel's interpreter
path, which is all the Triton interpreter ever runs."""

from __future__ import annotations

import re

MASK = 0xFFFFFFFF


def run(asm: str, inputs: list[int], outputs: int) -> list[int]:
    """Runs `asm` with $outputs .. $outputs + len(inputs) - 1 bound to `inputs`; returns $0 ..
    $outputs - 1."""
    regs: dict[str, int] = {f"${outputs + i}": v & MASK for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & MASK

    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        name = op.split(".")[0]
        v = [val(a) for a in src]
        if name == "and":
            r = v[0] & v[1]
        elif name == "shr":
            assert op.endswith((".u32", ".b32")), op  # logical shifts only
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif name == "mul":
            assert op == "mul.lo.u32", op
            r = v[0] * v[1]
        else:
            raise ValueError(f"unsupported PTX op {op!r}")
        regs[dst] = r & MASK
    assert all(re.fullmatch(r"\$\d+", f"${i}") for i in range(outputs))
    return [regs[f"${i}"] for i in range(outputs)]


def pack(values: list[int]) -> int:
    """Four byte values (int8 or uint8), element 0 in the low byte: one register of a pack=4 asm."""
    return sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))


def unpack(reg: int) -> list[int]:
    """A register -> its four bytes as int8."""
    return [((reg >> (8 * i)) & 0xFF) - (0x100 if (reg >> (8 * i)) & 0x80 else 0) for i in range(4)]
