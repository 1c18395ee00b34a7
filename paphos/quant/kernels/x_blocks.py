"""x for the int8 tensor-core GEMMs (triton_int_i8.py: GPTQ / AWQ / compressed-tensors planes;
paphos/quant/gguf/triton_gguf_i8.py: GGUF planes): one launch per linear and step turns x
[M, K] into two int8 parts per value, x = dx * (q1 + q2 / 254) with dx = max|x| / 127 per token
and block of XB values of K (the batch-1 GEMV's numerics, paphos/layers/x_int8.py: about 15
bits of x), written in the order in which the GEMM multiplies a weight plane's codes.

That order: `order` [XB] says which value of the block each position holds (a permutation of
0 .. XB - 1). With act-order the block's values are x[:, perm] (the gather happens here,
straight into registers). Beside the parts: dx per token and block, and the integer sum of
254 * q1 + q2 over every SUM positions (what zero points and minimums multiply).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paphos.layers import pdl, x_int8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch reference serves
    triton = None

QUANTIZE_BLOCKS = 4  # x blocks per program of `_quantize_kernel`
_ORDERS: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_order(name: str, device: torch.device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The order called `name` (made by `make`) as the int32 tensor the kernel reads, on `device`:
    made once per device, not at every call of a linear."""
    key = (name, device)
    if key not in _ORDERS:
        _ORDERS[key] = make().to(device=device, dtype=torch.int32)
    return _ORDERS[key]


def reference_quantize(
    x: torch.Tensor, order: torch.Tensor, xb: int, sum_every: int, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference of `quantize`: x [M, K] -> (parts int8 [2, M, K], dx float32 [M, K / xb],
    sums int32 [M, K / sum_every])."""
    m, k = x.shape
    xf = x.float() if perm is None else x.float()[:, perm.long()]
    blocks = xf.reshape(m, k // xb, xb)
    amax = blocks.abs().amax(-1, keepdim=True)
    # a tensor divided by a tensor: torch divides a Python scalar by a tensor as a multiplication by
    # the reciprocal, 1 ulp off the IEEE quotient the kernel takes
    v = blocks * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0.0)
    v = v[..., order.long().to(x.device)]
    q1 = torch.round(v)
    q2 = torch.round((v - q1) * 254.0)
    parts = torch.stack([q1, q2]).to(torch.int8).reshape(2, m, -1)
    sums = (254 * q1 + q2).reshape(m, -1, sum_every).sum(-1).to(torch.int32)
    return parts, amax[..., 0] * (1.0 / 127.0), sums


# ---------------------------------------------------------------------------- Triton kernel

if triton is not None:

    @triton.jit
    def _quantize_kernel(
        x_ptr, order_ptr, perm_ptr, q_ptr, dx_ptr, sum_ptr, M, K, stride_xm,
        XB: tl.constexpr, SUM: tl.constexpr, HAS_PERM: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """BLOCKS blocks of one token per program (grid: tokens x block groups), `order`'s gather
        (through perm with act-order) straight into registers; the rounding is x_int8's
        (`rounded_parts`)."""
        pdl.release(PDL)
        m = tl.program_id(0)
        n_blocks = K // XB
        blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        blk_ok = blk < n_blocks
        j = tl.arange(0, XB)
        k = blk[:, None] * XB + tl.load(order_ptr + j)[None, :]  # static: read before the wait
        ok = blk_ok[:, None]
        if HAS_PERM:
            k = tl.load(perm_ptr + k, mask=ok, other=0)
        pdl.wait(PDL)
        v = tl.load(x_ptr + m.to(tl.int64) * stride_xm + k, mask=ok, other=0).to(tl.float32)
        amax = tl.max(tl.abs(v), axis=1)
        # IEEE division (Triton's `/` is approximate on the GPU): the parts are the reference's
        v = v * tl.where(amax > 0, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30)),
                         0.0)[:, None]  # fmt: skip
        f1, f2 = x_int8.rounded_parts(v)
        r1 = f1 - 12582912.0
        r2 = f2 - 12582912.0
        at = m.to(tl.int64) * K + blk[:, None] * XB + j[None, :]
        tl.store(q_ptr + at, r1.to(tl.int32).to(tl.int8), mask=ok)
        tl.store(q_ptr + M * K + at, r2.to(tl.int32).to(tl.int8), mask=ok)
        tl.store(dx_ptr + m * n_blocks + blk, amax * (1.0 / 127.0), mask=blk_ok)
        sums = tl.sum(tl.reshape((254.0 * r1 + r2).to(tl.int32), (BLOCKS, XB // SUM, SUM)), axis=2)
        per: tl.constexpr = XB // SUM
        s_at = m * (n_blocks * per) + blk[:, None] * per + tl.arange(0, per)[None, :]
        tl.store(sum_ptr + s_at, sums, mask=ok)


if triton is not None:

    @triton.jit
    def program_tile(pid_n, pid_m, pid_k, N, M, n_blocks, iters_per_split, BN: tl.constexpr, BM: tl.constexpr):
        """What a GEMM program on these parts covers: BN weight rows (rows, row_ok), BM tokens (ms,
        m_ok), x blocks it0 .. it1 of its K slice; and the 2 BM columns of its x operand, both
        parts side by side: column j is part j // BM (first: j < BM) of token tok = pid_m * BM +
        j % BM (tok_ok)."""
        rows = pid_n * BN + tl.arange(0, BN)
        ms = pid_m * BM + tl.arange(0, BM)
        cols = tl.arange(0, 2 * BM)
        tok = pid_m * BM + cols % BM
        it0 = pid_k * iters_per_split
        it1 = tl.minimum(it0 + iters_per_split, n_blocks)
        return rows, rows < N, ms, ms < M, cols < BM, tok, tok < M, it0, it1

    @triton.jit
    def part_pointers(q_ptr, first, tok, M, K, KB: tl.constexpr):
        """[KB, 2 BM] pointers to the first KB positions of each x operand column's part."""
        return q_ptr + (tl.where(first, 0, M) + tok).to(tl.int64)[None, :] * K + tl.arange(0, KB)[:, None]

    @triton.jit
    def sum_parts(acc, BN: tl.constexpr, BM: tl.constexpr):
        """[BN, 2 BM] (each column one part of a token, scaled) -> [BN, BM]: the two parts summed."""
        return tl.sum(tl.reshape(tl.permute(tl.reshape(acc, (BN, 2, BM)), (0, 2, 1)), (BN, BM, 2)), axis=2)


def quantize(
    x: torch.Tensor, order: torch.Tensor, xb: int, sum_every: int, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride on K, K a multiple of xb) -> `reference_quantize`'s (parts, dx,
    sums) in one launch; `order` from `device_order`, perm int32 on x's device."""
    m, k = x.shape
    parts = torch.empty(2, m, k, dtype=torch.int8, device=x.device)
    dx = torch.empty(m, k // xb, dtype=torch.float32, device=x.device)
    sums = torch.empty(m, k // sum_every, dtype=torch.int32, device=x.device)
    _quantize_kernel[(m, triton.cdiv(k // xb, QUANTIZE_BLOCKS))](
        x, order, order if perm is None else perm, parts, dx, sums, m, k, x.stride(0),  # (perm unread without one)
        XB=xb, SUM=sum_every, HAS_PERM=perm is not None, BLOCKS=QUANTIZE_BLOCKS, num_warps=4,
        **pdl.options(x),
    )  # fmt: skip
    return parts, dx, sums
