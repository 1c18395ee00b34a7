"""The integer-weight family (paphos/quant/kernels/int_layout.py, triton_int.py): W4A16 / W8A16
planes for GPTQ, AWQ and compressed-tensors.

- `pack` -> `dequantize` gives (code - zero) * scale exactly, in input order (perm undone), for
  4 and 8 bits, groups of 32 / 64 / 128 and per-channel, a short last group (K = 576, group 128),
  symmetric and asymmetric, with and without act-order; bad inputs are refused at load.
- The Triton kernels under the interpreter (TRITON_INTERPRET=1, small shapes: M in 1, 2, 3, 5, 17,
  20, 70; K 64 / 192 / 256, N 40 / 64) against `reference_matmul`: the interpreter cannot run
  inline PTX, so it runs the kernels' plain
  branches (`ASM` False): float32 weights where the GPU uses packed 16-bit math (exact there,
  since (code - zero) * scale needs at most 16 significant bits, but rounded once to bf16 / fp16
  on the GPU), and `dp4a` spelled out byte by byte. Tolerances: the dequantize kernel bit-exact;
  the fused kernel 1e-5 of max|ref| (float32 products, only the summation order differs); the
  integer-dot GEMV 1e-4 (x in two int8 parts per tile group: about 15 bits); `matmul`'s bf16
  output 1e-2 (the reference is float32 accumulation of the same bf16 x).
- The kernels compile for sm_90 (H100 / H200) without a GPU, with the installed triton and the
  H200 image's (tests/device_triton.py): the inline PTX assembles, no register spills, the fused
  kernel uses wgmma, the GEMV dp4a, the decode-path kernels wait for their predecessors (PDL).
  What the GPU computes is checked by benchmarks/bench_int_gpu.py against `reference_matmul`.

The kernel modules are (re)imported interpreted here, as in test_gguf_triton.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from paphos.quant.kernels import int_layout, split_k
from paphos.quant.kernels.int_layout import IntSpec
from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles
from tests.triton_interpreted import interpreted

_MODULE = "paphos.quant.kernels.triton_int"
_KERNEL_MODULES = ("paphos.layers.pdl", "paphos.layers.x_int8", "paphos.quant.gguf.triton_gemv", "paphos.quant.kernels.split_k")


@pytest.fixture(scope="module")
def ti() -> Iterator[object]:
    with interpreted((*_KERNEL_MODULES, _MODULE), "_gemm_kernel") as module:
        yield module


def _layer(
    spec: IntSpec, seed: int, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Random codes [N, K], scales / zeros [N, G] (in dtype), perm [K]."""
    gen = torch.Generator().manual_seed(seed)
    n, k, g = spec.out_features, spec.in_features, spec.groups
    codes = torch.randint(0, 1 << spec.bits, (n, k), generator=gen, dtype=torch.int32)
    scales = ((torch.rand(n, g, generator=gen) + 0.5) * (0.02 if spec.bits == 4 else 0.002)).to(dtype)
    zeros = (
        torch.randint(0, (1 << spec.bits) + 1, (n, g), generator=gen).to(dtype) if spec.has_zeros else None
    )
    perm = torch.randperm(k, generator=gen) if spec.has_perm else None
    return codes, scales, zeros, perm


def _expected(spec: IntSpec, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
              perm: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
    """(code - zero) * scale in float32, column j moved to input column perm[j]."""
    group = torch.arange(spec.in_features) // spec.group_size
    z = zeros.float()[:, group] if zeros is not None else float(1 << (spec.bits - 1))
    w = (codes.float() - z) * scales.float()[:, group]
    if perm is None:
        return w
    out = torch.empty_like(w)
    out[:, perm] = w
    return out


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).abs().max() / ref.abs().max()).item()


SPECS = [
    IntSpec(bits, group, k, 24, zeros, perm)
    for bits in (4, 8)
    for group, k in ((32, 256), (64, 256), (128, 256), (256, 256), (128, 576))
    for zeros, perm in ((False, False), (True, False), (False, True), (True, True))
]


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_pack_dequantizes_exactly(spec: IntSpec) -> None:
    codes, scales, zeros, perm = _layer(spec, 1)
    planes = int_layout.pack(codes.to(torch.uint8), scales, zeros, spec, perm)
    assert planes["qweight"].dtype == torch.int32 and planes["scales"].dtype == torch.bfloat16
    assert torch.equal(int_layout.codes_of(planes, spec), codes.long())
    assert torch.equal(int_layout.dequantize(planes, spec), _expected(spec, codes, scales, zeros, perm))
    # the checkpoint's bytes: bits / 8 per weight, 2 per scale (and zero), 4 per perm entry
    n, k, g = spec.out_features, spec.in_features, spec.groups
    assert (
        int_layout.planes_nbytes(planes)
        == n * k * spec.bits // 8 + 2 * n * g * (1 + spec.has_zeros) + 4 * k * spec.has_perm
    )
    x = torch.randn(3, k)
    assert torch.allclose(
        int_layout.reference_matmul(x, planes, spec), x @ _expected(spec, codes, scales, zeros, perm).t()
    )


