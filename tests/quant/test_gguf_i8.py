"""GGUF's int8 tensor-core path for every type but Q2_K and Q3_K: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS (paphos/quant/gguf/triton_gguf_i8.py).

- `stream_order` is the order of the codes in each type's kernel operands, read from repacked
  planes the way the kernel reads them (Q4_K: a super-block's bytes' low nibbles, then high, Q5_K
  each with its fifth bit; Q8_0: the stored bytes; Q6_K: per sub-block its low-plane bytes' low
  nibbles, then high, each with its 2 high-plane bits; IQ4_XS: each word's 8 codes in turn);
  x_blocks.quantize writes x in that order, bit for bit its torch reference, within half a step
  of dx / 254 (the 32-value group types as IQ4_XS, Q5_0 / Q5_1 with their fifth bits). IQ4's
  byte-permute tables are its levels.
- Each type's GEMM under the interpreter against dequantize-then-float32-matmul
  (planes.reference_matmul) within 1e-4 of max|ref| (x's quantization; the integer sums are
  exact), at 2, 9, 16 and 29 tokens (two token tiles), one and several K slices, masked rows and
  tokens, 16- to 64-row programs.
- `triton_gguf.matmul` takes this path from 2 to I8_MAX_TOKENS tokens for the supported types'
  segments, the fused kernel for a layer's other segments, x quantized once per type.
- Every inline PTX body (the code assembly the interpreter never runs) in a PTX simulator
  (tests/quant/ptx_sim.py) on random registers, against the same arithmetic.
- The kernels compile for sm_90 with both tritons in the rules' launches, no spills, PDL: Q4_K
  with wgmma and the codes in registers, the scale multiplication in the dot operand's layout
  (four codes of one sub-block per register; a 32-row mma.sync program keeps it), Q5_K's fifth
  bits likewise; the others with mma.sync, their code assembly on runs of four operand
  positions.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from paphos.quant.gguf import planes
from paphos.quant.gguf.triton_gguf_i8 import IQ4_TABLES, stream_order, supports
from paphos.quant.kernels import split_k
from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles
from tests.quant import ptx_sim
from tests.quant.gguf_blocks import random_blocks, weight_scale
from tests.triton_interpreted import interpreted

K = 512
N = 37  # odd: masked rows


@pytest.fixture(scope="module")
def tg() -> Iterator[object]:
    from tests.quant.test_gguf_triton import GGUF_KERNEL_MODULES

    with interpreted(GGUF_KERNEL_MODULES, "_fused_kernel") as module:
        yield module


@pytest.fixture(scope="module")
def ti8(tg) -> object:  # noqa: ANN001
    return sys.modules["paphos.quant.gguf.triton_gguf_i8"]


def _raw(type_name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(random_blocks(type_name, rows, cols, rng, weight_scale(type_name)))


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


def test_supports() -> None:
    types = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS")
    assert all(supports(t, 4096) and supports(t, 14336) for t in types)
    assert not supports("Q4_K", 4096 + 128) and not supports("Q8_0", 4096 + 32)  # a partial x block
    assert not any(supports(t, 4096) for t in ("Q3_K", "Q2_K"))


def test_iq4_tables_are_the_levels() -> None:
    """`_iq4_values`' byte-permute tables hold IQ4_KVALUES (level i: byte i % 4 of word i // 4), its
    asm (`_ASM_IQ4`) spells them as these words, and the interpreter path as their int32 values."""
    import inspect

    from paphos.quant.gguf import triton_gguf_i8 as ti8
    from paphos.quant.gguf.dequant import IQ4_KVALUES

    levels = torch.tensor(IQ4_TABLES, dtype=torch.int64)[:, None] >> (8 * torch.arange(4)) & 0xFF
    assert torch.equal((levels ^ 0x80) - 0x80, torch.tensor(IQ4_KVALUES).reshape(4, 4))
    source = inspect.getsource(ti8._iq4_values.fn)
    for word in IQ4_TABLES:
        assert f"0x{word:08X}" in ti8._ASM_IQ4.value and str(word - (1 << 32) if word >= 1 << 31 else word) in source


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q8_0", "Q6_K", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_stream_order_is_the_operands_code_order(type_name: str) -> None:
    raw = _raw(type_name, 8, K, 1)
    fields = planes._codes_and_scales(raw.reshape(-1, planes.type_size(type_name)), type_name)
    natural = fields["q"].reshape(8, K).long()
    order = stream_order(type_name)
    assert sorted(order.tolist()) == list(range(256))
    packed = planes.repack(raw, type_name)
    lo = packed["lo"].contiguous()
    if type_name == "Q8_0":  # the stored bytes, as the kernel loads them
        operands = lo.long()
    elif type_name in ("IQ4_XS", "IQ4_NL"):  # each word's 8 codes in turn
        operands = ((lo.long().reshape(8, -1, 1) & 0xFFFFFFFF) >> (4 * torch.arange(8)) & 15).reshape(8, K)
    elif type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):  # per group: its 16 bytes' low nibbles, then high
        b = lo.view(torch.uint8).long().reshape(8, -1, 1, 16)
        operands = torch.cat([b & 15, b >> 4], 2).reshape(8, -1, 32)
        if "hi" in packed:  # Q5_0, Q5_1: the fifth-bit plane's byte w holds word w's codes' bits
            bits = packed["hi"].contiguous().view(torch.uint8).long().reshape(8, -1, 4)
            t = torch.arange(32) % 16
            code = 2 * (t % 4) + torch.arange(32) // 16  # operand position -> code of its word
            operands = operands | ((bits[:, :, t // 4] >> code) & 1) << 4
        operands = operands.reshape(8, K)
    elif type_name == "Q6_K":  # per sub-block: its 8 low-plane bytes' low nibbles, then high ones
        b = lo.view(torch.uint8).long().reshape(8, -1, 1, 8)
        low = torch.cat([b & 15, b >> 4], 2).reshape(8, -1, 16)
        hi = packed["hi"].long().reshape(8, -1, 1) & 0xFFFFFFFF  # 16 codes' 2 bits, in low-plane order
        p = torch.arange(16)
        in_lo_order = 8 * (p % 8 // 4) + 2 * (p % 4) + p // 8  # operand position -> code of the word pair
        operands = (low | ((hi >> (2 * in_lo_order)) & 3) << 4).reshape(8, K)
    else:  # per super-block: low nibbles, then high (Q5_K: each with its fifth bit)
        b = lo.view(torch.uint8).long().reshape(8, -1, 128)
        operands = torch.cat([b & 15, b >> 4], -1)
        if type_name == "Q5_K":  # fifth-plane byte w: low-plane word w's 8 codes, bit p: code p
            bits = packed["hi"].contiguous().view(torch.uint8).long().reshape(8, -1, 32, 1)
            p = torch.cat([2 * (torch.arange(128) % 4), 2 * (torch.arange(128) % 4) + 1])  # code in its word
            fifth = (bits.expand(-1, -1, -1, 4).reshape(8, -1, 128).repeat(1, 1, 2) >> p) & 1
            operands = operands | fifth << 4
        operands = operands.reshape(8, K)
    assert torch.equal(operands, natural[:, (torch.arange(0, K, 256).reshape(-1, 1) + order).reshape(-1)])


def test_quantize_x_matches_reference(tg, ti8) -> None:  # noqa: ANN001
    from paphos.quant.kernels import x_blocks

    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 256:512] = 0  # an all-zero block: dx 0, parts 0
    x[2, :256] *= 1000
    parts, dx, sums = ti8.quantize_x(x, "Q4_K")
    ref = x_blocks.reference_quantize(x, stream_order("Q4_K"), 256, 256)
    assert parts.shape == (2, 5, 768) and dx.shape == (5, 3) and sums.shape == (5, 3)
    assert torch.equal(parts, ref[0]) and torch.equal(dx, ref[1]) and torch.equal(sums, ref[2])
    assert not parts[:, 1, 256:512].any() and dx[1, 1] == 0
    q = parts.float()
    rep = (q[0] + q[1] / 254) * dx.repeat_interleave(256, 1)  # the represented x, within half a step
    source = x.float()[:, (torch.arange(0, 768, 256).reshape(-1, 1) + stream_order("Q4_K")).reshape(-1)]
    assert ((rep - source).abs() <= dx.repeat_interleave(256, 1) / 508 * 1.01).all()
    assert torch.equal(sums, (254 * q[0] + q[1]).reshape(5, 3, 256).sum(-1).int())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q8_0", "Q6_K", "IQ4_XS", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_gemm_matches_reference(tg, ti8, type_name: str) -> None:  # noqa: ANN001
    raw = _raw(type_name, N, K, 2)
    seg = tg.Segment(type_name, 0, N, K, planes.repack(raw, type_name))
    gen = torch.Generator().manual_seed(5)
    counters = split_k.counters(torch.device("cpu"))
    cases = ((2, ti8.I8Config(32, 16, 1, 2)), (9, ti8.I8Config(16, 16, 2, 1)), (16, ti8.I8Config(64, 16, 2)),
             (29, ti8.I8Config(16, 16, 2)))  # two token tiles  # fmt: skip
    for m, cfg in cases:
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        out = torch.full((m, N), float("nan"))
        ti8.matmul_into(out, ti8.quantize_x(x, type_name), seg, cfg)
        assert _rel(out, planes.reference_matmul(raw, type_name, x)) < 1e-4, (m, cfg)
        assert not counters.any()  # every split tile's counter is back to zero


def test_matmul_sends_batched_decode_here(tg, ti8, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A layer of Q4_K, Q6_K, Q3_K and Q8_0 segments (a Q4_K_M q|k|v with v in the middle, a Q3_K
    and a Q8_0 one): Q4_K, Q6_K and Q8_0 take the int8 path with x quantized once per type, Q3_K
    the fused kernel; one token stays on the GEMV, I8_MAX_TOKENS + 1 leaves the path."""
    types, rows = ("Q4_K", "Q6_K", "Q3_K", "Q8_0"), (32, 16, 8, 24)
    raws = [_raw(t, r, K, 7 + i) for i, (t, r) in enumerate(zip(types, rows, strict=True))]
    segs, start = [], 0
    for t, raw in zip(types, raws, strict=True):
        segs.append(tg.Segment(t, start, raw.shape[0], K, planes.repack(raw, t)))
        start += raw.shape[0]
    quantized, gemms = [], []
    quantize, gemm = ti8.quantize_x, ti8.matmul_into
    monkeypatch.setattr(ti8, "quantize_x", lambda x, t: quantized.append((x.shape[0], t)) or quantize(x, t))
    monkeypatch.setattr(ti8, "matmul_into", lambda o, q, s, c=None: gemms.append((o.shape[0], s.rows)) or gemm(o, q, s, c))
    gen = torch.Generator().manual_seed(9)
    for m in (1, 3, ti8.I8_MAX_TOKENS, ti8.I8_MAX_TOKENS + 1):
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        ref = torch.cat([planes.reference_matmul(r, t, x) for r, t in zip(raws, types, strict=True)], 1)
        got = tg.matmul(x, segs, start)
        assert got.dtype == torch.bfloat16 and got.shape == (m, start)
        assert _rel(got, ref) < 1e-2, m
    top = ti8.I8_MAX_TOKENS
    assert quantized == [(m, t) for m in (3, top) for t in ("Q4_K", "Q6_K", "Q8_0")]
    assert gemms == [(m, r) for m in (3, top) for r in (32, 16, 24)]


