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

from paphos.layers import pdl, x_int8, x_int8_blocks
from paphos.layers.x_int8_blocks import BlockLayout, BlockParts

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference path is used.
    triton = None


def available(x: torch.Tensor) -> bool:
    """Whether the fused kernels serve this tensor (a GPU tensor with Triton installed)."""
    return triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, f_ptr, order_ptr, bq_ptr, bdx_ptr, bsum_ptr,
        n_rows, n_cols, eps, stride_x, stride_res, stride_out,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, QLO: tl.constexpr, QTW: tl.constexpr,
        BXB: tl.constexpr, BSUM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl.release(PDL)
        pdl.wait(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
            # The residual stream is summed in the model dtype, as the reference does.
            x = (x.to(tl.float32) + res.to(tl.float32)).to(dtype)
            tl.store(res_out_ptr + row * stride_out + cols, x, mask=mask)
        xf = x.to(tl.float32)
        variance = tl.sum(xf * xf, axis=0) / n_cols
        normed = (xf * (1.0 / tl.sqrt(variance + eps))).to(dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        out = (normed.to(tl.float32) * w.to(tl.float32)).to(dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
        if QLO > 0:
            _int8_parts(out_ptr + row * stride_out, q_ptr, f_ptr, 0, n_cols, BLOCK, QLO, QTW)
        if BXB > 0:
            _block_parts(out_ptr + row * stride_out, order_ptr, bq_ptr, bdx_ptr, bsum_ptr, row, n_rows, 0, n_cols,
                         BLOCK, BXB, BSUM)  # fmt: skip

    @triton.jit
    def _int8_parts(x_ptr, q_ptr, f_ptr, col0, n_cols, BLOCK: tl.constexpr, QLO: tl.constexpr, QTW: tl.constexpr):
        """After a program stored x[col0 : col0 + BLOCK] of a one-row output: the int8 parts of
        those columns' tile groups (x_int8.store_groups), read back from what it stored."""
        TV: tl.constexpr = QTW * 32 // QLO
        tl.debug_barrier()  # the values were stored by other threads of this program
        t = col0 // TV + tl.arange(0, BLOCK // TV)
        x_int8.store_groups(x_ptr, q_ptr, f_ptr, t, t < n_cols // TV, n_cols // TV, QLO, QTW)

    @triton.jit
    def _block_parts(
        x_ptr, order_ptr, q_ptr, dx_ptr, sum_ptr, row, n_rows, col0, n_cols,
        BLOCK: tl.constexpr, XB: tl.constexpr, SUM: tl.constexpr,
    ):  # fmt: skip
        """After a program stored x[col0 : col0 + BLOCK] of row `row` of an [n_rows, n_cols] output:
        those columns' blocks for an int8 tensor-core GEMM (x_int8_blocks.store_blocks), read back
        from what it stored."""
        tl.debug_barrier()  # the values were stored by other threads of this program
        blk = col0 // XB + tl.arange(0, BLOCK // XB)
        blk_ok = blk < n_cols // XB
        k = x_int8_blocks.block_positions(order_ptr, order_ptr, blk, blk_ok, XB, False)
        v = tl.load(x_ptr + k, mask=blk_ok[:, None], other=0).to(tl.float32)
        x_int8_blocks.store_blocks(v, row, n_rows, n_cols, blk, blk_ok, q_ptr, dx_ptr, sum_ptr, XB, SUM, BLOCK // XB)

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
        if QLO > 0:
            _int8_parts(out_ptr + row * stride_out, q_ptr, f_ptr, tl.program_id(1) * BLOCK, n_cols, BLOCK, QLO, QTW)
        if BXB > 0:
            _block_parts(out_ptr + row * stride_out, order_ptr, bq_ptr, bdx_ptr, bsum_ptr, row, n_rows,
                         tl.program_id(1) * BLOCK, n_cols, BLOCK, BXB, BSUM)  # fmt: skip

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
    int8_layout: x_int8.Int8Layout | None = None, int8_blocks: BlockLayout | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """x, residual [T, H] -> (norm(x + residual) * weight, x + residual); without a residual the
    second result is None. Same arithmetic as `RMSNorm` in norm.py. With `int8_layout` and one
    row, the kernel also writes the output's int8 parts for the GEMV it feeds; with `int8_blocks`
    and a token count it serves, those of the int8 tensor-core GEMM (attached to it either way)."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if residual is not None:
        residual = residual.contiguous()
    parts = _int8_output(out, int8_layout)
    blocks = _block_output(out, int8_blocks)
    if rows:
        _add_rmsnorm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out if res_out is not None else out,
            *_int8_pointers(out, parts), *_block_pointers(out, int8_blocks, blocks), rows, cols, eps, x.stride(0),
            (residual if residual is not None else x).stride(0), out.stride(0), HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(cols), **_int8_constexprs(parts), **_block_constexprs(int8_blocks, blocks),
            **pdl.options(x),
        )  # fmt: skip
    return out, res_out


def silu_and_mul(
    x: torch.Tensor, int8_layout: x_int8.Int8Layout | None = None, int8_blocks: BlockLayout | None = None
) -> torch.Tensor:
    """x = [gate | up] [T, 2I] -> silu(gate) * up [T, I]; same arithmetic as `SiluAndMul`. With
    `int8_layout` / `int8_blocks`, also the output's int8 parts (as `add_rmsnorm`)."""
    rows, width = x.shape
    cols = width // 2
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((rows, cols), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(cols))
    # A program's columns are whole tile groups (`block` is a power of two >= the group), the
    # last program's groups past `cols` are masked.
    parts = _int8_output(out, int8_layout)
    blocks = _block_output(out, int8_blocks)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
            x, out, *_int8_pointers(out, parts), *_block_pointers(out, int8_blocks, blocks), rows, cols, x.stride(0),
            out.stride(0), BLOCK=block, **_int8_constexprs(parts), **_block_constexprs(int8_blocks, blocks),
            **pdl.options(x),
        )  # fmt: skip
    return out


def _int8_output(out: torch.Tensor, layout: x_int8.Int8Layout | None) -> x_int8.Int8X | None:
    """The int8 parts a producer writes beside `out` (one row, a whole number of tile groups), attached
    to it; None where it writes none."""
    if layout is None or out.shape[0] != 1 or out.shape[1] % layout.tile_values:
        return None
    parts = x_int8.empty(out, layout)
    x_int8.attach(out, layout, parts)
    return parts


def _int8_pointers(out: torch.Tensor, parts: x_int8.Int8X | None) -> tuple[torch.Tensor, torch.Tensor]:
    return (parts.words, parts.scales) if parts is not None else (out, out)


def _int8_constexprs(parts: x_int8.Int8X | None) -> dict[str, int]:
    lo, tw = parts.layout if parts is not None else (0, 1)
    return {"QLO": lo, "QTW": tw}


def _block_output(out: torch.Tensor, layout: BlockLayout | None) -> BlockParts | None:
    """The int8 tensor-core GEMM's parts a producer writes beside `out` where the GEMM reads them
    at out's token count, attached to it; None where it writes none."""
    if layout is None or not layout.serves(*out.shape):
        return None
    blocks = x_int8_blocks.empty(out, layout)
    x_int8.attach(out, layout, blocks)
    return blocks


def _block_pointers(
    out: torch.Tensor, layout: BlockLayout | None, blocks: BlockParts | None
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The order, parts, dx and sums arguments (`out` for each where none are written)."""
    return (layout.order(out.device), *blocks) if blocks is not None else (out,) * 4


def _block_constexprs(layout: BlockLayout | None, blocks: BlockParts | None) -> dict[str, int]:
    return {"BXB": layout.xb, "BSUM": layout.sum_every} if blocks is not None else {"BXB": 0, "BSUM": 1}


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
