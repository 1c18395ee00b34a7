"""Block-wise FP8 weight scales (DeepSeek-V3 and Qwen3-FP8's `weight_block_size`, compressed-tensors'
`strategy: block`, llm-compressor's FP8_BLOCK): one fp32 scale per [rows, cols] block of the fp8
weight, activations scaled per token and run of `cols` values.

Data flow (a linear layer whose `paphos.quant.fp8.Fp8LinearMethod` has blocks the kernels take,
`block_kernel_unsupported`): x [M, K] in the model dtype -> `quantize_per_group` (x_fp8 [M, K] and
a scale per token and run, [M, ceil(K / cols)]) -> `fp8_block_linear`: one token through
`_gemv_blocks_kernel` (each block's exact products summed in fp32, the block sums scaled by the
row's block scale and the token's run scale), up to fp8.SMALL_M_MAX tokens through fp8.py's
`_small_m_kernel` with BC > 0 (each K step's fp8 `wgmma` product scaled by its block's two scales
as it is added; K steps never cross a block), more through cuBLAS's block-scaled
`torch._scaled_mm` (1 x 128 activation runs, 128 x 128 weight blocks; Hopper, `BlockScales.cublas`)
or, where cuBLAS cannot take the layer, the small-M kernel again -> y [M, N] in the model dtype.
The rounding, the GEMV's row load and store and the small-M launch are fp8.py's; the torch
reference is fp8.py's `reference_quantize_groups` / `fake_quantize(group=...)`.

Measured on an H200 (benchmarks/bench_fp8_gpu.py `blocks`, Llama-3-8B, 128 x 128 blocks, us for a
layer's four linears; benchmarks/README.md, "Block-wise FP8 at prefill sizes: cuBLAS"): 77.6 at one
token (bf16 116.4, per-channel FP8 64.0) and 70 with the long rows' GEMV one row a program; at 512
tokens cuBLAS 222 against bf16's 297 and the small-M kernel's 673.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

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
        x_ptr, q_ptr, s_ptr, K, n_groups, stride_xm, stride_sm, stride_sg,
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
        q = fp8.clamped_codes(x, s[:, None], QMAX, False)
        tl.store(q_ptr + row * K + kk, q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + row * stride_sm + runs * stride_sg, s, mask=runs < n_groups)

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
    ceil(K / cols)] (contiguous); activations are scaled per token and run of `cols` values.
    `cublas`: above fp8.SMALL_M_MAX tokens cuBLAS multiplies (`cublas_blocks_unsupported` said
    it can)."""

    scales: torch.Tensor
    rows: int
    cols: int
    cublas: bool = False


# Rows longer than this take the GEMV one row a program (the whole row's blocks in registers):
# measured on an H200, the down projection (K = 14336) 19.8 us against 27.7 at two rows.
GEMV_LONG_K = 8192
GEMV_LONG_ROWS = fp8.GemvConfig(rows_per_program=1)
# Up to fp8.SMALL_M_MAX tokens: the per-channel launch (its K steps cut to a block's width), K
# split towards 4 programs a multiprocessor (on an H200 a Llama-3-8B layer 5 % faster than 2 at 4
# and 16 tokens).
SMALL_M = fp8.SmallMConfig(programs_per_sm=4)
CUBLAS_BLOCK = 128  # cuBLAS scales 1 x 128 activation runs and 128 x 128 weight blocks