# ---------------------------------------------------------------------------- the inline PTX
# The interpreter runs the kernels' torch-like branches; these run each asm body in a PTX
# simulator (tests/quant/ptx_sim.py) on random registers as the kernel packs them (four operand
# positions a register, k % 4 = 0..3) against the same arithmetic.


def _ti8() -> object:
    from paphos.quant.gguf import triton_gguf_i8

    return triton_gguf_i8


def test_ptx_scale_halves_fifth_bits_and_minimum() -> None:
    rng = np.random.default_rng(11)
    ti8 = _ti8()
    for _ in range(200):
        codes, sc, bits = rng.integers(0, 16, 4).tolist(), int(rng.integers(0, 64)), int(rng.integers(0, 256))
        # int32 operands take four registers an instance, all holding the run's value
        h, lo = ptx_sim.run(ti8._ASM_SCALE_HALVES.value, [ptx_sim.pack(codes)] + [sc] * 4, 2)
        assert ptx_sim.unpack(h) == [c * (sc >> 3) for c in codes] and ptx_sim.unpack(lo) == [c * (sc & 7) for c in codes]
        low, high = ptx_sim.run(ti8._ASM_FIFTH_BITS.value, [bits] * 4 + [sc] * 4, 2)
        assert ptx_sim.unpack(low) == [sc * (bits >> (2 * b) & 1) for b in range(4)]
        assert ptx_sim.unpack(high) == [sc * (bits >> (2 * b + 1) & 1) for b in range(4)]
        (splat,) = ptx_sim.run(ti8._ASM_SPLAT.value, [sc] * 4, 1)
        assert ptx_sim.unpack(splat) == [sc] * 4


