"""GGUF's int8 tensor-core path for Q4_K, Q5_K and Q8_0 (paphos/quant/gguf/triton_gguf_i8.py).

- `stream_order` is the order of the codes in the kernel's operands, read from repacked planes
  the way the kernel reads them (a super-block's bytes' low nibbles, then high, Q5_K each with its
  fifth bit); x_int8_blocks.quantize writes x in that order, bit for bit its torch reference, within
  half a step of dx / 254.
- The GEMM under the interpreter against dequantize-then-float32-matmul
  (planes.reference_matmul) within 1e-4 of max|ref| (x's quantization; the integer sums are
  exact), at 2, 9, 16 and 29 tokens (two 16-token tiles, one 32-token tile), one and several K slices, masked rows and
  tokens, 16- to 64-row programs.
- `triton_gguf.matmul` takes this path from 2 to I8_MAX_TOKENS[type] tokens for the Q4_K and Q5_K
  segments, the fused kernel for a layer's other segments, x quantized once; a Q8_0 segment
  reads x in the integer family's 8-bit blocks (its plane's code order), quantized once per
  layout, and x's producer is told the layout of the largest int8 segment.
- Every inline PTX body (the operand assembly the interpreter never runs) in a PTX simulator
  (tests/quant/ptx_sim.py) on random registers, against the same arithmetic.
- The kernel compiles for sm_90 with both tritons in the rule's launches, no spills, PDL: wgmma
  with the codes in registers, the scale multiplication in the dot operand's layout (four codes
  of one sub-block per register; a 32-row mma.sync program keeps it), Q5_K's fifth bits likewise;
  Q8_0's wgmma with both operands by descriptor (four dots a block), mma.sync on its narrow launch.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from paphos.quant.gguf import planes
from paphos.quant.gguf.triton_gguf_i8 import stream_order, supports
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
    assert all(supports(t, 4096) and supports(t, 14336) for t in ("Q4_K", "Q5_K", "Q8_0"))
    assert not supports("Q4_K", 4096 + 128)  # a partial x block
    assert supports("Q8_0", 4096 + 128) and not supports("Q8_0", 4096 + 32)  # Q8_0's blocks are 128 values
    # measured slower than the fused kernel as int8 GEMMs (the module docstring), or never built
    assert not any(supports(t, 4096) for t in ("Q6_K", "Q4_0", "IQ4_XS", "Q3_K", "Q2_K"))


def test_q8_0_reads_x_in_its_planes_code_order() -> None:
    """Q8_0's int8 operands are its low plane's bytes as stored (planes.py's tile order); x's parts
    come in the integer family's 8-bit block order, which must be that order."""
    from paphos.quant.gguf.triton_gguf_i8 import x_layout

    raw = _raw("Q8_0", 8, K, 1)
    natural = planes._codes_and_scales(raw.reshape(-1, planes.type_size("Q8_0")), "Q8_0")["q"].reshape(8, K).long()
    stored = planes.repack(raw, "Q8_0", tile=False)["lo"].long()
    layout = x_layout("Q8_0")
    order = layout.make_order()
    assert layout.xb == 128 and sorted(order.tolist()) == list(range(128))
    assert torch.equal(stored, natural[:, (torch.arange(0, K, 128).reshape(-1, 1) + order).reshape(-1)])


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K"])
def test_stream_order_is_the_operands_code_order(type_name: str) -> None:
    raw = _raw(type_name, 8, K, 1)
    fields = planes._codes_and_scales(raw.reshape(-1, planes.type_size(type_name)), type_name)
    natural = fields["q"].reshape(8, K).long()
    order = stream_order()
    assert sorted(order.tolist()) == list(range(256))
    packed = planes.repack(raw, type_name, tile=False)
    # per super-block: its bytes' low nibbles, then high (Q5_K: each with its fifth bit)
    b = packed["lo"].contiguous().view(torch.uint8).long().reshape(8, -1, 128)
    operands = torch.cat([b & 15, b >> 4], -1)
    if type_name == "Q5_K":  # fifth-plane byte w: low-plane word w's 8 codes, bit p: code p
        bits = packed["hi"].contiguous().view(torch.uint8).long().reshape(8, -1, 32, 1)
        p = torch.cat([2 * (torch.arange(128) % 4), 2 * (torch.arange(128) % 4) + 1])  # code in its word
        fifth = (bits.expand(-1, -1, -1, 4).reshape(8, -1, 128).repeat(1, 1, 2) >> p) & 1
        operands = operands | fifth << 4
    operands = operands.reshape(8, K)
    assert torch.equal(operands, natural[:, (torch.arange(0, K, 256).reshape(-1, 1) + order).reshape(-1)])


def test_quantize_x_matches_reference(tg, ti8) -> None:  # noqa: ANN001
    from paphos.layers import x_int8_blocks

    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 256:512] = 0  # an all-zero block: dx 0, parts 0
    x[2, :256] *= 1000
    parts, dx, sums = ti8.quantize_x(x)
    ref = x_int8_blocks.reference_quantize(x, stream_order(), 256, 256)
    assert parts.shape == (2, 5, 768) and dx.shape == (5, 3) and sums.shape == (5, 3)
    assert torch.equal(parts, ref[0]) and torch.equal(dx, ref[1]) and torch.equal(sums, ref[2])
    assert not parts[:, 1, 256:512].any() and dx[1, 1] == 0
    q = parts.float()
    rep = (q[0] + q[1] / 254) * dx.repeat_interleave(256, 1)  # the represented x, within half a step
    source = x.float()[:, (torch.arange(0, 768, 256).reshape(-1, 1) + stream_order()).reshape(-1)]
    assert ((rep - source).abs() <= dx.repeat_interleave(256, 1) / 508 * 1.01).all()
    assert torch.equal(sums, (254 * q[0] + q[1]).reshape(5, 3, 256).sum(-1).int())


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q8_0"])
def test_gemm_matches_reference(tg, ti8, type_name: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(split_k, "num_sms", lambda device: 1)  # stream-K: stream_per_sm programs in all
    raw = _raw(type_name, N, K, 2)
    seg = tg.Segment(type_name, 0, N, K, planes.repack(raw, type_name))
    gen = torch.Generator().manual_seed(5)
    counters = split_k.counters(torch.device("cpu"))
    cases = ((2, ti8.I8Config(32, 16, 1, 2)), (9, ti8.I8Config(16, 16, 2, 1)), (16, ti8.I8Config(64, 16, 2)),
             (29, ti8.I8Config(16, 16, 2)), (29, ti8.I8Config(32, 32, 2)))  # two token tiles, one
    if type_name != "Q8_0":  # stream-K (Q4_K's rule): runs inside tiles and across them, a tile shared by up to four programs
        cases += ((9, ti8.I8Config(16, 16, stream_per_sm=7)), (29, ti8.I8Config(16, 16, stream_per_sm=5)),
                  (29, ti8.I8Config(32, 32, stream_per_sm=3)))  # fmt: skip
    for m, cfg in cases:
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        out = torch.full((m, N), float("nan"))
        ti8.matmul_into(out, ti8.quantize_x(x, type_name), seg, cfg)
        assert _rel(out, planes.reference_matmul(raw, type_name, x)) < 1e-4, (m, cfg)
        assert not counters.any()  # every split tile's counter is back to zero


def test_the_rule_splits_q4_k_and_streams_when_asked() -> None:
    """The split launch for every type (measured ahead of stream-K on the tiled planes); with
    `stream`, stream-K for Q4_K's 16-token tiles where each program runs four super-blocks or more
    (a Llama-3-8B layer's q|k, gate|up and down), the split launch for o (3.9 a program), Q5_K
    and 32-token tiles."""
    from paphos.quant.gguf.triton_gguf_i8 import I8Config, i8_config

    shapes = ((5120, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
    assert not any(i8_config("Q4_K", n, k, 16).stream_per_sm for n, k in shapes)
    assert i8_config("Q4_K", 28672, 4096, 16) == I8Config(64, 16, 1)
    streamed = {(n, k) for n, k in shapes if i8_config("Q4_K", n, k, 16, stream=True).stream_per_sm}
    assert streamed == {(5120, 4096), (28672, 4096), (4096, 14336)}
    assert i8_config("Q4_K", 28672, 4096, 16, stream=True).stream_per_sm == 2
    assert not i8_config("Q5_K", 28672, 4096, 16, stream=True).stream_per_sm
    assert not i8_config("Q4_K", 28672, 4096, 32, stream=True).stream_per_sm


def test_matmul_sends_batched_decode_here(tg, ti8, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A layer of Q4_K, Q6_K, Q3_K and Q5_K segments (a Q4_K_M q|k|v with v in the middle, a Q3_K
    and a Q5_K one): Q4_K and Q5_K take the int8 path with x quantized once (their shared order), Q6_K and
    Q3_K the fused kernel; one token stays on the GEMV, and each type leaves the path above its
    I8_MAX_TOKENS (Q5_K 32, Q4_K 64)."""
    types, rows = ("Q4_K", "Q6_K", "Q3_K", "Q5_K"), (32, 16, 8, 24)
    raws = [_raw(t, r, K, 7 + i) for i, (t, r) in enumerate(zip(types, rows, strict=True))]
    segs, start = [], 0
    for t, raw in zip(types, raws, strict=True):
        segs.append(tg.Segment(t, start, raw.shape[0], K, planes.repack(raw, t)))
        start += raw.shape[0]
    quantized, gemms = [], []
    quantize, gemm = ti8.quantize_x, ti8.matmul_into
    monkeypatch.setattr(ti8, "quantize_x", lambda x, t: quantized.append(x.shape[0]) or quantize(x, t))
    monkeypatch.setattr(ti8, "matmul_into", lambda o, q, s, c=None: gemms.append((o.shape[0], s.rows)) or gemm(o, q, s, c))
    gen = torch.Generator().manual_seed(9)
    q5, q4 = ti8.I8_MAX_TOKENS["Q5_K"], ti8.I8_MAX_TOKENS["Q4_K"]
    for m in (1, 3, q5, q5 + 1, q4, q4 + 1):
        x = torch.randn(m, K, generator=gen).to(torch.bfloat16)
        ref = torch.cat([planes.reference_matmul(r, t, x) for r, t in zip(raws, types, strict=True)], 1)
        got = tg.matmul(x, segs, start)
        assert got.dtype == torch.bfloat16 and got.shape == (m, start)
        assert _rel(got, ref) < 1e-2, m
    assert quantized == [3, q5, q5 + 1, q4]
    assert gemms == [(m, r) for m in (3, q5) for r in (32, 24)] + [(q5 + 1, 32), (q4, 32)]
    # x's producer is told to write the parts up to the longest of those limits (paphos/layers/fused.py)
    layout = tg.int8_block_layout(segs)
    assert layout == ti8.x_layout() and (layout.min_tokens, layout.max_tokens) == (2, q4)
    assert tg.int8_block_layout(segs[1:3]) is None  # Q6_K and Q3_K: the fused kernel


def test_a_q8_0_segment_quantizes_x_in_its_own_layout(tg, ti8, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """A layer of Q8_0 and Q4_K segments: each type's int8 kernel reads x in its own layout (x
    quantized once per layout); x's producer is told the layout of the larger segment."""
    types, rows = ("Q8_0", "Q4_K"), (40, 16)
    raws = [_raw(t, r, K, 21 + i) for i, (t, r) in enumerate(zip(types, rows, strict=True))]
    segs, start = [], 0
    for t, raw in zip(types, raws, strict=True):
        segs.append(tg.Segment(t, start, raw.shape[0], K, planes.repack(raw, t)))
        start += raw.shape[0]
    layouts = []
    quantize = ti8.quantize_x
    monkeypatch.setattr(ti8, "quantize_x", lambda x, t: layouts.append(ti8.x_layout(t).name) or quantize(x, t))
    x = torch.randn(12, K, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ref = torch.cat([planes.reference_matmul(r, t, x) for r, t in zip(raws, types, strict=True)], 1)
    assert _rel(tg.matmul(x, segs, start), ref) < 1e-2  # bf16 output
    assert layouts == ["int8", "Q4_K"]
    layout = tg.int8_block_layout(segs)  # Q8_0's 40 rows of 34 bytes a block outweigh Q4_K's 16 of 144
    assert layout.name == "int8" and (layout.min_tokens, layout.max_tokens) == (2, ti8.I8_MAX_TOKENS["Q8_0"])


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


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_gguf_i8_kernel_compiles_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_gguf_i8", CASES, triton_path)


def _gemm(rows: int, k: int, mma_sync: bool = False, type_name: str = "Q4_K", tokens: int = 16,
          stream: bool = False) -> None:  # fmt: skip
    """Q4_K (or Q5_K): the launch `i8_config` picks at `tokens` for a [rows, k] weight (or a
    32-row mma.sync program; or its tiles by stream-K)."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    cfg = ti8.i8_config(type_name, rows, k, tokens)
    if mma_sync:
        cfg = ti8.I8Config(32, 16, cfg.split_k, 2, 3)
    if stream:
        cfg = dataclasses.replace(cfg, stream_per_sm=2)
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
            "w_ptr": "*u8", "hi_ptr": "*u8", "sc_ptr": "*i64", "sd_ptr": "*fp16", "mn_ptr": "*i64",
            "smin_ptr": "*fp16"}  # fmt: skip
    ints = dict(M=tokens, N=rows, K=k, stride_om=rows)
    constexprs = dict(FIVE=type_name == "Q5_K", BN=cfg.block_n, BM=cfg.block_m, ASM=True, PDL=True,
                      SCALE_WORDS=ti8.scale_words(type_name, cfg), TT=planes.row_tile(type_name, rows, k))  # fmt: skip
    if not stream:
        ints["iters_per_split"] = k // 256 // cfg.split_k
        constexprs["SPLIT"] = cfg.split_k > 1
    args |= {name: "i32" for name in ints}
    kernel = ti8._q4_k_stream_kernel if stream else ti8._q4_k_kernel
    ptx = compile_sm90(kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages, ttgir=True)
    assert "cp.async" in ptx  # the weights' loads software-pipelined (in stream-K's inner loop too)
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
    n = 2 * cfg.block_m  # both x parts side by side
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.s32\.s8\.s8 \{{[^}}]*\}}, \{{%r", ptx)
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx
    # Q4_K in 32-token tiles: the sub-block scales and minima reach the operand layout without a
    # byte-wide shared load each (`_sub_block_bytes`); 16-token tiles and Q5_K's fifth bits take them
    if type_name == "Q4_K" and ti8.scale_words(type_name, cfg):
        assert not re.search(r"ld\.shared(\.v\d)?\.[bus]8", ptx)


def _q8_0_gemm(rows: int, k: int, tokens: int = 16) -> None:
    """Q8_0 at the launch `i8_config` picks: the codes go from the pipeline's shared-memory stage to
    the tensor cores as they are (wgmma: both operands by descriptor), one K=32 dot per scale
    group."""
    from paphos.quant.gguf import triton_gguf_i8 as ti8

    cfg = ti8.i8_config("Q8_0", rows, k, tokens)
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32",
            "w_ptr": "*i8", "sc_ptr": "*i64"}  # fmt: skip
    ints = dict(M=tokens, N=rows, K=k, stride_om=rows, iters_per_split=k // ti8.Q8_0_XB // cfg.split_k)
    args |= {name: "i32" for name in ints}
    constexprs = dict(BN=cfg.block_n, BM=cfg.block_m, SPLIT=cfg.split_k > 1, ASM=True, PDL=True,
                      TT=planes.row_tile("Q8_0", rows, k))  # fmt: skip
    ptx = compile_sm90(ti8._q8_0_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    assert "cp.async" in ptx and "griddepcontrol.wait" in ptx and "STACK:0 " in ptx
    if cfg.num_warps < 4:  # the narrow layers' launch: mma.sync on 2 warps
        assert re.search(r"mma\.sync\.aligned\.m16n8k32\.row\.col(\.satfinite)?\.s32\.s8\.s8", ptx)
        return
    n = 2 * cfg.block_m  # both x parts side by side
    dots = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.s32\.s8\.s8 \{{[^}}]*\}}, %rd\d+, %rd\d+", ptx)
    assert len(dots) == 4 * cfg.block_n // 64, ptx  # four groups a block, each by its own dot


CASES = {
    "q8_0-gate_up": (_q8_0_gemm, 28672, 4096), "q8_0-down": (_q8_0_gemm, 4096, 14336),
    "q8_0-32-tokens-o": (_q8_0_gemm, 4096, 4096, 32), "q8_0-32-tokens-gate_up": (_q8_0_gemm, 28672, 4096, 32),
    "gate_up": (_gemm, 28672, 4096), "down": (_gemm, 4096, 14336), "mma.sync": (_gemm, 28672, 4096, True),
    "q5_k-gate_up": (_gemm, 28672, 4096, False, "Q5_K"), "q5_k-down": (_gemm, 4096, 14336, False, "Q5_K"),
    "32-tokens-gate_up": (_gemm, 28672, 4096, False, "Q4_K", 32), "32-tokens-o": (_gemm, 4096, 4096, False, "Q4_K", 32),
    "stream-gate_up": (_gemm, 28672, 4096, False, "Q4_K", 16, True),
    "stream-q5_k-down": (_gemm, 4096, 14336, False, "Q5_K", 16, True),
}  # fmt: skip


if __name__ == "__main__":
    run_compiles(CASES)
