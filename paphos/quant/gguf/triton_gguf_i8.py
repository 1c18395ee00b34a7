"""GGUF's int8 tensor-core GEMM for batched decode (2 to I8_MAX_TOKENS tokens a step) on Q4_K's
repacked planes (planes.py), most of the bytes of a Q4_K_M file; the other types keep
triton_gguf's fused kernel.

Data flow: `triton_gguf.matmul` calls `matmul_into(out, quantize_x(x), seg)` for each Q4_K
segment of a linear (`supports`); two launches per linear:
  1. paphos/quant/kernels/x_blocks.py: x -> two int8 parts per value, x = dx (q1 + q2 / 254)
     with one dx per token and super-block of XB = 256 values, in the order the kernel
     multiplies the plane's codes (`stream_order`), with the integer sum per 32 values.
  2. `_gemm_kernel`: out^T = W x^T, BN weight rows x BM tokens a program (both x parts side by
     side: N = 2 BM columns). Per 32-value sub-block (16 bytes a row): low nibbles (AND) and
     high nibbles (shift, AND) joined into one K=32 int8 operand, one dot (mma.sync or wgmma
     s8), then in int32, exactly: acc += D * sc and mins += mn * sum(x) (6-bit scale and min);
     per super-block float32 acc += (d acc - dmin mins) dx / 254, the parts summed at the end.
     Split-K through split_k.store_tile as the integer family's kernels.
So the only roundings are x's quantization (about 15 bits) and float32 sums; K must be a
multiple of 256.

Measured on an H100 (benchmarks/bench_gguf_gpu.py `i8`, 16 tokens, the Q4_K shapes of a
Llama-3-8B Q4_K_M layer, CUDA-graph replays, weights from memory, x's launch included): q|k
31.2 us (fused kernel 37.5), o 24.1 (30.8), gate|up 119.1 (178.3), down 57.6 (88.0). cuBLAS in
bf16 takes 16.7 / 16.5 / 83.5 / 45.3: a dot and its scale per 32 values leaves the kernel
issue-bound at 19-20 % of copy bandwidth (the integer family's per-128 scales reach 58 %,
triton_int_i8.py). Q8_0 and Q6_K (16-value groups: a zero-padded K=32 dot each) were measured
on the same path and lost to the fused kernel (Q8_0 layer 178 against 170 us, Q6_K down 112
against 80), so they stay there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from paphos.layers import pdl
from paphos.quant.kernels import x_blocks

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
    from paphos.quant.kernels.triton_int_i8 import nibbles_i8
except ImportError:  # CPU-only installs: the torch reference (planes.reference_matmul) serves
    triton = None

XB = 256  # K values per x block: one dx per token and block, the kernel's K step
SUM_EVERY = 32  # values per integer sum of x (a sub-block)
# Up to this many tokens a step the int8 path runs (above: the fused kernel, then cuBLAS): one
# 16-token tile (with 32 tokens a tile ptxas spills the three accumulators; two tiles would
# unpack every code twice)
I8_MAX_TOKENS = 16


def supports(type_name: str, k: int) -> bool:
    return type_name == "Q4_K" and k % XB == 0


def stream_order() -> torch.Tensor:
    """[XB] int64: position j of a quantized x block holds value stream_order()[j] of the block,
    the order of the codes in the kernel's operands: per 32-value sub-block (16 bytes, a tile
    group of T = 4 words; code p of word w is value p * 4 + w, planes.py) the joined operand holds
    byte i's low nibble (code 2 (i % 4) of word i // 4) at 2i and its high nibble at 2i + 1."""
    j = torch.arange(XB)
    byte, high = j % 32 // 2, j % 2
    return j // 32 * 32 + (2 * (byte % 4) + high) * 4 + byte // 4