def test_ptx_q6_k_codes() -> None:
    rng = np.random.default_rng(12)
    ti8 = _ti8()
    for _ in range(300):
        lo, word = rng.integers(0, 256, 4).tolist(), int(rng.integers(0, 1 << 32))
        high, w, second = (int(v) for v in rng.integers(0, 2, 3))
        hi_shift = 16 * w + 2 * high
        v, v_b = ptx_sim.run(ti8._ASM_Q6_K.value, [ptx_sim.pack(lo), word, ptx_sim.pack([4 * high] * 4),
                                                    ptx_sim.pack([hi_shift] * 4), ptx_sim.pack([-second] * 4)], 2)  # fmt: skip
        want = [((b >> (4 * high)) & 15 | ((word >> (hi_shift + 4 * i)) & 3) << 4) - 32 for i, b in enumerate(lo)]
        assert ptx_sim.unpack(v) == want and ptx_sim.unpack(v_b) == [x * second for x in want]


@pytest.mark.parametrize("nib", [1, 2, 3, 4, 5])
def test_ptx_nibble_values(nib: int) -> None:
    """Q4_0, Q4_1, Q5_0, Q5_1: four bytes' low or high nibbles (and their fifth bits); IQ4: codes
    4h .. 4h + 3 of a word."""
    from paphos.quant.gguf.dequant import IQ4_KVALUES

    rng = np.random.default_rng(13 + nib)
    ti8 = _ti8()
    asm = {1: ti8._ASM_Q4_0, 2: ti8._ASM_IQ4, 3: ti8._ASM_Q4_1, 4: ti8._ASM_Q5_0, 5: ti8._ASM_Q5_1}[nib].value
    for _ in range(300):
        word, half, fifth = int(rng.integers(0, 1 << 32)), int(rng.integers(0, 2)), int(rng.integers(0, 256))
        if nib == 2:
            (got,) = ptx_sim.run(asm, [word, ptx_sim.pack([16 * half] * 4)], 1)
            want = [IQ4_KVALUES[(word >> (4 * (4 * half + i))) & 15] for i in range(4)]
        else:  # int32 operands: four registers an instance, all holding the run's value
            (got,) = ptx_sim.run(asm, [word] + [4 * half] * 4 + [fifth] * 4, 1)
            codes = [(word >> (8 * i + 4 * half)) & 15 for i in range(4)]
            if nib >= 4:  # byte i holds codes 2i and 2i + 1 of its word
                codes = [c | ((fifth >> (2 * i + half)) & 1) << 4 for i, c in enumerate(codes)]
            want = [c - {1: 8, 3: 0, 4: 16, 5: 0}[nib] for c in codes]
        assert ptx_sim.unpack(got) == want, (nib, hex(word), half, fifth)


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_gguf_i8_kernel_compiles_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_gguf_i8", CASES, triton_path)


