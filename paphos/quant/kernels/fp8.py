"""FP8 (e4m3) weights: activation quantization, the GEMMs, and their torch reference.

Data flow (a linear layer whose method is `paphos.quant.fp8.Fp8LinearMethod`): x [M, K] in the
model dtype -> `quantize_per_token` (dynamic: one scale per row, amax / 448) or
`quantize_per_tensor` (static: the checkpoint's `input_scale`) -> x_fp8 [M, K] + a per-row fp32
scale [M, 1] -> y[m, n] = s_x[m] * s_w[n] * sum_k x_fp8[m, k] w_fp8[n, k] against the fp8 weight
[N, K] with its per-output-channel fp32 scale [N] -> y [M, N] in the model dtype. `fp8_linear`
picks the GEMM by M (fixed per captured CUDA graph, so is the path): one token (batch-1 decode)
`_gemv_kernel`, a CUDA-core GEMV (codes widened to fp32, products exact, fp32 sums); up to
SMALL_M_MAX tokens (decode) `_small_m_kernel`, a Triton tensor-core kernel with the weight as the
MMA's large side; above, `torch._scaled_mm` (row-wise scaling, fp32 accumulation by cuBLAS on
Hopper, CUTLASS on Ada). `scaled_mm_unsupported` says, once per layer at load, whether these run
here; where they do not (CPU, GPUs before compute capability 8.9, N or K not multiples of 16) the
method dequantizes the weight at load and keeps the activation rounding with `fake_quantize`.

Block-wise weight scales are fp8_blocks.py's; they share `_small_m_kernel` (BC > 0), the GEMV's
row load and store and the rounding with this module.

The activation math is the references' (llm-compressor / compressed-tensors `FP8_DYNAMIC` and
static `FP8`, see quant-toolchain.md §3): s = amax|x| / 448 per row (clamped to float32 eps, as
compressed-tensors does, which only matters for all-zero or near-zero rows), x_fp8 =
fp8(clamp(x / s, -448, 448)) with torch's round-to-nearest-even cast. The Triton quantization
kernel reads x once and reproduces that bit for bit (IEEE division, the same rounding), so the
GPU paths differ from `reference_fp8_linear` only by the GEMM's summation and the output
rounding (float32 output, K = 4096, M = 16, max |error| / max |reference|: 4.5e-5 for
`_small_m_kernel`'s fp8 MMA, 1.4e-4 for `_scaled_mm`; the GEMV's fp32 sums 1e-7 or less).

Measured on the H200 (benchmarks/bench_fp8_gpu.py: Llama-3-8B shapes, CUDA-graph replay with
programmatic dependent launch, weights read from memory, not L2; copy bandwidth 4.2 TB/s). At
M = 1, us per call, bf16 F.linear / quantize + _scaled_mm / `small_m_linear` (quantize +
`_small_m_kernel`, K split by `split_for`; its bytes per second over copy bandwidth): q|k|v
16.2 / 20.6 / 12.8 (0.47), o 13.4 / 17.2 / 10.0 (0.40), gate|up 57.3 / 48.5 / 32.1 (0.87), down
32.1 / 49.7 / 23.0 (0.61): a decoder layer's four linears 1.53x bf16 (1.33x before the split:
o 11.6, down 33.7 us), 1.46-1.58x at M = 2-16, 1.45x at 32 (_scaled_mm 0.85-0.98x up to 32).
At M = 64 _scaled_mm is ahead (1.04x bf16 against 0.93x); at 256 it runs 0.94-1.47x bf16 per
shape.

At M = 1 the small-M kernel left q|k|v and o (17-25 MB) at 0.40-0.47 of copy bandwidth: a
kernel's ramp, first loads and split-K epilogue weigh on so little work. The GEMV that replaced it
there (2026-12-06) streams each row whole: a program takes 2 rows, one at a time, over all of K
(4 warps: 32 codes a thread at K = 4096, 128 at 14336, no spills), the next row's 16-byte loads
issued before this row's sum and the first row's before `pdl.wait`; no split, no tensor cores.
H100 (copy bandwidth 2.93 TB/s), M = 1, us per call, bf16 / `small_m_linear` (with its quantize
launch) / the GEMV (x already quantized; its fraction of copy bandwidth): q|k|v 20.1 / 15.5 / 9.0
(0.95), o 16.0 / 11.6 / 6.8 (0.84), gate|up 77.6 / 42.8 / 38.4 (1.04: reads only), down 43.0 /
29.2 / 21.3 (0.94); quantize launches 1.8 us at K = 4096, 4.9 at 14336 (then one program a row:
`triton_quantize` slices decode rows since). A layer: 99.1 us -> 75.5 + 10.4 (1.58x -> 1.82x
bf16's 156.7). H200 (bench_fp8_gpu.py `sweep`, quantize included): the small-M kernel 13.1 /
9.9 / 31.9 / 22.9 us, `fp8_linear` now 9.3 / 8.0 / 30.3 / 21.8, bf16 15.9 / 13.5 / 61.2 / 31.3:
a layer 1.57x -> 1.76x bf16. In the engine (bench_quant_gpu.py `-q fp8`): on that H100 batch 1
252.5 -> 279.5 tok/s (1.67x bf16's 167.4), batch 16-64 unchanged, and 291.5 (1.74x) once x's
quantization was sliced (`triton_quantize`); on an H200 340.1 tok/s before the slices, 1.55x
bf16's 220.1 there (not profiled: at 4.1 TB/s the weights take 1.95 of the 2.94 ms step, so the
step's other kernels, the 128 quantize launches among them, weigh more). Earlier, a CUDA-core
GEMV with several rows per step and K in blocks spilled registers (0.20-0.38 of copy bandwidth);
the sweep (rows per program 1-8, 1-2 rows a step, 4-16 warps) found 2 rows, one a step, on 4
warps within 2 % of each shape's best over the layer.

Also measured and dropped: the norms and SiLU x mul writing x's codes in their own kernels (96
launches fewer: 305 tok/s at batch 1 against 311 before, with the small-M kernel); the
quantization as the small-M kernel's prologue (each program takes the amax of the whole row and
rounds its own K slice; 1.0-1.4x slower at M = 1, up to 7.5x at M = 64: the amax and the IEEE
divisions repeat in every program), L2 prefetches of the weights before `pdl.wait` or a few K
steps ahead (0-25 % slower), K split towards 4 programs per SM (up to 1.27x slower), 32-row
tiles (Triton widens fp8 to fp16 for mma.sync there: 1.24-1.30x slower at M = 1) and fp16
operands at 64 rows (1.1-2.6x slower). One row of x quantized over several programs made no
difference then (an engine run, beside the small-M kernel); timed alone it saves 0.5 us at K =
4096 and 3.1 at 14336, and `triton_quantize` does it at decode sizes since.
`use_fast_accum` stays off: at M = 1 it gave 5e-2 relative error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import cache

import torch
import torch.nn.functional as F

from paphos.layers import pdl

try:
    import triton
    import triton.language as tl

    from paphos.quant.kernels import split_k
except ImportError:  # CPU-only installs: quantization runs in torch
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = torch.finfo(torch.float32).eps
# Rows up to this many values are quantized from registers in one read; longer rows take a
# second read for the quantization pass (served from L2).
_SINGLE_BLOCK_MAX = 16384


def reference_quantize(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference: x [M, K] -> (x_fp8 [M, K], scale [M, 1] fp32); dynamic per row when
    `input_scale` is None, else the static per-tensor scale broadcast to every row. Also the
    per-output-channel quantization of a float weight (`-q fp8`), rows being channels."""
    xf = x.float()
    if input_scale is None:
        scale = row_scales(xf)
    else:  # one scale for every row, or (a row-parallel rank's dynamic scales) one per row
        scale = input_scale.float().reshape(-1, 1).expand(xf.shape[0], 1).contiguous()
    return quantize_rows(xf, scale), scale


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """The per-row scale [M, 1] fp32 of `reference_quantize`: amax / 448."""
    return amax_scales(x.float().abs().amax(dim=-1, keepdim=True))


