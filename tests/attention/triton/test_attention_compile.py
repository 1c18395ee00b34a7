"""The paged-attention kernels compile for sm_90 (H100/H200) on this machine, no GPU needed, and an
fp8 cache under bf16 queries widens to fp16 in one conversion per pair of values: through bf16
it took a second, per-value conversion (F2F, 16 a cycle per multiprocessor), slower than the
bytes the fp8 cache saves; and the decode kernel never reads an fp8 V tile from shared memory one
byte at a time (it did, 128 loads a thread per tile, until `widen_v`: 2150 -> 2560 GB/s on an
H100). The compiles run in a child process without TRITON_INTERPRET, once
with the installed triton and once with the H200 image's (tests/device_triton.py)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.device_triton import TRITON_IDS, TRITONS, check_compiles_in_child, compile_sm90, run_compiles


@pytest.mark.parametrize("triton_path", TRITONS, ids=TRITON_IDS)
def test_attention_kernels_compile_for_sm90(triton_path: Path | None) -> None:
    check_compiles_in_child("tests.attention.triton.test_attention_compile", CASES, triton_path)


_CACHE = {"bf16": "*bf16", "fp8": "*fp8e4nv"}
_STRIDES = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ckv", "stride_cs", "stride_ch",
            "stride_bt", "head_dim")  # fmt: skip
_SCALARS = {"q_prescale": "fp32", "qk_scale": "fp32", "v_scale": "fp32", "soft_cap": "fp32",
            "sliding_window": "i32"}  # fmt: skip
# Llama-3-8B heads in a block-16 cache [blocks, 2, 16, 8, 128]
_INTS = dict(stride_qt=4096, stride_qh=128, stride_ot=4096, stride_oh=128, stride_cb=32768, stride_ckv=16384,
             stride_cs=1024, stride_ch=128, stride_bt=256, head_dim=128)  # fmt: skip


def _check_conversions(ptx: str, cache: str) -> None:
    assert "cvt.bf16.f16" not in ptx  # the per-value F2F of fp8 -> fp16 -> bf16
    if cache == "fp8":
        assert "cvt.rn.f16x2.e4m3x2" in ptx


def _decode(cache: str) -> None:
    from paphos.attention import triton_attention as ta

    args = {"q_ptr": "*bf16", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
            "cache_ptr": _CACHE[cache], "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32", **{name: "i32" for name in _STRIDES}, **_SCALARS}  # fmt: skip
    cfg = ta.default_decode_config(128, _Cuda(), _dtype(cache))
    dot = ta.DOT_FP16 if cache == "fp8" else ta.DOT_AS_IS
    constexprs = dict(GROUP=4, BLOCK_G=16, BLOCK_D=128, BLOCK_N=cfg.block_n, BLOCK_SIZE=16, NUM_SPLITS=4, MIXED=False,
                      USE_WINDOW=False, USE_SOFTCAP=False, DOT=dot, PDL=True)  # fmt: skip
    ptx = compile_sm90(ta._decode_split_kernel, args, constexprs, cfg.num_warps, _INTS, cfg.num_stages)
    assert "STACK:0 " in ptx, ptx[-300:]  # no register spills
    _check_conversions(ptx, cache)
    assert "ld.shared.b8" not in ptx  # V's bytes gathered along the tokens for the dot's operand


def _prefill(cache: str) -> None:
    from paphos.attention import triton_attention as ta
    from paphos.attention import triton_prefill as tp

    args = {"q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": _CACHE[cache], "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "num_seqs": "i32",
            **{name: "i32" for name in _STRIDES}, **_SCALARS}  # fmt: skip
    tp._num_sms = lambda device: 132  # an H100 / H200, as the config rule would query it
    cfg = tp.default_prefill_config(128, _Cuda(), num_tiles_at_128=4096)  # a 4 x 4096 prefill's tiles
    dot = ta.DOT_FP16 if cache == "fp8" else ta.DOT_AS_IS
    constexprs = dict(GROUP=4, BLOCK_G=4, BLOCK_Q=cfg.block_m // 4, BLOCK_D=128, BLOCK_N=cfg.block_n, BLOCK_SIZE=16,
                      SKIP_DECODE=True, USE_WINDOW=False, USE_SOFTCAP=False, DOT=dot)  # fmt: skip
    ints = _INTS | {"num_seqs": 4}
    ptx = compile_sm90(tp._prefill_kernel, args, constexprs, cfg.num_warps, ints, cfg.num_stages)
    print(re.search(r"REG:\d+ STACK:\d+", ptx).group(0), file=sys.stderr)  # 128 x 32 tiles spill a little
    _check_conversions(ptx, cache)


class _Cuda:
    """Stands in for a CUDA device where the configs only look at the type."""

    type = "cuda"


def _dtype(cache: str) -> object:
    import torch

    return torch.float8_e4m3fn if cache == "fp8" else torch.bfloat16


CASES = {f"{kernel.__name__[1:]}-{cache}": (kernel, cache) for kernel in (_decode, _prefill)
         for cache in _CACHE}  # fmt: skip


if __name__ == "__main__":
    run_compiles(CASES)
