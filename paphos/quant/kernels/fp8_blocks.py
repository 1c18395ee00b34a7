"""Block-wise FP8 weight scales (DeepSeek-V3 and Qwen3-FP8's `weight_block_size`, compressed-tensors'
`strategy: block`, llm-compressor's FP8_BLOCK): one fp32 scale per [rows, cols] block of the fp8
weight, activations scaled per token and run of `cols` values.

Data flow (a linear layer whose `paphos.quant.fp8.Fp8LinearMethod` has blocks the kernels take,
`block_kernel_unsupported`): x [M, K] in the model dtype -> `quantize_per_group` (x_fp8 [M, K] and
a scale per token and run, [M, ceil(K / cols)]) -> `fp8_block_linear`: one token through
`_gemv_blocks_kernel` (each block's exact products summed in fp32, the block sums scaled by the
row's block scale and the token's run scale), more through fp8.py's `_small_m_kernel` with BC > 0
(each K step's fp8 `wgmma` product scaled by its block's two scales as it is added; K steps never
cross a block), at every M (`torch._scaled_mm` takes no block scales here) -> y [M, N] in the
model dtype. The rounding, the GEMV's row load and store and the small-M launch are fp8.py's; the
torch reference is fp8.py's `reference_quantize_groups` / `fake_quantize(group=...)`.

Measured on an H200 (benchmarks/bench_fp8_gpu.py `blocks`, Llama-3-8B, 128 x 128 blocks, us for a
layer's four linears): 77.6 at one token (bf16 116.4, per-channel FP8 64.0), 93.7 at 16 (118.1,
76.3), 675.8 at 512 (318.6, 229.6): 1.50x bf16 at batch 1; at prefill sizes the small-M kernel's
64 x 64 tiles run at half of bf16's speed (benchmarks/README.md, "Block-wise FP8 on an H200").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paphos.layers import pdl
from paphos.quant.kernels import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None


if triton is not None:

    @triton.jit
    def _quantize_groups_kernel(
        x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm,
        G: tl.constexpr, GB: tl.constexpr, QMAX: tl.constexpr, SMIN: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """GB runs of G values of one row of x per program (row: grid axis 0): each run's scale
        (amax / 448) to s_ptr[row, run] and its fp8 codes to q_ptr[row, :], rounded as
        fp8.py's `_quantize_rows_kernel` rounds (`reference_quantize_groups` bit for bit)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        runs = tl.program_id(1) * GB + tl.arange(0, GB)
        kk = runs[:, None] * G + tl.arange(0, G)[None, :]
        ok = (kk < K) & (runs < n_groups)[:, None]
        x = tl.load(x_ptr + row * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)
        s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), QMAX), SMIN)
        q = fp8.to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -QMAX), QMAX))
        tl.store(q_ptr + row * K + kk, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * n_groups + runs, s, mask=runs < n_groups)

    @triton.jit
    def _gemv_blocks_kernel(
        q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, NB: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, RPP: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        """fp8.py's `_gemv_kernel` with block-wise scales: K as NB blocks of BC codes ([NB, BC] tiles, NB a
        power of two), each row's exact products summed per block, the block sums scaled by the
        row's block scale sw[row // BR, block] and the token's sx[block], then summed."""
        pdl.release(PDL)
        kb = tl.arange(0, NB)
        kk = kb[:, None] * BC + tl.arange(0, BC)[None, :]
        k_ok = kk < K
        n_kb = tl.cdiv(K, BC)
        kb_ok = kb < n_kb
        row = tl.program_id(0) * RPP
        w = fp8.gemv_row(w_ptr, row, N, stride_wn, kk, k_ok)
        pdl.wait(PDL)
        x = tl.load(q_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        sx = tl.load(sx_ptr + kb, mask=kb_ok, other=0.0)
        for r in tl.static_range(RPP):
            if r + 1 < RPP:
                w_next = fp8.gemv_row(w_ptr, row + 1, N, stride_wn, kk, k_ok)
            sw = tl.load(sw_ptr + (tl.minimum(row, N - 1) // BR) * n_kb + kb, mask=kb_ok, other=0.0)
            y = tl.sum(tl.sum(w.to(tl.float32) * x, axis=1) * sw * sx, axis=0)
            fp8.gemv_store(y, b_ptr, out_ptr, row, N, HAS_BIAS)
            if r + 1 < RPP:
                w = w_next
                row += 1


@dataclass(frozen=True)
class BlockScales:
    """Block-wise weight scales as `fp8_block_linear` takes them: `scales` fp32 [ceil(N / rows),
    ceil(K / cols)] (contiguous); activations are scaled per token and run of `cols` values."""

    scales: torch.Tensor
    rows: int
    cols: int


def block_kernel_unsupported(cols: int) -> str | None:
    """Why `fp8_block_linear` cannot take blocks `cols` inputs wide (None when it can): its tiles
    are powers of two of at least 32 codes (the fp8 MMA's K)."""
    if cols < 32 or cols & (cols - 1):
        return f"block-wise scales over {cols} inputs (the kernels take a power of two >= 32)"
    return None


def quantize_per_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K / group)] fp32), dynamic per token and run of
    `group` values: `triton_quantize_groups` on CUDA, else torch."""
    if x.is_cuda and triton is not None:
        return triton_quantize_groups(x, group)
    return fp8.reference_quantize_groups(x, group)


def triton_quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_quantize_groups_kernel` for x [M, K] (`group` a power of two; CPU tensors too under
    TRITON_INTERPRET=1): `reference_quantize_groups` bit for bit."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=fp8.FP8_DTYPE, device=x.device)
    scale = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m:
        runs = max(1, min(triton.next_power_of_2(n_groups), 2048 // group))  # ~2048 values a program
        _quantize_groups_kernel[(m, triton.cdiv(n_groups, runs))](
            x, q, scale, k, n_groups, x.stride(0), G=group, GB=runs, QMAX=fp8.FP8_MAX, SMIN=fp8.MIN_SCALE,
            num_warps=max(1, min(8, runs * group // 512)), **pdl.options(x),
        )  # fmt: skip
    return q, scale


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    blocks: BlockScales,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    cfg: fp8.SmallMConfig = fp8.DEFAULT_SMALL_M,
    gemv: fp8.GemvConfig = fp8.DEFAULT_GEMV,
) -> torch.Tensor:
    """y = x W^T (+ bias) with W = weight [N, K] float8_e4m3fn times its block's scale and x
    quantized per token and run of blocks.cols values (`quantize_per_group`). One token:
    `_gemv_blocks_kernel` (launched as `gemv` says); more (launched as `cfg` says): fp8.py's `_small_m_kernel` with the block scales applied per K step, at
    every M (`_scaled_mm` takes no block scales here). CUDA with fp8 tensor cores
    (`fp8.scaled_mm_unsupported` and `block_kernel_unsupported` return None), or CPU tensors under
    TRITON_INTERPRET=1; no host sync (CUDA-graph safe)."""
    flat = x.reshape(-1, x.shape[-1])
    q, sx = quantize_per_group(flat, blocks.cols)
    m, k = q.shape
    n = weight.shape[0]
    if m == 1 and k <= fp8.GEMV_MAX_K:
        y = torch.empty((1, n), dtype=out_dtype, device=x.device)
        _gemv_blocks_kernel[(triton.cdiv(n, gemv.rows_per_program),)](
            q, sx, weight, blocks.scales, blocks.scales if bias is None else bias, y, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, NB=triton.next_power_of_2(triton.cdiv(k, blocks.cols)), BR=blocks.rows,
            BC=blocks.cols, RPP=gemv.rows_per_program, num_warps=gemv.num_warps, **pdl.options(x),
        )  # fmt: skip
    else:
        y = fp8.launch_small_m(q, sx, weight, blocks.scales, out_dtype, bias, cfg, (blocks.rows, blocks.cols))
    return y.reshape(*x.shape[:-1], n)