def amax_scales(amax: torch.Tensor) -> torch.Tensor:
    """Dynamic FP8 scales of rows whose max |x| is `amax` [M, 1] fp32."""
    # Divided by a tensor on amax's device: CUDA turns a division by a Python scalar into a
    # multiplication by its reciprocal, 1 ulp off the quotient in many rows, which
    # then breaks the many exact rounding ties of bf16 inputs the other way.
    return (amax / amax.new_full((), FP8_MAX)).clamp(min=MIN_SCALE)


def quantize_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] / scale [M, 1] rounded to FP8 (saturating), as `reference_quantize` does it."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def reference_quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of dynamic scales per token and run of `group` values (compressed-tensors'
    `group` activations, block-wise FP8's 1 x 128; a short last run is scaled by its own amax):
    x [M, K] -> (x_fp8 [M, K], scale [M, ceil(K / group)] fp32)."""
    m, k = x.shape
    runs = F.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = amax_scales(runs.abs().amax(dim=-1, keepdim=True))
    q = (runs / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k], scale.view(m, -1)


def fake_quantize(x: torch.Tensor, input_scale: torch.Tensor | None = None, group: int = 0) -> torch.Tensor:
    """x rounded through FP8 as the references do it (dequantized again), in x's dtype: per token,
    with the static scale, or with `group` per token and run of that many values."""
    flat = x.reshape(-1, x.shape[-1])
    if group:
        q, scale = reference_quantize_groups(flat, group)
        scale = scale.repeat_interleave(group, dim=1)[:, : flat.shape[1]]
    else:
        q, scale = reference_quantize(flat, input_scale)
    return (q.float() * scale).to(x.dtype).reshape(x.shape)


def reference_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The emulation the kernels are checked against: dequantized weight (fp8 * per-channel scale),
    fake-quantized activations (dynamic per row, or static), one float32 matmul."""
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    xq = fake_quantize(x.float(), input_scale)
    y = F.linear(xq, w, None if bias is None else bias.float())
    return y.to(out_dtype)