def test_pack_refuses_inputs_outside_the_layout() -> None:
    spec = IntSpec(4, 32, 64, 8, True, True)
    codes, scales, zeros, perm = _layer(spec, 2)
    with pytest.raises(ValueError, match="codes outside"):
        int_layout.pack(codes + 1, scales, zeros, spec, perm)
    with pytest.raises(ValueError, match="zero points must be integers"):
        int_layout.pack(codes, scales, zeros + 0.5, spec, perm)
    with pytest.raises(ValueError, match="permutation"):
        int_layout.pack(codes, scales, zeros, spec, torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ValueError, match="must match"):
        int_layout.pack(codes, scales, None, spec, perm)
    for bad, why in ((IntSpec(4, 96, 192, 8, False, False), "group_size 96"),
                     (IntSpec(4, 32, 80, 8, False, False), "in_features 80"), (IntSpec(3, 32, 64, 8, False, False), "3-bit")):  # fmt: skip
        assert why in bad.invalid()
        with pytest.raises(ValueError, match=why):
            int_layout.pack(codes[:8, :64], scales[:8, :2], None, bad, None)


KERNEL_SPECS = [
    IntSpec(4, 32, 64, 40, False, False),
    IntSpec(4, 128, 192, 64, True, False),  # short last group
    IntSpec(4, 64, 192, 40, False, True),
    IntSpec(4, 192, 192, 64, True, True),  # per-channel, K not a power of two
    IntSpec(8, 128, 192, 40, False, True),
    IntSpec(8, 64, 64, 64, True, False),
    IntSpec(8, 64, 64, 40, True, True),
]


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=str)
def test_dequantize_kernel_is_exact(ti, spec: IntSpec) -> None:  # noqa: ANN001
    planes = int_layout.pack(*_layer(spec, 3)[:3], spec, _layer(spec, 3)[3])
    expected = int_layout.dequantize(planes, spec)
    if spec.has_perm:  # the kernel writes the kernel's K order
        expected = expected[:, planes["perm"].long()]
    out = torch.full((spec.out_features, spec.in_features), float("nan"))
    ti.dequantize_into(planes, spec, 0, spec.out_features, out, block_n=16, block_k=64)
    assert torch.equal(out, expected)
    part = torch.full((9, spec.in_features), float("nan"))  # a row range lands at the top
    ti.dequantize_into(planes, spec, 20, 29, part, block_n=16, block_k=64)
    assert torch.equal(part, expected[20:29])


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=str)
def test_fused_kernel_matches_reference(ti, spec: IntSpec) -> None:  # noqa: ANN001
    """Tiles of 16 and 32 tokens and rows, K slices summed by the last program of each tile
    (split-K), masked rows (N = 40) and tokens."""
    codes, scales, zeros, perm = _layer(spec, 4)
    planes = int_layout.pack(codes, scales, zeros, spec, perm)
    gen = torch.Generator().manual_seed(5)
    counters = split_k.counters(torch.device("cpu"))
    for m, cfg in ((1, ti.GemmConfig(16, 16, 64, 1)), (3, ti.GemmConfig(32, 16, 32, 3)),
                   (17, ti.GemmConfig(16, 32, 64, 2)), (70, ti.GemmConfig(32, 64, 32, 1))):  # fmt: skip
        x = torch.randn(m, spec.in_features, generator=gen).to(torch.bfloat16)
        ref = int_layout.reference_matmul(x, planes, spec)
        got = ti.gemm(x.float(), planes, spec, cfg)
        assert got.shape == (m, spec.out_features)
        assert _rel(got, ref) < 1e-5, (m, cfg)
        assert not counters.any()  # every split tile's counter is back to zero


