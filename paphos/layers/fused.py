"""Triton kernels for the elementwise parts of a decoder layer: residual add + RMSNorm, RoPE and
SiLU * mul, one launch each instead of the ten-odd small kernels their torch forms launch.

Data flow: decoder layer -> norm.py / rotary.py / activation.py -> here when the tensor lives on a
GPU (the torch code in those modules is the reference and the CPU path). At batch 1 an 8B model's
step is ~4 ms of weight reads; unfused, these ops add ~40 launches per layer, which inside a CUDA
graph still cost ~2 us each — about as much as the weights themselves.

Rounding follows the torch reference operation by operation (each bf16/fp16 intermediate the
reference materialises is rounded here too), so the kernels reproduce the reference bit for bit
up to the order of the fp32 sum in the norm.
"""

from __future__ import annotations

import torch

from paphos.layers import pdl, x_int8_outputs
from paphos.layers.x_int8_outputs import Int8Outputs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference path is used.
    triton = None


# Columns of a row per program of the norm where it writes int8 parts: every program sums the
# whole row's squares, then normalises and quantizes its own columns. One program a row left a
# batch-16 step's parts to 16 programs (4.77 us a launch against 2.53 in chunks of 1024, 2.81 of
# 512; H100, benchmarks/bench_producers_gpu.py; benchmarks/README.md, "The norm's int8 parts in
# column chunks").
NORM_CHUNK = 1024


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor (a GPU tensor with Triton installed)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _summed_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_out,
                    HAS_RESIDUAL: tl.constexpr, STORE: tl.constexpr):  # fmt: skip
        """x (+ residual) at `cols` of `row`, in the model dtype (the residual stream is summed in
        it, as the reference does); with STORE, the sum is also stored as the new residual."""
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)
            if STORE:
                tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
        return x

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr,
        n_rows, n_cols, eps, stride_x, stride_res, stride_out,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, QLO: tl.constexpr,
        QTW: tl.constexpr, BXB: tl.constexpr, BSUM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """Program (row, c) normalises columns c * CHUNK .. + CHUNK of the row (CHUNK == BLOCK: the
        whole row). Each program sums the whole row's squares itself (the row is read from L2 by
        the others), so a row's int8 parts are written by several programs at once."""
        pdl.release(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = _summed_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_out,
                        HAS_RESIDUAL, CHUNK == BLOCK)  # fmt: skip
        xf = x.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        col0 = tl.program_id(1) * CHUNK
        if CHUNK < BLOCK:
            cols = col0 + tl.arange(0, CHUNK)
            mask = cols < n_cols
            x = _summed_row(x_ptr, res_ptr, res_out_ptr, row, cols, mask, stride_x, stride_res, stride_out,
                            HAS_RESIDUAL, True)  # fmt: skip
        normed = (x.to(tl.float32) * inv_rms).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
        x_int8_outputs.write_after_store(out_ptr + row * stride_out, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr,
                                         row, n_rows, col0, n_cols, CHUNK, QLO, QTW, BXB, BSUM)  # fmt: skip

    @triton.jit
    def _silu_and_mul_kernel(
        x_ptr, out_ptr, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr, n_rows, n_cols, stride_x, stride_out,
        BLOCK: tl.constexpr, QLO: tl.constexpr, QTW: tl.constexpr, BXB: tl.constexpr, BSUM: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        pdl.release(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
        x_int8_outputs.write_after_store(out_ptr + row * stride_out, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr,
                                         row, n_rows, tl.program_id(1) * BLOCK, n_cols, BLOCK, QLO, QTW, BXB,
                                         BSUM)  # fmt: skip

    @triton.jit
    def _rope_rotate_heads(
        x_ptr, stride_token, stride_head, token, num_heads, cos, sin,
        HALF: tl.constexpr, HEADS: tl.constexpr,
    ):  # fmt: skip
        heads = tl.arange(0, HEADS)[:, None]
        dims = tl.arange(0, HALF)[None, :]
        mask = heads < num_heads
        base = x_ptr + token * stride_token + heads * stride_head + dims
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        dtype = x1.dtype
        # Each product and each sum is rounded to the model dtype, as the torch reference's
        # separate tensor ops round them.
        c = cos.to(dtype).to(tl.float32)
        s = sin.to(dtype).to(tl.float32)
        x1c = (x1.to(tl.float32) * c).to(dtype).to(tl.float32)
        x2s = (x2.to(tl.float32) * s).to(dtype).to(tl.float32)
        x2c = (x2.to(tl.float32) * c).to(dtype).to(tl.float32)
        x1s = (x1.to(tl.float32) * s).to(dtype).to(tl.float32)
        tl.store(base, (x1c - x2s).to(dtype), mask=mask)
        tl.store(base + HALF, (x2c + x1s).to(dtype), mask=mask)

    @triton.jit
    def _rope_kernel(
        q_ptr, k_ptr, pos_ptr, cache_ptr,
        q_stride_token, q_stride_head, k_stride_token, k_stride_head, cache_stride,
        num_q_heads, num_k_heads,
        HALF: tl.constexpr, Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl.release(PDL)
        pdl.wait(PDL)
        token = tl.program_id(0).to(tl.int64)
        pos = tl.load(pos_ptr + token)
        dims = tl.arange(0, HALF)[None, :]
        cos = tl.load(cache_ptr + pos * cache_stride + dims)
        sin = tl.load(cache_ptr + pos * cache_stride + HALF + dims)
        _rope_rotate_heads(q_ptr, q_stride_token, q_stride_head, token, num_q_heads, cos, sin, HALF, Q_HEADS)
        _rope_rotate_heads(k_ptr, k_stride_token, k_stride_head, token, num_k_heads, cos, sin, HALF, K_HEADS)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
    int8_outputs: Int8Outputs | None = None, chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x, residual [T, H] -> (norm(x + residual) * weight, x + residual); without a residual the
    second result is None. Same arithmetic as `RMSNorm` in norm.py. With `int8_outputs`, the
    kernel also writes the int8 parts of the output that the next layer reads at T tokens
    (x_int8_outputs.prepare: attached to it), each row's over columns of NORM_CHUNK (`chunk`
    overrides it) in programs of their own. x [T, heads, D] is normalised per head (every head a
    row: Qwen3's q and k norms); its results have x's shape."""
    shape, launch = x.shape, pdl.options(x)  # PDL by the step's tokens, not its heads
    x = x.reshape(-1, shape[-1]).contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        residual = residual.reshape(-1, cols).contiguous()
    block = triton.next_power_of_2(cols)
    wanted = int8_outputs.at(rows, cols) if int8_outputs is not None else None
    if chunk is None:
        writes = wanted is not None and wanted.columns_per_write() > 1
        chunk = min(block, max(NORM_CHUNK, wanted.columns_per_write())) if writes else block
    parts = x_int8_outputs.prepare(out, wanted, columns_per_program=chunk)
    if rows:
        _add_rmsnorm_kernel[(rows, triton.cdiv(cols, chunk))](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            *parts.args, rows, cols, eps, x.stride(0), (residual if residual is not None else x).stride(0),
            out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block, CHUNK=chunk, **parts.constexprs,
            **launch,
        )  # fmt: skip
    if len(shape) == 2:
        return out, res_out  # the very tensors the int8 parts are attached to (views carry none)
    return out.view(shape), None if res_out is None else res_out.view(shape)


def silu_and_mul(x: torch.Tensor, int8_outputs: Int8Outputs | None = None) -> torch.Tensor:
    """x = [gate | up] [T, 2I] -> silu(gate) * up [T, I]; same arithmetic as `SiluAndMul`. With
    `int8_outputs`, also the output's int8 parts (as `add_rmsnorm`)."""
    rows, width = x.shape
    cols = width // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(cols))
    parts = x_int8_outputs.prepare(out, int8_outputs, columns_per_program=block)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            x, out, *parts.args, rows, cols, x.stride(0), out.stride(0), BLOCK=block, **parts.constexprs,
            **pdl.options(x),
        )  # fmt: skip
    return out


def rope_(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place (neox halves over the first `rotary_dim`
    dims) and returns them; same arithmetic as `RotaryEmbedding` in rotary.py. q and k may be
    strided views of one fused qkv tensor; only the last dim must be contiguous."""
    tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    half = rotary_dim // 2
    if half & (half - 1):
        raise ValueError(f"fused rope needs a power-of-two rotary_dim / 2, got {half}")
    if tokens:
        _rope_kernel[(tokens,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
            num_q_heads, num_k_heads,
            HALF=half, Q_HEADS=triton.next_power_of_2(num_q_heads), K_HEADS=triton.next_power_of_2(num_k_heads),
            **pdl.options(q),
        )  # fmt: skip
    return q, k