# ---------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _row_scalar(ptr, rows, row_ok, per_row, at):
        return tl.load(ptr + rows.to(tl.int64) * per_row + at, mask=row_ok, other=0)

    @triton.jit
    def _gemm_kernel(
        q_ptr, dx_ptr, sum_ptr, out_ptr, part_ptr, count_ptr, w_ptr, sc_ptr, sd_ptr, mn_ptr, smin_ptr,
        M, N, K, stride_om, iters_per_split,
        BN: tl.constexpr, BM: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """out [M, N] = x W^T for BN rows and BM tokens per program, super-blocks it0 .. it1 of K
        per program along grid axis 2 (module docstring). w_ptr: the code plane as bytes."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_n * BN + tl.arange(0, BN)
        row_ok = rows < N
        ms = pid_m * BM + tl.arange(0, BM)
        m_ok = ms < M
        # column j of the x operand: part j // BM of token pid_m * BM + j % BM
        cols = tl.arange(0, 2 * BM)
        first = cols < BM
        tok = pid_m * BM + cols % BM
        tok_ok = tok < M
        n_blocks = K // 256
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, n_blocks)
        x_cols = q_ptr + (tl.where(first, 0, M) + tok).to(tl.int64)[None, :] * K + tl.arange(0, 32)[:, None]
        x_ok = tok_ok[None, :]
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * (K // 2) + tl.arange(0, 16)[None, :]
        part_w = tl.where(first, 1.0, 1.0 / 254.0)  # 254 * (codes . q1) + codes . q2, over 254
        acc = tl.zeros((BN, 2 * BM), dtype=tl.float32)
        for it in range(it0, it1):
            blk = tl.zeros((BN, 2 * BM), dtype=tl.int32)
            mins = tl.zeros((BN, 2 * BM), dtype=tl.int32)
            sums = sum_ptr + tok * (K // 32) + it * 8
            for s in tl.static_range(8):
                lo, hi = nibbles_i8(tl.load(w_rows + it * 128 + 16 * s, mask=row_ok[:, None], other=0), ASM)
                a = tl.reshape(tl.join(lo, hi), (BN, 32))
                d = tl.dot(a, tl.load(x_cols + it * 256 + 32 * s, mask=x_ok, other=0), out_dtype=tl.int32)
                sc = _row_scalar(sc_ptr, rows, row_ok, K // 32, it * 8 + s).to(tl.int32)
                mn = _row_scalar(mn_ptr, rows, row_ok, K // 32, it * 8 + s).to(tl.int32)
                blk += d * sc[:, None]
                mins += mn[:, None] * tl.load(sums + s, mask=tok_ok & first, other=0)[None, :]
            dd = _row_scalar(sd_ptr, rows, row_ok, n_blocks, it).to(tl.float32)
            dm = _row_scalar(smin_ptr, rows, row_ok, n_blocks, it).to(tl.float32) * (1.0 / 254.0)
            dx = tl.load(dx_ptr + tok * n_blocks + it, mask=tok_ok, other=0.0) * part_w
            acc += (blk.to(tl.float32) * dd[:, None] - mins.to(tl.float32) * dm[:, None]) * dx[None, :]
        acc = tl.sum(tl.reshape(tl.permute(tl.reshape(acc, (BN, 2, BM)), (0, 2, 1)), (BN, BM, 2)), axis=2)
        split_k.store_tile(acc, out_ptr, part_ptr, count_ptr, rows, row_ok, ms, m_ok, M, N, stride_om,
                           pid_n * tl.num_programs(0) + pid_m, pid_k, tl.num_programs(2), SPLIT, ASM)  # fmt: skip


# ---------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class GGUFI8Config:
    """`_gemm_kernel`'s launch: weight rows and tokens per program, K slices, warps, stages."""

    block_n: int = 64
    block_m: int = 16
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# (N, K, tokens per program) -> a launch measured better than `i8_config`'s, filled by
# benchmarks/bench_gguf_gpu.py's `i8` sweep (the engine sections after it use them)
TUNED_CONFIGS: dict[tuple[int, int, int], GGUFI8Config] = {}


def i8_config(
    rows: int, k: int, m: int, programs_per_sm: int | None = None, block_n: int | None = None, num_warps: int = 4
) -> GGUFI8Config:
    """The launch at M tokens (16 per program), by the rule the H100 sweep's winners follow (module docstring's shapes): 32 rows and 2 warps
    (mma.sync) where a layer has 160 such row tiles or more (q|k, gate|up), K split towards 8
    programs per multiprocessor; else 64 rows and 4 warps (wgmma), towards 2 (o, down). K is split
    while each slice keeps two super-blocks or more; `programs_per_sm`, `block_n` and `num_warps`
    override the rule. A per-shape entry of TUNED_CONFIGS wins. (sm_90 compiles: 128 rows spill
    with 4 warps at 16 tokens and with 8 warps at 32.)"""
    bm = 16
    tuned = TUNED_CONFIGS.get((rows, k, bm))
    if tuned is not None and programs_per_sm is None and block_n is None:
        return tuned
    if block_n is None:
        block_n, num_warps = (32, 2) if rows >= 160 * 32 else (64, 4)
    per_sm = programs_per_sm or (8 if block_n == 32 else 2)
    tiles = math.ceil(rows / block_n) * math.ceil(m / bm)
    blocks, split = k // XB, 1
    while blocks // (split * 2) >= 2 and tiles * split * 2 <= per_sm * split_k.NUM_SMS_GUESS:
        split *= 2
    return GGUFI8Config(block_n, bm, split, num_warps)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> the (parts, dx, sums) `_gemm_kernel` reads."""
    return x_blocks.quantize(x, x_blocks.device_order(stream_order(), x.device), XB, SUM_EVERY)


def matmul_into(
    out: torch.Tensor, xq: tuple[torch.Tensor, torch.Tensor, torch.Tensor], seg: object,
    cfg: GGUFI8Config | None = None,
) -> None:  # fmt: skip
    """out [M, seg.rows] (a column slice of the linear's output, unit stride on rows) = x W^T of
    one Q4_K segment (triton_gguf.Segment), from `quantize_x`; `cfg` overrides `i8_config`."""
    parts, dx, sums = xq
    m, k = out.shape[0], seg.k
    n = seg.rows
    cfg = cfg or i8_config(n, k, m)
    n_blocks = k // XB
    per_split = math.ceil(n_blocks / max(1, cfg.split_k))
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), math.ceil(n_blocks / per_split))
    split = grid[2] > 1 and grid[0] * grid[1] <= split_k.COUNTERS and grid[2] * m * n < 1 << 31
    if not split:
        per_split, grid = n_blocks, (grid[0], grid[1], 1)
    partials = torch.empty(grid[2] if split else 1, m, n, dtype=torch.float32, device=out.device)
    counters = split_k.counters(out.device) if split else partials
    p = seg.planes
    _gemm_kernel[grid](
        parts, dx, sums, out, partials, counters, p["lo"].view(torch.uint8), p["sc"], p["sd"], p["mn"], p["smin"],
        m, n, k, out.stride(0), per_split, BN=cfg.block_n, BM=cfg.block_m, SPLIT=split, ASM=out.is_cuda,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.options(out),
    )  # fmt: skip