def cublas_blocks_unsupported(
    device: torch.device, out_dtype: torch.dtype, rows: int, cols: int, n: int, k: int
) -> str | None:
    """Why cuBLAS's block-scaled `torch._scaled_mm` cannot run an [N, K] weight in rows x cols
    blocks here (None when it can): 128 x 128 blocks, compute capability 9.x (cuBLAS >= 12.9),
    N and K multiples of 16 and whole groups of four K blocks (the scale layout cuBLAS reads),
    and one small product checked once per device and dtype."""
    if (rows, cols) != (CUBLAS_BLOCK, CUBLAS_BLOCK):
        return f"cuBLAS takes 128 x 128 blocks, not {rows} x {cols}"
    if device.type != "cuda":
        return f"no cuBLAS on {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability[0] != 9:
        return f"cuBLAS's block-wise FP8 scaling runs on compute capability 9.x, not {capability[0]}.{capability[1]}"
    if n % 16 or k % 16 or -(-k // CUBLAS_BLOCK) % 4:
        return f"a {n} x {k} layer (cuBLAS needs N and K multiples of 16 and K's 128-wide blocks in fours)"
    return _probe_cublas(device.index if device.index is not None else torch.cuda.current_device(), out_dtype)


@cache
def _probe_cublas(device_index: int, out_dtype: torch.dtype) -> str | None:
    """One block-scaled product with a different scale per block against its known result: torch
    and cuBLAS versions differ in whether (and how) they take block scales."""
    device = torch.device("cuda", device_index)
    m, n, k = 32, 256, 512
    x = torch.ones(m, k, device=device).to(fp8.FP8_DTYPE)
    weight = torch.ones(n, k, device=device).to(fp8.FP8_DTYPE)
    runs = (torch.arange(k // CUBLAS_BLOCK, device=device, dtype=torch.float32) + 1) / 4
    x_scales = runs.expand(m, -1).t().contiguous().t()  # one scale per token and run, by column
    w_scales = (torch.arange(n // CUBLAS_BLOCK, device=device, dtype=torch.float32) + 1)[:, None].expand(-1, k // CUBLAS_BLOCK)
    want = (CUBLAS_BLOCK * runs.sum() * w_scales[:, 0]).repeat_interleave(CUBLAS_BLOCK).expand(m, -1)
    try:
        y = torch._scaled_mm(x, weight.t(), scale_a=x_scales, scale_b=w_scales.contiguous().t(), out_dtype=out_dtype)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
        return f"torch._scaled_mm refuses block-wise scales with {out_dtype} output ({e})"
    if not torch.equal(y.float(), want):
        return "torch._scaled_mm gave wrong results with block-wise scales in its start-up check"
    return None


def block_kernel_unsupported(cols: int) -> str | None:
    """Why `fp8_block_linear` cannot take blocks `cols` inputs wide (None when it can): its tiles
    are powers of two of at least 32 codes (the fp8 MMA's K)."""
    if cols < 32 or cols & (cols - 1):
        return f"block-wise scales over {cols} inputs (the kernels take a power of two >= 32)"
    return None


def quantize_per_group(
    x: torch.Tensor, group: int, scales_by_column: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K / group)] fp32), dynamic per token and run of
    `group` values: `triton_quantize_groups` on CUDA, else torch. `scales_by_column`: the scale
    stored column by column (strides (1, M)), as cuBLAS reads it."""
    if x.is_cuda and triton is not None:
        return triton_quantize_groups(x, group, scales_by_column)
    q, scale = fp8.reference_quantize_groups(x, group)
    return q, scale.t().contiguous().t() if scales_by_column else scale


def triton_quantize_groups(
    x: torch.Tensor, group: int, scales_by_column: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_quantize_groups_kernel` for x [M, K] (`group` a power of two; CPU tensors too under
    TRITON_INTERPRET=1): `reference_quantize_groups` bit for bit, the scale's layout as
    `quantize_per_group` says."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n_groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=fp8.FP8_DTYPE, device=x.device)
    if scales_by_column:
        scale = torch.empty((n_groups, m), dtype=torch.float32, device=x.device).t()
    else:
        scale = torch.empty((m, n_groups), dtype=torch.float32, device=x.device)
    if m:
        runs = max(1, min(triton.next_power_of_2(n_groups), 2048 // group))  # ~2048 values a program
        _quantize_groups_kernel[(m, triton.cdiv(n_groups, runs))](
            x, q, scale, k, n_groups, x.stride(0), scale.stride(0), scale.stride(1), G=group, GB=runs, QMAX=fp8.FP8_MAX, SMIN=fp8.MIN_SCALE,
            num_warps=max(1, min(8, runs * group // 512)), **pdl.options(x),
        )  # fmt: skip
    return q, scale


def fp8_block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    blocks: BlockScales,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    cfg: fp8.SmallMConfig = SMALL_M,
    gemv: fp8.GemvConfig | None = None,
) -> torch.Tensor:
    """y = x W^T (+ bias) with W = weight [N, K] float8_e4m3fn times its block's scale and x
    quantized per token and run of blocks.cols values (`quantize_per_group`). One token:
    `_gemv_blocks_kernel` (launched as `gemv` says, or by the rows' length); up to fp8.SMALL_M_MAX
    tokens, and above where `blocks.cublas` is False: fp8.py's `_small_m_kernel` with the block
    scales applied per K step (launched as `cfg` says); above with `blocks.cublas`: cuBLAS's
    block-scaled `torch._scaled_mm`. CUDA with fp8 tensor cores (`fp8.scaled_mm_unsupported` and
    `block_kernel_unsupported` return None), or CPU tensors under TRITON_INTERPRET=1; no host
    sync (CUDA-graph safe)."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    n = weight.shape[0]
    if blocks.cublas and m > fp8.SMALL_M_MAX:
        q, sx = quantize_per_group(flat, blocks.cols, scales_by_column=True)
        # _scaled_mm takes W^T column-major and its scales [K blocks, N blocks] column-major too:
        # the transposes of the row-major weight and scales, no copies.
        y = torch._scaled_mm(q, weight.t(), scale_a=sx, scale_b=blocks.scales.t(), out_dtype=out_dtype)
        if bias is not None:
            y += bias
        return y.reshape(*x.shape[:-1], n)
    q, sx = quantize_per_group(flat, blocks.cols)
    if m == 1 and k <= fp8.GEMV_MAX_K:
        gemv = gemv or (GEMV_LONG_ROWS if k > GEMV_LONG_K else fp8.DEFAULT_GEMV)
        y = torch.empty((1, n), dtype=out_dtype, device=x.device)
        _gemv_blocks_kernel[(triton.cdiv(n, gemv.rows_per_program),)](
            q, sx, weight, blocks.scales, blocks.scales if bias is None else bias, y, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, NB=triton.next_power_of_2(triton.cdiv(k, blocks.cols)), BR=blocks.rows,
            BC=blocks.cols, RPP=gemv.rows_per_program, num_warps=gemv.num_warps, **pdl.options(x),
        )  # fmt: skip
    else:
        y = fp8.launch_small_m(q, sx, weight, blocks.scales, out_dtype, bias, cfg, (blocks.rows, blocks.cols))
    return y.reshape(*x.shape[:-1], n)