if triton is not None:

    @triton.jit
    def to_e4m3(v):
        """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as fp32; the cast
        that follows is then exact. Rounding here rather than in the cast keeps the kernel exact
        under the Triton interpreter too, whose fp32 -> fp8 cast (triton 3.9) drops the carry when
        rounding up crosses a power of two (125.5 -> 64 instead of 128)."""
        bits = v.to(tl.int32, bitcast=True)
        a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
        # The spacing of e4m3 values around a: 2^(e - 3), e = max(exponent of a, -6) (subnormals).
        e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
        inv_ulp = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
        # a / ulp < 16, so adding 1.5 * 2^23 rounds it to an integer (fp32 adds round to even).
        r = ((a * inv_ulp + 12582912.0) - 12582912.0) * ulp
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def clamped_codes(x, s, QMAX: tl.constexpr, HW_ROUND: tl.constexpr):
        """x / s (IEEE division) clamped to +-QMAX; rounded to e4m3 values here unless HW_ROUND
        leaves the rounding to the cast that stores them."""
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -QMAX), QMAX)
        if not HW_ROUND:
            v = to_e4m3(v)
        return v

    @triton.jit
    def _quantize_rows_kernel(
        x_ptr, q_ptr, s_ptr, static_scale_ptr, K, stride_xm,
        BLOCK: tl.constexpr, SLICE: tl.constexpr, STATIC: tl.constexpr, SINGLE: tl.constexpr,
        QMAX: tl.constexpr, SMIN: tl.constexpr, PDL: tl.constexpr, STATIC_STRIDE: tl.constexpr = 0,
        HW_ROUND: tl.constexpr = False,
    ):  # fmt: skip
        """A row of x per program along grid axis 0: its scale (amax / 448, or the static one: one
        for all rows, or with STATIC_STRIDE 1 one per row) to s_ptr[row] and the fp8 codes to
        q_ptr[row, :]. SINGLE rows (K <= BLOCK) may be cut into slices of SLICE values, one per
        program along axis 1: each takes the amax of the whole row (a second read, from L2) and
        divides and rounds its slice only. HW_ROUND: the store's conversion rounds (the GPU's
        round-to-nearest-even cvt), else `to_e4m3` does first (the interpreter)."""
        pdl.release(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        x_row = x_ptr + row * stride_xm
        q_row = q_ptr + row * K
        offs = tl.arange(0, BLOCK)
        if SINGLE:
            so = part * SLICE + tl.arange(0, SLICE)  # SLICE == BLOCK: the whole row
            x = tl.load(x_row + so, mask=so < K, other=0.0).to(tl.float32)
            if STATIC:
                s = tl.load(static_scale_ptr + row * STATIC_STRIDE).to(tl.float32)
            else:
                if SLICE < BLOCK:
                    whole = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
                else:
                    whole = x
                s = tl.maximum(tl.math.div_rn(tl.max(tl.abs(whole), axis=0), QMAX), SMIN)
            q = clamped_codes(x, s, QMAX, HW_ROUND)
            tl.store(q_row + so, q.to(q_ptr.dtype.element_ty), mask=so < K)
        else:
            if STATIC:
                s = tl.load(static_scale_ptr + row * STATIC_STRIDE).to(tl.float32)
            else:
                amax = tl.zeros([BLOCK], dtype=tl.float32)
                for k0 in range(0, K, BLOCK):
                    x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.abs(x))
                s = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), QMAX), SMIN)
            for k0 in range(0, K, BLOCK):
                x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
                q = clamped_codes(x, s, QMAX, HW_ROUND)
                tl.store(q_row + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
        if part == 0:
            tl.store(s_ptr + row, s)

    @triton.jit
    def _small_m_kernel(
        q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_qm, stride_wn, stride_om,
        k_per_split,
        F8_MMA: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
        BR: tl.constexpr = 0, BC: tl.constexpr = 0,
    ):  # fmt: skip
        """out^T [BN, BM] = W [BN, K] x_fp8^T [K, BM] on the tensor cores, then both scales and
        the bias: the weight is the large operand (swap-AB), so BN weight rows fill the MMA's
        M side however few the tokens (BM >= 16, rows past M load as zeros and are not stored).

        Grid (N / BN, M / BM, K slices): with SPLIT each program takes k_per_split of K (a
        multiple of BK), writes float32 partials, and the last program of a tile to finish (an
        atomic counter it resets) sums them and applies the scales, as triton_int's fused kernel
        does: the narrow layers (N = 4096: 64 row tiles) fill the 132 multiprocessors that way.

        F8_MMA: fp8 x fp8 operands as they are (BN = 64 with 4 warps is Hopper's fp8 wgmma; a
        smaller BN takes mma.sync, for which Triton widens both to fp16, exactly). Hopper's fp8
        MMA adds its products with fewer bits than fp32, so its partial sums move into the fp32
        accumulator every 32 products (max_num_imprecise_acc; Triton's default on sm_90 keeps all
        of K in it, as _scaled_mm's use_fast_accum does): measured 4.5e-5 of the largest output
        at K = 4096. Otherwise fp32 operands (the interpreter).

        BC > 0: block-wise scales, sw [ceil(N / BR), ceil(K / BC)] and sx [M, ceil(K / BC)] (BK
        divides BC): each K step's product is scaled by its block's two scales as it is added."""
        pdl.release(PDL)
        pdl.wait(PDL)
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        rows = pid_n * BN + tl.arange(0, BN)
        rows_in = tl.minimum(rows, N - 1)  # rows past N read row N - 1; their results are not stored
        ms = pid_m * BM + tl.arange(0, BM)
        m_ok = ms < M
        kk = tl.arange(0, BK)
        w_tile = w_ptr + rows_in.to(tl.int64)[:, None] * stride_wn + kk[None, :]
        x_tile = q_ptr + ms.to(tl.int64)[None, :] * stride_qm + kk[:, None]  # [BK, BM]: x^T
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        for k0 in range(k_lo, k_hi, BK):
            if EVEN_K:
                w = tl.load(w_tile + k0)
                x = tl.load(x_tile + k0, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = k0 + kk < K
                w = tl.load(w_tile + k0, mask=k_ok[None, :], other=0.0)
                x = tl.load(x_tile + k0, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
            if BC > 0:
                if F8_MMA:
                    step = tl.dot(w, x, max_num_imprecise_acc=32)
                else:
                    step = tl.dot(w.to(tl.float32), x.to(tl.float32), input_precision="ieee")
                n_kb = tl.cdiv(K, BC)
                swb = tl.load(sw_ptr + (rows_in // BR) * n_kb + k0 // BC)
                sxb = tl.load(sx_ptr + ms * n_kb + k0 // BC, mask=m_ok, other=0.0)
                acc += step * swb[:, None] * sxb[None, :]
            elif F8_MMA:
                acc = tl.dot(w, x, acc, max_num_imprecise_acc=32)
            else:
                acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        out = out_ptr + ms.to(tl.int64)[None, :] * stride_om + rows[:, None]
        mask = (rows < N)[:, None] & m_ok[None, :]
        if SPLIT:
            at = ms[None, :] * N + rows[:, None]  # in one [M, N] plane of float32 partials
            last, acc = split_k.sum_slices(acc, part_ptr, count_ptr, pid_m * tl.num_programs(0) + pid_n, at, mask,
                                           pid_k, tl.num_programs(2), M * N, F8_MMA)  # fmt: skip
            if last:
                y = _small_m_epilogue(acc, sx_ptr, sw_ptr, b_ptr, rows_in, ms, m_ok, HAS_BIAS, BC)
                tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            y = _small_m_epilogue(acc, sx_ptr, sw_ptr, b_ptr, rows_in, ms, m_ok, HAS_BIAS, BC)
            tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _small_m_epilogue(acc, sx_ptr, sw_ptr, b_ptr, rows_in, ms, m_ok, HAS_BIAS: tl.constexpr, BC: tl.constexpr):
        """out^T tile: the per-row and per-token scales (block-wise ones were applied per step),
        then the bias."""
        y = acc
        if BC == 0:
            y = y * tl.load(sw_ptr + rows_in)[:, None] * tl.load(sx_ptr + ms, mask=m_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(b_ptr + rows_in).to(tl.float32)[:, None]
        return y

    @triton.jit
    def _gemv_kernel(
        q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, KB: tl.constexpr, RPP: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """One token: out[n] = s_x * s_w[n] * sum_k x_fp8[k] w_fp8[n, k] (+ bias) for RPP rows per
        program, one row per step over the whole of K (KB: K rounded up to a power of two), on
        the CUDA cores: each code widened to fp32 (exact), the products exact in fp32, summed in
        fp32. The first row's weights are loaded before waiting for the kernels that write x, the
        next row's before this row's sum."""
        pdl.release(PDL)
        kk = tl.arange(0, KB)
        k_ok = kk < K
        row = tl.program_id(0) * RPP
        w = gemv_row(w_ptr, row, N, stride_wn, kk, k_ok)
        pdl.wait(PDL)
        x = tl.load(q_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        sx = tl.load(sx_ptr)
        for r in tl.static_range(RPP):
            if r + 1 < RPP:
                w_next = gemv_row(w_ptr, row + 1, N, stride_wn, kk, k_ok)
            y = tl.sum(w.to(tl.float32) * x, axis=0) * tl.load(sw_ptr + tl.minimum(row, N - 1)) * sx
            gemv_store(y, b_ptr, out_ptr, row, N, HAS_BIAS)
            if r + 1 < RPP:
                w = w_next
                row += 1

    @triton.jit
    def gemv_row(w_ptr, row, N, stride_wn, kk, k_ok):
        """A weight row's codes at kk (a row past N reads row N - 1; its result is not stored)."""
        return tl.load(w_ptr + tl.minimum(row, N - 1).to(tl.int64) * stride_wn + kk, mask=k_ok, other=0.0)

    @triton.jit
    def gemv_store(y, b_ptr, out_ptr, row, N, HAS_BIAS: tl.constexpr):
        """A GEMV row's result plus its bias into out[row] (rows past N not stored)."""
        if HAS_BIAS:
            y += tl.load(b_ptr + tl.minimum(row, N - 1)).to(tl.float32)
        tl.store(out_ptr + row, y.to(out_ptr.dtype.element_ty), mask=row < N)


def _hardware_rounding(x: torch.Tensor) -> bool:
    """Whether the quantization kernels leave the rounding to fp8 to the conversion that stores
    the codes: on a GPU, where it is the references' round-to-nearest-even (`cvt.rn.satfinite`),
    not under the interpreter, whose conversion misrounds (`to_e4m3`)."""
    return x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1"


def triton_quantize(
    x: torch.Tensor, input_scale: torch.Tensor | None = None, hw_round: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel behind `quantize_per_token` / `quantize_per_tensor` (on CPU tensors too
    under TRITON_INTERPRET=1, as the CPU tests run it). x [M, K], unit stride on K. At decode
    sizes (M <= SMALL_M_MAX) a row takes K / 1024 programs (K / 2048 past 4096 values), each
    dividing and rounding its slice: one program a row spent 1.87 us at K = 4096 and 4.68 at
    14336 (H200, one row, CUDA-graph replay; the same at four rows), sliced 1.37 and 1.62, bit
    for bit the same codes; the rounding is the longest part, done by one multiprocessor per row
    before. In the engine (`-q fp8`, one H100, the same machine): batch 1 278.3 -> 291.5 tok/s,
    16 tokens 3638 -> 3766, 32 6905 -> 7060. Larger M keeps one program a row, each row read
    once; there the store's conversion rounds the codes (`hw_round`, by default where a program
    takes a whole row and `_hardware_rounding(x)`): one H100, CUDA-graph replays, us at K = 4096
    / 14336, `to_e4m3` then the conversion: 256 tokens 3.76 -> 3.44 / 9.62 -> 8.50, 2048 11.9 ->
    9.5 / 54.0 -> 47.3, 8192 40.2 -> 36.0 (0.94 of copy bandwidth) / 191 -> 165; sliced decode
    rows gained nothing (1.3-2.7 us either way) and keep `to_e4m3`. The codes are the same
    (`bench_fp8_gpu.py --sections quantize,quantize_sweep`)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    single = k <= _SINGLE_BLOCK_MAX
    block = triton.next_power_of_2(k) if single else 4096
    part = min(block, 1024 if k <= 4096 else 2048) if single and m <= SMALL_M_MAX else block
    static = input_scale is not None
    _quantize_rows_kernel[(m, triton.cdiv(k, part) if single else 1)](
        x, q, scale, input_scale if static else scale, k, x.stride(0),
        BLOCK=block, SLICE=part, STATIC=static, SINGLE=single, QMAX=FP8_MAX, SMIN=MIN_SCALE,
        STATIC_STRIDE=int(static and input_scale.numel() > 1), num_warps=min(16, max(1, block // 512)),
        HW_ROUND=(part == block and _hardware_rounding(x)) if hw_round is None else hw_round, **pdl.options(x),
    )  # fmt: skip
    return q, scale


def _quantize(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if x.is_cuda and triton is not None:
        return triton_quantize(x, input_scale)
    return reference_quantize(x, input_scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, scale [M, 1] fp32), one scale per row (dynamic)."""
    return _quantize(x, None)


def quantize_per_tensor(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, 1]) with the static scale (a one-element fp32 tensor on
    x's device) repeated per row, the layout row-wise `_scaled_mm` takes."""
    return _quantize(x, input_scale)


@dataclass(frozen=True)
class SmallMConfig:
    """`_small_m_kernel`'s launch: weight rows and K codes per step, warps, pipeline stages, and
    K slices (split_k 0: `split_for`'s rule, towards programs_per_sm programs per multiprocessor).
    Tokens per program: M rounded up to a power of two, 16 to block_m. The default is the fastest of
    those benchmarks/bench_fp8_gpu.py measured at every M <= SMALL_M_MAX and Llama-3-8B shape."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0
    programs_per_sm: int = 2
    block_m: int = 64


# Up to this many tokens fp8_linear runs `small_m_linear`; above, torch._scaled_mm (measured: at
# M = 32 the Triton kernel is 0.84x _scaled_mm's time over a layer, at 64 1.04x).
SMALL_M_MAX = 32
DEFAULT_SMALL_M = SmallMConfig()


def split_for(m: int, n: int, k: int, cfg: SmallMConfig) -> int:
    """K slices of `_small_m_kernel`: cfg.split_k, or doubled while the grid holds fewer than
    cfg.programs_per_sm programs per multiprocessor and each slice keeps at least two K steps."""
    if cfg.split_k:
        return cfg.split_k
    bm = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, cfg.block_n) * triton.cdiv(m, bm)
    steps = triton.cdiv(k, cfg.block_k)
    split = 1
    while tiles * split * 2 <= cfg.programs_per_sm * split_k.NUM_SMS_GUESS and steps // (split * 2) >= 2:
        split *= 2
    return split


def small_m_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    cfg: SmallMConfig = DEFAULT_SMALL_M,
) -> torch.Tensor:
    """fp8_linear's Triton side for x [M, K]: `triton_quantize`, then `_small_m_kernel` (any M;
    BM tokens per program, BM = M rounded up to a power of two, 16 to 64; K split by
    `split_for`). CUDA, or CPU tensors under TRITON_INTERPRET=1."""
    q, scale = _quantize(x, input_scale)
    return launch_small_m(q, scale, weight, weight_scale, out_dtype, bias, cfg)


def launch_small_m(
    q: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype,
    bias: torch.Tensor | None, cfg: SmallMConfig, block: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`_small_m_kernel` on quantized x: per-token scales [M, 1] and per-row weight scales [N], or
    with `block` (rows, cols) per-run scales [M, ceil(K / cols)] and per-block weight scales
    [ceil(N / rows), ceil(K / cols)] (fp8_blocks.py)."""
    m, k = q.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    if block is not None:  # a K step never crosses a block
        cfg = replace(cfg, block_k=min(cfg.block_k, block[1]))
    bm = min(cfg.block_m, max(16, triton.next_power_of_2(m)))
    tiles = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, bm))
    cut = split_k.slices(triton.cdiv(k, cfg.block_k), split_for(m, n, k, cfg), tiles[0] * tiles[1], m, n, q.device)
    per_split = cut.per * cfg.block_k if cut.split else k  # in K values
    _small_m_kernel[(*tiles, cut.count)](
        q, scale, weight, weight_scale, weight_scale if bias is None else bias, out, cut.partials, cut.counters, m,
        n, k, q.stride(0), weight.stride(0), out.stride(0), per_split,
        F8_MMA=q.is_cuda, HAS_BIAS=bias is not None, BN=cfg.block_n, BM=bm, BK=cfg.block_k,
        EVEN_K=k % cfg.block_k == 0, SPLIT=cut.split, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        BR=block[0] if block else 0, BC=block[1] if block else 0, **pdl.options(q),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class GemvConfig:
    """`_gemv_kernel`'s launch: weight rows per program (one at a time) and warps. The default is
    the fastest rule over the four Llama-3-8B shapes that benchmarks/bench_fp8_gpu.py measured."""

    rows_per_program: int = 2
    num_warps: int = 4


DEFAULT_GEMV = GemvConfig()
# Rows up to this many values take the GEMV at one token (a thread holds K / (32 * warps) of x in
# fp32 registers: 128 at K = 14336, the longest measured); longer ones the small-M kernel.
GEMV_MAX_K = 16384


def gemv_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    cfg: GemvConfig = DEFAULT_GEMV,
) -> torch.Tensor:
    """fp8_linear's one-token side for x [1, K]: `triton_quantize`, then `_gemv_kernel`. CUDA, or
    CPU tensors under TRITON_INTERPRET=1."""
    q, scale = _quantize(x, input_scale)
    n, k = weight.shape
    out = torch.empty((1, n), dtype=out_dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.rows_per_program),)](
        q, scale, weight, weight_scale, weight_scale if bias is None else bias, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, KB=triton.next_power_of_2(k), RPP=cfg.rows_per_program,
        num_warps=cfg.num_warps, **pdl.options(x),
    )  # fmt: skip
    return out


def scaled_mm_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """fp8_linear's cuBLAS side for x [M, K]: `triton_quantize`, then row-wise `torch._scaled_mm`."""
    q, scale = _quantize(x, input_scale)
    # _scaled_mm takes the second operand column-major: W^T of a row-major [N, K] is just that.
    return torch._scaled_mm(
        q, weight.t(), scale_a=scale, scale_b=weight_scale.view(1, -1), bias=bias,
        out_dtype=out_dtype, use_fast_accum=use_fast_accum,
    )  # fmt: skip


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """y = x W^T (+ bias) with W = weight [N, K] float8_e4m3fn (row-major) * weight_scale [N] fp32,
    x [..., K] quantized per token (input_scale None) or with the static per-tensor input_scale
    (or one given scale per token, [M, 1]).
    One token: the CUDA-core GEMV (`gemv_linear`); up to SMALL_M_MAX tokens the Triton
    tensor-core kernel (`small_m_linear`), above `torch._scaled_mm`
    (`use_fast_accum` applies there and sends every M there). CUDA, compute capability >= 8.9
    (`scaled_mm_unsupported` returns None); no host sync, so it can be captured in a CUDA graph
    (M is fixed per graph, and so is the path)."""
    flat = x.reshape(-1, x.shape[-1])
    m, k = flat.shape
    if use_fast_accum or not 0 < m <= SMALL_M_MAX:
        y = scaled_mm_linear(flat, weight, weight_scale, input_scale, out_dtype, bias, use_fast_accum)
    elif m == 1 and k <= GEMV_MAX_K:
        y = gemv_linear(flat, weight, weight_scale, input_scale, out_dtype, bias)
    else:
        y = small_m_linear(flat, weight, weight_scale, input_scale, out_dtype, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_mm_unsupported(device: torch.device, out_dtype: torch.dtype, n: int, k: int) -> str | None:
    """Why `fp8_linear` cannot run an [N, K] weight here (None when it can): the device, the
    16-multiples `_scaled_mm` needs, or `_scaled_mm` itself refusing row-wise scales with this
    output dtype (e.g. float32 output on Ada)."""
    if device.type != "cuda":
        return f"no FP8 GEMM on {device.type}"
    if triton is None:
        return "triton is not installed"
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        return f"compute capability {capability[0]}.{capability[1]} < 8.9 has no FP8 tensor cores"
    if n % 16 or k % 16:
        return f"torch._scaled_mm needs N and K multiples of 16, the layer is {n} x {k}"
    return _probe(device.index if device.index is not None else torch.cuda.current_device(), out_dtype)


@cache
def _probe(device_index: int, out_dtype: torch.dtype) -> str | None:
    """Run one small row-wise `_scaled_mm` (once per device and dtype): torch versions and GPUs
    differ in which output dtypes they take."""
    device = torch.device("cuda", device_index)
    a = torch.ones(16, 32, device=device).to(FP8_DTYPE)
    b = torch.ones(16, 32, device=device).to(FP8_DTYPE)
    ones = torch.ones(16, 1, device=device)
    try:
        y = torch._scaled_mm(a, b.t(), scale_a=ones, scale_b=ones.view(1, -1), out_dtype=out_dtype)
    except (RuntimeError, ValueError) as e:
        return f"torch._scaled_mm refuses row-wise scales with {out_dtype} output ({e})"
    if not bool((y == 32).all()):
        return "torch._scaled_mm gave wrong results in its start-up check"
    return None