@pytest.mark.parametrize("spec", KERNEL_SPECS, ids=str)
def test_gemv_matches_reference(ti, spec: IntSpec) -> None:  # noqa: ANN001
    """One token: rows per step and per program, warps; x's int8 parts quantized once and
    shared, or gathered through perm and quantized in one launch. Three tokens (the weights read
    once for all): blocks of rows."""
    planes = int_layout.pack(*_layer(spec, 6)[:3], spec, _layer(spec, 6)[3])
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, spec.in_features, generator=gen).to(torch.bfloat16)
    ref = int_layout.reference_matmul(x, planes, spec)
    xq = ti.quantize_x(x.float(), planes, spec)
    for cfg in (ti.GemvConfig(4, 4, 12), ti.GemvConfig(2, 2, 8)):
        got = ti.gemv(x.float(), planes, spec, cfg)
        assert got.shape == (1, spec.out_features)
        assert _rel(got, ref) < 1e-4, cfg
        assert torch.equal(ti.gemv(x.float(), planes, spec, cfg, xq), got)
    x = torch.randn(3, spec.in_features, generator=gen).to(torch.bfloat16)
    ref = int_layout.reference_matmul(x, planes, spec)
    for cfg in (ti.GemvConfig(16, 4), ti.GemvConfig(8, 2)):
        got = ti.gemv(x.float(), planes, spec, cfg)
        assert got.shape == (3, spec.out_features)
        assert _rel(got, ref) < 1e-4, cfg


