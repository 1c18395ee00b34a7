"""The integer family's int8 tensor-core path (paphos/quant/kernels/triton_int_i8.py).

- `block_order` is the order in which the plane's bytes hold a 128-value block's codes (read
  straight from packed planes, 4-bit and 8-bit).
- `quantize_x` under the interpreter equals `reference_quantize_x` bit for bit (with and without
  act-order's gather), and the parts hold x to half a step of dx / 254 (about 15 bits).
- The GEMM under the interpreter (int8 dots spelled out by numpy) against
  `int_layout.reference_matmul` within 1e-4 of max|ref| (x's quantization; the integer sums are
  exact), at 3, 17 and 70 tokens, one and several K slices, masked rows and tokens, symmetric
  and asymmetric, 4 and 8 bits, act-order, per-channel scales.
- `triton_int.matmul` sends 3 to I8_MAX_TOKENS[bits] tokens here where `supports` holds.
- The kernels compile for sm_90 with the installed triton and the H200 image's: int8 wgmma with
  the weights in registers (no shared-memory round trip for the unpacked codes), no spills, PDL.
What the GPU computes on Llama-3-8B shapes is checked by benchmarks/bench_int_gpu.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import paphos.quant.kernels.triton_int  # noqa: F401 - imported compiled first, so `interpreted` reloads it
from paphos.quant.kernels import int_layout, split_k
from paphos.quant.kernels.int_layout import IntSpec
from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles
from tests.quant.test_int_kernels import _layer, _rel
from tests.triton_interpreted import interpreted

_MODULES = ("paphos.layers.pdl", "paphos.layers.x_int8", "paphos.quant.gguf.triton_gemv", "paphos.quant.kernels.split_k",
            "paphos.layers.x_int8_blocks", "paphos.quant.kernels.x_blocks", "paphos.quant.kernels.triton_int_i8", "paphos.quant.kernels.triton_int")  # fmt: skip


@pytest.fixture(scope="module")
def ti() -> Iterator[object]:
    with interpreted(_MODULES, "_gemm_kernel") as module:
        yield module


@pytest.fixture(scope="module")
def ti8(ti) -> object:  # noqa: ANN001
    import paphos.quant.kernels.triton_int_i8 as module

    return module


SPECS = [
    IntSpec(4, 128, 256, 40, False, False),
    IntSpec(4, 128, 384, 64, True, True),
    IntSpec(4, 256, 256, 64, True, False),
    IntSpec(4, 384, 384, 40, False, True),  # per-channel
    IntSpec(8, 256, 256, 40, True, False),
    IntSpec(8, 384, 384, 64, False, True),
]


def test_supports() -> None:
    from paphos.quant.kernels.triton_int_i8 import supports

    assert all(supports(s) for s in SPECS)
    assert not supports(IntSpec(4, 64, 256, 64, False, False))  # groups shorter than a block
    assert not supports(IntSpec(4, 192, 192, 64, False, False))  # K not a multiple of 128
    assert not supports(IntSpec(4, 128, 576, 64, False, False))  # a short last block


@pytest.mark.parametrize("bits", [4, 8])
def test_block_order_is_the_planes_byte_order(bits: int) -> None:
    from paphos.quant.kernels.triton_int_i8 import block_order

    spec = IntSpec(bits, 128, 256, 8, False, False)
    codes = _layer(spec, 1)[0]
    plane = int_layout.pack(codes, torch.ones(8, 2), None, spec, None)["qweight"].view(torch.uint8)
    # tiles of ROW_TILE rows x one block, the tiles along K (int_layout's docstring)
    tiles = plane.reshape(8 // int_layout.ROW_TILE, 2, int_layout.ROW_TILE, -1)
    per_block = tiles.transpose(1, 2).reshape(8, 2, -1).long()  # [rows, blocks, bytes of a block]
    stored = torch.cat([per_block & 15, per_block >> 4], -1) if bits == 4 else per_block ^ 0x80
    order = torch.arange(0, 256, 128).reshape(-1, 1) + block_order(bits)
    assert sorted(block_order(bits).tolist()) == list(range(128))
    assert torch.equal(stored, codes.long()[:, order])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act-order"])
def test_quantize_x_matches_reference(ti8, bits: int, act_order: bool) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(bits)
    x = torch.randn(5, 512, generator=gen).to(torch.bfloat16)
    x[1, 128:256] = 0  # an all-zero block: dx 0, parts 0
    x[2, :128] *= 1000
    perm = torch.randperm(512, generator=gen) if act_order else None
    parts, dx, sums = ti8.quantize_x(x, bits, None if perm is None else perm.int())
    ref = ti8.reference_quantize_x(x, bits, perm)
    assert torch.equal(parts, ref[0]) and torch.equal(dx, ref[1]) and torch.equal(sums, ref[2])
    if not act_order:
        assert not parts[:, 1, 128:256].any() and dx[1, 1] == 0
    # the represented x, back in input order, within half a step of the second part
    q = parts.float()
    rep = (q[0] + q[1] / 254) * dx.repeat_interleave(128, 1)
    order = (torch.arange(0, 512, 128).reshape(-1, 1) + ti8.block_order(bits)).reshape(-1)
    source = x.float()[:, perm] if act_order else x.float()
    # (1 % over: float32 rounding of dx * q with |q| up to 127)
    assert ((rep - source[:, order]).abs() <= dx.repeat_interleave(128, 1) / 508 * 1.01).all()
    assert torch.equal(sums, (254 * q[0] + q[1]).reshape(5, 4, 128).sum(-1).int())


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_gemm_matches_reference(ti8, spec: IntSpec) -> None:  # noqa: ANN001
    codes, scales, zeros, perm = _layer(spec, 4)
    planes = int_layout.pack(codes, scales, zeros, spec, perm)
    gen = torch.Generator().manual_seed(5)
    counters = split_k.counters(torch.device("cpu"))
    for m, cfg in ((3, ti8.I8Config(16, 16, 1)), (17, ti8.I8Config(32, 16, 2)), (70, ti8.I8Config(16, 64, 3))):
        x = torch.randn(m, spec.in_features, generator=gen).to(torch.bfloat16)
        got = ti8.matmul(x.float(), planes, spec, cfg)
        assert got.shape == (m, spec.out_features)
        assert _rel(got, int_layout.reference_matmul(x, planes, spec)) < 1e-4, (m, cfg)
        assert not counters.any()  # every split tile's counter is back to zero
        assert not split_k.zeros(torch.device("cpu"), m * spec.out_features).any()  # the sum plane too


def test_matmul_sends_small_batches_here(ti, ti8, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    spec = SPECS[1]
    planes = int_layout.pack(*_layer(spec, 8)[:3], spec, _layer(spec, 8)[3])
    calls = []
    real = ti8.matmul
    monkeypatch.setattr(ti.triton_int_i8, "matmul", lambda x, p, s: calls.append(x.shape[0]) or real(x, p, s))
    gen = torch.Generator().manual_seed(9)
    for m in (1, 3, 32, 40):
        x = torch.randn(m, spec.in_features, generator=gen).to(torch.bfloat16)
        got = ti.matmul(x, planes, spec)
        assert got.dtype == torch.bfloat16 and got.shape == (m, spec.out_features)
        assert _rel(got, int_layout.reference_matmul(x, planes, spec)) < 1e-2, m
    assert calls == [3, 32]  # 4-bit codes: up to I8_MAX_TOKENS[4], then the fused kernel


def test_gemm_reads_the_parts_x_s_producer_attached(ti, ti8) -> None:  # noqa: ANN001
    """Where x's producer attached its parts in the GEMM's layout (paphos/layers/fused.py writes
    them), the GEMM multiplies those and launches no quantization; the layer's layout is the one
    its producer is told to write (int_linear via triton_int.int8_block_layout), none with
    act-order."""
    from paphos.layers import x_int8, x_int8_blocks

    spec = SPECS[0]
    planes = int_layout.pack(*_layer(spec, 6)[:3], spec, None)
    layout = ti.int8_block_layout(spec)
    assert layout == ti8.x_layout(4) and (layout.min_tokens, layout.max_tokens) == (3, 32)
    assert ti.int8_block_layout(SPECS[1]) is None  # act-order gathers x first
    x = torch.randn(5, spec.in_features, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).float()
    fed = x_int8.attach(x.clone(), layout, x_int8_blocks.quantize(2 * x, layout))
    got = ti8.matmul(fed, planes, spec, ti8.I8Config(16, 16, 1))
    assert _rel(got, int_layout.reference_matmul(2 * x, planes, spec)) < 1e-4


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_i8_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_int_i8", CASES, triton_path)


def _gemm(bits: int, zeros: bool, m: int) -> None:
    """The launch `i8_config` picks at M tokens for a 4096 x 4096 weight."""
    import re

    from paphos.quant.kernels import triton_int_i8 as ti8

    spec = IntSpec(bits, 128, 4096, 4096, zeros, False)
    cfg = ti8.i8_config(spec, m)
    args = {"q_ptr": "*i8", "dx_ptr": "*fp32", "sum_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32",
            "count_ptr": "*i32", "w_ptr": "*u8" if bits == 4 else "*i8", "s_ptr": "*bf16", "z_ptr": "*bf16"}  # fmt: skip
    ints = dict(M=m, N=4096, K=4096, stride_w=4096 * bits // 8, stride_om=4096, group_shift=7,
                iters_per_split=32 // cfg.split_k)  # fmt: skip
    args |= {name: "i32" for name in ints}
    split = cfg.split_k > 1
    constexprs = dict(BITS=bits, HAS_Z=zeros, BN=cfg.block_n, BM=cfg.block_m, SPLIT=split, ATOMIC=split, ASM=True,
                      PDL=True, TT=spec.row_tile)  # fmt: skip
    ptx = compile_sm90(ti8._gemm_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    if split:  # the partials added into one plane (split_k.py's atomic launch), not stored one plane a slice
        assert re.search(r"(red|atom)\.global\.\S*add(\.v[24])?\.f32", ptx), ptx[-300:]
    # 4-bit: the A operand (the unpacked codes) in registers, `{%r..}, {%r..}, descriptor`;
    # 8-bit: the stored bytes are the operand, read from shared memory (two descriptors)
    a_operand = r"\{%r" if bits == 4 else "%rd"
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8 \{[^}]*\}, " + a_operand, ptx), ptx[-300:]
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]


def _quantize(perm: bool) -> None:
    from paphos.layers import x_int8_blocks

    args = {"x_ptr": "*bf16", "order_ptr": "*i32", "perm_ptr": "*i32", "q_ptr": "*i8", "dx_ptr": "*fp32",
            "sum_ptr": "*i32", "M": "i32", "K": "i32", "stride_xm": "i32"}  # fmt: skip
    constexprs = dict(XB=128, SUM=128, HAS_PERM=perm, BLOCKS=x_int8_blocks.QUANTIZE_BLOCKS, PDL=True)
    ptx = compile_sm90(x_int8_blocks._quantize_kernel, args, constexprs, 4, dict(M=16, K=4096, stride_xm=4096))
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx


CASES = {
    "gemm-w4-sym-m16": (_gemm, 4, False, 16),
    "gemm-w4-asym-m8": (_gemm, 4, True, 8),
    "gemm-w4-sym-m32": (_gemm, 4, False, 32),
    "gemm-w8-asym-m16": (_gemm, 8, True, 16),
    "gemm-w8-sym-m64": (_gemm, 8, False, 64),
    "quantize": (_quantize, False),
    "quantize-act-order": (_quantize, True),
}


if __name__ == "__main__":
    run_compiles(CASES)