def _gemm(rows: int, k: int, mma_sync: bool = False, type_name: str = "Q4_K") -> None:
    """Q4_K (or Q5_K): the launch `i8_config` picks at 16 tokens for a [rows, k] weight (or a
    32-row mma.sync program)."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    cfg = ti8.i8_config(type_name, rows, k, 16)
    if mma_sync:
        cfg = ti8.I8Config(32, 16, cfg.split_k, 2, 3)
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
            "w_ptr": "*u8", "hi_ptr": "*u8", "sc_ptr": "*u8", "sd_ptr": "*fp16", "mn_ptr": "*u8",
            "smin_ptr": "*fp16"}  # fmt: skip
    ints = dict(M=16, N=rows, K=k, stride_om=rows, iters_per_split=k // 256 // cfg.split_k)
    args |= {name: "i32" for name in ints}
    constexprs = dict(FIVE=type_name == "Q5_K", BN=cfg.block_n, BM=cfg.block_m, SPLIT=cfg.split_k > 1, ASM=True,
                      PDL=True)  # fmt: skip
    ptx = compile_sm90(ti8._q4_k_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages, ttgir=True)
    # `_scale_halves`, `_as_int8` (and Q5_K's `_fifth_bits`) take four codes by the first one's
    # scale: their operands must be in the dot's operand layout with 4, 8 or 16 consecutive K
    # values of a row per register
    asm = [line for line in ptx.splitlines() if "elementwise_inline_asm" in line and "mul.lo.u32" in line]
    assert len(asm) == (4 if type_name == "Q5_K" else 3)
    for op in asm:
        assert re.search(r"tensor<\d+x\d+xi8, #ttg\.dot_op<\{opIdx = 0, parent = #mma, kWidth = (4|8|16)\}>", op), op
    if mma_sync:
        assert re.search(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.satfinite\.s32\.s8\.s8", ptx)
        return
    # the scaled codes in registers: `{%r..}, {%r..}, descriptor`
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n32k32\.s32\.s8\.s8 \{[^}]*\}, \{%r", ptx)
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx


def _groups(rows: int, k: int, type_name: str) -> None:
    """A type of `_group_kernel` at the rule's launch: an mma.sync per 32-value group and 16 tokens,
    the two x parts joined in int32 in registers (no shuffles), no spills, PDL; the 4-bit types'
    `_linear_nibbles` / `_iq4_values` on runs of four operand positions (as `_chunks` checks)."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    cfg = ti8.i8_config(type_name, rows, k, 16)
    nib = ti8._GROUP_TYPES[type_name]
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "sum_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32",
            "count_ptr": "*i32", "w_ptr": "*u8" if nib else "*i8", "hi_ptr": "*u8", "d_ptr": "*fp16",
            "m_ptr": "*fp16"}  # fmt: skip
    ints = dict(M=16, N=rows, K=k, stride_om=rows, iters_per_split=k // 256 // cfg.split_k)
    args |= {name: "i32" for name in ints}
    constexprs = dict(NIB=nib, BN=cfg.block_n, BM=cfg.block_m, SPLIT=cfg.split_k > 1, ASM=True, PDL=True)
    ptx = compile_sm90(ti8._group_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages, ttgir=True)
    # 8 groups a step, 32 rows and 32 columns a warp: 2 x 4 m16n8k32 each
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.satfinite\.s32\.s8\.s8", ptx)) == 8 * 2 * 4
    assert "shfl" not in ptx and "wgmma" not in ptx
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx
    if nib:
        _four_positions_a_register(ptx, "0x9D8C" if nib == 2 else "0x0F0F0F0F")


def _four_positions_a_register(ptx: str, mark: str) -> None:
    """The asm holding `mark` runs on tensors whose registers hold four consecutive K positions,
    the first at k % 4 == 0: the dot operand's layout, or a blocked one with runs of 4, 8 or 16."""
    codes = next(line for line in ptx.splitlines() if "elementwise_inline_asm" in line and mark in line)
    layout = re.search(r"tensor<\d+x32xi8, #(\w+)>", codes).group(1)
    if layout.startswith("blocked"):
        blocked = re.search(rf"#{layout} = #ttg\.blocked<\{{sizePerThread = \[1, (\d+)\].*order = \[1, 0\]", ptx)
        assert blocked and int(blocked.group(1)) % 4 == 0, codes
    else:
        assert re.search(r"#ttg\.dot_op<\{opIdx = 0, parent = #mma, kWidth = (4|8|16)\}>", codes), codes


def _chunks(rows: int, k: int, type_name: str) -> None:
    """Q6_K or IQ4_XS at the rule's launch: mma.sync per chunk of 32 values and 16 tokens (two for
    Q6_K), no spills, PDL; the code assembly (`_q6_k_codes`, `_iq4_values`) reads four
    consecutive operand positions a register, the first at k % 4 == 0 (in the dot operand's
    layout, or a blocked one holding runs of 4, 8 or 16 along K)."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    cfg = ti8.i8_config(type_name, rows, k, 16)
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
            "lo_ptr": "*u8", "hi_ptr": "*u8", "sc_ptr": "*i8", "sd_ptr": "*fp16"}  # fmt: skip
    ints = dict(M=16, N=rows, K=k, stride_om=rows, iters_per_split=k // 256 // cfg.split_k)
    args |= {name: "i32" for name in ints}
    iq4 = type_name == "IQ4_XS"
    constexprs = dict(IQ4=iq4, BN=cfg.block_n, BM=cfg.block_m, SPLIT=cfg.split_k > 1, ASM=True, PDL=True)
    ptx = compile_sm90(ti8._chunk_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages, ttgir=True)
    dots = 8 * (1 if iq4 else 2)  # per step, each 2 x 4 m16n8k32 a warp (32 rows, 32 columns)
    assert len(re.findall(r"mma\.sync\.aligned\.m16n8k32\.row\.col\.satfinite\.s32\.s8\.s8", ptx)) == dots * 8
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx
    _four_positions_a_register(ptx, "0x9D8C" if iq4 else "0x60606060")


CASES = {
    "gate_up": (_gemm, 28672, 4096), "down": (_gemm, 4096, 14336), "mma.sync": (_gemm, 28672, 4096, True),
    "q5_k-gate_up": (_gemm, 28672, 4096, False, "Q5_K"), "q5_k-down": (_gemm, 4096, 14336, False, "Q5_K"),
    "q8_0-gate_up": (_groups, 28672, 4096, "Q8_0"), "q8_0-down": (_groups, 4096, 14336, "Q8_0"),
    "q4_0-gate_up": (_groups, 28672, 4096, "Q4_0"), "iq4_nl-down": (_groups, 4096, 14336, "IQ4_NL"),
    "q4_1-down": (_groups, 4096, 14336, "Q4_1"), "q5_0-gate_up": (_groups, 28672, 4096, "Q5_0"),
    "q5_1-gate_up": (_groups, 28672, 4096, "Q5_1"),
    "q6_k-down": (_chunks, 4096, 14336, "Q6_K"), "q6_k-head": (_chunks, 128256, 4096, "Q6_K"),
    "iq4_xs-gate_up": (_chunks, 28672, 4096, "IQ4_XS"), "iq4_xs-down": (_chunks, 4096, 14336, "IQ4_XS"),
}  # fmt: skip


if __name__ == "__main__":
    run_compiles(CASES)
