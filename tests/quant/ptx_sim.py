"""A simulator for the straight-line 32-bit PTX the GGUF kernels' inline asm uses (and, shr, shl,
mul.lo, prmt, lop3, mov with {a, b} packing of 16-bit registers, and fma.rn on bf16x2 / f16x2 pairs),
so that CPU tests can run each asm body on chosen registers and compare it with the kernel's
interpreter path, which is all the Triton interpreter ever runs."""

from __future__ import annotations

import re

import torch

MASK = 0xFFFFFFFF
HALF_TYPES = {"bf16x2": torch.bfloat16, "f16x2": torch.float16}


def _halves_to_float(reg: int, dtype: torch.dtype) -> list[float]:
    return torch.tensor([reg & 0xFFFF, reg >> 16], dtype=torch.int32).to(torch.int16).view(dtype).double().tolist()


def _fma_pairs(a: int, b: int, c: int, dtype: torch.dtype) -> int:
    """fma.rn on two 16-bit lanes: a * b + c exactly, rounded once to the lane type (the exact value
    must fit a float32, so torch's float32 -> 16-bit rounding is the only one)."""
    lanes = []
    for x, y, z in zip(*(_halves_to_float(r, dtype) for r in (a, b, c)), strict=True):
        exact = x * y + z
        assert float(torch.tensor(exact, dtype=torch.float32)) == exact, "not exact in float32"
        lanes.append(torch.tensor([exact], dtype=torch.float32).to(dtype).view(torch.int16).item() & 0xFFFF)
    return lanes[0] | lanes[1] << 16


def _prmt(a: int, b: int, selector: int) -> int:
    assert not selector & 0x8888, "sign-replicating byte selectors are not simulated"
    data = a | b << 32
    return sum(((data >> (8 * ((selector >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))


def _operands(args: str) -> list[str]:
    """Comma-separated operands, a {a, b} vector as one."""
    return [a.strip() for a in re.findall(r"\s*(\{[^}]*\}|[^,]+)", args)]


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
        dst, *src = _operands(args)
        name = op.split(".")[0]
        if name == "mov" and dst.startswith("{"):  # a 32-bit register into two 16-bit ones
            low, high = (t.strip() for t in dst.strip("{}").split(","))
            regs[low], regs[high] = val(src[0]) & 0xFFFF, val(src[0]) >> 16
            continue
        if name == "mov" and src[0].startswith("{"):
            low, high = (val(t) & 0xFFFF for t in src[0].strip("{}").split(","))
            regs[dst] = low | high << 16
            continue
        v = [val(a) for a in src]
        if name == "mov":
            r = v[0]
        elif name == "and":
            r = v[0] & v[1]
        elif name == "shr":
            assert op.endswith((".u32", ".b32")), op  # logical shifts only
            r = v[0] >> v[1] if v[1] < 32 else 0
        elif name == "shl":
            r = v[0] << v[1] if v[1] < 32 else 0
        elif name == "mul":
            assert op == "mul.lo.u32", op
            r = v[0] * v[1]
        elif name == "prmt":
            r = _prmt(*v)
        elif name == "lop3":
            r = _lop3(*v)
        elif name == "fma":
            r = _fma_pairs(*v, HALF_TYPES[op.split(".")[-1]])
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