@pytest.mark.parametrize("spec", KERNEL_SPECS[:3] + KERNEL_SPECS[4:5], ids=str)
def test_matmul_dispatch_in_bf16(ti, spec: IntSpec, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """`matmul`: the GEMV up to GEMV_MAX_TOKENS, the fused kernel up to FUSED_MAX_TOKENS,
    dequantize + GEMM above (also in row chunks of a small scratch buffer); bf16 out."""
    from paphos.quant.gguf import triton_gguf

    planes = int_layout.pack(*_layer(spec, 8)[:3], spec, _layer(spec, 8)[3])
    gen = torch.Generator().manual_seed(9)
    monkeypatch.setattr(ti, "GEMV_MAX_TOKENS", 2)
    monkeypatch.setattr(ti, "FUSED_MAX_TOKENS", {4: 16, 8: 16})
    monkeypatch.setattr(triton_gguf, "_SCRATCH", {})
    monkeypatch.setattr(triton_gguf, "SCRATCH_ELEMS", 16 * spec.in_features)  # 16-row chunks
    for m in (1, 2, 5, 20):
        x = torch.randn(m, spec.in_features, generator=gen).to(torch.bfloat16)
        got = ti.matmul(x, planes, spec)
        assert got.dtype == torch.bfloat16
        assert got.shape == (m, spec.out_features)
        assert _rel(got, int_layout.reference_matmul(x, planes, spec)) < 1e-2, m


def test_supports_and_int8_layout(ti) -> None:  # noqa: ANN001
    from paphos.layers import x_int8

    spec = IntSpec(4, 128, 256, 64, False, False)
    assert not ti.supports(spec, torch.device("cpu"), torch.bfloat16)
    assert spec.invalid() is None
    assert ti.int8_layout(spec) == x_int8.Int8Layout(4, 4)  # the GGUF 4-bit GEMV's: producers write it
    assert ti.int8_layout(IntSpec(8, 128, 256, 64, False, False)) == x_int8.Int8Layout(8, 4)
    assert ti.fit_block_k(128, IntSpec(4, 128, 576, 64, False, False)) == 64
    assert spec.group_shift == 7 and IntSpec(4, 576, 576, 64, False, False).group_shift == 31


# ---------------------------------------------------------------------------- sm_90 compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_int_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_int_kernels", CASES, triton_path)


def _gemm(bits: int, zeros: bool, dtype: str, m: int) -> None:
    """The launch `gemm_config` picks at M tokens for a 4096 x 4096 weight."""
    from paphos.quant.kernels import triton_int as ti

    spec = IntSpec(bits, 128, 4096, 4096, zeros, False)
    cfg = ti.gemm_config(spec, m)
    n, k = spec.out_features, spec.in_features
    by_bytes = bits == 4 and cfg.bytes_unpack
    args = {"x_ptr": dtype, "out_ptr": dtype, "part_ptr": "*fp32", "count_ptr": "*i32",
            "w_ptr": "*u8" if by_bytes else "*i32", "s_ptr": dtype, "z_ptr": dtype}  # fmt: skip
    ints = dict(M=m, N=n, K=k, stride_xm=k, stride_om=n, stride_w=k * bits // (8 if by_bytes else 32),
                group_shift=7, iters_per_split=k // cfg.block_k // cfg.split_k)  # fmt: skip
    args |= {name: "i32" for name in ints}
    constexprs = dict(BITS=bits, HAS_Z=zeros, BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k,
                      ONE_GROUP=True, SPLIT=cfg.split_k > 1, ASM=True, PACKED=True, BYTES=by_bytes,
                      SCALE_AFTER=by_bytes and cfg.scale_after, PDL=True, TT=spec.row_tile)  # fmt: skip
    ptx = compile_sm90(ti._gemm_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    assert "wgmma.mma_async" in ptx and "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]
    if bits == 4:
        assert ("sub.rn.f16x2" if dtype == "*fp16" else "sub.rn.bf16x2") in ptx
    if cfg.split_k > 1:
        assert "fence.acq_rel.gpu" in ptx and "atom.global" in ptx


def _gemv(bits: int, zeros: bool, k: int, m: int) -> None:
    """The launch `gemv_config` picks for a 4096 x K weight and M tokens."""
    from paphos.quant.kernels import triton_int as ti

    spec = IntSpec(bits, 128, k, 4096, zeros, False)
    cfg = ti.gemv_config(spec, m)
    args = {
        "q_ptr": "*i32",
        "f_ptr": "*fp32",
        "out_ptr": "*bf16",
        "w_ptr": "*i32",
        "s_ptr": "*bf16",
        "z_ptr": "*bf16",
    }
    ints = dict(M=m, N=4096, K=k, stride_w=k * bits // 32, stride_om=4096, group_shift=7)
    args |= {name: "i32" for name in ints}
    constexprs = dict(BITS=bits, HAS_Z=zeros, BN=cfg.block_n, T=1 << (k // spec.tile_values - 1).bit_length(),
                      RPP=cfg.rows_per_program if m == 1 else cfg.block_n, MULTI=m > 1, ASM=True,
                      PDL=True, TT=spec.row_tile)  # fmt: skip
    ptx = compile_sm90(ti._gemv_kernel, args, constexprs, cfg.num_warps, ints)
    assert "dp4a.s32.s32" in ptx and "griddepcontrol.wait" in ptx and "STACK:0 " in ptx, ptx[-300:]


def _permute_quantize() -> None:
    from paphos.layers import x_int8
    from paphos.quant.kernels import triton_int as ti

    args = {"x_ptr": "*bf16", "perm_ptr": "*i32", "q_ptr": "*i32", "f_ptr": "*fp32", "K": "i32", "n_groups": "i32"}
    ptx = compile_sm90(ti._permute_quantize_kernel, args, dict(LO=4, TB=x_int8.QUANTIZE_GROUPS, PDL=True), 1,
                   dict(K=4096, n_groups=128))  # fmt: skip
    assert "griddepcontrol.wait" in ptx and "STACK:0 " in ptx


def _dequant(bits: int) -> None:
    from paphos.quant.kernels import triton_int as ti

    ints = dict(row0=0, row_end=4096, N=4096, stride_w=4096 * bits // 32, group_shift=7, stride_o=4096)
    args = {
        "out_ptr": "*bf16",
        "w_ptr": "*i32",
        "s_ptr": "*bf16",
        "z_ptr": "*bf16",
        **{n: "i32" for n in ints},
    }
    constexprs = dict(BITS=bits, HAS_Z=True, BN=32, BK=128, ONE_GROUP=True, ASM=True, TT=int_layout.ROW_TILE)
    assert "STACK:0 " in compile_sm90(ti._dequant_kernel, args, constexprs, 4, ints)


CASES = {
    "gemm-w4-sym-bf16-m16": (_gemm, 4, False, "*bf16", 16),
    "gemm-w4-asym-fp16-m128": (_gemm, 4, True, "*fp16", 128),
    "gemm-w8-sym-bf16-m32": (_gemm, 8, False, "*bf16", 32),
    "gemv-w4-sym-4096": (_gemv, 4, False, 4096, 1),
    "gemv-w4-asym-14336": (_gemv, 4, True, 14336, 1),
    "gemv-w8-asym-14336": (_gemv, 8, True, 14336, 1),
    "gemv-w4-asym-14336-2-tokens": (_gemv, 4, True, 14336, 2),
    "gemv-w8-sym-14336-2-tokens": (_gemv, 8, False, 14336, 2),
    "gemv-w8-sym-4096-2-tokens": (_gemv, 8, False, 4096, 2),
    "permute-quantize": (_permute_quantize,),
    "dequant-w4": (_dequant, 4),
}


if __name__ == "__main__":
    run_compiles(CASES)
