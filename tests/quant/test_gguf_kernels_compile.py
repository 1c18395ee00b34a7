"""The GGUF Triton kernels compile for sm_90 (H100/H200) on this machine, no GPU needed: the
interpreter runs of test_gguf_triton.py accept code that may not lower for the GPU (a constexpr
reassigned in an unrolled loop, inline PTX, layouts, programmatic dependent launch: the
interpreter never runs the PDL branches). The batch-1 GEMVs must not spill; the kernels of the
batch-1 path (GEMVs, x's quantization, the norm, SiLU x mul and attention merge writing it) wait for the kernels
before them (griddepcontrol.wait). The
compiles run in a child process without TRITON_INTERPRET (this one has the interpreter set up), once
with the installed triton and once with the H200 image's (tests/device_triton.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_gguf_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.quant.test_gguf_kernels_compile", CASES, triton_path)


_POINTER = {0: "*fp16", 1: "*i8", 2: "*u8"}


def _plane_args(fmt: object, lo: str = "*i32", hi: str = "*i32") -> dict[str, str]:
    return {
        "lo_ptr": lo, "hi_ptr": hi, "sc_ptr": _POINTER[fmt.scale], "sd_ptr": "*fp16",
        "mn_ptr": "*fp16" if fmt.mink == 1 else "*u8", "smin_ptr": "*fp16",
    }  # fmt: skip


def _integer_gemv(type_name: str, rows: int, k: int) -> None:
    """The launch `default_gemv_config` picks for a (rows, K) weight, as `triton_gemv.gemv` makes it."""
    from paphos.quant.gguf import planes
    from paphos.quant.gguf import triton_gemv as gemv
    from paphos.quant.gguf import triton_gguf as tg

    fmt = planes.FORMATS[type_name]
    assert gemv.integer_dots(fmt)
    cfg = tg.default_gemv_config(type_name, rows, k)
    args = {"q_ptr": "*i32", "f_ptr": "*fp32", "out_ptr": "*bf16", **_plane_args(fmt, hi="*i16")}
    args |= {n: "i32" for n in ("N", "K", "stride_lo", "stride_hi", "stride_g", "stride_s")}
    constexprs = dict(LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink,
                      TW=fmt.tile_words, BN=cfg.block_n, T=1 << (k // fmt.tile_values - 1).bit_length(),
                      RPP=cfg.rows_per_program, ASM=True, PDL=True, TT=planes.row_tile(type_name, rows, k),
                      TILE=planes.tile_values(type_name))  # fmt: skip
    ints = dict(N=rows, K=k, stride_lo=k * fmt.lo // 32, stride_hi=k * fmt.hi // 16, stride_g=k // fmt.sg,
                stride_s=k // 256)  # fmt: skip
    ptx = compile_sm90(gemv._gemv_int8_kernel, args, constexprs, cfg.num_warps, ints)
    assert "dp4a.s32.s32" in ptx and "STACK:0 " in ptx, ptx[-300:]  # no register spills
    assert "griddepcontrol.wait" in ptx


def _quantize_x(type_name: str) -> None:
    from paphos.layers import x_int8
    from paphos.quant.gguf import planes

    fmt = planes.FORMATS[type_name]
    args = {"x_ptr": "*bf16", "q_ptr": "*i32", "f_ptr": "*fp32", "n_groups": "i32"}
    constexprs = dict(LO=fmt.lo, TW=fmt.tile_words, TB=x_int8.QUANTIZE_GROUPS, PDL=True)
    ptx = compile_sm90(x_int8._quantize_x_kernel, args, constexprs, 1, {"n_groups": 256})
    assert "STACK:0 " in ptx and "griddepcontrol.wait" in ptx


def _x_producer(kernel_name: str, type_name: str, block_xb: int = 0) -> None:
    """The norm and SiLU x mul kernels writing x's int8 parts for a GEMV of `type_name`, or (block_xb)
    for an int8 tensor-core GEMM reading blocks of that many values."""
    from paphos.layers import fused
    from paphos.quant.gguf import planes

    fmt = planes.FORMATS[type_name]
    quant = dict(QLO=0 if block_xb else fmt.lo, QTW=fmt.tile_words, BXB=block_xb, BSUM=block_xb or 1, PDL=True)
    parts = {"q_ptr": "*i32", "f_ptr": "*fp32", "order_ptr": "*i32", "bq_ptr": "*i8", "bdx_ptr": "*fp32",
             "bsum_ptr": "*i32", "n_rows": "i32"}  # fmt: skip
    if kernel_name == "add_rmsnorm":
        args = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16",
                **parts, "n_cols": "i32", "eps": "fp32", "stride_x": "i32", "stride_res": "i32", "stride_out": "i32"}
        ptx = compile_sm90(fused._add_rmsnorm_kernel, args, dict(HAS_RESIDUAL=True, BLOCK=4096, CHUNK=1024, **quant), 4,
                       dict(n_rows=16, n_cols=4096, stride_x=4096, stride_res=4096, stride_out=4096))
    else:
        args = {"x_ptr": "*bf16", "out_ptr": "*bf16", **parts, "n_cols": "i32", "stride_x": "i32", "stride_out": "i32"}
        ptx = compile_sm90(fused._silu_and_mul_kernel, args, dict(BLOCK=1024, **quant), 4,
                       dict(n_rows=16, n_cols=14336, stride_x=28672, stride_out=14336))
    assert "STACK:0 " in ptx and "griddepcontrol.wait" in ptx and "bar.sync" in ptx


def _float_gemv(type_name: str) -> None:
    from paphos.quant.gguf import planes
    from paphos.quant.gguf import triton_gemv as gemv

    fmt = planes.FORMATS[type_name]
    assert gemv.supports(fmt) and not gemv.integer_dots(fmt)
    args = {"x_ptr": "*bf16", "out_ptr": "*bf16", **_plane_args(fmt)}
    args |= {n: "i32" for n in ("N", "K", "stride_lo", "stride_hi", "stride_g", "stride_s", "hi_tile_stride")}
    constexprs = dict(LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink,
                      SCMIN_NIB=fmt.scmin_nib, TW=fmt.tile_words, BN=2, KC=64 * fmt.tile_values, EVEN_K=False,
                      PDL=True, TT=planes.ROW_TILE, TILE=planes.tile_values(type_name))  # fmt: skip
    assert "STACK:0 " in compile_sm90(gemv._gemv_kernel, args, constexprs, 2)


def _fused(type_name: str, block_m: int, x_type: str = "*bf16") -> None:
    """The fused kernel at `block_m` tokens a tile; Q6_K's tiles decode by its inline PTX
    (q6_k_tile.py, in the orientation this triton takes), which must not spill."""
    from paphos.quant.gguf import planes, q6_k_tile
    from paphos.quant.gguf import triton_gguf as tg

    fmt = planes.FORMATS[type_name]
    args = {"x_ptr": x_type, "out_ptr": "*fp32", **_plane_args(fmt, "*i8" if fmt.lo == 8 else "*i32"),
            "lut_ptr": "*fp32"}  # fmt: skip
    args |= {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_om", "iters_per_split")}
    decodes_q6_k = type_name == "Q6_K" and block_m > 1
    constexprs = dict(LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink, LUT=fmt.lut,
                      SCMIN_NIB=fmt.scmin_nib, BM=block_m, BN=32, BK=128, ATOMIC=True, DOT_F32=False,
                      Q6_K_TILE=decodes_q6_k, ASM=True, Q6_K_TRANSPOSED=q6_k_tile.TRANSPOSED,
                      TT=planes.ROW_TILE, TILE=planes.tile_values(type_name))  # fmt: skip
    sass = compile_sm90(tg._fused_kernel, args, constexprs, 4)
    assert sass and (not decodes_q6_k or "STACK:0 " in sass)


def _gather(type_name: str) -> None:
    from paphos.quant.gguf import planes
    from paphos.quant.gguf import triton_gguf as tg

    fmt = planes.FORMATS[type_name]
    args = {"out_ptr": "*bf16", "ids_ptr": "*i64", **_plane_args(fmt), "lut_ptr": "*fp32"}
    args |= {n: "i32" for n in ("T", "K", "stride_o")}
    constexprs = dict(LO=fmt.lo, HI=fmt.hi, OFF=fmt.off, SG=fmt.sg, SCALE=fmt.scale, MINK=fmt.mink, LUT=fmt.lut,
                      SCMIN_NIB=fmt.scmin_nib, BN=16, BK=256, TT=planes.ROW_TILE,
                      TILE=planes.tile_values(type_name))  # fmt: skip
    assert compile_sm90(tg._gather_kernel, args, constexprs, 4)


def _merge_producer(type_name: str, block_xb: int = 0) -> None:
    """The split-KV attention merge writing the o projection's int8 parts (128-wide heads, 8
    splits): GEMV parts of `type_name`, or GEMM blocks of block_xb values (two heads a program
    for 256)."""
    from paphos.attention import triton_attention as ta
    from paphos.quant.gguf import planes

    fmt = planes.FORMATS[type_name]
    args = {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "query_start_loc_ptr": "*i32",
            "q_ptr": "*i32", "f_ptr": "*fp32", "order_ptr": "*i32", "bq_ptr": "*i8", "bdx_ptr": "*fp32",
            "bsum_ptr": "*i32", "n_rows": "i32", "stride_ot": "i32", "stride_oh": "i32", "head_dim": "i32",
            "v_scale": "fp32"}  # fmt: skip
    constexprs = dict(BLOCK_D=128, NUM_SPLITS=8, MIXED=False, HEADS=max(1, block_xb // 128),
                      QLO=0 if block_xb else fmt.lo, QTW=fmt.tile_words, BXB=block_xb, BSUM=block_xb or 1, PDL=True)
    ptx = compile_sm90(ta._decode_reduce_kernel, args, constexprs, 4,
                       dict(n_rows=16, stride_ot=4096, stride_oh=128, head_dim=128))  # fmt: skip
    assert "STACK:0 " in ptx and "griddepcontrol.wait" in ptx and "bar.sync" in ptx


CASES = {
    # Llama-3-8B's attention output, gate|up and down projections
    **{f"int8-gemv-{t}-{n}x{k}": (_integer_gemv, t, n, k) for t in ("Q4_K", "Q6_K", "Q8_0", "Q4_1")
       for n, k in ((4096, 4096), (28672, 4096), (4096, 14336))},
    **{f"quantize-x-{t}": (_quantize_x, t) for t in ("Q4_K", "Q6_K", "Q8_0")},
    "norm-int8-x-Q4_K": (_x_producer, "add_rmsnorm", "Q4_K"), "silu-int8-x-Q8_0": (_x_producer, "silu", "Q8_0"),
    # the int8 tensor-core GEMMs' blocks: GGUF's 256 values, the integer family's 128
    "norm-int8-blocks-256": (_x_producer, "add_rmsnorm", "Q4_K", 256),
    "silu-int8-blocks-128": (_x_producer, "silu", "Q4_K", 128),
    "merge-int8-x-Q4_K": (_merge_producer, "Q4_K"), "merge-int8-blocks-128": (_merge_producer, "Q4_K", 128),
    "merge-int8-blocks-256": (_merge_producer, "Q4_K", 256),
    **{f"float-gemv-{t}": (_float_gemv, t) for t in ("Q5_K", "Q2_K")},
    "fused-Q4_K-m16": (_fused, "Q4_K", 16), "fused-Q3_K-m1": (_fused, "Q3_K", 1), "fused-IQ4_XS-m16": (_fused, "IQ4_XS", 16),
    "fused-Q6_K-m16-bf16": (_fused, "Q6_K", 16), "fused-Q6_K-m32-fp16": (_fused, "Q6_K", 32, "*fp16"),
    "fused-Q6_K-m64-bf16": (_fused, "Q6_K", 64),
    "gather-Q6_K": (_gather, "Q6_K"),
}  # fmt: skip


if __name__ == "__main__":
    run_compiles(CASES)
